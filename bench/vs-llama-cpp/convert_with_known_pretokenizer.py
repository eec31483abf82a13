#!/usr/bin/env python3
"""Runs llama.cpp's own convert_hf_to_gguf.py, telling it that a byte-level BPE tokenizer it has
never seen pre-tokenises as GPT-2 does (the demo model's tokenizer is trained with
`pre_tokenizers.ByteLevel`, which is exactly that). Nothing else of the converter changes; for
models whose tokenizer it knows, the patch never triggers.

    python3 convert_with_known_pretokenizer.py LLAMA_CPP_DIR HF_DIR --outtype bf16 --outfile OUT.gguf
"""
import os
import runpy
import sys

llama = os.path.abspath(sys.argv[1])
sys.path[:0] = [llama, os.path.join(llama, "gguf-py")]
import conversion.base as base  # noqa: E402

original = base.TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"


base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [os.path.join(llama, "convert_hf_to_gguf.py")] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
