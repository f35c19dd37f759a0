#!/usr/bin/env python3
"""Reference logits from HF transformers for the CPU backend's parity tests (tests/cpu/reference.rs,
tests/gemma3.rs, tests/moe.rs).

Builds small random models offline from config objects (Llama with GQA 4:1 and llama3 rope scaling;
Qwen2 with q/k/v bias and a tied head; Qwen3 with q/k norm and head_dim 128 at hidden 1024; Gemma 3
text with sliding-window layers every third layer global, linear rope scaling on the global layers, a
local rotary base, query_pre_attn_scalar apart from head_dim and a tied head; Qwen3-MoE with 8
experts, 2 a token, not renormalized; Mixtral with 4 experts, 2 a token), fills them with the
synthetic weights hostembed generates (checkpoint::write::synthetic_weights, same formula bit for bit,
each tensor by its canonical name: Gemma's norm weights are HF's w, which its RMSNorm multiplies by as
1 + w; Mixtral's block_sparse_moe parts and transformers' fused expert stacks are filled expert by
expert under the per-expert names), and writes, per model, into OUT/<name>/:
  config.json         the model's config, every key (as config.json, without defaults left out)
  tokens.u32          the 64 input ids, little-endian u32
  logits.f32          teacher-forced logits, [64][vocab] little-endian f32, from the float64 run
  inv_freq.f32        HF's rotary inverse frequencies (head_dim/2 values; the global layers' for Gemma)
  inv_freq_local.f32  Gemma 3 only: its sliding-window layers' frequencies
  reference.json      seed, versions, the canonical tensors filled, and the float32-vs-float64 error of HF

tests/cpu/reference.rs checks llama, qwen2 and qwen3; tests/gemma3.rs checks gemma3; tests/moe.rs checks
qwen3_moe and mixtral.

Usage: hf_reference.py --out OUT [--only NAME[,NAME...] ...] [--save-models DIR]   (torch + transformers; no network)
       hf_reference.py --selftest          (numpy only: prints generator values the Rust test pins)
"""

import argparse
import json
import os
import sys

import numpy as np

POSITIONS = 64
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
INDEX_MULT = np.uint64(0xD1B54A32D192ED03)
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3

