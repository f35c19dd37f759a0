#!/usr/bin/env python3
"""Writes a small random Llama as GGUF through the `gguf` package's GGUFWriter, laid out as llama.cpp's
converter (convert_hf_to_gguf.py) writes a Hugging Face Llama at its default output type: every 2-D
matrix F16 and the norms F32 (through gguf.quants.quantize, as the converter does), Q and K rows
permuted for adjacent-pair rotation, names mapped by gguf.TensorNameMap, the `llama.*` hyperparameters,
general.file_type MOSTLY_F16, and a byte-level BPE tokenizer (tokenizer.ggml.model "gpt2", pre
"gpt-2") read from assets/tokenizer.json the way the converter reads a tokenizer.json: tokens by id
(special added tokens CONTROL), merges and the BOS/EOS ids through gguf.SpecialVocab.

tests/batch_formats.rs decodes it on the CPU and tests/gpu_engine/batches.rs on CUDA. The same package version
writes the same bytes. The package quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 but not the k-quants
(gguf.quants only decodes Q2_K to Q6_K), so a Q4_K_M file cannot be written here; the tests write that
mix with the crate's own writer.

usage: python3 scripts/gguf_f16_model.py [OUT (default models/gguf-f16.gguf)]
scripts/write-gguf-f16.sh installs the pinned package and runs it.
"""

import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import version

import numpy as np
import gguf
from gguf import GGMLQuantizationType, TokenType

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOKENIZER = os.path.join(ROOT, "assets", "tokenizer.json")
SEED = 1234
# A Hugging Face config.json's fields; the vocabulary size comes from the tokenizer. Under 2 MB in F16.
CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def vocab(tokenizer):
    """Tokens and their types by id, as the converter's get_vocab_base lists them."""
    by_id = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    added = {a["id"]: a for a in tokenizer.get("added_tokens", [])}
    by_id.update((i, a["content"]) for i, a in added.items())
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    return tokens, types


def permute(w, n_head, n_head_kv):
    """The converter's LlamaModel.permute: each head's rows (i, i + d/2) become (2i, 2i + 1)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(c, rng):
    """Random weights under Hugging Face names and shapes: norms near 1, matrices scaled by 1/sqrt(in)."""
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, ff = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]

    def matrix(rows, cols):
        return rng.uniform(-1, 1, (rows, cols)).astype(np.float32) / np.float32(np.sqrt(cols))

    def norm():
        return (1 + 0.1 * rng.uniform(-1, 1, h)).astype(np.float32)

    yield "model.embed_tokens.weight", rng.uniform(-1, 1, (c["vocab_size"], h)).astype(np.float32)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm()
        yield p + "self_attn.q_proj.weight", matrix(q, h)
        yield p + "self_attn.k_proj.weight", matrix(kv, h)
        yield p + "self_attn.v_proj.weight", matrix(kv, h)
        yield p + "self_attn.o_proj.weight", matrix(h, q)
        yield p + "post_attention_layernorm.weight", norm()
        yield p + "mlp.gate_proj.weight", matrix(ff, h)
        yield p + "mlp.up_proj.weight", matrix(ff, h)
        yield p + "mlp.down_proj.weight", matrix(h, ff)
    yield "model.norm.weight", norm()
    yield "lm_head.weight", matrix(c["vocab_size"], h)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "gguf-f16.gguf")
    with open(TOKENIZER, encoding="utf-8") as f:
        tokenizer = json.load(f)
    tokens, types = vocab(tokenizer)
    specials = {a["content"]: a["id"] for a in tokenizer["added_tokens"]}
    c = dict(CONFIG, vocab_size=len(tokens), bos_token_id=specials["<|bos|>"], eos_token_id=specials["<|eos|>"])

    w = gguf.GGUFWriter(out + ".part", "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("hostembed gguf-f16")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c["head_dim"])

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # SpecialVocab reads an HF folder: the tokenizer.json beside a config.json holding the special ids.
    with tempfile.TemporaryDirectory() as hf:
        shutil.copy(TOKENIZER, os.path.join(hf, "tokenizer.json"))
        with open(os.path.join(hf, "config.json"), "w", encoding="utf-8") as f:
            json.dump(c, f)
        gguf.SpecialVocab(hf, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c["num_hidden_layers"])
    for name, data in hf_tensors(c, np.random.default_rng(SEED)):
        if name.endswith("q_proj.weight"):
            data = permute(data, c["num_attention_heads"], c["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            data = permute(data, c["num_attention_heads"], c["num_key_value_heads"])
        new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        qtype = GGMLQuantizationType.F32 if data.ndim <= 1 else GGMLQuantizationType.F16
        w.add_tensor(new_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(out + ".part", out)
    print(f"wrote {out} ({os.path.getsize(out)} bytes, gguf {version('gguf')})")


if __name__ == "__main__":
    main()
