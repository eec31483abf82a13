"""A cluster of real processes behind the OpenAI API: `shimmer worker`s on 127.0.0.2–4 and a
`shimmer coordinator`, held to the single box (the session's `shimmer run`) with the real `openai`
client.

- Two copies of every expert: a worker killed with SIGKILL mid-stream changes no token; restarted,
  it is re-admitted and serves again (seen on /metrics).
- One copy: a worker killed, its experts are read by the survivor from its own disk (the same
  tokens); with workers that serve only their slice, a clear error naming the expert instead.
- The cluster series on /metrics are scraped by a real Prometheus server and queried back.
- The dashboard's cluster view lists the workers (headless Chromium; test_dashboard.py's driver).
- Workers restarted on a re-planned placement (the next epoch): the coordinator adopts it.
"""
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import openai
import pytest

from conftest import Server, shimmer_bin

MODEL = "shimmer-demo"
PROMPT = [{"role": "user", "content": "And the LORD spake unto Moses, saying,"}]
TOKEN = "api-tests-cluster-join-token"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Worker:
    """A `shimmer worker` process on a fixed address, so that it can be killed and restarted."""

    def __init__(self, addr: str, *args: str):
        self.addr, self.args = addr, args
        self.start()

    def start(self):
        # Several workers share an address here: each its own free port for /health, /ready, /metrics.
        http = self.addr.rsplit(":", 1)[0] + ":0"
        self.proc = subprocess.Popen(
            [shimmer_bin(), "worker", "--listen", self.addr, "--http-listen", http, "--join-token", TOKEN, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.log = []
        deadline = time.time() + 60
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            if "worker serving" in line:
                threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr], daemon=True).start()
                return
        self.proc.kill()
        raise RuntimeError("shimmer worker did not start:\n" + "".join(self.log))

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def placement(tmp: Path, addrs: list[str], copies: int) -> Path:
    """`shimmer plan`'s file for the demo over `addrs`, with every expert on `copies` workers
    (planned over an earlier one, the next epoch)."""
    out = tmp / "placement.json"
    r = subprocess.run([shimmer_bin(), "plan", "--workers", ",".join(addrs), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    p = json.loads(out.read_text())
    for layer in p["layers"]:
        layer["replicas"] = [[addrs[(e + i) % len(addrs)] for i in range(copies)] for e in range(len(layer["replicas"]))]
    out.write_text(json.dumps(p))
    return out


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(c, max_tokens=40):
    r = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def metric(server, name: str, worker: str | None = None) -> float:
    want = name + (f'{{worker="{worker}"}}' if worker else "")
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{want} not on /metrics")


@pytest.fixture(scope="module")
def replicated():
    """Three workers on 127.0.0.2–4, every expert on two of them, and their coordinator."""
    tmp = Path(tempfile.mkdtemp())
    addrs = [f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3, 4)]
    p = placement(tmp, addrs, copies=2)
    workers = [Worker(a, "--placement", str(p)) for a in addrs]
    coord = Server("--host", "127.0.0.1", "--placement", str(p), "--join-token", TOKEN, "--worker-timeout-s", "2", "--connect-timeout-s", "1", verb="coordinator")
    yield coord, workers, addrs
    coord.stop()
    for w in workers:
        w.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def test_a_worker_killed_mid_stream_changes_no_token_and_is_readmitted_when_back(server, replicated):
    coord, workers, addrs = replicated
    want = greedy(client(server))
    assert greedy(client(coord)) == want
    stream = client(coord).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=40, temperature=0, stream=True)
    text, chunks = "", 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            chunks += 1
            if chunks == 5:
                workers[0].kill9()
    assert chunks > 5, "the kill came mid-stream"
    assert text == want
    assert metric(coord, "shimmer_worker_up", addrs[0]) == 0
    assert metric(coord, "shimmer_expert_failovers_total") > 0
    # Back on the same address: redialled after its backoff, then used again.
    workers[0].start()
    deadline = time.time() + 30
    while metric(coord, "shimmer_worker_up", addrs[0]) == 0:
        assert time.time() < deadline, "the restarted worker was not re-admitted"
        assert greedy(client(coord), max_tokens=4) == greedy(client(server), max_tokens=4)
        time.sleep(0.3)
    served = metric(coord, "shimmer_worker_selections_total", addrs[0])
    assert greedy(client(coord)) == want
    assert metric(coord, "shimmer_worker_selections_total", addrs[0]) > served


