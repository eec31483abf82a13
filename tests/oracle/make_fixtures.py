#!/usr/bin/env python3
"""Makes shimmer's oracle fixtures: tiny random-initialised MoE models of each supported family,
saved as standard Hugging Face checkpoints, with what transformers computes on them.

For each fixture directory under tests/fixtures/<name>/ it writes the checkpoint (config.json,
safetensors, tokenizer.json, tokenizer_config.json / chat_template.jinja, generation_config.json)
and two oracle files:
  oracle.json          prompts, their ids, greedy continuations, per-position argmax and top-2
                       margins, chat-template renders, tokenizer round trips
  oracle.safetensors   the teacher-forced logits [T, vocab] (f32) for each prompt

The oracle is computed by *reloading the saved directory* with transformers in float32 and eager
attention, so the files on disk are exactly what transformers reads (older config spellings
included) and bf16/f16 weights are the rounded values both sides use.

Usage (from the repository root):
  python3 -m venv /tmp/oracle-venv && /tmp/oracle-venv/bin/pip install -r tests/oracle/requirements.txt
  apt-get install -y bible-kjv          # the public-domain text the tokenizers are trained on
  /tmp/oracle-venv/bin/python tests/oracle/make_fixtures.py
  /tmp/oracle-venv/bin/python tests/oracle/make_fixtures.py --demo models/demo   # the demo model's oracle
  /tmp/oracle-venv/bin/python tests/oracle/make_fixtures.py --only gpt_oss        # one family's fixtures
"""
import json
import math
import re
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, GlmMoeDsaConfig, GptOssConfig,
                          DeepseekV4Config, KimiLinearConfig, MixtralConfig, InklingForCausalLM, Inkling2ForCausalLM,
                          InklingConfig, InklingForConditionalGeneration, Inkling2Config, Inkling2ForConditionalGeneration,
                          OlmoeConfig, PreTrainedTokenizerFast, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                          Qwen3MoeConfig, Qwen3NextConfig)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fixtures")
NEAR_TIE = 1e-3  # logit margin under which the top-2 order is not meaningful in f32
GREEDY_TOKENS = 40

CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BRACKETS = (
    "{{ bos_token }}{% for m in messages %}\n"
    "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "[{{ m.role | upper }}] {{ m.content.strip() }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "  {% if loop.index > 6 %}{% break %}{% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
META = (
    "{% set roles = messages | map(attribute='role') | list %}"
    "<meta>{{ {'turns': messages | length, 'roles': roles, 'first': messages[0]['content'][:12]} | tojson }}</meta>\n"
    "{% for m in messages %}{% if loop.first and m.role != 'system' %}<|system|>\nYou are helpful.\n{% endif %}"
    "<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# gpt-oss's harmony layout (the published template's structure and tokens, without its tools and
# date line, which would make the render depend on the day).
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|start|>developer<|message|># Instructions\n\n{{ m.content }}<|end|>"
    "{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|return|>"
    "{%- else %}{{ raise_exception('Unknown role: ' + m.role) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
# GLM's layout (GLM-4.5 and GLM-5 publish it, with tools and thinking besides).
GLM = (
    "[gMASK]<sop>"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}"
    "{%- else %}{{ raise_exception('Unknown role: ' + m.role) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}"
)
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]

# Kimi's layout (Kimi K2 and Kimi Linear publish it, with tools besides).
KIMI = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- else %}{{ raise_exception('Unknown role: ' + m.role) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{%- endif %}"
)

HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>", "<|call|>"]

CONVERSATIONS = [
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Who made the heaven and the earth?"}],
    [{"role": "user", "content": "  Hello there  "}, {"role": "assistant", "content": "Peace be unto you."},
     {"role": "user", "content": "Tell me of \"Moses\" — and Aaron."}],
]
BAD_CONVERSATION = [{"role": "wizard", "content": "abracadabra"}]

PROMPTS = [
    "In the beginning God created",
    "And the LORD spake unto Moses, saying,",
    "Blessed are the meek: for they shall inherit the earth. Blessed are they which do hunger and thirst after righteousness",
]
TOKENIZER_PROBES = ["Hello, world!", "  leading spaces\tand tabs\nnewlines", "ümlauts, émigré and 日本語", "<|im_start|>user\nhi<|im_end|>"]


def corpus():
    books = ["Genesis 1:1-50:26", "Exodus 1:1-40:38", "Psalms 1:1-150:6", "Matthew 1:1-28:20"]
    lines = []
    for b in books:
        out = subprocess.run(["bible", "-f", b], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split(" ", 1)
            if len(parts) == 2:
                lines.append(parts[1])
    return lines


# Moonshot's tokenizer class for Kimi checkpoints (`TikTokenTokenizer`, `tokenization_kimi.py`):
# its split pattern, and 256 + 2 special ids after the ranks, named by tokenizer_config.json's
# added_tokens_decoder (the rest `<|reserved_token_{id}|>`).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_SPECIAL_IDS = 258
# Offsets after the ranks at which Kimi's tokenizer_config.json names its specials (K2, Linear).
KIMI_SPECIAL_OFFSETS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
                        "<|start_header_id|>": 6, "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10,
                        "<|im_middle|>": 17, "[UNK]": 254, "[PAD]": 255}


class KimiTikToken:
    """A Kimi checkpoint's tokenizer as its class behaves, over the `tiktoken` package (the engine
    the class runs): encode with every special allowed, after cutting the text into pieces of at
    most 400 000 characters and runs of at most 25 000 (non-)whitespace characters; decode as
    UTF-8 with replacement; `skip_special_tokens` drops what added_tokens_decoder marks special."""

    extra_probes = ["DON'T you know? We'll see; they've 12345 apples.", "中文和English混合 文本", "[BOS]hi[EOS]<|im_user|>x",
                    "<|reserved_token_{}|> reserved", "tabs\t\t and \r\n crlf   ", "emoji 🙂 and ĳ ligature"]

    def __init__(self, ranks, added, template):
        import tiktoken
        self.ranks, self.added, self.template = ranks, added, template
        base = len(ranks)
        names = {base + off: name for name, off in added.items()}
        self.specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + KIMI_SPECIAL_IDS)}
        self.skip = set(names)
        self.enc = tiktoken.Encoding(name="kimi-fixture", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=self.specials)
        self.extra_probes = [p.format(base + 5) for p in KimiTikToken.extra_probes]

    @classmethod
    def from_bpe(cls, bpe):
        """Ranks from a byte-level BPE: its tokens' bytes, ranked in id order."""
        # GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others
        # for U+0100 upwards in byte order.
        printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
        others = [b for b in range(256) if b not in printable]
        byte_of = {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}
        vocab = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
        ranks = {bytes(byte_of[c] for c in tok): i for i, (tok, _) in enumerate(vocab)}
        return cls(ranks, KIMI_SPECIAL_OFFSETS, None)

    @classmethod
    def load(cls, d):
        from tiktoken.load import load_tiktoken_bpe
        ranks = load_tiktoken_bpe(os.path.join(d, "tiktoken.model"))
        config = json.load(open(os.path.join(d, "tokenizer_config.json")))
        added = {e["content"]: int(i) - len(ranks) for i, e in config["added_tokens_decoder"].items()}
        template = open(os.path.join(d, "chat_template.jinja")).read()
        return cls(ranks, added, template)

    def vocab_size(self):
        return len(self.ranks) + KIMI_SPECIAL_IDS

    def token_to_id(self, name):
        return self.specials[name]

    def save(self, d, template):
        import base64
        with open(os.path.join(d, "tiktoken.model"), "w") as f:
            for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
                f.write(f"{base64.b64encode(token).decode()} {rank}\n")
        base = len(self.ranks)
        config = {
            "tokenizer_class": "TikTokenTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
            "bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
            "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                          "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
            "added_tokens_decoder": {str(base + off): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                                       "single_word": False, "special": True}
                                     for name, off in sorted(self.added.items(), key=lambda kv: kv[1])},
            "model_max_length": 1048576,
        }
        json.dump(config, open(os.path.join(d, "tokenizer_config.json"), "w"), indent=2)
        with open(os.path.join(d, "chat_template.jinja"), "w") as f:
            f.write(template)

    @staticmethod
    def _runs(s, most):
        out, start, run, space = [], 0, 0, s[:1].isspace()
        for i, c in enumerate(s):
            if c.isspace() != space:
                run, space = 1, c.isspace()
            else:
                run += 1
                if run > most:
                    out.append(s[start:i])
                    start, run = i, 1
        out.append(s[start:])
        return out

    def encode(self, text):
        ids = []
        for i in range(0, len(text), 400_000):
            for piece in self._runs(text[i:i + 400_000], 25_000):
                ids.extend(self.enc.encode(piece, allowed_special="all"))
        return ids

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens=False):
        kept = [i for i in ids if not (skip_special_tokens and i in self.skip)]
        return self.enc.decode_bytes(kept).decode("utf-8", "replace")

    def apply_chat_template(self, conv, tokenize=True, add_generation_prompt=False, return_dict=False):
        from transformers.utils.chat_template_utils import render_jinja_template
        rendered, _ = render_jinja_template(conversations=[conv], chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt,
                                            bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]")
        return self.encode(rendered[0]) if tokenize else rendered[0]


