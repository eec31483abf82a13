#!/usr/bin/env python3
"""Byte-level BPE vocabularies as GGUF files, small enough to commit, with the ids the real
tokenizers give llama.cpp's tokenizer test texts (`tests/fixtures/gguf/vocab/`).

llama.cpp ships vocabulary-only GGUFs of real tokenizers (`models/ggml-vocab-NAME.gguf`) with test
texts (`.inp`) and the ids transformers gave them with the original tokenizer (`.out`). Those files
are 6-8 MB each, so this script cuts each down to what its test texts use, keeping the ids'
meaning:

1. The full vocabulary is rebuilt as a `tokenizers` BPE with the pre-tokenizer of the original
   `tokenizer.json` (the regexes below, as published with each model) and `ignore_merges` as the
   original has it, and must give every `.out` line: this checks the splits against transformers'
   recorded output, independently of shimmer's Rust.
2. Every word of every text is run through BPE with the full merge list and the merges it applies
   are recorded. The kept vocabulary is the 256 byte symbols, the control / user-defined tokens,
   and every token those merges produce; the kept merges are the applied ones, in their original
   order. For any of these words, the lowest-ranked merge present at each step is the same in the
   kept list as in the full one, so the result is the same token sequence.
3. The cut vocabulary is rebuilt the same way and must give the `.out` ids renumbered into it;
   the GGUF (same `tokenizer.ggml.*` keys, no tensors), the `.inp` and the renumbered `.out` are
   written.

`deepseek-v3` and `glm4` have no vocabulary file in llama.cpp: `deepseek-v3` reuses the Llama 3
vocabulary under DeepSeek-V3's three splits with its ids from `tokenizers` (the splits as
DeepSeek-V3's `tokenizer.json` has them; the script checks that they give other ids than Llama 3's
split on some texts, so the fixture tells them apart), `glm4` is the Llama 3 file under GLM-4.5's name (its
split and `ignore_merges` are Llama 3's; llama.cpp treats them alike).

    /tmp/oracle-venv/bin/python tests/oracle/make_gguf_vocabs.py LLAMA_CPP_DIR
"""
import os
import sys

import gguf
import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "gguf", "vocab")

# The pre-tokenizer regexes of the original tokenizer.json files (llama.cpp quotes the Qwen2,
# Qwen3.5 and Llama 3 ones beside its own adaptations in src/llama-vocab.cpp).
QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN35 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
DEEPSEEK3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
]

# Texts whose ids differ between DeepSeek-V3's splits and Llama 3's (CJK runs isolated from the
# space before them, kana, punctuation before non-ASCII letters, marks inside words).
DEEPSEEK3_TEXTS = [
    "Hello 中文 text",
    " 你好世界 and 日本語のテキスト",
    "漢字とカタカナ、ひらがな。",
    "(привет) «мир»",
    "x=1234567; y = 89 0.5",
    "नमस्ते दुनिया",
]

# (fixture name, llama.cpp vocabulary file, tokenizer.ggml.pre written, splits, ignore_merges)
VOCABS = [
    ("qwen2", "qwen2", "qwen2", [QWEN2], False),
    ("qwen35", "qwen35", "qwen35", [QWEN35], False),
    ("llama-bpe", "llama-bpe", "llama-bpe", [LLAMA3], True),
    ("glm4", "llama-bpe", "glm4", [LLAMA3], True),
    ("deepseek-v3", "llama-bpe", "deepseek-v3", DEEPSEEK3, False),
]

CONTROL, USER_DEFINED = 3, 4


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def build(tokens, merges, splits, ignore_merges, specials):
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits] + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    if specials:
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    return tok