@pytest.mark.parametrize("assigned_only", [False, True])
def test_with_one_copy_a_dead_workers_experts_come_from_the_survivors_disk_or_are_a_clear_error(server, assigned_only):
    tmp = Path(tempfile.mkdtemp())
    addrs = [f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3)]
    p = placement(tmp, addrs, copies=1)
    workers = [Worker(a, "--placement", str(p), *(["--assigned-only"] if assigned_only else [])) for a in addrs]
    coord = Server("--host", "127.0.0.1", "--placement", str(p), "--join-token", TOKEN, "--worker-timeout-s", "2", "--connect-timeout-s", "1", verb="coordinator")
    try:
        want = greedy(client(server))
        assert greedy(client(coord)) == want
        workers[1].kill9()
        if not assigned_only:
            # The survivor loads the dead worker's experts from its own disk: the same tokens.
            assert greedy(client(coord)) == want
            assert metric(coord, "shimmer_worker_selections_total", addrs[0]) > 0
            return
        with pytest.raises(openai.APIStatusError) as e:
            greedy(client(coord))
        message = str(e.value)
        assert e.value.status_code == 503, e.value
        assert "expert" in message and "no worker can serve it" in message and addrs[1] in message, message
        # The coordinator itself stays up and says what is wrong on the next request too.
        with pytest.raises(openai.APIStatusError):
            greedy(client(coord), max_tokens=2)
    finally:
        coord.stop()
        for w in workers:
            w.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_real_prometheus_scrapes_the_cluster_series(replicated):
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is not installed (scripts/test installs Debian's prometheus package)"
    coord, _, addrs = replicated
    greedy(client(coord), max_tokens=8)
    target = coord.url.removeprefix("http://")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "prometheus.yml").write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: shimmer\n    static_configs:\n      - targets: ['{target}']\n")
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:

        def query(q):
            r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query?query=" + urllib.parse.quote(q), timeout=5)
            return r.json()["data"]["result"]

        deadline = time.time() + 60
        while True:
            try:
                rtt = query("shimmer_worker_request_rtt_seconds_count")
                if len(rtt) == len(addrs):
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.time() < deadline, "prometheus did not scrape the coordinator"
            time.sleep(0.5)
        assert {r["metric"]["worker"] for r in rtt} == set(addrs)
        assert sum(float(r["value"][1]) for r in query("shimmer_network_bytes_sent_total")) > 0
        assert float(query("shimmer_cluster_tokens_total")[0]["value"][1]) > 0
        # The histogram works with PromQL's quantiles.
        q = query("histogram_quantile(0.5, sum by (le) (shimmer_worker_request_rtt_seconds_bucket))")
        assert q and 0 < float(q[0]["value"][1]) < 10
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_dashboard_shows_the_cluster_view(replicated):
    import asyncio

    from test_dashboard import CHROMIUM, drive

    coord, _, addrs = replicated
    assert CHROMIUM, "chromium is not installed (scripts/test installs Debian's chromium package)"
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        facts, errors = asyncio.run(drive(coord.url + "/", profile, shot="dashboard-cluster.png", cluster_rows=len(addrs)))
    assert errors == [], errors
    assert facts["error"] == 0 and len(facts["answer"].strip()) > 0, facts
    assert [row[0] for row in facts["cluster"]] == addrs, facts["cluster"]
    assert "round trips" in facts["cluster_facts"], facts
    assert "network wait" in facts["breakdown"] and "I/O wait" not in facts["breakdown"], facts["breakdown"]
    # The Brain colours each expert by the worker that first serves it: every worker appears.
    snap = httpx.get(coord.url + "/api/dashboard").json()
    assert len(snap["node"]) == len(snap["moe_layers"]) * snap["experts"], snap["node"]
    assert set(snap["node"]) == set(range(len(addrs))), set(snap["node"])
    assert metric(coord, "shimmer_placement_epoch") == 1