def train_tokenizer(lines, vocab_size, bos, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>")):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(specials)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    if bos:
        name = bos if isinstance(bos, str) else "<s>"
        bos_id = tok.token_to_id(name)
        tok.post_processor = processors.TemplateProcessing(single=f"{name} $A", pair=f"{name} $A {name} $B", special_tokens=[(name, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def randomize(model, std, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Norm weights of exactly 1 would hide a missing multiply.
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name and getattr(model.config, "tie_word_embeddings", False):
                # A tied head dots each state with its own input embedding; a smaller embedding keeps
                # the layers, not the echo of the input token, in charge of the prediction.
                p.copy_(0.5 * std * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                # Sinks comparable with the scores, so that each head's sink takes a real share.
                p.copy_(1.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                # transformers initialises it to zeros, which would hide a bias applied to the weights.
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def old_spelling(config_path, rope_scaling=None):
    """Rewrites a transformers-5 config.json into the spelling most hub checkpoints still use."""
    cfg = json.load(open(config_path))
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["rope_theta"]
    if "partial_rotary_factor" in rp:
        cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]
    cfg["rope_scaling"] = rope_scaling
    cfg["torch_dtype"] = cfg.pop("dtype")
    json.dump(cfg, open(config_path, "w"), indent=2, sort_keys=True)


def margins(logits):
    top2 = torch.topk(logits, 2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def make(name, config, *, dtype, std, seed, tokenizer, template, template_in_config, old=None, shard=None,
         extra_eos=None, prompts=PROMPTS, f32_routers=False, bos_token="<s>", eos_token="<|im_end|>", adjust=None,
         model_class=None, check=None, keep_f32=(), rename=None, load=None):
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for attempt in range(int(os.environ.get("FIXTURE_TRIES", 20))):
        torch.manual_seed(seed + attempt)
        model = model_class(config) if model_class else AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize(model, std, seed + attempt)
        if adjust is not None:
            adjust(model)
        model = model.to(dtype)
        if f32_routers:
            # As DeepSeek-V3's hub checkpoints: router weights and biases stay f32 in bf16 shards.
            for mod_name, mod in model.named_modules():
                if mod_name.endswith("mlp.gate"):
                    mod.float()
        if keep_f32:
            # As the checkpoint ships them: these stay f32 in a bf16 model.
            with torch.no_grad():
                for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
                    if p.is_floating_point() and any(k in pname for k in keep_f32):
                        p.data = p.data.float()
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        model.save_pretrained(d, max_shard_size=shard) if shard else model.save_pretrained(d)
        if rename is not None:
            rename(d)
        if old is not None:
            old_spelling(os.path.join(d, "config.json"), old.get("rope_scaling"))
        if extra_eos is not None:
            json.dump({"eos_token_id": extra_eos, "do_sample": False}, open(os.path.join(d, "generation_config.json"), "w"), indent=2)
        if isinstance(tokenizer, KimiTikToken):
            tokenizer.save(d, template)
        else:
            fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos_token, eos_token=eos_token,
                                           unk_token=None, chat_template=template)
            fast.save_pretrained(d)
        if template_in_config:
            # The older layout: the template inside tokenizer_config.json.
            tc_path = os.path.join(d, "tokenizer_config.json")
            tc = json.load(open(tc_path))
            tc["chat_template"] = template
            json.dump(tc, open(tc_path, "w"), indent=2)
            os.remove(os.path.join(d, "chat_template.jinja"))
        # `load`: what transformers needs to read the saved files (a quantised release's config).
        ok, record, tensors = oracle(d, prompts, **(load or {}))
        if ok and check is not None:
            ok = check(d, record, **(load or {}))
        if ok:
            break
        print(f"{name}: seed {seed + attempt} gives EOS or a near-tie on a greedy path; trying the next", file=sys.stderr)
    else:
        raise SystemExit(f"{name}: no seed without EOS/near-ties in 20 tries")
    json.dump(record, open(os.path.join(d, "oracle.json"), "w"), indent=1, ensure_ascii=False)
    save_file(tensors, os.path.join(d, "oracle.safetensors"))
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"{name}: {size / 1e6:.2f} MB, seed {seed + attempt}")


def teacher_forced_stepwise(model, ids, dtype=torch.float32):
    """Logits at every position of `ids`, one token at a time through the cache."""
    out = model(torch.tensor([ids[:1]]), use_cache=True)
    rows = [out.logits[0, -1]]
    for t in ids[1:]:
        out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).to(dtype)


def why(reason):
    if os.environ.get("FIXTURE_WHY"):
        print(f"  rejected: {reason}", file=sys.stderr)


# Image-text checkpoints whose class AutoModelForCausalLM does not map: the oracle reads them
# with their own class (the text path is the causal LM's).
ORACLE_CLASS = {"inkling_mm_model": InklingForConditionalGeneration, "inkling2": Inkling2ForConditionalGeneration}


def oracle(d, prompts, **load):
    model_type = json.load(open(os.path.join(d, "config.json")))["model_type"]
    model = ORACLE_CLASS.get(model_type, AutoModelForCausalLM).from_pretrained(d, dtype=torch.float32, attn_implementation="eager", **load)
    model.eval()
    recurrent = "linear_attention" in (getattr(model.config, "layer_types", None) or [])
    if recurrent:
        model64 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager",
                                                       experts_implementation="eager").eval()
    tok = KimiTikToken.load(d) if os.path.exists(os.path.join(d, "tiktoken.model")) else PreTrainedTokenizerFast.from_pretrained(d)
    gen_eos = model.generation_config.eos_token_id
    eos = set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    record = {"transformers": __import__("transformers").__version__, "torch": torch.__version__,
              "near_tie": NEAR_TIE, "eos_ids": sorted(eos), "prompts": [], "chat": [], "tokenizer": []}
    tensors = {}
    ok = True
    for i, text in enumerate(prompts):
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            greedy = out[0, len(ids):].tolist()
            full = ids + greedy
            logits = model(torch.tensor([full])).logits[0].float()
            if recurrent:
                # A linear-attention model: a recurrent state carries rounding from token to
                # token, so f32 results sit ~5e-4 from the exact ones here (attention-only
                # fixtures: ~1e-5), and transformers' one-pass (chunked) and token-by-token f32
                # paths differ by ~1e-3. The oracle is the recurrence in float64; how far
                # transformers' own f32 evaluations sit from it is recorded, and bounds shimmer's
                # tolerance (`tests/parity.rs`).
                exact = teacher_forced_stepwise(model64, full, torch.float64)
                f32_error = max((logits.double() - exact).abs().max().item(),
                                (teacher_forced_stepwise(model, full).double() - exact).abs().max().item())
                record["reference_f32_error"] = max(record.get("reference_f32_error", 0.0), f32_error)
                if logits.argmax(-1).tolist() != exact.argmax(-1).tolist():
                    ok = False  # f32 and the exact answer disagree somewhere: a near-tie
                logits = exact.float()
        m = margins(logits)
        # The greedy path must be free of EOS and near-ties, so that an exact implementation
        # reproduces it token for token.
        path = m[len(ids) - 1: len(full) - 1]
        if any(t in eos for t in greedy) or min(path) < 2 * NEAR_TIE:
            why(f"prompt {i}: EOS in the greedy path or a margin of {min(path):.2g}")
            ok = False
        if logits.argmax(-1)[len(ids) - 1:-1].tolist() != greedy:
            why(f"prompt {i}: cached generate and one full pass disagree")
            ok = False  # cached generate and a single full pass disagree: treat as a near-tie
        tensors[f"logits.{i}"] = logits.contiguous()
        record["prompts"].append({
            "text": text, "ids": ids, "greedy": greedy, "greedy_text": tok.decode(greedy, skip_special_tokens=True),
            "argmax": logits.argmax(-1).tolist(), "margin": m,
            "logprobs": torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(full[1:])[:, None])[:, 0].tolist(),
        })
    for conv in CONVERSATIONS:
        for agp in (True, False):
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp)
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=agp, return_dict=False)
            record["chat"].append({"messages": conv, "add_generation_prompt": agp, "text": text, "ids": list(ids)})
    try:
        tok.apply_chat_template(BAD_CONVERSATION, tokenize=False)
        record["chat_error"] = None
    except Exception as e:  # the template's raise_exception, if it has one
        record["chat_error"] = {"messages": BAD_CONVERSATION, "message": str(e)}
    for probe in TOKENIZER_PROBES + getattr(tok, "extra_probes", []):
        ids = tok(probe)["input_ids"]
        record["tokenizer"].append({"text": probe, "ids": ids, "ids_no_special": tok(probe, add_special_tokens=False)["input_ids"],
                                    "decoded": tok.decode(ids), "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
    return ok, record, tensors


DEMO_PROMPTS = [
    "In the beginning God created the heaven and the earth. And the earth was",
    "To be, or not to be, that is the question:",
    "And the LORD said unto Moses,",
]
DEMO_TOP = 16


def make_demo(model_dir):
    """The demo model's oracle: greedy continuations, per-position argmax and margins, and the
    top-16 logits per position (the full 6k-wide rows would be megabytes)."""
    d = os.path.join(OUT, "demo_oracle")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    record = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "near_tie": NEAR_TIE,
              "top": DEMO_TOP, "prompts": [], "chat": []}
    for text in DEMO_PROMPTS:
        ids = tok(text)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, temperature=None, top_p=None)
            greedy = out[0, len(ids):].tolist()
            full = ids + greedy
            logits = model(torch.tensor([full])).logits[0].float()
        top = torch.topk(logits, DEMO_TOP, dim=-1)
        record["prompts"].append({
            "text": text, "ids": ids, "greedy": greedy, "greedy_text": tok.decode(greedy, skip_special_tokens=True),
            "argmax": logits.argmax(-1).tolist(), "margin": margins(logits),
            "top_ids": top.indices.tolist(), "top_logits": top.values.tolist(),
        })
    for conv in CONVERSATIONS:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
        record["chat"].append({"messages": conv, "add_generation_prompt": True, "text": text, "ids": list(ids)})
    json.dump(record, open(os.path.join(d, "oracle.json"), "w"), indent=1, ensure_ascii=False)
    print(f"demo_oracle: {os.path.getsize(os.path.join(d, 'oracle.json')) / 1e6:.2f} MB")


