#!/usr/bin/env python3
"""Decode speed during a placement move against steady state, in one run: three `shimmer worker`
members and a `shimmer coordinator` member (the demo model, R=2) serve one greedy stream through
the API without pause; ROUNDS times a fourth worker joins (the leader proposes an epoch with it,
every holder reads its share, the epoch becomes active, the coordinator moves, the old epoch is
retired) and then drains on SIGTERM (the same in reverse). Every token's arrival is timed; tok/s
is tokens arrived in a window over its length:

    steady — the STEADY seconds before each join and before each drain
    join   — from the fourth worker's start until its epoch is active and the one before retired
    drain  — from SIGTERM until the worker exited (its experts placed elsewhere first)

Every answer is compared with the single box's (a `shimmer run` asked first). Usage:

    bench/control-plane/move.py [--rounds 5] [--steady 10] [--max-tokens 128] [--bin target/release/shimmer]
"""

import argparse
import http.client
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos import Cluster, single_box_answers, wait_for  # noqa: E402

PROMPT = "The tide came in and"


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steady", type=float, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--bin", default=os.environ.get("SHIMMER_BIN", os.path.join(root, "target", "release", "shimmer")))
    return p.parse_args()


def stream_tokens(port, body, on_token):
    """One streamed completion; calls on_token() as each chunk with text arrives; returns the text."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("POST", "/v1/completions", json.dumps({"model": "shimmer-demo", **body, "stream": True}), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        text = ""
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            piece = chunk["choices"][0].get("text", "")
            if piece:
                on_token()
                text += piece
        return text
    finally:
        c.close()


def main():
    args = parse()
    if not os.access(args.bin, os.X_OK):
        raise SystemExit(f"move: no shimmer binary at {args.bin} (cargo build --release -p shimmer-coordinator, or --bin)")
    work = tempfile.mkdtemp(prefix="shimmer-move-")
    api, single_port = 18441, 18442
    body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
    [want] = single_box_answers(args.bin, single_port, [body], os.path.join(work, "single.log"))

    cluster = Cluster(argparse.Namespace(bin=args.bin, workers=4), work)
    arrivals, problems, answers = [], [], [0]
    stop = threading.Event()
    try:
        cluster.start_members(3)
        cluster.start_coordinator("127.0.0.7:7431", api)

        def client():
            while not stop.is_set():
                try:
                    text = stream_tokens(api, body, lambda: arrivals.append(time.time()))
                    answers[0] += 1
                    if text != want:
                        problems.append(f"altered: {text!r}")
                except Exception as e:
                    problems.append(f"failed: {e}")

        t = threading.Thread(target=client, daemon=True)
        t.start()
        rate = lambda a, b: sum(1 for x in arrivals if a <= x < b) / (b - a)

        def settled(n):
            s = cluster.status()
            p = s and s["placements"] and s["placements"][0]
            return bool(p) and p["proposed"] is None and p["previous"] is None and len(p["workers"]) == n

        steady, joins, drains, join_s, drain_s = [], [], [], [], []
        time.sleep(2)
        for r in range(args.rounds):
            t0 = time.time()
            time.sleep(args.steady)
            steady.append(rate(t0, time.time()))
            t_join = time.time()
            cluster.start_worker(3, [] if os.path.isdir(os.path.join(work, "w3")) else ["--join", cluster.addrs[0]])
            wait_for("the epoch with the fourth worker active and the one before retired", lambda: settled(4), within=120)
            t_done = time.time()
            joins.append(rate(t_join, t_done))
            join_s.append(t_done - t_join)
            t0 = time.time()
            time.sleep(args.steady)
            steady.append(rate(t0, time.time()))
            t_term = time.time()
            p = cluster.procs.pop(3)
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=150)
            t_gone = time.time()
            drains.append(rate(t_term, t_gone))
            drain_s.append(t_gone - t_term)
            wait_for("the placement over 3 workers again", lambda: settled(3), within=120)
            print(f"round {r + 1}: steady {steady[-2]:.1f} / {steady[-1]:.1f} tok/s; join {joins[-1]:.1f} tok/s over {join_s[-1]:.2f} s; drain {drains[-1]:.1f} tok/s over {drain_s[-1]:.2f} s", flush=True)
        stop.set()
        t.join(timeout=150)
        med = statistics.median
        summary = {
            "rounds": args.rounds, "answers": answers[0], "problems": len(problems),
            "steady_tok_s": round(med(steady), 1), "join_tok_s": round(med(joins), 1), "drain_tok_s": round(med(drains), 1),
            "join_over_steady": round(med(joins) / med(steady), 3), "drain_over_steady": round(med(drains) / med(steady), 3),
            "join_s": round(med(join_s), 2), "drain_s": round(med(drain_s), 2),
        }
        print(json.dumps(summary))
        for line in problems[:10]:
            print(line)
        sys.exit(0 if not problems and answers[0] > 0 else 1)
    finally:
        stop.set()
        cluster.stop()
        print(f"logs in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
