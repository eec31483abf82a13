"""The dashboard in a real headless Chromium (Debian's `chromium`), driven over the DevTools
protocol: the page loads with no console errors, sends a chat message, shows the streamed answer
and a non-zero tok/s, and fills the panels. A screenshot is kept as a test artifact
(`target/test-artifacts/dashboard.png`)."""
import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import websockets

from conftest import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "test-artifacts"


class Page:
    """One tab, over the DevTools websocket: commands, and the console errors seen so far."""

    def __init__(self, ws):
        self.ws, self.next_id, self.errors, self.pending = ws, 0, [], {}

    async def pump(self):
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg and msg["id"] in self.pending:
                self.pending.pop(msg["id"]).set_result(msg)
            elif msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append(msg["params"]["exceptionDetails"].get("text", "exception") + " " + json.dumps(msg["params"]["exceptionDetails"].get("exception", {}).get("description", "")))
            elif msg.get("method") == "Runtime.consoleAPICalled" and msg["params"]["type"] == "error":
                self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in msg["params"]["args"]))
            elif msg.get("method") == "Log.entryAdded" and msg["params"]["entry"]["level"] == "error":
                self.errors.append(msg["params"]["entry"]["text"])

    async def call(self, method, **params):
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        await self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, 60)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg["result"]

    async def eval(self, expr):
        r = await self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def until(self, expr, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if await self.eval(expr):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out waiting for {expr}")


async def drive(url: str, profile: str, shot: str = "dashboard.png", cluster_rows: int | None = None) -> tuple[dict, list]:
    proc = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1400,900", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own process group: the renderer and helper processes go with it at the end.
        start_new_session=True,
    )
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.time() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.time() < deadline and proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list").read())
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        async with websockets.connect(ws_url, max_size=64 << 20) as ws:
            page = Page(ws)
            pump = asyncio.create_task(page.pump())
            await page.call("Runtime.enable")
            await page.call("Log.enable")
            await page.call("Page.enable")
            await page.call("Page.navigate", url=url)
            await page.until("document.readyState === 'complete' && document.getElementById('model').textContent === 'shimmer-demo'")
            await page.eval("document.getElementById('input').value = 'And the LORD spake unto Moses, saying,'")
            await page.eval("document.getElementById('send').click()")
            await page.until("(() => { const m = document.querySelectorAll('.msg.assistant'); return m.length > 0 && m[m.length - 1].dataset.done === '1'; })()", timeout=120)
            await page.until("parseFloat(document.getElementById('toks').textContent) > 0", timeout=30)
            await page.until("document.getElementById('breakdown').children.length === 6")
            if cluster_rows is not None:
                await page.until(f"!document.getElementById('cluster-panel').hidden && document.querySelectorAll('#cluster tbody tr').length === {cluster_rows}")
            facts = await page.eval("""({
                cluster: [...document.querySelectorAll('#cluster tbody tr')].map((tr) => [...tr.children].map((td) => td.textContent)),
                cluster_facts: document.getElementById('cluster-facts').textContent,
                raft: [...document.querySelectorAll('#raft tbody tr')].map((tr) => [...tr.children].map((td) => td.textContent)),
                raft_facts: document.getElementById('raft-facts').textContent,
                raft_hidden: document.getElementById('raft-panel').hidden,
                breakdown: document.getElementById('breakdown-legend').textContent,
                answer: [...document.querySelectorAll('.msg.assistant')].pop().textContent,
                error: document.querySelectorAll('.msg.error').length,
                toks: parseFloat(document.getElementById('toks').textContent),
                ttft: document.getElementById('ttft').textContent,
                brain: document.getElementById('brain').width * document.getElementById('brain').height,
                tiers: document.getElementById('tiers-legend').textContent,
            })""")
            png = await page.call("Page.captureScreenshot", format="png")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / shot).write_bytes(base64.b64decode(png["data"]))
            pump.cancel()
            return facts, page.errors
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_dashboard_chats_and_shows_live_figures(server):
    assert CHROMIUM, "chromium is not installed (scripts/test installs Debian's chromium package)"
    # A helper process may still be writing the profile as it dies; leftovers are not a failure.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        facts, errors = asyncio.run(drive(server.url + "/", profile))
    assert errors == [], errors
    assert facts["error"] == 0 and len(facts["answer"].strip()) > 0, facts
    assert facts["toks"] > 0 and facts["ttft"].endswith("ms"), facts
    assert facts["brain"] > 0 and "RAM" in facts["tiers"], facts
    assert facts["raft_hidden"] and facts["raft"] == [], "a single box has no control plane to show"
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_the_dashboard_shows_the_vram_tier(make_server):
    """With the experts on a GPU (Mesa's lavapipe through `--gpu vulkan`; the test command builds
    the binary with its `vulkan` feature), the tier bar counts bytes served from VRAM, the Brain
    colours the experts VRAM holds, and /metrics counts VRAM accesses — all from one chat."""
    assert CHROMIUM, "chromium is not installed (scripts/test installs Debian's chromium package)"
    s = make_server("--gpu", "vulkan")
    assert any("VRAM tier" in line for line in s.log), "".join(s.log)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        facts, errors = asyncio.run(drive(s.url + "/", profile, shot="dashboard-vram.png"))
    assert errors == [], errors
    assert facts["error"] == 0 and len(facts["answer"].strip()) > 0, facts
    # The second turn's experts were uploaded by the first: served from VRAM.
    snap = json.loads(urllib.request.urlopen(s.url + "/api/dashboard").read())
    assert "vram" in snap["tier"], snap["tier"][:64]
    assert snap["tiers"]["vram_bytes"] > 0, snap["tiers"]
    metrics = urllib.request.urlopen(s.url + "/metrics").read().decode()
    hits = [line for line in metrics.splitlines() if line.startswith('shimmer_expert_accesses_total{result="hit",tier="vram"}')]
    assert hits and float(hits[0].split()[-1]) > 0, hits
    assert 'shimmer_gpu_faults_total{kind="injected"} 0' in metrics