def make_fp8(src, dst, block=16):
    """A DeepSeek-style fp8 checkpoint from a bf16 fixture: every projection matrix (not the
    embeddings, LM head, routers or norms) as float8_e4m3fn with `<name>_scale_inv` block scales
    (amax/448 per block), and beside it, for the test, torch's own dequantisation in f32."""
    import json, shutil
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, reference = {}, {}
    for name, w in sorted(tensors.items()):
        if w.dim() == 2 and name.endswith("proj.weight"):
            w32 = w.to(torch.float32)
            r, c = w32.shape
            br, bc = -(-r // block), -(-c // block)
            scale = torch.zeros(br, bc, dtype=torch.float32)
            q = torch.zeros(r, c, dtype=torch.float8_e4m3fn)
            for i in range(br):
                for j in range(bc):
                    blk = w32[i * block:(i + 1) * block, j * block:(j + 1) * block]
                    s = blk.abs().max().clamp(min=1e-12) / 448.0
                    scale[i, j] = s
                    q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(torch.float8_e4m3fn)
            out[name] = q
            out[name + "_scale_inv"] = scale
            expanded = scale.repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]
            reference[name] = q.to(torch.float32) * expanded
        else:
            out[name] = w
    save_file(out, os.path.join(dst, "model.safetensors"))
    save_file(reference, dst.rstrip("/") + ".dequantized.safetensors")


FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_encode(w):
    """OCP MXFP4 along the last axis (groups of 32): e2m1 codes packed two per byte, low nibble
    first, and e8m0 scale bytes, as gpt-oss ships its experts. Returns (blocks [..., G, 16] u8,
    scales [..., G] u8, the exact values they stand for)."""
    *lead, k = w.shape
    g = w.float().reshape(*lead, k // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).clamp(0, 254)
    scale = torch.pow(2.0, e - 127)[..., None]
    x = (g / scale).clamp(-6, 6)
    code = (x.abs()[..., None] - FP4_GRID).abs().argmin(-1)  # nearest magnitude (ties to the smaller)
    code = code + 8 * ((x < 0) & (code > 0))
    values = torch.where(code >= 8, -FP4_GRID[code - 8 * (code >= 8)], FP4_GRID[code % 8]) * scale
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, e.to(torch.uint8), values.reshape(*lead, k)


def snap_experts_to_mxfp4(model):
    """Makes every routed expert weight exactly representable in MXFP4, so the bf16 fixture and
    its MXFP4 twin (`make_mxfp4`) are the same model."""
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            if mod_name.endswith("mlp.experts"):
                # gate_up_proj is [E, hidden, 2·inter] (in × out); the blocks run along the input.
                _, _, v = mxfp4_encode(mod.gate_up_proj.transpose(1, 2))
                mod.gate_up_proj.copy_(v.transpose(1, 2))
                _, _, v = mxfp4_encode(mod.down_proj.transpose(1, 2))
                mod.down_proj.copy_(v.transpose(1, 2))


def make_mxfp4(src, dst):
    """gpt-oss as OpenAI ships it: the routed experts as `<name>_blocks` / `<name>_scales`
    (out × in/32 × 16 and out × in/32), everything else as in the bf16 fixture, and
    `quantization_config.quant_method = mxfp4`. The oracle is transformers reading these files."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        if f.startswith("oracle"):
            os.remove(os.path.join(dst, f))
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            blocks, scales, values = mxfp4_encode(t.transpose(1, 2))
            assert torch.equal(values.to(t.dtype), t.transpose(1, 2)), f"{name} is not MXFP4-exact"
            # transformers' own dequantisation gives back the bf16 tensor bit for bit.
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=t.dtype), t), name
            out[name + "_blocks"], out[name + "_scales"] = blocks.contiguous(), scales.contiguous()
        else:
            out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    ok, record, logits = oracle(dst, PROMPTS)
    assert ok, "the MXFP4 twin must follow the bf16 fixture's greedy paths"
    json.dump(record, open(os.path.join(dst, "oracle.json"), "w"), indent=1, ensure_ascii=False)
    save_file(logits, os.path.join(dst, "oracle.safetensors"))
    print(f"{os.path.basename(dst)}: from {os.path.basename(src)}")


def e8m0_at_least(x):
    """The smallest power of two ≥ x, as its UE8M0 exponent byte and its value."""
    e = torch.ceil(torch.log2(x.clamp(min=2.0 ** -126))).clamp(-127, 127)
    return (e + 127).to(torch.uint8), torch.pow(2.0, e)


def fp8_ue8m0(w, block):
    """fp8-e4m3 with one power-of-two (UE8M0) scale per `block`×`block` block, each scale the least
    that keeps the block's largest magnitude within e4m3's 448, as DeepSeek-V4 ships its dense set."""
    w = w.float()
    r, c = w.shape
    br, bc = -(-r // block), -(-c // block)
    # transformers derives the block from the scale grid: the shapes used keep the two the same.
    assert (br == 1 or r == br * block) and (bc == 1 or c == bc * block), f"{w.shape} with blocks of {block}"
    amax = torch.zeros(br, bc)
    for i in range(br):
        for j in range(bc):
            amax[i, j] = w[i * block:(i + 1) * block, j * block:(j + 1) * block].abs().max()
    code, scale = e8m0_at_least(amax / 448.0)
    expanded = scale.repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]
    return (w / expanded).to(torch.float8_e4m3fn), code.view(torch.float8_e8m0fnu)


def fp4_packed(w):
    """FP4 (e2m1) as DeepSeek-V4 ships its routed experts: two codes a byte, low nibble first, in an
    int8 tensor (out × in/2), and one UE8M0 scale per 32 inputs of a row (out × ⌈in/32⌉)."""
    out_dim, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % 32))
    blocks, scales, _ = mxfp4_encode(padded)
    packed = blocks.reshape(out_dim, -1)[:, :k // 2]
    return packed.view(torch.int8).contiguous(), scales.view(torch.float8_e8m0fnu).contiguous()


V4_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$")
V4_FP4 = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


QUANTIZED_V4 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                "expert_dtype": "fp4", "weight_block_size": [32, 32]}


def quantize_v4_release(d):
    """DeepSeek-V4's release form, in place: the attention's and shared expert's projections in
    fp8-e4m3 with UE8M0 block scales (`<stem>.scale`), the routed experts in FP4 with UE8M0 scales
    per 32 inputs; the compressor, the indexer's scorer, router, embeddings, head and norms as they
    were; `quantization_config` as the release's, with blocks of 32 (so matrices span several)."""
    from safetensors.torch import load_file
    path = os.path.join(d, "model.safetensors")
    block = QUANTIZED_V4["weight_block_size"][0]
    out = {}
    for name, t in load_file(path).items():
        stem = name[:-len(".weight")]
        if V4_FP8.search(name):
            out[name], out[stem + ".scale"] = fp8_ue8m0(t, block)
        elif V4_FP4.search(name):
            out[name], out[stem + ".scale"] = fp4_packed(t)
        else:
            out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = QUANTIZED_V4
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--demo":
        make_demo(sys.argv[2])
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--fp8":
        make_fp8(sys.argv[2], sys.argv[3])
        return
    only = sys.argv[2] if len(sys.argv) == 3 and sys.argv[1] == "--only" else None
    lines = corpus()
    if only in (None, "gpt_oss"):
        make_gpt_oss(lines)
    if only in (None, "qwen3_next"):
        make_qwen3_next(lines)
    if only in (None, "qwen3_5_moe"):
        make_qwen3_5_moe(lines)
    if only in (None, "glm_moe_dsa"):
        make_glm_moe_dsa(lines)
    if only in (None, "kimi_linear"):
        make_kimi_linear(lines)
    if only in (None, "deepseek_v4"):
        make_deepseek_v4(lines)
    if only in (None, "inkling_text"):
        make_inkling(lines)
    if only in (None, "inkling2_text"):
        make_inkling2(lines)
    if only in (None, "deepseek_v4_fp8"):
        make_deepseek_v4_fp8(lines)
    if only in (None, "inkling"):
        make_inkling_image_text(lines)
    if only in (None, "inkling", "inkling_nvfp4"):
        make_nvfp4_twin(os.path.join(OUT, "inkling"), os.path.join(OUT, "inkling_nvfp4"))
    if only in (None, "inkling2"):
        make_inkling2_image_text(lines)
    if only in (None, "inkling2", "inkling2_mxfp8"):
        make_mxfp8_twin(os.path.join(OUT, "inkling2"), os.path.join(OUT, "inkling2_mxfp8"))
    if only is not None:
        return
    tok_plain = train_tokenizer(lines, 512, bos=False)
    tok_bos = train_tokenizer(lines, 640, bos=True)
    end, im_end = tok_plain.token_to_id("<|endoftext|>"), tok_plain.token_to_id("<|im_end|>")

    # OLMoE: MHA with QK-norm over the full projection, clip_qkv that bites, no top-k renorm,
    # a hidden size that is not a power of two, bf16 weights, transformers-5 config spelling.
    make("olmoe", OlmoeConfig(
        vocab_size=tok_plain.get_vocab_size(), hidden_size=96, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
        num_experts=12, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=1.5,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=end, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dtype=torch.bfloat16, std=0.25, seed=100, tokenizer=tok_plain, template=META, template_in_config=False)

    # Qwen3-MoE: GQA, explicit head_dim (32, not 64/4), per-head QK-norm, a dense layer among MoE
    # layers (mlp_only_layers and decoder_sparse_step), top-k renorm, tied embeddings, f32, older
    # config spelling with llama3 rope scaling, sharded safetensors with an index.
    make("qwen3_moe", Qwen3MoeConfig(
        vocab_size=tok_plain.get_vocab_size(), hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=[end, im_end], pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
        dtype=torch.float32, std=0.25, seed=200, tokenizer=tok_plain, template=CHATML, template_in_config=True,
        old={"rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32}},
        shard="150KB")

    # Qwen3-MoE, the other dialect: attention biases, MQA (one kv head), an explicit head_dim,
    # use_sliding_window with a window shorter than the prompts, decoder_sparse_step 2 (dense and
    # MoE layers alternate), no top-k renorm, untied, bf16, transformers-5 spelling.
    make("qwen3_moe_variant", Qwen3MoeConfig(
        vocab_size=tok_plain.get_vocab_size(), hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1, head_dim=24,
        max_position_embeddings=192, rms_norm_eps=1e-6, num_experts=10, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=2, attention_bias=True, use_sliding_window=True,
        sliding_window=10, tie_word_embeddings=False, bos_token_id=None, eos_token_id=end, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        dtype=torch.bfloat16, std=0.25, seed=400, tokenizer=tok_plain, template=CHATML, template_in_config=False)

    # DeepSeek-V3: MLA with q_lora_rank, YaRN (mscale ≠ mscale_all_dim, so both the rotary
    # attention factor and the softmax mscale matter), interleaved rotary, a dense first layer,
    # sigmoid routing over 4 groups (2 chosen) with a random e_score_correction_bias, shared
    # expert, renormalised weights times 2.5, bf16 with f32 routers, transformers-5 spelling.
    make("deepseek_v3", DeepseekV3Config(
        vocab_size=tok_plain.get_vocab_size(), hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=end, pad_token_id=0, attention_bias=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}),
        dtype=torch.bfloat16, std=0.25, seed=500, tokenizer=tok_plain, template=CHATML, template_in_config=False,
        f32_routers=True)

    # DeepSeek-V2-Lite-style MLA: no q_lora_rank (a plain q_proj), attention biases, split-half
    # rotary, one group, no renormalisation, scaling 1, f32, older spelling.
    make("deepseek_v3_plain_q", DeepseekV3Config(
        vocab_size=tok_plain.get_vocab_size(), hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=None, kv_lora_rank=20,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.0,
        norm_topk_prob=False, rope_interleave=False, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=end, pad_token_id=0, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dtype=torch.float32, std=0.25, seed=600, tokenizer=tok_plain, template=META, template_in_config=True,
        old={})

    # GLM-4.5-MoE: GQA with partial rotary (half of head_dim 32), per-head QK-norm, q/k/v biases
    # (none on o_proj), a dense first layer, sigmoid routing over 2 groups (1 chosen) with bias,
    # shared expert, scaling 1.5, bf16, older spelling (partial_rotary_factor at the top level).
    make("glm4_moe", Glm4MoeConfig(
        vocab_size=tok_plain.get_vocab_size(), hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=12,
        num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=1.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=[end, im_end], pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        dtype=torch.bfloat16, std=0.25, seed=700, tokenizer=tok_plain, template=CHATML, template_in_config=False,
        old={})

    # Mixtral: GQA, a sliding window shorter than the longest prompt, f16 weights, a BOS-adding
    # tokenizer, linear rope scaling in the older spelling, extra stop ids in generation_config.
    make("mixtral", MixtralConfig(
        vocab_size=tok_bos.get_vocab_size(), hidden_size=80, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=12, tie_word_embeddings=False,
        bos_token_id=tok_bos.token_to_id("<s>"), eos_token_id=tok_bos.token_to_id("</s>"), pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        dtype=torch.float16, std=0.25, seed=300, tokenizer=tok_bos, template=BRACKETS, template_in_config=False,
        old={"rope_scaling": {"type": "linear", "factor": 2.0}},
        extra_eos=[tok_bos.token_to_id("</s>"), tok_bos.token_to_id("<|im_end|>")])



def make_gpt_oss(lines):
    # gpt-oss: attention sinks, sliding (window 6, shorter than every prompt) and full layers
    # alternating, q/k/v/o biases, YaRN without truncation, a router with a bias and softmax over
    # the top-k logits, experts fused as gate_up (interleaved) with biases and the clamped SwiGLU
    # (limit 1.5, so that the clamps bite), experts exactly representable in MXFP4; bf16; the
    # harmony chat layout. Its twin gpt_oss_mxfp4 ships the experts as MXFP4 blocks and scales.
    tok = train_tokenizer(lines, 560, bos=False, specials=HARMONY_SPECIALS)
    make("gpt_oss", GptOssConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        max_position_embeddings=256, rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=3,
        swiglu_limit=1.5, attention_bias=True, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<|startoftext|>"), pad_token_id=0,
        eos_token_id=[tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}),
        dtype=torch.bfloat16, std=0.25, seed=800, tokenizer=tok, template=HARMONY, template_in_config=False,
        bos_token="<|startoftext|>", eos_token="<|return|>", adjust=snap_experts_to_mxfp4)
    make_mxfp4(os.path.join(OUT, "gpt_oss"), os.path.join(OUT, "gpt_oss_mxfp4"))



def make_qwen3_next(lines):
    # Qwen3-Next: Gated DeltaNet layers (2 key heads serving 4 value heads, key dim 16 ≠ value dim
    # 24, a depthwise causal convolution of width 4) among full-attention layers with an output
    # gate, partial rotary (a quarter of head_dim 32) and zero-centred RMSNorm weights; a dense
    # layer (mlp_only_layers); softmax top-3 of 8 renormalised; a shared expert behind a sigmoid
    # gate; bf16; ChatML. The prompts are longer than the convolution and the fixture chunk.
    tok = train_tokenizer(lines, 512, bos=False)
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    make("qwen3_next", Qwen3NextConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[2],
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=[end, im_end], pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
        dtype=torch.bfloat16, std=0.25, seed=900, tokenizer=tok, template=CHATML, template_in_config=False)



def make_qwen3_5_moe(lines):
    # Qwen3.5-MoE as Qwen publishes it: the image-text checkpoint (ForConditionalGeneration, a
    # vision tower, the text model under `text_config` and `model.language_model.`), of which
    # shimmer serves the text part from the files as they are. Gated DeltaNet with separate
    # projections (in_proj_qkv, _z, _b, _a) among gated full attention, interleaved mRoPE sections
    # (text positions make them plain rotary), every layer MoE with a gated shared expert; bf16.
    # The oracle is transformers' text model read from the same files.
    tok = train_tokenizer(lines, 512, bos=False)
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    config = Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
            linear_conv_kernel_dim=3, linear_key_head_dim=24, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=6, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8,
            num_experts_per_tok=2, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
            bos_token_id=None, eos_token_id=[end, im_end], pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, num_position_embeddings=16),
        tie_word_embeddings=False)
    make("qwen3_5_moe", config, dtype=torch.bfloat16, std=0.25, seed=1000, tokenizer=tok, template=CHATML,
         template_in_config=False, model_class=Qwen3_5MoeForConditionalGeneration)
    # The text-only form (`Qwen3_5MoeForCausalLM`, tensors under `model.`), with the config's
    # defaults for the layer pattern (every 4th layer full) and the convolution (width 4).
    text = Qwen3_5MoeConfig(text_config=dict(
        vocab_size=tok.get_vocab_size(), hidden_size=48, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
        bos_token_id=None, eos_token_id=end, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [4, 2, 2], "mrope_interleaved": True})).text_config
    # bf16: a recurrent state amplifies rounding so much in these random weights (rounding this
    # model's f32 weights to bf16 moves transformers' own logits by 7) that a bf16 container of
    # an f32 fixture would be another model.
    make("qwen3_5_moe_text", text, dtype=torch.bfloat16, std=0.25, seed=1100, tokenizer=tok, template=META,
         template_in_config=False)



INDEX_MARGIN = 1e-5  # relative gap required between the k-th and (k+1)-th indexer scores (f32 rounding: ~1e-7)


def indexer_selections_are_clear(d, record, **load):
    """True when every DSA indexer choice on every prompt (and its continuation) is clear: no key
    that could tie the k-th selected one (transformers' top-k breaks ties arbitrarily, and an f32
    rounding difference could swap near-tied keys)."""
    def candidates(t):
        if t.dim() == 3 and t.shape[-1] == t.shape[-2]:  # the indexer's [B, S, T] scores
            return [t[0][row, : row + 1] for row in range(t.shape[1])]
        return []
    return topk_choices_are_clear(d, record, candidates, **load)


def topk_choices_are_clear(d, record, candidates, **load):
    """Runs every prompt with its continuation and checks each top-k whose `candidates(scores)`
    (the rows a query may choose from) hold more than k: the k-th and (k+1)-th differ by more than
    INDEX_MARGIN relative. Records the smallest gap."""
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager", **load).eval()
    gaps = []
    original_topk = torch.Tensor.topk

    def watching_topk(t, k, *args, **kwargs):
        for row in candidates(t):
            if row.numel() > k:
                top = torch.sort(row, descending=True).values
                gaps.append(((top[k - 1] - top[k]) / top[k - 1].abs().clamp(min=1e-6)).item())
        return original_topk(t, k, *args, **kwargs)

    torch.Tensor.topk = watching_topk
    try:
        with torch.no_grad():
            for p in record["prompts"]:
                model(torch.tensor([p["ids"] + p["greedy"]]))
    finally:
        torch.Tensor.topk = original_topk
    record["indexer_min_gap"] = min(gaps) if gaps else None
    print(f"indexer: {len(gaps)} selections, smallest relative gap {record['indexer_min_gap']}", file=sys.stderr)
    return bool(gaps) and min(gaps) > INDEX_MARGIN


DEEPSEEK_SPECIALS = ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
DEEPSEEK = (
    "{{ bos_token }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ m.content }}"
    "{%- elif m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>"
    "{%- else %}{{ raise_exception('Unknown role: ' + m.role) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{%- endif %}"
)


def deepseek_v4_release_names(d):
    """Rewrites transformers' save of a DeepSeek-V4 model in the tensor names the release ships
    (`embed.weight`, `head.weight`, `norm.weight`, `hc_head_fn`, `layers.N.attn.wq_a.weight`, …:
    no `model.` prefix); transformers reads them back through its conversion mapping."""
    from safetensors.torch import load_file
    path = os.path.join(d, "model.safetensors")
    leaves = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
              "hc_head.hc_scale": "hc_head_scale"}
    out = {}
    for name, t in load_file(path).items():
        name = name.removeprefix("model.")
        out[leaves.get(name, name)] = t
    save_file(out, path, metadata={"format": "pt"})
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    if any(info.values()):
        raise SystemExit(f"deepseek_v4: transformers does not read the release names back: {info}")


def deepseek_v4_hash_tables(model):
    """The hash layers' `tid2eid` as the release has it: each token's own top-k distinct experts
    (transformers initialises the table to zeros, which would route every token to expert 0)."""
    g = torch.Generator().manual_seed(77)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=g)[: buf.shape[1]] for _ in range(buf.shape[0])]
                buf.copy_(torch.stack(rows))


