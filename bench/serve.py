#!/usr/bin/env python3
"""Benchmark of `shimmer run` (docs/benchmarks.md): aggregate decode tok/s with 1, 4 and 16
concurrent streams, and the time to first token of a chat's second turn with and without prefix
reuse. Standard library only; starts its own servers.

    cargo build --release && python3 bench/serve.py [--model DIR] [--runs 5] [--seconds 20]
"""
import argparse
import json
import re
import statistics
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONG = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ") * 8


def start(binary, model, *args):
    cmd = [binary, "run", "--port", "0", *(["--model", model] if model else []), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        m = re.search(r"on (http://[0-9.]+:[0-9]+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("shimmer run did not start")


def model_id(url):
    return json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]


def stream(url, model, messages, max_tokens, temperature=0.0, seed=0):
    """Returns (seconds to the first content chunk, completion tokens, seconds in all)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            v = json.loads(line[6:])
            if v.get("usage"):
                tokens = v["usage"]["completion_tokens"]
            for ch in v.get("choices", []):
                if ttft is None and ch.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
    return ttft, tokens, time.perf_counter() - t0


def aggregate(url, model, streams, seconds):
    deadline = time.perf_counter() + seconds
    totals = [0] * streams

    def worker(k):
        n = 0
        while time.perf_counter() < deadline:
            msgs = [{"role": "user", "content": f"And the LORD spake unto Moses ({k}-{n}), saying,"}]
            totals[k] += stream(url, model, msgs, 64, temperature=0.8, seed=k * 100_000 + n)[1]
            n += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(totals) / (time.perf_counter() - t0)


def second_turn_ttft(url, model, i):
    first = [{"role": "system", "content": LONG}, {"role": "user", "content": f"Who moved upon the waters? ({i})"}]
    answer = json.load(urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(
        {"model": model, "messages": first, "max_tokens": 32, "temperature": 0}).encode(), headers={"content-type": "application/json"})))["choices"][0]["message"]["content"]
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And what was upon the face of the deep?"}]
    return stream(url, model, second, 8)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--binary", default=str(ROOT / "target/release/shimmer"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20)
    a = ap.parse_args()

    proc, url = start(a.binary, a.model, "--max-batch", "16", "--max-queue", "64")
    model = model_id(url)
    print(f"model {model}; aggregate decode, 64-token answers, {a.seconds:.0f} s per setting")
    for n in (1, 4, 16):
        print(f"  {n:2} streams: {aggregate(url, model, n, a.seconds):7.1f} tok/s")
    proc.terminate()
    proc.wait()

    warm, wurl = start(a.binary, a.model)
    cold, curl = start(a.binary, a.model, "--kv-gb", "0")
    with_reuse, without = [], []
    for i in range(a.runs):  # alternating pairs
        with_reuse.append(second_turn_ttft(wurl, model, i))
        without.append(second_turn_ttft(curl, model, i))
    for p in (warm, cold):
        p.terminate()
        p.wait()
    ratio = [w / c for w, c in zip(with_reuse, without)]
    print(f"second chat turn TTFT ({a.runs} alternating pairs, median): with prefix reuse {statistics.median(with_reuse) * 1e3:.1f} ms, "
          f"without {statistics.median(without) * 1e3:.1f} ms, ratio min/median/max {min(ratio):.2f} / {statistics.median(ratio):.2f} / {max(ratio):.2f}")


if __name__ == "__main__":
    main()
