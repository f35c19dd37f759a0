#!/usr/bin/env python3
"""Writes the reference data tests/tokenizer/reference.rs checks hostembed's GGUF tokenizers against.

  pip install tokenizers sentencepiece transformers
  python3 scripts/tokenizer_reference.py        # from the repository root

tests/data/tokenizer/bpe_vocab.json: a byte-level BPE trained here (the `tokenizers` package) on
assets/hostembed.txt and tests/data/tokenizer/mixed.txt, in GGUF's terms (tokens by id, merges as
"left right", token types).
tests/data/tokenizer/bpe_expected.json: for each `tokenizer.ggml.pre` name (names giving the same ids
share an entry of "results"), the ids the `tokenizers` package gives for the test texts with that vocabulary and the split the name stands for, built here
from the model family's own pre-tokenizer (GPT-2's byte-level split, digits then GPT-2, or the family's
split patterns) rather than from hostembed's table.
tests/data/tokenizer/spm_vocab.json and spm_expected.json: a SentencePiece BPE model with byte
fallback (Llama 2's settings) trained here with the `sentencepiece` package, as GGUF's pieces, scores
and token types, and the ids `sentencepiece` itself gives for the test texts.

tests/data/tokenizer/chat_expected.json: the Llama 3, Llama 3.1, Qwen2.5 and SmolLM2 chat templates
(tests/data/tokenizer/templates/, as their tokenizer_config.json files give them) rendered by
transformers' `apply_chat_template` over a few conversations, with and without a system message and
the generation prompt. Llama 3.1 writes today's date (strftime_now): "date" records the one rendered.

Training is deterministic for a given package version; the files are committed, so tests need neither
package.
"""

import json
import os
import sys
import tempfile

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "tokenizer")
SPECIAL = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"]
BPE_VOCAB = 1400

# GGUF token types (llama.cpp's numbering).
NORMAL, CONTROL, UNUSED, BYTE = 1, 3, 5, 6


def corpus():
    with open(os.path.join(ROOT, "assets", "hostembed.txt"), encoding="utf-8") as f:
        text = f.read()
    with open(os.path.join(DATA, "mixed.txt"), encoding="utf-8") as f:
        mixed = f.read()
    return text + "\n" + mixed, mixed


def test_texts(mixed):
    texts = [line for line in mixed.split("\n") if line]
    texts += [
        mixed,
        "CRLF\r\nline\r\n\r\nends\r",
        "trailing spaces   ",
        "   leading spaces and\ttabs\t\t",
        "digits 1 12 123 1234 12345 123456 1234567 and 3.14 and 1,000,000",
        "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n",
        "not special: <|im_start and |> and <|eos |>",
        "",
        " ",
        "\n\n\n",
        "Ünïcödé 😀😀 中文字符 ١٢٣ Ⅻ ⑦",
    ]
    return texts


# ---------------------------------------------------------------------------------------------
# Byte-level BPE and the pre-tokenizer names

GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# BLOOM's tokenizer.json pattern, punctuation as characters.
BLOOM = " ?[^(\\s|[.,!?…。，、।۔،])]+"
DEEPSEEK_LLM_LETTERS = "\\s?[A-Za-z" + "".join(
    chr(a) if a == b else chr(a) + "-" + chr(b)
    for a, b in [
        (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF),
        (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A),
        (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
        (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
        (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
        (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
        (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
        (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
        (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
        (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
        (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
        (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
        (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
        (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
        (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2),
        (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
    ]
) + "]+"
DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿]+"
DEEPSEEK3_WORDS = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
TEKKEN = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
KIMI_K2 = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
BAILING = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
SEED_CODER = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
# Digits grouped by three from the right, as SuperBPE's tokenizer.json splits them: runs, then cuts.
DIGIT_RUNS_BY_THREE = [r"\p{N}+", r"(?=(\d{3})+(?!\d))"]
AFMOE_CJK = "[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+"


def byte_level(use_regex):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def splits(*patterns):
    return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns] + [byte_level(False)]


GPT2_SPLIT = [byte_level(True)]
DIGITS_THEN_GPT2 = [pre_tokenizers.Digits(individual_digits=True), byte_level(True)]

# name -> (pre-tokenizer steps, ignore_merges)
FAMILIES = [
    (["gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"],
     lambda: GPT2_SPLIT, False),
    (["default"], lambda: splits(r"[\p{P}\$\+<=>\^~\|]+", GPT2_WORDS, r"\p{N}+", "[0-9][0-9][0-9]"), False),
    (["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
     lambda: splits(LLAMA3), True),
    (["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], lambda: splits(LLAMA3), False),
    (["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"], lambda: splits(QWEN2), False),
    (["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"], lambda: DIGITS_THEN_GPT2, False),
    (["deepseek-llm"], lambda: splits("[\r\n]", DEEPSEEK_LLM_LETTERS, "\\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                                      DEEPSEEK_CJK, r"\p{N}+"), False),
    (["deepseek-v3", "hunyuan-dense"], lambda: splits(r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3_WORDS), False),
    (["deepseek-coder"], lambda: splits("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DEEPSEEK_CJK, r"\p{N}"), False),
    (["falcon"], lambda: splits(r"[\p{P}\$\+<=>\^~\|`]+", GPT2_WORDS, "[0-9][0-9][0-9]"), False),
    (["poro-chat", "bloom", "gpt3-finnish"], lambda: splits(BLOOM), False),
    (["viking"], lambda: splits(BLOOM)[:-1] + [pre_tokenizers.Digits(individual_digits=True), byte_level(False)], False),
    (["tekken"], lambda: splits(TEKKEN), True),
    (["chameleon"], lambda: splits("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\t\n]|    |  )",
                                   r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2_WORDS), False),
    (["gpt-4o", "llama4", "minimax-m2"], lambda: splits(GPT4O), False),
    (["kimi-k2"], lambda: splits(KIMI_K2), False),
    (["superbpe"], lambda: splits(*DIGIT_RUNS_BY_THREE), False),
    (["bailingmoe", "bailingmoe2", "llada-moe"], lambda: splits(BAILING), False),
    (["seed-coder"], lambda: splits(SEED_CODER), False),
    (["afmoe"], lambda: splits(*DIGIT_RUNS_BY_THREE, AFMOE_CJK, DEEPSEEK3_WORDS), False),
]


def byte_chars():
    """GPT-2's byte-to-character map."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def train_bpe(text):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level(True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(s, special=True) for s in SPECIAL],
        initial_alphabet=sorted(byte_chars().values()),
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in by_id]
    assert [i for _, i in by_id] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [CONTROL if t in SPECIAL else NORMAL for t in tokens]
    # Two padding entries past the trained ids, as real vocabularies pad to a round size.
    for i in range(2):
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(UNUSED)
    return tokens, merges, types


def bpe_reference(tokens, merges, types, steps, ignore_merges):
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, types) if k == CONTROL])
    return tok


def write_json(name, value):
    path = os.path.join(DATA, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")
    print("wrote", os.path.relpath(path, ROOT))


def bpe_data(text, texts):
    tokens, merges, types = train_bpe(text)
    write_json("bpe_vocab.json", {"tokens": tokens, "merges": merges, "token_types": types})
    # Names whose splits give the same ids share one entry of "results".
    results, names_to_result = [], {}
    for names, steps, ignore_merges in FAMILIES:
        tok = bpe_reference(tokens, merges, types, steps(), ignore_merges)
        ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
        if ids not in results:
            results.append(ids)
        for name in names:
            names_to_result[name] = results.index(ids)
    write_json("bpe_expected.json", {"texts": texts, "results": results, "names": names_to_result})


# ---------------------------------------------------------------------------------------------
# SentencePiece

def spm_data(text, texts):
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        corpus_path = os.path.join(tmp, "corpus.txt")
        with open(corpus_path, "w", encoding="utf-8") as f:
            f.write(text)
        prefix = os.path.join(tmp, "spm")
        # Llama 2's trainer settings that change what encoding does: BPE, byte fallback, no
        # normalization, a dummy prefix, whitespace kept as written, digits split.
        spm.SentencePieceTrainer.train(
            input=corpus_path,
            model_prefix=prefix,
            model_type="bpe",
            vocab_size=900,
            byte_fallback=True,
            normalization_rule_name="identity",
            add_dummy_prefix=True,
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            character_coverage=0.9995,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=1,
            minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_byte(i):
            types.append(BYTE)
        elif sp.is_unused(i):
            types.append(UNUSED)
        else:
            types.append(NORMAL)
    write_json("spm_vocab.json", {"tokens": tokens, "scores": scores, "token_types": types})
    # Special tokens in text are llama.cpp's business, not sentencepiece's: plain texts only.
    plain = [t for t in texts if "<|" not in t]
    write_json("spm_expected.json", {"texts": plain, "ids": [sp.encode(t) for t in plain]})


# ---------------------------------------------------------------------------------------------
# Chat templates

# template file -> (bos_token, eos_token) as the model's tokenizer_config.json names them.
TEMPLATES = {
    "llama3.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3.1.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5.jinja": ("<|endoftext|>", "<|im_end|>"),
    "smollm2.jinja": ("<|im_start|>", "<|im_end|>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello! What's 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  Tell me a joke.\n"},
    ],
    [
        {"role": "user", "content": "Grüße, 你好 😀"},
        {"role": "assistant", "content": "Bonjour !\n\nLine two."},
        {"role": "user", "content": "Quotes \"here\" and 'there' and {{ braces }}"},
    ],
    [{"role": "system", "content": "System only."}],
]


def chat_data():
    import datetime

    from transformers import PreTrainedTokenizerFast

    cases = []
    for name, (bos, eos) in TEMPLATES.items():
        with open(os.path.join(DATA, "templates", name), encoding="utf-8") as f:
            template = f.read()
        backend = Tokenizer(models.BPE())
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
        tok.chat_template = template
        for messages in CONVERSATIONS:
            for add_generation_prompt in (False, True):
                date = datetime.datetime.now().strftime("%d %b %Y")
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
                cases.append({
                    "date": date,
                    "template": name,
                    "bos_token": bos,
                    "eos_token": eos,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "text": text,
                })
    write_json("chat_expected.json", cases)


def main():
    text, mixed = corpus()
    texts = test_texts(mixed)
    bpe_data(text, texts)
    spm_data(text, texts)
    chat_data()


if __name__ == "__main__":
    sys.exit(main())