def v4_indexer_selections_are_clear(d, record, **load):
    """As `indexer_selections_are_clear`, for DeepSeek-V4's compressed-entry indexer: its scores
    are [B, S, entries] with the entries a query may not see at -inf."""
    def candidates(t):
        return [row[torch.isfinite(row)] for row in t[0]] if t.dim() == 3 else []
    return topk_choices_are_clear(d, record, candidates, **load)


def make_deepseek_v4(lines):
    # DeepSeek-V4: four residual streams mixed by manifold-constrained hyper-connections (Sinkhorn
    # projection), shared-KV attention with q/kv norms, partial interleaved rotary on the trailing
    # dims undone on the output, per-head sinks, a sliding window (6) shorter than every prompt,
    # grouped low-rank output projection; compressed-sparse layers (windows of 4 with overlapping
    # halves, a lightning indexer of 16 heads choosing 3 entries) and heavily-compressed layers
    # (windows of 8) with YaRN on the compressed rotary; a hash-routed first MoE layer (`tid2eid`)
    # then sqrtsoftplus routing with a random correction bias, clamped SwiGLU experts (limit 1, so
    # the clamps bite) and a shared expert; bf16 with the release's f32 modules; the release's
    # tensor names; DeepSeek's chat layout. Seeds are accepted only when every indexer choice is
    # clear of ties (`v4_indexer_selections_are_clear`).
    # EOS first (id 0, the padding id generate() is given): a BOS at id 0 would be masked as padding.
    deepseek_v4_fixture(lines, "deepseek_v4", seed=1400)


