#!/usr/bin/env python3
"""The control plane's chaos run: a cluster of WORKERS `shimmer worker` members (127.0.0.2…) and
one `shimmer coordinator` member serving the API, the demo model, R=2. STREAMS clients send
greedy completions through the API for MINUTES while a killer sends kill -9 to a random worker
every KILL_EVERY seconds (a supervisor starts it again on its --data-dir after RESTART_AFTER
seconds, so the leader places the model without it and then with it again); LEADER_KILLS of
those kills, spread over the run, go to the Raft leader. Every answer is compared with the
single box's answer to the same prompt (a `shimmer run` on the same model, asked first):

    failed   — the request did not complete (an HTTP error or no answer within 120 s)
    altered  — it completed with text other than the single box's

Both must be 0. Usage:

    bench/control-plane/chaos.py [--minutes 10] [--streams 8] [--kill-every 12] [--leader-kills 5]
                                 [--restart-after 5] [--max-tokens 48] [--bin target/release/shimmer]

Prints one line per kill, then a summary (also as JSON with --json FILE). Figures go to
docs/benchmarks.md with the command that made them.
"""

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

TOKEN = "chaos-run-cluster-token-0123456789"
PORT = 7431


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kill-every", type=float, default=12)
    p.add_argument("--leader-kills", type=int, default=5)
    p.add_argument("--restart-after", type=float, default=5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bin", default=os.environ.get("SHIMMER_BIN", os.path.join(root, "target", "release", "shimmer")))
    p.add_argument("--json", help="write the summary here too")
    return p.parse_args()


def post(port, body, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", json.dumps({"model": "shimmer-demo", **body}), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read().decode("utf-8", "replace")
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:200]}")
        if body.get("stream"):
            text = ""
            for line in data.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"error in the stream: {chunk['error']}")
                    text += chunk["choices"][0].get("text", "")
            return text
        return json.loads(data)["choices"][0]["text"]
    finally:
        c.close()


def wait_for(what, ok, within=120):
    until = time.time() + within
    while time.time() < until:
        try:
            if ok():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit(f"chaos: gave up waiting for {what}")


def single_box_answers(bin_path, port, bodies, log):
    """The single box's answer to each request body (a `shimmer run` on the same model)."""
    single = subprocess.Popen([bin_path, "run", "--port", str(port), "--host", "127.0.0.1", "--no-usage"], stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    try:
        wait_for("the single box", lambda: post(port, {"prompt": "x", "max_tokens": 1}) is not None)
        return [post(port, b) for b in bodies]
    finally:
        single.kill()
        single.wait()


class Cluster:
    def __init__(self, args, work):
        self.args, self.work = args, work
        self.addrs = [f"127.0.0.{i + 2}:{PORT}" for i in range(args.workers)]
        self.procs = {}
        self.logs = {}
        self.env = dict(os.environ, SHIMMER_JOIN_TOKEN=TOKEN, RUST_LOG=os.environ.get("RUST_LOG", "warn"))

    def start_worker(self, i, extra=()):
        d = os.path.join(self.work, f"w{i}")
        log = open(os.path.join(self.work, f"w{i}.log"), "ab")
        host = self.addrs[i].rsplit(":", 1)[0]
        cmd = [self.args.bin, "worker", "--listen", self.addrs[i], "--data-dir", d, "--no-usage", "--no-mdns", "--http-listen", f"{host}:0", *extra]
        self.procs[i] = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=log)

    def start_members(self, n):
        """Workers 0..n, the first bootstrapping and the rest joining it, until they are placed."""
        self.start_worker(0, ["--bootstrap"])
        wait_for("the first member", lambda: self.status() is not None)
        for i in range(1, n):
            self.start_worker(i, ["--join", self.addrs[0]])
        wait_for(f"a placement over {n} workers", lambda: self.placed(n))

    def start_coordinator(self, listen, api):
        """A coordinator member serving the API on 127.0.0.1:`api`, once it answers."""
        p = subprocess.Popen(
            [self.args.bin, "coordinator", "--listen", listen, "--data-dir", os.path.join(self.work, "coordinator"), "--join", self.addrs[0],
             "--host", "127.0.0.1", "--port", str(api), "--no-usage", "--no-mdns", "--worker-timeout-s", "2", "--connect-timeout-s", "1"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.work, "coordinator.log"), "wb"))
        self.procs["coordinator"] = p
        wait_for("the coordinator's API", lambda: post(api, {"prompt": "x", "max_tokens": 1}) is not None)

    def status(self):
        out = subprocess.run([self.args.bin, "cluster", "status", "--json", "--join", ",".join(self.addrs)], env=self.env, capture_output=True, timeout=30)
        if out.returncode != 0:
            return None
        return json.loads(out.stdout)

    def placed(self, n):
        s = self.status()
        p = s and s["placements"] and s["placements"][0]
        return bool(p) and p["proposed"] is None and len(p["workers"]) == n

    def kill(self, i):
        p = self.procs.pop(i)
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop(self):
        for p in list(self.procs.values()):
            p.send_signal(signal.SIGKILL)
            p.wait()
        self.procs.clear()


