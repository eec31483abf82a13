"""Server memory under eight concurrent 3.9 MB prompts (far over the demo's context), the issue-17
probe: `python bench/hostile/long_prompts.py [SHIMMER_BINARY]` starts `shimmer run` on the demo
model, sends the eight chat requests at once, and prints their statuses and the server's RSS
before, at peak (VmHWM) and after. Needs httpx (tests/api/requirements.txt)."""
import concurrent.futures as cf
import sys
import time

import httpx
import server

binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/shimmer"
p, url = server.start(binary)


def memory_mb():
    now, peak = server.memory_mb(p)
    return int(now), int(peak)


text = "And the LORD spake unto Moses, saying, " * 100_000
body = {"model": "shimmer-demo", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
before, start = memory_mb()[0], time.time()
with cf.ThreadPoolExecutor(8) as pool:
    codes = list(pool.map(lambda _: httpx.post(url + "/v1/chat/completions", json=body, timeout=300).status_code, range(8)))
elapsed = time.time() - start
now, peak = memory_mb()
print(f"{binary}: statuses {codes}; RSS before {before} MB, peak {peak} MB, after {now} MB; {elapsed:.1f} s")
p.terminate()
p.wait()
