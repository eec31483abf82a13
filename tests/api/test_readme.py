"""The README's commands, as a new user types them, in a clean checkout.

Users copy the README's commands. So this test reads them out of README.md (fenced `sh` blocks and
the inline `cargo run --release -- ...` spans) and runs each one word for word in a fresh copy of
the working tree (tracked and untracked-but-not-ignored files only, its own `target/`, no
`CARGO_TARGET_DIR`), appending only a free `--port`. Placeholders a user would fill in are
substituted, and each substitution is listed in `SUBSTITUTIONS` with its reason.

- `cargo run --release -- run` builds, serves, answers `/health` and one chat completion, and
  stops on Ctrl-C (SIGINT to the process group, as a terminal sends it).
- `cargo run --release -- chat` answers one turn on stdin.
- `cargo run --release -- generate --prompt ...` streams a continuation.
- The streaming block: `convert` writes a container, `chat --model MODEL_DIR --ram-gb 4
  --direct-io` answers from it.
- The pooling block: a `worker` that bootstraps the cluster, one that joins it and a
  `coordinator` that joins too, on 127.0.0.x, answer a chat completion with the single box's
  text (greedy); the inline `cluster status` shows them while they run; each stops on Ctrl-C.

The checkout lives under the main target directory (`readme-checkout/`), so a developer's second
run reuses its build; CI's clean clone builds it once (a release build).
"""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# A release build from nothing on a 2-core machine; generous, since the first command compiles.
BUILD_TIMEOUT_S = 40 * 60

# The whole run's `--timeout` is per test and far shorter: whichever test comes first builds, so
# every test here gets the build's time and then some (a loaded two-core machine once took more
# than ten minutes for that build, and the run failed on a timeout that the build's own allowed).
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 10 * 60)

# What a user fills in, and what this test fills in instead (with why).
SUBSTITUTIONS = {
    # a Hugging Face checkpoint directory: the bundled demo model is one
    "HF_DIR": "models/demo",
    # where `convert` writes the container (a disk directory: --direct-io needs O_DIRECT)
    "MODEL_DIR": "work/model",
    # two LAN machines become two loopback addresses of this one
    "192.168.1.10": "127.0.0.2",
    "192.168.1.11": "127.0.0.3",
}

# The pooling block's nodes run on one machine here: each gets its own loopback address in place
# of the README's every-interface one (a LAN machine has one of its own), and its own data
# directory in place of the README's one per machine.
POOL_NODES = {
    "bootstrap": ("0.0.0.0:7070", "127.0.0.2:7070", "work/node-2"),
    "join": ("0.0.0.0:7070", "127.0.0.3:7070", "work/node-3"),
}
# The coordinator's control plane listens on every interface by default and advertises this
# machine's address on its default route; a machine without one (a CI box) says where with
# --listen.
COORDINATOR_LISTEN = "127.0.0.4:7071"
POOL_DATA_DIR = "shimmer-node"


def fenced_blocks(text: str) -> list[list[str]]:
    """The `sh` code blocks of the README, each as its command lines (comments dropped)."""
    blocks = []
    for body in re.findall(r"```sh\n(.*?)```", text, re.S):
        lines = [ln.strip() for ln in body.splitlines()]
        blocks.append([ln for ln in lines if ln and not ln.startswith("#")])
    return blocks


def inline_commands(text: str) -> list[str]:
    return re.findall(r"`(cargo run --release -- [^`]+)`", text)


def readme() -> tuple[list[list[str]], list[str]]:
    text = README.read_text()
    return fenced_blocks(text), inline_commands(text)


def substitute(cmd: str) -> str:
    for placeholder, value in SUBSTITUTIONS.items():
        cmd = cmd.replace(placeholder, value)
    return cmd