def make_deepseek_v4_fp8(lines):
    # DeepSeek-V4 as released (`quantize_v4_release`): fp8-e4m3 attention and shared expert with
    # UE8M0 block scales, FP4 routed experts; otherwise `deepseek_v4`'s shapes. The oracle is
    # transformers reading these files, dequantised on the CPU (FineGrainedFP8Config(dequantize)).
    from transformers import FineGrainedFP8Config
    load = FineGrainedFP8Config(**{k: v for k, v in QUANTIZED_V4.items() if k != "quant_method"}, dequantize=True)
    deepseek_v4_fixture(lines, "deepseek_v4_fp8", seed=1900, then=quantize_v4_release, load={"quantization_config": load})


def deepseek_v4_fixture(lines, name, seed, then=None, load=None):
    tok = train_tokenizer(lines, 512, bos="<｜begin▁of▁sentence｜>", specials=DEEPSEEK_SPECIALS)
    end = tok.token_to_id("<｜end▁of▁sentence｜>")

    def release(d):
        deepseek_v4_release_names(d)
        if then is not None:
            then(d)
    make(name, DeepseekV4Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25,
        num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=4, hc_sinkhorn_iters=20, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], swiglu_limit=1.0,
        sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tok.token_to_id("<｜begin▁of▁sentence｜>"),
        eos_token_id=end, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}),
        dtype=torch.bfloat16, std=0.25, seed=seed, tokenizer=tok, template=DEEPSEEK, template_in_config=False,
        bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>", adjust=deepseek_v4_hash_tables,
        keep_f32=("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
                  "kv_norm", "input_layernorm", "post_attention_layernorm", "model.norm"),
        rename=release, check=v4_indexer_selections_are_clear, load=load)


def inkling_scales(model):
    """Inkling's global scales (the dense MLP's, each router's) start at one in transformers; here
    they are positive and not one, so a missing multiply shows."""
    g = torch.Generator().manual_seed(91)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("global_scale"):
                p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=g))


def make_inkling(lines):
    # Inkling (text): no rotary — a relative-position bias from each query's own states over the
    # last `rel_extent` keys (12 on full layers, the window on sliding ones); short causal
    # convolutions with a residual on k, v, the attention output and the MLP output; per-layer
    # head shapes (full: 4 heads, 2 kv heads of 16; sliding: 4 heads, 1 kv head of 24, window 6);
    # per-head q/k RMSNorm and a 1/d scale; logarithmic query scaling past position 4 on full
    # layers; a normed embedding; a dense first layer with a global scale, then a sigmoid router
    # over routed and shared experts with logsigmoid-softmax weights (shared experts weighted by
    # their own logits), a correction bias and a global scale; the head on hidden / 0.25 (muP; a
    # multiplier under one keeps the tiny model's logits apart), a
    # vocabulary padded past the tokenizer's; bf16 with the release's f32 modules.
    tok = train_tokenizer(lines, 512, bos=False)
    end, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    vocab = tok.get_vocab_size()
    make("inkling_text", InklingForCausalLM.config_class(
        vocab_size=vocab + 8, unpadded_vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=1,
        swa_head_dim=24, sliding_window_size=6, d_rel=4, rel_extent=12, log_scaling_n_floor=4, log_scaling_alpha=0.3,
        layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        route_scale=2.5, logits_mup_width_multiplier=0.25, conv_kernel_size=4, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=im_end, pad_token_id=0),
        dtype=torch.bfloat16, std=0.25, seed=1500, extra_eos=[end, im_end], tokenizer=tok, template=CHATML, template_in_config=False,
        adjust=inkling_scales, keep_f32=("attn_sconv", "mlp_sconv", "k_sconv", "v_sconv", "e_score_correction_bias", "gate.global_scale"))