def bpe_applied(word, ranks, vocab, ignore_merges):
    """The merges BPE applies to `word` (a byte-level string) and the tokens it makes."""
    if ignore_merges and word in vocab:
        return [], [word]
    symbols = list(word)
    applied = []
    while len(symbols) > 1:
        best = None
        for i in range(len(symbols) - 1):
            r = ranks.get((symbols[i], symbols[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        pair = (symbols[best[1]], symbols[best[1] + 1])
        applied.append(pair)
        merged, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
                merged.append(pair[0] + pair[1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return applied, symbols


def main(llama_cpp):
    os.makedirs(OUT, exist_ok=True)
    byte_symbols = set(pre_tokenizers.ByteLevel.alphabet())
    for name, source, pre, splits, ignore_merges in VOCABS:
        path = os.path.join(llama_cpp, "models", f"ggml-vocab-{source}.gguf")
        reader = gguf.GGUFReader(path)
        tokens = field(reader, "tokenizer.ggml.tokens")
        merges = field(reader, "tokenizer.ggml.merges")
        types = field(reader, "tokenizer.ggml.token_type")
        specials = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
        texts = open(path + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")[:-1]
        full = build(tokens, merges, splits, ignore_merges, specials)
        if name == "deepseek-v3":
            texts += DEEPSEEK3_TEXTS
            expected = [full.encode(t, add_special_tokens=False).ids for t in texts]
            other = build(tokens, merges, [LLAMA3], ignore_merges, specials)
            differ = sum(other.encode(t, add_special_tokens=False).ids != e for t, e in zip(texts, expected))
            assert differ >= 2, f"{name}: only {differ} texts split differently from Llama 3"
            print(f"{name}: {differ} of {len(texts)} texts have other ids under Llama 3's split")
        else:
            lines = open(path + ".out", encoding="utf-8").read().split("\n")
            expected = [[int(x) for x in line.split()] for line in lines[: len(texts)]]
            for text, want in zip(texts, expected):
                got = full.encode(text, add_special_tokens=False).ids
                assert got == want, f"{name}: {text!r}: {got} != transformers' {want}"
        ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        vocab = {t: i for i, t in enumerate(tokens)}
        keep_merges, keep_tokens = set(), set(byte_symbols) | {tokens[i] for i in specials}
        for text, want in zip(texts, expected):
            keep_tokens.update(tokens[i] for i in want)
            for word, _ in full.pre_tokenizer.pre_tokenize_str(text):
                applied, made = bpe_applied(word, ranks, vocab, ignore_merges)
                keep_merges.update(applied)
                keep_tokens.update(made)
                keep_tokens.update(a + b for a, b in applied)
        kept_ids = sorted(vocab[t] for t in keep_tokens if t in vocab)
        renumber = {old: new for new, old in enumerate(kept_ids)}
        cut_tokens = [tokens[i] for i in kept_ids]
        cut_merges = [m for m in merges if tuple(m.split(" ", 1)) in keep_merges]
        cut_types = [int(types[i]) for i in kept_ids]
        cut_specials = [renumber[i] for i in specials]
        cut = build(cut_tokens, cut_merges, splits, ignore_merges, cut_specials)
        cut_expected = [[renumber[i] for i in want] for want in expected]
        for text, want in zip(texts, cut_expected):
            got = cut.encode(text, add_special_tokens=False).ids
            assert got == want, f"{name} (cut): {text!r}: {got} != {want}"
            assert cut.decode(want, skip_special_tokens=False) == text, f"{name}: {text!r} decodes back"

        out = os.path.join(OUT, f"ggml-vocab-{name}.gguf")
        writer = gguf.GGUFWriter(out, arch=field(reader, "general.architecture"))
        writer.add_name(f"{name} (cut to llama.cpp's test texts)")
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(cut_tokens)
        writer.add_token_types(cut_types)
        writer.add_token_merges(cut_merges)
        for key, add in [("tokenizer.ggml.bos_token_id", writer.add_bos_token_id), ("tokenizer.ggml.eos_token_id", writer.add_eos_token_id)]:
            old = field(reader, key)
            if old is not None and int(old) in renumber:
                add(renumber[int(old)])
        add_bos = field(reader, "tokenizer.ggml.add_bos_token")
        if add_bos is not None:
            writer.add_add_bos_token(bool(add_bos))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(out + ".inp", "w", encoding="utf-8") as f:
            f.write("".join(t + "\n__ggml_vocab_test__\n" for t in texts))
        with open(out + ".out", "w", encoding="utf-8") as f:
            f.write("".join(" " + " ".join(map(str, ids)) + "\n" if ids else "\n" for ids in cut_expected))
        print(f"{name}: {len(tokens)} -> {len(cut_tokens)} tokens, {len(merges)} -> {len(cut_merges)} merges, {os.path.getsize(out)} bytes, {len(texts)} texts")


if __name__ == "__main__":
    main(sys.argv[1])
