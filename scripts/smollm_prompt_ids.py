#!/usr/bin/env python3
"""Prints the token ids tests/smollm.rs checks in: the prompt "The capital of France is" and " Paris",
then a Rust constant SENTENCES with the ids of varied sentences (punctuation, digit runs, runs of spaces
and newlines, contractions, accented Latin, CJK and emoji, code), all tokenized by the Python `tokenizers`
package from the vocabulary and merges of SmolLM2's GGUF file (byte-level BPE with SmolLM's split:
single digits, then GPT-2's byte-level pattern), so the library's own tokenizer can be checked against
an independent implementation. Exits non-zero if the file's pre-tokenizer is not "smollm" or an id list
does not decode back to its exact sentence.
Usage: PYTHONPATH=<gguf and tokenizers packages> python3 scripts/smollm_prompt_ids.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import sys

from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# Each one exercises a different part of the split or of the byte-level alphabet.
SENTENCES = [
    "Hello, world! How are you today?",
    "In 2024, 1,234,567 people paid $3.50 each.",
    "  two leading spaces,   three inside\nand a newline\n\n\tthen a tab.",
    "I don't think it's what they'll say; we've done it.",
    "Café naïve résumé façade Ångström",
    "日本語のテキスト 你好，世界！ 😀👍🏽",
    "fn main() { println!(\"hi\"); }\nlet p = \"C:\\\\tmp\";",
    "x=12abc3   trailing  ",
]


def field(reader, key):
    return reader.fields[key].contents()


def rust_str(text):
    """A Rust string literal for text: escapes quotes, backslashes and control characters, keeps other UTF-8."""
    out = []
    for ch in text:
        if ch in "\\\"":
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def main(path):
    reader = GGUFReader(path)
    # The split below is llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json); refuse any other.
    pre = field(reader, "tokenizer.ggml.pre")
    if pre != "smollm":
        sys.exit(f"tokenizer.ggml.pre is {pre!r}, not 'smollm': the split here would be wrong")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    # use_regex=True (the default, spelled out) applies GPT-2's pattern after the digit split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for text in ["The capital of France is", " Paris"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        print(f"{text!r}: {ids} -> {tok.decode(ids)!r}")

    rows = []
    for text in SENTENCES:
        ids = tok.encode(text, add_special_tokens=False).ids
        back = tok.decode(ids)
        # BPE without unk_token drops bytes absent from the vocabulary; a lossless round trip rules that out.
        if back != text:
            sys.exit(f"round trip failed: {text!r} -> {ids} -> {back!r}")
        print(f"round trip ok: {text!r} ({len(ids)} ids)")
        rows.append(f"    ({rust_str(text)}, &[{', '.join(map(str, ids))}]),")
    print()
    print("const SENTENCES: &[(&str, &[i32])] = &[")
    print("\n".join(rows))
    print("];")


if __name__ == "__main__":
    main(sys.argv[1])