def make_inkling2(lines):
    # Inkling 2 (text): Inkling's relative bias and convolutions plus block attention residuals
    # (each layer reads a learned-query attention over the outputs of earlier blocks of 2
    # layers; full layers read three, one each for q, k and v, each with its own norm), per-token
    # attention sinks, L2-clipped queries, keys and relative states with learned scales (small
    # thresholds, so the clips bite), dynamic key/value convolutions on full layers, a sigmoid-
    # gated output projection, convolutions scaled by 1/sqrt(K+1), softcapped SwiGLU experts,
    # sigmoid routing, a final logit softcap; the release's tensor names (`model.llm.*`,
    # interleaved `w13`), a vocabulary padded past the tokenizer's; bf16 with f32 modules.
    tok = train_tokenizer(lines, 512, bos=False)
    im_end = tok.token_to_id("<|im_end|>")
    vocab = tok.get_vocab_size()
    make("inkling2_text", Inkling2ForCausalLM.config_class(
        vocab_size=vocab + 8, unpadded_vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=1,
        swa_head_dim=24, sliding_window_size=6, d_rel=4, rel_extent=12, log_scaling_n_floor=4, log_scaling_alpha=0.3,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=2,
        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, route_scale=2.5, conv_kernel_size=4,
        qk_l2_clip_threshold=1.5, rel_l2_clip_threshold=1.0, mlp_gate_softcap=1.0, mlp_up_softcap=1.5,
        final_logit_softcapping=6.0, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=im_end, pad_token_id=0),
        dtype=torch.bfloat16, std=0.25, seed=1600, tokenizer=tok, template=CHATML, template_in_config=False,
        keep_f32=("e_score_correction_bias", "mlp.gate.weight", "post_attention_convolution", "post_mlp_convolution",
                  "sconv.conv1d", "attention_input", "mlp_input", "final_input"))


def make_inkling_image_text(lines):
    # Inkling as released: the image-text checkpoint (`InklingForConditionalGeneration`, tiny
    # vision and audio towers, the text model under `text_config`), saved by transformers under
    # the release's names (`model.llm.layers.N.attn.wq_du.weight`; gate and up rows interleaved in
    # the experts' and the shared bank's `w13` and the dense MLP's `w13_dn`), of which shimmer
    # serves the text part. Shapes as `inkling_text`, with one shared expert, the sliding and full
    # layers in another order and two dense layers.
    tok = train_tokenizer(lines, 512, bos=False)
    im_end = tok.token_to_id("<|im_end|>")
    vocab = tok.get_vocab_size()
    config = InklingConfig(
        text_config=dict(
            vocab_size=vocab + 8, unpadded_vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=1,
            swa_head_dim=24, sliding_window_size=6, d_rel=4, rel_extent=12, log_scaling_n_floor=4, log_scaling_alpha=0.3,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "dense", "sparse", "sparse"],
            intermediate_size=40, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            route_scale=1.5, logits_mup_width_multiplier=0.25, conv_kernel_size=4, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=im_end, pad_token_id=0),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4),
        audio_config=dict(n_mel_bins=8, mel_vocab_size=16))
    make("inkling", config, dtype=torch.bfloat16, std=0.25, seed=1700, tokenizer=tok, template=CHATML, template_in_config=False,
         model_class=InklingForConditionalGeneration, adjust=lambda m: (inkling_scales(m), snap_experts_to_nvfp4(m)),
         keep_f32=("attn_sconv", "mlp_sconv", "k_sconv", "v_sconv", "e_score_correction_bias", "gate.global_scale"))


def mxfp8_encode(w):
    """MXFP8 along the last axis: fp8-e4m3 values with one UE8M0 scale per 32 (the least power of two
    keeping the group within e4m3's 448; a short last group padded). Returns (values as e4m3,
    scale bytes, the exact values they stand for)."""
    *lead, k = w.shape
    g = torch.nn.functional.pad(w.float(), (0, -k % 32)).reshape(*lead, -1, 32)
    code, scale = e8m0_at_least(g.abs().amax(-1) / 448.0)
    q = (g / scale[..., None]).to(torch.float8_e4m3fn)
    values = (q.float() * scale[..., None]).reshape(*lead, -1)[..., :k]
    return q.reshape(*lead, -1)[..., :k].contiguous(), code.contiguous(), values


def snap_experts_to_mxfp8(model):
    """Makes every routed expert weight exactly an MXFP8 value (groups of 32 along each row), so the
    fixture and its MXFP8 twin (`make_mxfp8_twin`) are the same model."""
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            if mod_name.endswith("mlp.experts"):
                mod.gate_up_proj.copy_(mxfp8_encode(mod.gate_up_proj)[2])
                mod.down_proj.copy_(mxfp8_encode(mod.down_proj)[2])


