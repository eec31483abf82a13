"""The container image (deploy/Containerfile), built and run as a user would, offline.

`deploy/image/build.sh` builds it with Debian's buildah from the release binary (SHIMMER_RELEASE_BIN,
else the build script's own release build) without reaching a registry. Then the image's own
command runs in a network namespace of its own through `buildah run --isolation chroot` (podman
fails on this kind of machine: its crun may not call setrlimit) — and:
its health check command passes while it serves and fails once it stops; the real `openai` client
gets a chat completion, greedy, equal to `shimmer generate --chat` on the host; it runs as the
image's unprivileged user. Where the machine refuses (not root, no buildah, no network
namespaces), the test says so and why.
"""
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import BUILDAH, Netns, config, host_bin, run

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Say something about the sea."
MAX_TOKENS = 12


def test_the_image_says_how_it_runs(image):
    c = config(image)
    assert c["User"] == "10001:10001", c["User"]
    assert c["Entrypoint"] == ["/usr/local/bin/shimmer"]
    assert {"8080/tcp", "7070/udp", "7070/tcp", "7080/tcp"} <= set(c["ExposedPorts"]), c["ExposedPorts"]
    assert c["Healthcheck"]["Test"][:3] == ["CMD", "/usr/local/bin/shimmer", "probe"], c["Healthcheck"]
    labels = c["Labels"]
    version = next(ln.split('"')[1] for ln in (ROOT / "Cargo.toml").read_text().splitlines() if ln.startswith("version = "))
    assert labels["org.opencontainers.image.title"] == "shimmer"
    assert labels["org.opencontainers.image.version"] == version
    head = run(["git", "rev-parse", "HEAD"], cwd=ROOT).stdout.strip()
    assert labels["org.opencontainers.image.revision"] == head


@pytest.fixture(scope="module")
def container(image):
    """The image's own command (entrypoint + cmd), serving in a network namespace of its own."""
    ns = Netns()
    c = config(image)
    ctr = run([*BUILDAH, "from", "--name", f"shimmer-test-{uuid.uuid4().hex[:8]}", image])
    assert ctr.returncode == 0, ctr.stderr
    name = ctr.stdout.strip()
    # Not podman: on this kind of machine crun may not call setrlimit, so the image's command runs
    # through buildah's chroot isolation, which keeps the image's user, environment and working
    # directory (docs/deploy.md shows `podman run` for machines where it works).
    proc = subprocess.Popen(ns.cmd(*BUILDAH, "run", "--isolation", "chroot", name, "--", *c["Entrypoint"], *c["Cmd"]), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    health = c["Healthcheck"]["Test"][1:]
    deadline = time.time() + 120
    while time.time() < deadline:
        if run(ns.cmd(*BUILDAH, "run", "--isolation", "chroot", name, "--", *health)).returncode == 0:
            break
        assert proc.poll() is None, f"the container exited: {proc.stderr.read()}"
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"the image's health check never passed: {proc.stderr.read() if proc.poll() is not None else ''}")
    yield ns, name, proc, health
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)
    run([*BUILDAH, "rm", name])
    ns.close()


CLIENT = """
import json, sys, openai
c = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none")
model = c.models.list().data[0].id
r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": sys.argv[1]}], max_tokens=int(sys.argv[2]), temperature=0)
print(json.dumps({"content": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason}))
"""


def test_the_container_answers_a_chat_completion_as_the_host_does(container):
    ns, name, proc, _ = container
    got = run(ns.cmd(sys.executable, "-c", CLIENT, PROMPT, str(MAX_TOKENS)), timeout=300)
    assert got.returncode == 0, got.stderr
    answer = json.loads(got.stdout)
    want = run([host_bin(), "generate", "--chat", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json"], timeout=300)
    assert want.returncode == 0, want.stderr
    assert answer["content"] == json.loads(want.stdout)["text"], (answer, want.stdout)
    # The server inside runs as the image's user, not root.
    assert uid_of_serving_process(proc.pid) == 10001
    # The smoke test the chart's `helm test` pod runs, from inside the image.
    smoke = run(ns.cmd(*BUILDAH, "run", "--isolation", "chroot", name, "--", "/usr/local/bin/shimmer", "probe", "--chat", "http://127.0.0.1:8080", "--timeout-s", "60"))
    assert smoke.returncode == 0, smoke.stderr


def uid_of_serving_process(root_pid: int) -> int:
    """The real uid of the image's `shimmer` process below `root_pid` (buildah forks it)."""
    pending = [root_pid]
    while pending:
        pid = pending.pop()
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if argv[0] == "/usr/local/bin/shimmer":
                status = Path(f"/proc/{pid}/status").read_text()
                return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Uid:")))
            # Every thread's children: Go programs such as buildah fork from any thread.
            for task in Path(f"/proc/{pid}/task").iterdir():
                pending += [int(k) for k in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    raise AssertionError(f"no /usr/local/bin/shimmer process below pid {root_pid}")


def test_the_health_check_fails_once_the_server_is_gone(container):
    ns, name, proc, health = container
    proc.terminate()
    proc.wait(timeout=30)
    out = run(ns.cmd(*BUILDAH, "run", "--isolation", "chroot", name, "--", *health))
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "did not answer" in out.stderr, out.stderr
