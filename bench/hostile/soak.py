"""The soak run of issue 17 (a script, not a test): `shimmer run` on the demo model under N
concurrent clients for M minutes, each sending a mix of valid streamed chats (prompts that share
prefixes, so the prefix cache fills and evicts), streams it cancels after a few tokens, and
malformed requests; the server's RSS is recorded every few seconds.

    python bench/hostile/soak.py [--binary target/release/shimmer] [--minutes 30] [--streams 64]

Prints one line per sample and a summary: requests of each kind, errors on valid requests (a
status other than 200, or a stream that does not end in [DONE]), 5xx on malformed ones, and the
RSS after warm-up (the first fifth of the run) against the RSS at its end — flat means the last
sample within 5 % of the warm-up's. Needs httpx (tests/api/requirements.txt)."""
import argparse
import json
import random
import threading
import time

import httpx
import server as shimmer_server

parser = argparse.ArgumentParser()
parser.add_argument("--binary", default="target/release/shimmer")
parser.add_argument("--minutes", type=float, default=30)
parser.add_argument("--streams", type=int, default=64)
parser.add_argument("--every-s", type=float, default=10)
args = parser.parse_args()

server, url = shimmer_server.start(args.binary, "--max-queue", str(4 * args.streams))


def rss_mb():
    return shimmer_server.memory_mb(server)[0]


VERSES = ["And the LORD spake unto Moses, saying,", "In the beginning God created the heaven and the earth.", "And it came to pass,",
          "Speak unto the children of Israel, and say unto them,", "These are the generations of", "And the sons of Levi were"]
MALFORMED = [
    b"{not json",
    json.dumps({"model": "shimmer-demo", "messages": "hello"}).encode(),
    json.dumps({"model": "shimmer-demo", "messages": [{"role": "user", "content": "x"}], "top_p": 0}).encode(),
    json.dumps({"model": "shimmer-demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": -4}).encode(),
    json.dumps({"model": "shimmer-demo", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
    json.dumps({"model": "shimmer-demo", "messages": [{"role": "user", "content": "And the LORD spake " * 30_000}]}).encode(),
    json.dumps({"model": "shimmer-demo", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": []}}}}).encode(),
]
counts = {"valid": 0, "cancelled": 0, "malformed": 0, "valid_errors": 0, "malformed_5xx": 0, "transport_errors": 0}
lock = threading.Lock()
deadline = time.time() + args.minutes * 60


def count(key):
    with lock:
        counts[key] += 1


def client(seed):
    rng = random.Random(seed)
    http = httpx.Client(timeout=120)
    while time.time() < deadline:
        kind = rng.choices(["valid", "cancelled", "malformed"], weights=[70, 15, 15])[0]
        try:
            if kind == "malformed":
                r = http.post(url + "/v1/chat/completions", content=rng.choice(MALFORMED), headers={"content-type": "application/json"})
                count("malformed")
                if r.status_code >= 500:
                    count("malformed_5xx")
                continue
            prompt = " ".join(rng.choice(VERSES) for _ in range(rng.randint(1, 4)))
            body = {"model": "shimmer-demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(16, 96),
                    "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 1 << 30), "stream": True}
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if kind == "cancelled":
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= 3:
                            break
                    count("cancelled")
                    continue
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                count("valid")
                if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]":
                    count("valid_errors")
        except httpx.HTTPError:
            count("transport_errors")


threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.streams)]
for t in threads:
    t.start()
samples = []
start = time.time()
while time.time() < deadline:
    time.sleep(args.every_s)
    samples.append((time.time() - start, rss_mb()))
    with lock:
        print(f"{samples[-1][0]:7.0f} s  RSS {samples[-1][1]:7.1f} MB  {counts}", flush=True)
for t in threads:
    t.join(timeout=180)
server.terminate()
server.wait(timeout=60)
warm = [rss for t, rss in samples if t >= args.minutes * 60 / 5]
if warm:
    first, last, peak = warm[0], warm[-1], max(warm)
    print(json.dumps({"minutes": args.minutes, "streams": args.streams, **counts, "rss_after_warmup_mb": round(first, 1), "rss_end_mb": round(last, 1),
                      "rss_peak_mb": round(peak, 1), "end_over_warmup": round(last / first, 3), "flat": last <= first * 1.05}))