def make_mxfp8_twin(src, dst):
    """Inkling 2 as released in MXFP8 (`Inkling-2-Small-MXFP8`): the routed experts' `w13_weight`
    and `w2_weight` as fp8-e4m3 with UE8M0 `<name>_scale` bytes per 32 values of a row, everything
    else as in `src`, `quantization_config.quant_method = mxfp8`. transformers 5.24 cannot read
    these on the CPU (with `dequantize` the interleaved experts' scales are left unpaired and the
    fp8 values taken as they are), so the oracle is `src`'s — the same model: every tensor written
    here is checked, by transformers' own MXFP8 dequantisation, to give back `src`'s values."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    out = {}
    for name, t in load_file(path).items():
        if name.endswith("mlp.experts.w13_weight") or name.endswith("mlp.experts.w2_weight"):
            q, scale, _ = mxfp8_encode(t)
            back = Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32)
            assert torch.equal(back, t.float()), f"{name} is not MXFP8-exact"
            out[name], out[name + "_scale"] = q, scale
        else:
            out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                                  "weight_block_size": [1, 32]}
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    print(f"{os.path.basename(dst)}: from {os.path.basename(src)}")


E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_VALUES = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])


def nvfp4_factor(experts):
    """The per-expert second-level scale (`weight_scale_2`) the fixtures use: powers of two that
    differ by expert (2^-6, 2^-7, 2^-8, ...), so that every NVFP4 value is exact in bf16 and a
    factor read for the wrong expert shows."""
    return torch.tensor([2.0 ** -(6 + e % 3) for e in range(experts)])


def nvfp4_encode(w):
    """NVFP4 along the last axis of an `experts × rows × cols` tensor, as ModelOpt stores it: e2m1
    codes two to a byte (even element in the low nibble), one fp8-e4m3 scale per 16 values of a row
    (the least e4m3 value keeping the group within e2m1's 6 after the expert's factor), one f32
    factor per expert (`nvfp4_factor`). Returns (packed codes, scales, factors, the exact values
    they stand for). Encoding those values again gives the same codes and scales."""
    experts, rows, k = w.shape
    factor = nvfp4_factor(experts)
    g = torch.nn.functional.pad(w.float(), (0, -k % 16)).reshape(experts, rows, -1, 16)
    target = g.abs().amax(-1) / 6.0 / factor[:, None, None]
    scale = target.to(torch.float8_e4m3fn)
    low = scale.float() < target
    scale = torch.where(low, (scale.view(torch.uint8) + 1).view(torch.float8_e4m3fn), scale)
    scale = torch.where(scale.float() == 0, torch.tensor(2.0 ** -9).to(torch.float8_e4m3fn), scale)
    unit = g / (scale.float() * factor[:, None, None])[..., None]
    magnitude = (unit.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)
    code = magnitude + 8 * ((unit < 0) & (magnitude > 0))
    values = E2M1_VALUES[code] * scale.float()[..., None] * factor[:, None, None, None]
    values = values.reshape(experts, rows, -1)[..., :k]
    code = torch.nn.functional.pad(code.reshape(experts, rows, -1)[..., :k], (0, k % 2))
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), scale.contiguous(), factor, values


def snap_experts_to_nvfp4(model):
    """Makes every routed expert weight exactly an NVFP4 value (`nvfp4_encode`), so the fixture and
    its NVFP4 twin (`make_nvfp4_twin`) are the same model. The shared experts stay as they are (the
    release keeps them in bf16)."""
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            if mod_name.endswith("mlp.experts"):
                mod.gate_up_proj.copy_(nvfp4_encode(mod.gate_up_proj)[3])
                mod.down_proj.copy_(nvfp4_encode(mod.down_proj)[3])


def make_nvfp4_twin(src, dst):
    """Inkling as released in NVFP4 (`Inkling-NVFP4`, ModelOpt): the routed experts' `w13_weight`
    and `w2_weight` as packed e2m1 codes with `<name>_scale` (fp8-e4m3 per 16 values of a row) and
    `<name>_scale_2` (f32 per expert), everything else as in `src`, `quantization_config` ModelOpt's
    NVFP4 as vLLM reads it. transformers 5.24 has no ModelOpt quantizer, so the oracle is `src`'s —
    the same model: every tensor written here is checked, by transformers' own NVFP4
    dequantisation (`Inkling2LoopDequantizeExperts`, whose per-expert factor `amax / denominator`
    is `_scale_2` over one), to give back `src`'s values."""
    from safetensors.torch import load_file
    from transformers.core_model_loading import Inkling2LoopDequantizeExperts
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    out = {}
    for name, t in load_file(path).items():
        if name.endswith("mlp.experts.w13_weight") or name.endswith("mlp.experts.w2_weight"):
            packed, scale, factor, values = nvfp4_encode(t)
            assert torch.equal(values.to(t.dtype), t) and torch.equal(values, t.float()), f"{name} is not NVFP4-exact"
            sources = ["w", "s", "amax", "den"]
            back = Inkling2LoopDequantizeExperts().convert(
                {"w": packed, "s": scale, "amax": factor, "den": torch.ones_like(factor)}, sources, ["out"])["out"]
            assert torch.equal(back.float(), t.float()), f"{name}: transformers reads other values"
            out[name], out[name + "_scale"], out[name + "_scale_2"] = packed, scale, factor
        else:
            out[name] = t
    save_file(out, path, metadata={"format": "pt"})
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    layers = cfg["text_config"]["num_hidden_layers"]
    cfg["quantization_config"] = {
        "quant_method": "modelopt", "group_size": 16,
        "modelopt_quant_config": {"quant_cfg": {"*weight_quantizer": {
            "num_bits": [2, 1], "block_sizes": {"-1": 16, "type": "dynamic", "scale_bits": [4, 3]}, "enable": True}}},
        "exclude_modules": [f"model.llm.layers.{i}.mlp.shared_experts" for i in range(layers)]}
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    print(f"{os.path.basename(dst)}: from {os.path.basename(src)}")


def make_inkling2_image_text(lines):
    # Inkling 2 as released: the image-text checkpoint (`Inkling2ForConditionalGeneration`, a tiny
    # vision tower, the text model under `text_config`; tensors under the same `model.llm.` names
    # as `inkling2_text`), of which shimmer serves the text part. Shapes as `inkling2_text`, with
    # full layers first and blocks of 3 layers for the attention residuals; the experts' weights
    # exactly MXFP8 values, so that `inkling2_mxfp8` (the MXFP8 release form) is the same model.
    tok = train_tokenizer(lines, 512, bos=False)
    im_end = tok.token_to_id("<|im_end|>")
    vocab = tok.get_vocab_size()
    config = Inkling2Config(
        text_config=dict(
            vocab_size=vocab + 8, unpadded_vocab_size=vocab, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=1,
            swa_head_dim=24, sliding_window_size=6, d_rel=4, rel_extent=12, log_scaling_n_floor=4, log_scaling_alpha=0.3,
            layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"], n_layers_per_attn_res_block=3,
            moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, route_scale=2.5, conv_kernel_size=4,
            qk_l2_clip_threshold=1.5, rel_l2_clip_threshold=1.0, mlp_gate_softcap=1.0, mlp_up_softcap=1.5,
            final_logit_softcapping=6.0, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None,
            eos_token_id=im_end, pad_token_id=0),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, text_hidden_size=64, patch_size=4,
                           posemb_grid_size=4, projection_hidden_dim=32),
        eos_token_id=im_end)
    make("inkling2", config, dtype=torch.bfloat16, std=0.25, seed=1800, tokenizer=tok, template=CHATML, template_in_config=False,
         model_class=Inkling2ForConditionalGeneration, adjust=snap_experts_to_mxfp8,
         keep_f32=("e_score_correction_bias", "mlp.gate.weight", "post_attention_convolution", "post_mlp_convolution",
                   "sconv.conv1d", "attention_input", "mlp_input", "final_input"))


def make_glm_moe_dsa(lines):
    # GLM-5 (glm_moe_dsa): MLA with interleaved rotary and DeepSeek Sparse Attention — a lightning
    # indexer (16 heads of 16, a LayerNorm'd key cached per position) picks each query's top 6
    # keys, fewer than every prompt holds; the middle layer reuses the first layer's choice
    # (`indexer_types` shared); the first layer dense; sigmoid group-limited routing with a random
    # correction bias and a shared expert; bf16; GLM's chat layout and special tokens. Seeds are
    # accepted only when every indexer choice is clear of ties (`indexer_selections_are_clear`).
    tok = train_tokenizer(lines, 512, bos=False, specials=GLM_SPECIALS)
    end, user, observation = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|user|>"), tok.token_to_id("<|observation|>")
    make("glm_moe_dsa", GlmMoeDsaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5, index_topk=6, index_head_dim=16,
        index_n_heads=16, indexer_types=["full", "shared", "full"], tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=[end, user, observation], pad_token_id=0, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dtype=torch.bfloat16, std=0.25, seed=1200, tokenizer=tok, template=GLM, template_in_config=False,
        check=indexer_selections_are_clear, eos_token="<|user|>")



def make_kimi_linear(lines):
    # Kimi Linear: Kimi Delta Attention layers (per-channel decay from a low-rank forget gate,
    # a sigmoid-gated output norm, separate q/k/v convolutions in the published checkpoint) among
    # MLA layers without any positional encoding (NoPE, plain q_proj); a dense first layer, then
    # sigmoid group-limited routing with a correction bias and a shared expert; bf16; Kimi's chat
    # layout and special tokens.
    # The tokenizer as Kimi ships it: a tiktoken rank file (from a byte-level BPE trained here) read
    # by Moonshot's tokenizer class, no tokenizer.json.
    tok = KimiTikToken.from_bpe(train_tokenizer(lines, 512, bos=False, specials=()))
    end, im_end = tok.token_to_id("[EOS]"), tok.token_to_id("<|im_end|>")
    make("kimi_linear", KimiLinearConfig(
        vocab_size=tok.vocab_size(), hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_local_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.446, norm_topk_prob=True,
        max_position_embeddings=256, rms_norm_eps=1e-5, linear_head_dim=16, linear_num_heads=4,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=[end, im_end], pad_token_id=0),
        dtype=torch.bfloat16, std=0.25, seed=1300, tokenizer=tok, template=KIMI, template_in_config=False)


if __name__ == "__main__":
    main()
