#!/usr/bin/env python3
"""A Hugging Face tokenizer.json rebuilt from one of llama.cpp's vocabulary test files.

llama.cpp's converter only accepts tokenizers whose pre-tokenization it recognises (it hashes the
encoding of a probe string). Its source tree ships vocab-only GGUFs of known tokenizers
(models/ggml-vocab-*.gguf); this rebuilds GPT-2's byte-level BPE from one, so a random benchmark
model carries a tokenizer both engines accept — with no download.

    python3 tokenizer_from_gguf.py LLAMA_CPP_DIR/models/ggml-vocab-gpt-2.gguf OUT_DIR
"""
import json
import os
import sys


def main():
    src, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(src))), "gguf-py"))
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    r = gguf.GGUFReader(src)

    def strings(name):
        f = r.fields[name]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(name):
        f = r.fields[name]
        return int(f.parts[f.data[0]][0])

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = tokens[scalar("tokenizer.ggml.eos_token_id")]
    tok.add_special_tokens([eos])
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    json.dump({"tokenizer_class": "GPT2Tokenizer", "bos_token": eos, "eos_token": eos, "unk_token": eos,
               "model_max_length": 1024, "add_bos_token": False},
              open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)
    json.dump({"eos_token_id": scalar("tokenizer.ggml.eos_token_id"), "vocab_size": len(tokens)},
              open(os.path.join(out, "vocab.json.meta"), "w"))
    print(f"{len(tokens)} tokens, {len(merges)} merges, eos {eos!r}")


if __name__ == "__main__":
    main()
