#!/usr/bin/env python3
"""Prints the token ids tests/smollm.rs checks in: the prompt "The capital of France is" and " Paris",
tokenized by the Python `tokenizers` package from the vocabulary and merges of SmolLM2's GGUF file
(byte-level BPE with SmolLM's split: single digits, then GPT-2's byte-level pattern).
Usage: PYTHONPATH=<gguf package> python3 scripts/smollm_prompt_ids.py models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import sys

from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def field(reader, key):
    return reader.fields[key].contents()


def main(path):
    reader = GGUFReader(path)
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    for text in ["The capital of France is", " Paris"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        print(f"{text!r}: {ids} -> {tok.decode(ids)!r}")


if __name__ == "__main__":
    main(sys.argv[1])