def test_the_dashboard_of_a_member_coordinator_shows_raft_roles_and_the_epoch():
    """Three workers joined into a cluster (--bootstrap / --join) and a member coordinator: its
    dashboard shows the leader, the term, each member's Raft role and the placement epoch, as
    `cluster status` reports them."""
    import asyncio

    from test_dashboard import CHROMIUM, drive

    assert CHROMIUM, "chromium is not installed (scripts/test installs Debian's chromium package)"
    tmp = Path(tempfile.mkdtemp())
    addrs = [f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3, 4)]
    workers = [Worker(addrs[0], "--data-dir", str(tmp / "w0"), "--bootstrap", "--no-mdns")]
    workers += [Worker(a, "--data-dir", str(tmp / f"w{i + 1}"), "--join", addrs[0], "--no-mdns") for i, a in enumerate(addrs[1:])]
    coord_listen = f"127.0.0.5:{free_port('127.0.0.5')}"
    coord = None
    try:
        coord = Server("--host", "127.0.0.1", "--listen", coord_listen, "--data-dir", str(tmp / "coordinator"), "--join", addrs[0], "--join-token", TOKEN,
                       "--no-mdns", "--worker-timeout-s", "2", "--connect-timeout-s", "1", verb="coordinator")
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
            facts, errors = asyncio.run(drive(coord.url + "/", profile, shot="dashboard-raft.png", cluster_rows=len(addrs)))
        assert errors == [], errors
        r = subprocess.run([shimmer_bin(), "cluster", "status", "--json", "--join", ",".join(addrs), "--join-token", TOKEN], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        assert not facts["raft_hidden"], facts
        rows = {row[0]: row[1:] for row in facts["raft"]}
        assert set(rows) == set(addrs) | {coord_listen}, facts["raft"]
        for m in status["members"]:
            kind, role, _ = rows[m["name"]]
            assert kind == m["kind"], (m, rows[m["name"]])
            assert role == (f"{m['role']} (leader)" if m["name"] == status["leader"] else m["role"]), (m, rows[m["name"]])
        assert sorted(role for _, role, _ in rows.values()).count("learner") == 1, "three voters and the coordinator a learner"
        epoch = status["placements"][0]["epoch"]
        assert f"leader {status['leader']}" in facts["raft_facts"] and f"placement epoch {epoch}" in facts["raft_facts"], facts["raft_facts"]
        assert f"term {status['term']}" in facts["raft_facts"], facts["raft_facts"]
    finally:
        if coord:
            coord.stop()
        for w in workers:
            w.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_new_placement_is_adopted_when_the_workers_move_to_it(server):
    tmp = Path(tempfile.mkdtemp())
    addrs = [f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3)]
    p = placement(tmp, addrs, copies=1)
    workers = [Worker(a, "--placement", str(p)) for a in addrs]
    coord = Server("--host", "127.0.0.1", "--placement", str(p), "--join-token", TOKEN, "--worker-timeout-s", "2", "--connect-timeout-s", "1", verb="coordinator")
    try:
        want = greedy(client(server))
        assert greedy(client(coord)) == want and metric(coord, "shimmer_placement_epoch") == 1
        # Re-planned over the same file (epoch 2, now every expert on both), the workers restarted on it.
        placement(tmp, addrs, copies=2)
        assert json.loads(p.read_text())["epoch"] == 2
        for w in workers:
            w.stop()
            w.start()
        assert greedy(client(coord)) == want
        assert metric(coord, "shimmer_placement_epoch") == 2
    finally:
        coord.stop()
        for w in workers:
            w.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_every_long_running_verb_exits_0_on_sigterm_single_box_and_clustered():
    """No panic on shutdown: `run` (test_openai.py), and here a static coordinator and its
    workers, then a member coordinator and member workers, each stopped by SIGTERM, exit 0."""
    tmp = Path(tempfile.mkdtemp())
    started: list = []
    try:
        addrs = [f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3)]
        p = placement(tmp, addrs, copies=2)
        workers = [Worker(a, "--placement", str(p)) for a in addrs]
        started += workers
        coord = Server("--host", "127.0.0.1", "--placement", str(p), "--join-token", TOKEN, verb="coordinator")
        started.append(coord)
        greedy(client(coord), max_tokens=4)
        assert coord.stop(signal.SIGTERM) == 0, "".join(coord.log[-20:])
        for w in workers:
            w.proc.send_signal(signal.SIGTERM)
            assert w.proc.wait(timeout=30) == 0, "".join(w.log[-20:])
        members = [Worker(addrs[0], "--data-dir", str(tmp / "m0"), "--bootstrap", "--no-mdns")]
        members.append(Worker(addrs[1], "--data-dir", str(tmp / "m1"), "--join", addrs[0], "--no-mdns"))
        started += members
        member = Server("--host", "127.0.0.1", "--listen", f"127.0.0.5:{free_port('127.0.0.5')}", "--data-dir", str(tmp / "c"), "--join", addrs[0],
                        "--join-token", TOKEN, "--no-mdns", verb="coordinator")
        started.append(member)
        greedy(client(member), max_tokens=4)
        assert member.stop(signal.SIGTERM) == 0, "".join(member.log[-20:])
        # A member worker drains on SIGTERM (its experts move to the other first), then exits 0.
        members[1].proc.send_signal(signal.SIGTERM)
        assert members[1].proc.wait(timeout=150) == 0, "".join(members[1].log[-20:])
    finally:
        for proc in (x.proc for x in started):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
