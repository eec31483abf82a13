"""The dashboards and alert rules against a real Prometheus scraping a real cluster.

Two `shimmer worker`s joined into a cluster (--bootstrap / --join) and a member `shimmer
coordinator`, under a short load through the `openai` client (sequential and concurrent chat
completions); Debian's Prometheus scrapes the coordinator's /metrics and both workers' every
second, with charts/shimmer/files/alerts.yaml loaded. Then every query of every Grafana panel
(deploy/monitoring/dashboards.py, `$__rate_interval` as 15s) returns data, every alert's
expression evaluates without error, and Prometheus reports every rule healthy. And /metrics
behind a key of its own (`--metrics-api-key`) on the API server and on a worker.
"""
import importlib.util
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import openai

from conftest import ROOT, Server
from test_cluster import MODEL, PROMPT, TOKEN, Worker, free_port


def dashboard_queries() -> list[tuple[str, str, str]]:
    spec = importlib.util.spec_from_file_location("dashboards", ROOT / "deploy/monitoring/dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.queries()


def http_of(worker: Worker) -> str:
    deadline = time.time() + 30
    while time.time() < deadline:
        for line in list(worker.log):
            m = re.search(r"metrics on (http://\S+)", line)
            if m:
                return m.group(1)
        time.sleep(0.1)
    raise AssertionError("the worker never said where its /metrics are:\n" + "".join(worker.log))


def test_every_dashboard_query_returns_data_and_every_alert_evaluates():
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is not installed (scripts/test installs Debian's prometheus package)"
    tmp = Path(tempfile.mkdtemp())
    addrs = [f"127.0.0.{i}:{free_port(f'127.0.0.{i}')}" for i in (2, 3)]
    workers = [Worker(addrs[0], "--data-dir", str(tmp / "w0"), "--bootstrap", "--no-mdns")]
    workers.append(Worker(addrs[1], "--data-dir", str(tmp / "w1"), "--join", addrs[0], "--no-mdns"))
    coord, proc = None, None
    try:
        coord = Server("--host", "127.0.0.1", "--listen", f"127.0.0.5:{free_port('127.0.0.5')}", "--data-dir", str(tmp / "coordinator"), "--join", addrs[0],
                       "--join-token", TOKEN, "--no-mdns", "--worker-timeout-s", "2", "--connect-timeout-s", "1", verb="coordinator")
        targets = [coord.url.removeprefix("http://")] + [http_of(w).removeprefix("http://") for w in workers]
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: ['{ROOT / 'charts/shimmer/files/alerts.yaml'}']\n"
            "scrape_configs:\n  - job_name: shimmer\n    static_configs:\n      - targets: [" + ", ".join(f"'{t}'" for t in targets) + "]\n"
        )
        check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        port = free_port("127.0.0.1")
        proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{port}/api/v1"

        def query(q: str) -> dict:
            return httpx.get(f"{api}/query?query=" + urllib.parse.quote(q), timeout=10).json()

        deadline = time.time() + 60
        while True:
            try:
                up = query("up")["data"]["result"]
                if len(up) == 3 and all(r["value"][1] == "1" for r in up):
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.time() < deadline, "prometheus never scraped the coordinator and both workers"
            time.sleep(0.5)
        # A short load: sequential, then four at once, over several scrapes.
        c = openai.OpenAI(base_url=coord.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = lambda: c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16, temperature=0)  # noqa: E731
        for _ in range(3):
            ask()
            time.sleep(1)
        together = [threading.Thread(target=ask) for _ in range(4)]
        [t.start() for t in together]
        [t.join() for t in together]
        time.sleep(4)
        empty, failed = [], []
        for dashboard, panel, expr in dashboard_queries():
            r = query(expr.replace("$__rate_interval", "15s"))
            if r.get("status") != "success":
                failed.append(f"{dashboard} / {panel}: {expr}: {r.get('error')}")
            elif not r["data"]["result"]:
                empty.append(f"{dashboard} / {panel}: {expr}")
        assert not failed, "queries Prometheus refused:\n" + "\n".join(failed)
        assert not empty, "panels with no data:\n" + "\n".join(empty)
        rules = httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"]
        alerting = [r for g in rules for r in g["rules"] if r["type"] == "alerting"]
        assert len(alerting) == 6, alerting
        for rule in alerting:
            r = query(rule["query"])
            assert r.get("status") == "success", (rule["name"], r)
            assert rule["health"] in ("ok", "unknown") and not rule.get("lastError"), rule
        # Evaluated at least once each, healthy.
        deadline = time.time() + 20
        while any(r["health"] != "ok" for g in httpx.get(f"{api}/rules", timeout=10).json()["data"]["groups"] for r in g["rules"]):
            assert time.time() < deadline, httpx.get(f"{api}/rules").text
            time.sleep(0.5)
    finally:
        if proc:
            proc.kill()
            proc.wait()
        if coord:
            coord.stop()
        for w in workers:
            w.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_metrics_can_require_a_key_of_their_own_on_the_api_server_and_a_worker(make_server):
    key = "metrics-only-key-0123456789"
    s = make_server("--api-key", "the-api-key-0123456789", "--metrics-api-key", key)
    assert httpx.get(s.url + "/metrics").status_code == 401
    assert httpx.get(s.url + "/metrics", headers={"authorization": "Bearer the-api-key-0123456789"}).status_code == 401, "an API key does not open /metrics"
    r = httpx.get(s.url + "/metrics", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200 and "shimmer_num_requests_running" in r.text
    assert httpx.get(s.url + "/health").status_code == 200
    # A worker: /metrics behind the key, /health and /ready open for probes.
    worker = Worker(f"127.0.0.2:{free_port('127.0.0.2')}", "--metrics-api-key", key)
    try:
        base = http_of(worker)
        assert httpx.get(base + "/metrics").status_code == 401
        assert httpx.get(base + "/metrics", headers={"authorization": "Bearer wrong-key-0123456789"}).status_code == 401
        r = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200 and "shimmer_worker_" in r.text, r.text[:500]
        assert httpx.get(base + "/health").status_code == 200
    finally:
        worker.stop()
    # Without the flag, as before: open.
    open_server = make_server()
    assert httpx.get(open_server.url + "/metrics").status_code == 200