def main():
    args = parse()
    if not os.access(args.bin, os.X_OK):
        raise SystemExit(f"chaos: no shimmer binary at {args.bin} (cargo build --release -p shimmer-coordinator, or --bin)")
    rng = random.Random(args.seed)
    prompts = [f"Story {i}: the tide came in and" for i in range(args.prompts)]
    work = tempfile.mkdtemp(prefix="shimmer-chaos-")
    api, single_port = 18431, 18432

    bodies = [{"prompt": p, "max_tokens": args.max_tokens, "temperature": 0} for p in prompts]
    reference = dict(zip(prompts, single_box_answers(args.bin, single_port, bodies, os.path.join(work, "single.log"))))

    cluster = Cluster(args, work)
    try:
        cluster.start_members(args.workers)
        cluster.start_coordinator(f"127.0.0.{args.workers + 2}:{PORT}", api)
        first_epoch = cluster.status()["placements"][0]["epoch"]

        stop = threading.Event()
        lock = threading.Lock()
        results = {"ok": 0, "failed": 0, "altered": 0, "tokens": 0}
        problems = []
        latencies = []

        def stream(n):
            k = n
            while not stop.is_set():
                p = prompts[k % len(prompts)]
                k += args.streams
                body = {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "stream": k % 2 == 0}
                t0 = time.time()
                try:
                    text = post(api, body)
                except Exception as e:
                    with lock:
                        results["failed"] += 1
                        problems.append(f"failed: {p!r}: {e}")
                    continue
                with lock:
                    latencies.append(time.time() - t0)
                    if text == reference[p]:
                        results["ok"] += 1
                        results["tokens"] += args.max_tokens
                    else:
                        results["altered"] += 1
                        problems.append(f"altered: {p!r}: {text!r} instead of {reference[p]!r}")

        threads = [threading.Thread(target=stream, args=(n,), daemon=True) for n in range(args.streams)]
        t_start = time.time()
        for t in threads:
            t.start()
        duration = args.minutes * 60
        kills_planned = max(1, int(duration // args.kill_every))
        leader_slots = {round((j + 0.5) * kills_planned / args.leader_kills) for j in range(args.leader_kills)} if args.leader_kills else set()
        kills = leader_kills = 0
        elections = []
        pending_restarts = []
        k = 0
        while time.time() - t_start < duration:
            # Kills half a period into each period: MINUTES × 60 / KILL_EVERY of them in the run.
            next_kill = t_start + (k + 0.5) * args.kill_every
            while time.time() < next_kill and time.time() - t_start < duration:
                for r in [r for r in pending_restarts if r[0] <= time.time()]:
                    cluster.start_worker(r[1])
                    pending_restarts.remove(r)
                time.sleep(0.1)
            if time.time() - t_start >= duration:
                break
            k += 1
            up = [i for i in range(args.workers) if i in cluster.procs]
            if len(up) < args.workers:
                continue  # one down already: with R=2 a second could take an expert's last holder
            target, why = rng.choice(up), "a random worker"
            s = cluster.status() if k in leader_slots else None
            old_leader = s and s.get("leader")
            if old_leader in cluster.addrs:
                target, why = cluster.addrs.index(old_leader), "the leader"
            elif k in leader_slots:
                leader_slots.add(k + 1)  # the leader is not a worker now: the next kill tries again
            t_kill = time.time()
            cluster.kill(target)
            kills += 1
            line = f"{t_kill - t_start:6.1f} s: kill -9 {cluster.addrs[target]} ({why})"
            if why == "the leader":
                leader_kills += 1
                while time.time() - t_kill < 60:
                    s = cluster.status()
                    if s and s.get("leader") and s["leader"] != old_leader:
                        elections.append(time.time() - t_kill)
                        line += f"; new leader {s['leader']} after {elections[-1]:.2f} s"
                        break
                    time.sleep(0.1)
            pending_restarts.append((t_kill + args.restart_after, target))
            with lock:
                line += f"; so far {results['ok']} ok, {results['failed']} failed, {results['altered']} altered"
            print(line, flush=True)
        stop.set()
        for t in threads:
            t.join(timeout=150)
        elapsed = time.time() - t_start
        final = cluster.status() or {}
        epoch = (final.get("placements") or [{}])[0].get("epoch")
        latencies.sort()
        pct = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None
        summary = {
            "minutes": round(elapsed / 60, 2), "streams": args.streams, "workers": args.workers, "replicas": 2,
            "requests": results["ok"] + results["failed"] + results["altered"], **results,
            "kills": kills, "leader_kills": leader_kills,
            "election_s_median": sorted(elections)[len(elections) // 2] if elections else None,
            "election_s_max": max(elections) if elections else None,
            "epochs": (epoch - first_epoch) if epoch else None,
            "tokens_per_s": round(results["tokens"] / elapsed, 1),
            "latency_s_p50": pct(0.5), "latency_s_p99": pct(0.99),
        }
        print(json.dumps(summary))
        for line in problems[:20]:
            print(line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)
        sys.exit(0 if results["failed"] == 0 and results["altered"] == 0 and results["ok"] > 0 else 1)
    finally:
        cluster.stop()
        print(f"logs in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