# The config keys most of the models share; each model's dict below is these with its own keys over them.
BASE = dict(
    vocab_size=256,
    hidden_size=256,
    num_hidden_layers=2,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# The rotary settings of the models that scale nothing.
ROPE_DEFAULT = dict(rope_theta=1000000.0, rope_type="default")


def config(**keys):
    """BASE with `keys` over it."""
    return {**BASE, **keys}


# name -> (architecture, config kwargs, rotary settings, weight seed). Small, but each exercises its
# architecture's quirk.
MODELS = {
    "llama": (
        "llama",
        config(
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=8,
            head_dim=32,
            rms_norm_eps=1e-5,
            attention_bias=False,
            mlp_bias=False,
        ),
        # Original context 64 puts the rotary wavelengths in all three llama3 bands within 64 positions.
        dict(
            rope_theta=500000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        11,
    ),
    "qwen2": (
        "qwen2",
        config(intermediate_size=640, num_attention_heads=4, tie_word_embeddings=True, use_sliding_window=False),
        ROPE_DEFAULT,
        22,
    ),
    "qwen3": (
        "qwen3",
        config(
            hidden_size=1024,
            intermediate_size=1024,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            attention_bias=False,
            use_sliding_window=False,
        ),
        ROPE_DEFAULT,
        33,
    ),
    # Layers 2 and 5 global, the others sliding over 16 positions (64 are run).
    "gemma3": (
        "gemma3",
        config(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            head_dim=48,
            query_pre_attn_scalar=64,
            sliding_window=16,
            tie_word_embeddings=True,
            attention_bias=False,
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
        dict(rope_theta=1000000.0, rope_type="linear", factor=8.0, local_rope_theta=10000.0, global_every=3),
        44,
    ),
    "qwen3_moe": (
        "qwen3_moe",
        config(
            intermediate_size=512,
            moe_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_attention_heads=4,
            head_dim=64,
            attention_bias=False,
            use_sliding_window=False,
            output_router_logits=False,
        ),
        ROPE_DEFAULT,
        44,
    ),
    "mixtral": (
        "mixtral",
        config(
            intermediate_size=384,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=8,
            head_dim=32,
            rms_norm_eps=1e-5,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
        ),
        ROPE_DEFAULT,
        55,
    ),
}

# Mixtral's spellings of the expert parts, and the canonical ones hostembed names every tensor by.
MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def splitmix64(x):
    """splitmix64's output function on a uint64 array (wrapping arithmetic)."""
    z = x + GOLDEN
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


def fnv1a64(name):
    h = FNV_OFFSET
    for b in name.encode():
        h = ((h ^ b) * FNV_PRIME) % (1 << 64)
    return h


def synthetic_tensor(name, shape, seed):
    """The value of every element of tensor `name`, row-major over `shape`, as float32."""
    n = int(np.prod(shape))
    with np.errstate(over="ignore"):
        index = np.arange(n, dtype=np.uint64)
        key = np.uint64(seed) ^ np.uint64(fnv1a64(name))
        bits = splitmix64(key ^ (index * INDEX_MULT))
    u = (bits >> np.uint64(40)).astype(np.float32) / np.float32(16777216.0) * np.float32(2.0) - np.float32(1.0)
    if name.endswith("norm.weight"):
        v = np.float32(1.0) + np.float32(0.1) * u
    elif name.endswith(".bias"):
        v = np.float32(0.05) * u
    elif name == "model.embed_tokens.weight":
        v = u
    elif len(shape) == 2:
        v = u * (np.float32(1.0) / np.sqrt(np.float32(shape[1])))
    else:
        raise ValueError(f"no synthetic rule for {name} {shape}")
    assert v.dtype == np.float32
    return v.reshape(shape)


def tokens_for(vocab):
    """A fixed sequence touching many ids, with repeats so attention sees equal keys."""
    return [(i * 97 + 13) % vocab if i % 16 != 15 else 13 for i in range(POSITIONS)]


def selftest():
    """Values the Rust test `synthetic_formula_matches_the_python_generator` pins, as f32 bit patterns."""
    cases = [
        ("model.embed_tokens.weight", (8, 16), 11),
        ("model.layers.0.self_attn.q_proj.weight", (32, 48), 22),
        ("model.layers.1.input_layernorm.weight", (64,), 33),
        ("model.layers.0.self_attn.k_proj.bias", (40,), 44),
    ]
    for name, shape, seed in cases:
        v = synthetic_tensor(name, shape, seed).reshape(-1)
        picks = [0, 1, 2, len(v) - 1]
        bits = " ".join(f"{i}:{v[i].view(np.uint32):08x}" for i in picks)
        print(f"{name} {list(shape)} seed {seed} fnv {fnv1a64(name):016x} {bits}")


def build(arch, kwargs, rope):
    import inspect

    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (getattr(transformers, "Gemma3TextConfig", None), getattr(transformers, "Gemma3ForCausalLM", None)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }
    cls, model_cls = classes[arch]
    kwargs = dict(kwargs)
    params = inspect.signature(cls.__init__).parameters
    rope = dict(rope)
    if arch == "gemma3":
        local_theta, every = rope.pop("local_rope_theta"), rope.pop("global_every")
        layers = kwargs["num_hidden_layers"]
        if "layer_types" in params:
            kwargs["layer_types"] = [
                "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
            ]
        else:
            kwargs["sliding_window_pattern"] = every
        if "rope_parameters" in params:
            kwargs["rope_parameters"] = {
                "full_attention": dict(rope),
                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            }
        else:
            kwargs["rope_theta"] = rope["rope_theta"]
            kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
            kwargs["rope_local_base_freq"] = local_theta
    elif "rope_parameters" in params:
        kwargs["rope_parameters"] = dict(rope)
    else:
        kwargs["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling["rope_type"] != "default":
            kwargs["rope_scaling"] = scaling
    cfg = cls(attn_implementation="eager", **kwargs)
    cfg.architectures = [model_cls.__name__]
    if arch == "gemma3":
        # The config as built, not as asked: the layer pattern and the window the model will run.
        types = getattr(cfg, "layer_types", None)
        if types is not None:
            want = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
            assert list(types) == want, types
        assert cfg.sliding_window == kwargs["sliding_window"], cfg.sliding_window
    model = model_cls(cfg)
    # transformers 5's grouped experts products take no float64; its loop over the experts does.
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return cfg, model


def rotary_frequencies(model, arch):
    """HF's rotary inverse frequencies: {"global": ..., "local": ...} (local for Gemma 3 only), as float32,
    from the buffers whichever transformers version named them."""
    import torch

    found = {}
    for name, buf in model.model.named_buffers():
        # original_inv_freq (kept for dynamic scaling) repeats inv_freq at these settings.
        if not name.endswith("inv_freq") or "original" in name:
            continue
        local = "local" in name or "sliding" in name
        found["local" if local else "global"] = buf.detach().to(torch.float32).numpy()
    want = {"global", "local"} if arch == "gemma3" else {"global"}
    assert set(found) == want, f"rotary buffers {sorted(found)}, expected {sorted(want)}"
    return found


def canonical(name):
    """A parameter's name as hostembed names the tensor: Mixtral's block_sparse_moe parts as the
    Qwen3-MoE spelling (mlp.gate, mlp.experts.E.gate_proj / up_proj / down_proj)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    if len(parts) >= 3 and parts[-3].isdigit() and parts[-2] in MIXTRAL_PARTS and parts[-4] == "experts":
        parts[-2] = MIXTRAL_PARTS[parts[-2]]
    return ".".join(parts)


def expert_values(name, shape, seed, hidden):
    """A fused expert stack (transformers 5: mlp.experts.gate_up_proj [E, 2I, H], gate rows then up
    rows, and mlp.experts.down_proj [E, H, I]; either stored transposed where its last dimension is not
    the one multiplied) filled expert by expert with the per-expert tensors' values; and the canonical
    names it stands for."""
    prefix, stack = name.rsplit(".", 1)
    if stack == "weight":
        prefix, stack = prefix.rsplit(".", 1)
    parts = {"gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}.get(stack)
    if parts is None:
        raise ValueError(f"no expert rule for {name} {shape}")
    # gate/up read the hidden state (their columns are hidden); down writes it (its rows are hidden).
    reads_hidden = stack == "gate_up_proj"
    as_stored = shape[2] == hidden if reads_hidden else shape[1] == hidden
    assert as_stored or (shape[1] == hidden if reads_hidden else shape[2] == hidden), f"{name} {shape}"
    out, names = [], []
    for e in range(shape[0]):
        pieces = [f"{prefix}.{e}.{p}.weight" for p in parts]
        rows = (shape[1] if as_stored else shape[2]) // len(pieces)
        cols = shape[2] if as_stored else shape[1]
        block = np.concatenate([synthetic_tensor(n, (rows, cols), seed) for n in pieces], axis=0)
        out.append(block if as_stored else block.T)
        names.extend(pieces)
    return np.ascontiguousarray(np.stack(out)), names


def load_synthetic(model, seed, tied, hidden):
    """Fills every parameter by the synthetic formula under its canonical name; returns those names."""
    import torch

    params = dict(model.named_parameters())
    filled = []
    for name, p in params.items():
        shape = tuple(p.shape)
        if len(shape) == 3:
            # Which way a stack is stored is told by its hidden size: the models keep 2I and I apart from it.
            values, names = expert_values(canonical(name), shape, seed, hidden)
            filled.extend(names)
        else:
            values = synthetic_tensor(canonical(name), shape, seed)
            filled.append(canonical(name))
        p.data.copy_(torch.from_numpy(values))
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert (head.data_ptr() == embed.data_ptr()) == tied, "tied head does not match the config"
    assert tied or "lm_head.weight" in params
    return sorted(filled)


def logits(model, tokens, dtype):
    import torch

    model = model.to(dtype)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    return out.to(torch.float64).numpy()


def relative_l2_per_position(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output directory (one subdirectory per model)")
    ap.add_argument("--selftest", action="store_true", help="print generator values and exit (numpy only)")
    ap.add_argument("--save-models", metavar="DIR", help="also save each model as an HF folder (float32)")
    ap.add_argument(
        "--only",
        action="append",
        metavar="NAMES",
        help=f"these models only: comma-separated, repeatable (of {', '.join(MODELS)})",
    )
    args = ap.parse_args()
    if args.selftest:
        selftest()
        return
    if not args.out:
        ap.error("--out is required")
    only = [n for names in args.only for n in names.split(",") if n] if args.only else list(MODELS)
    unknown = [n for n in only if n not in MODELS]
    if unknown:
        ap.error(f"--only: unknown model {', '.join(unknown)} (of {', '.join(MODELS)})")

    import torch
    import transformers

    torch.manual_seed(0)
    worst = 0.0
    for name in only:
        arch, kwargs, rope, seed = MODELS[name]
        cfg, model = build(arch, kwargs, rope)
        model.eval()
        tied = kwargs["tie_word_embeddings"]
        loaded = load_synthetic(model, seed, tied, kwargs["hidden_size"])
        tokens = tokens_for(kwargs["vocab_size"])

        freqs = rotary_frequencies(model, arch)
        head_dim = kwargs.get("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        for f in freqs.values():
            assert f.shape == (head_dim // 2,), f.shape

        if args.save_models:
            model.save_pretrained(os.path.join(args.save_models, name), safe_serialization=True)
        l32 = logits(model, tokens, torch.float32)
        l64 = logits(model, tokens, torch.float64)
        err = float(relative_l2_per_position(l32, l64).max())
        worst = max(worst, err)

        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(cfg.to_json_string(use_diff=False))
        np.asarray(tokens, dtype="<u4").tofile(os.path.join(d, "tokens.u32"))
        l64.astype("<f4").tofile(os.path.join(d, "logits.f32"))
        freqs["global"].astype("<f4").tofile(os.path.join(d, "inv_freq.f32"))
        if "local" in freqs:
            freqs["local"].astype("<f4").tofile(os.path.join(d, "inv_freq_local.f32"))
        meta = {
            "seed": seed,
            "positions": POSITIONS,
            "vocab": kwargs["vocab_size"],
            "tensors": loaded,
            "hf_float32_vs_float64_max_relative_l2": err,
            "logits": "float64 run, stored as float32",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(f"{name}: {len(loaded)} tensors, logits {l64.shape}, HF f32 vs f64 max relative L2 {err:.3e}")
    print(f"max relative L2 of HF float32 vs float64 over all models: {worst:.3e}")


if __name__ == "__main__":
    sys.exit(main())