@pytest.fixture(scope="module")
def checkout() -> Path:
    """A copy of the working tree as `git clone` of it would give, beside its own build."""
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    dest = target / "readme-checkout"
    dest.mkdir(parents=True, exist_ok=True)
    for child in dest.iterdir():
        if child.name == "target":
            continue
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if not src.is_file():
            continue  # deleted in the working tree
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name)  # modification times kept: an unchanged tree is not rebuilt
    (dest / "work").mkdir()
    return dest


def user_env() -> dict:
    """The environment a user's shell would have: no build-directory or test overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO_TARGET_DIR", "SHIMMER_", "RUST_LOG"))}
    return env


class Running:
    """A README command that serves: started in its own process group (a terminal's job)."""

    def __init__(self, cmd: str, cwd: Path, env: dict, ready: str, timeout: float):
        self.cmd = cmd
        self.proc = subprocess.Popen(shlex.split(cmd), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.log: list[str] = []
        self.match = None
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            self.match = re.search(ready, line)
            if self.match:
                break
        if self.match is None:
            self.kill()
            raise AssertionError(f"`{cmd}` never printed /{ready}/:\n" + "".join(self.log[-40:]))
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr], daemon=True).start()

    def interrupt(self, timeout: float = 60) -> int:
        """Ctrl-C: SIGINT to the whole foreground job (cargo and shimmer)."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def serve(cmd: str, cwd: Path, env: dict, timeout: float = BUILD_TIMEOUT_S) -> tuple[Running, str]:
    """Starts a README serving command with a free port appended; returns it and its base URL."""
    r = Running(cmd + " --port 0", cwd, env, r"on (http://[0-9.]+:[0-9]+)", timeout)
    url = r.match.group(1).replace("//0.0.0.0:", "//127.0.0.1:")
    return r, url


def one_turn(cmd: str, cwd: Path, env: dict, line: str, timeout: float = BUILD_TIMEOUT_S) -> str:
    """A terminal chat command with one line typed and then end of input; returns its answer."""
    out = subprocess.run(shlex.split(cmd), cwd=cwd, env=env, input=line + "\n", capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"`{cmd}` exited {out.returncode}:\n{out.stderr[-4000:]}"
    turns = out.stdout.split("› ")
    assert len(turns) >= 3, f"`{cmd}`: expected a prompt, an answer and the next prompt:\n{out.stdout}"
    answer = turns[1].strip()
    assert answer, f"`{cmd}` gave an empty answer:\n{out.stdout}"
    return answer


def complete(url: str, text: str, max_tokens: int = 16) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def test_the_readme_first_command_is_the_one_users_copy():
    blocks, _ = readme()
    assert blocks and blocks[0][0] == "cargo run --release -- run", f"the README's first command changed: {blocks[:1]}"
    assert blocks[0][1] == "./scripts/test", f"the README's test command changed: {blocks[0]}"


def test_the_main_job_serves_answers_and_stops_on_ctrl_c(checkout):
    blocks, _ = readme()
    server, url = serve(blocks[0][0], checkout, user_env())
    try:
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 200, health.text
        assert complete(url, "And the LORD spake unto Moses, saying,")
    finally:
        rc = server.interrupt()
    assert rc == 0, "".join(server.log[-20:])


def test_every_inline_readme_command_runs(checkout):
    _, inline = readme()
    verbs = {shlex.split(c)[4] for c in inline}
    assert {"chat", "generate"} <= verbs, inline
    # `cluster` needs a running cluster: the pooling block's test runs it.
    for cmd in (c for c in inline if shlex.split(c)[4] != "cluster"):
        verb = shlex.split(cmd)[4]
        if verb == "chat":
            one_turn(cmd, checkout, user_env(), "Who made the earth?")
        else:
            out = subprocess.run(shlex.split(cmd), cwd=checkout, env=user_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            assert out.returncode == 0, f"`{cmd}` exited {out.returncode}:\n{out.stderr[-4000:]}"
            assert out.stdout.strip(), f"`{cmd}` printed nothing"


def test_the_streaming_block_converts_and_chats_from_the_container(checkout):
    blocks, _ = readme()
    block = next(b for b in blocks if any(" convert " in c for c in b))
    cmds = [substitute(c) for c in block]
    convert, chat = cmds[0], cmds[-1]
    assert " convert " in convert and " chat " in chat, block
    shutil.rmtree(checkout / "work" / "model", ignore_errors=True)
    # convert, then what the block does between (tune), each as typed; then the chat.
    for cmd in cmds[:-1]:
        out = subprocess.run(shlex.split(cmd), cwd=checkout, env=user_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        assert out.returncode == 0, f"`{cmd}`:\n{out.stderr[-4000:]}"
    if any(" tune " in c for c in cmds):
        assert (checkout / "work" / "model" / "shimmer-tune.json").is_file(), "tune writes its choices beside the model"
    one_turn(chat, checkout, user_env(), "Who made the earth?")


def test_the_pooling_block_answers_as_the_single_box(checkout):
    blocks, _ = readme()
    block = next(b for b in blocks if any(" coordinator " in c for c in b))
    env = user_env()
    commands = []
    for line in block:
        if line.startswith("export "):
            name, value = line[len("export "):].split("=", 1)
            env[name] = shlex.split(value)[0]
        else:
            commands.append(substitute(line))
    first, joiner, coordinator = commands
    assert " --bootstrap" in first and " --join " in joiner and " coordinator " in coordinator, block
    assert "SHIMMER_JOIN_TOKEN" in env
    if not (checkout / "work" / "model").exists():
        test_the_streaming_block_converts_and_chats_from_the_container(checkout)
    for d in ("node-2", "node-3", "node-4"):
        shutil.rmtree(checkout / "work" / d, ignore_errors=True)
    _, inline = readme()
    status_cmds = [substitute(c) for c in inline if shlex.split(c)[4] == "cluster"]
    assert status_cmds, "the README shows `cluster status`"
    nodes = []
    try:
        for cmd, role in ((first, "bootstrap"), (joiner, "join")):
            everywhere, addr, data_dir = POOL_NODES[role]
            assert everywhere in cmd and POOL_DATA_DIR in cmd, cmd
            nodes.append(Running(cmd.replace(everywhere, addr).replace(POOL_DATA_DIR, data_dir), checkout, env, "control plane on", BUILD_TIMEOUT_S))
        assert POOL_DATA_DIR in coordinator, coordinator
        server, url = serve(coordinator.replace(POOL_DATA_DIR, "work/node-4") + f" --listen {COORDINATOR_LISTEN}", checkout, env)
        nodes.append(server)
        prompt = "Who made the earth?"
        got = complete(url, prompt)
        for cmd in status_cmds:
            out = subprocess.run(shlex.split(cmd), cwd=checkout, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            assert out.returncode == 0, f"`{cmd}`:\n{out.stderr[-4000:]}"
            for name in ("127.0.0.2:7070", "127.0.0.3:7070", COORDINATOR_LISTEN):
                assert name in out.stdout, f"`{cmd}` does not show {name}:\n{out.stdout}"
            assert "leader " in out.stdout and "placement epoch" in out.stdout, out.stdout
    finally:
        codes = []
        for n in reversed(nodes):
            try:
                codes.append((n.cmd, n.interrupt(), "".join(n.log[-20:])))
            except subprocess.TimeoutExpired:
                codes.append((n.cmd, "no exit within a minute", "".join(n.log[-20:])))
    for cmd, rc, log in codes:
        assert rc == 0, f"`{cmd}` exited {rc} on Ctrl-C:\n{log}"
    single = subprocess.run(
        shlex.split("cargo run --release -- generate --model work/model --chat --temperature 0 --max-tokens 16 --json --prompt") + [prompt],
        cwd=checkout, env=user_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    assert got == json.loads(single.stdout)["text"], "the pooled machines must answer as the single box"
