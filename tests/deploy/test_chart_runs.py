"""The chart really starts a cluster: what `helm template` renders, run as a kubelet would run it.

Every pod the rendered StatefulSets make (and the `helm test` pod) gets a network namespace named
like the pod, on one bridge, and runs its container — the image built by deploy/image/build.sh,
through `buildah run --isolation chroot` — with the rendered args (`$(VAR)` expanded from its
env), its env resolved from the rendered Secrets and the downward API, `/data` a volume of its
own owned by the pod's fsGroup, `/tmp` an emptyDir. Cluster DNS is Debian's dnsmasq on the
bridge (each namespace's /etc/netns/NAME/resolv.conf names it): every running pod's name under
its headless Service, each headless Service's name for all its pods, the API Service's name for
the coordinators — updated as pods start. The rendered NetworkPolicies are enforced as a CNI
would, with iptables in each selected pod's namespace, and a stranger (a pod of another app in
the namespace) stands beside the release's pods. Then: the members form one cluster through Raft by themselves (worker 0 starts it,
the rest join by `dns:`); every probe the chart declares answers on the port it names; the `helm
test` pod's command succeeds against the API Service's name; and a chat completion through that
name equals `shimmer generate --chat` on the host.
"""
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import BUILDAH, ROOT, config, host_bin, run

CHART = ROOT / "charts/shimmer"
NAMESPACE = "llm"
DOMAIN = "cluster.local"
SUBNET = "10.203.0"
PROMPT = "Say something about the sea."
MAX_TOKENS = 12


# Rendered with one worker more than starts at first: the last one is the scale-up.
WORKERS = 4


def rendered(helm: Path, release: str) -> list[dict]:
    out = run([str(helm), "template", release, str(CHART), "--namespace", NAMESPACE, "--set", f"worker.replicas={WORKERS}"])
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


class Pod:
    def __init__(self, name: str, spec: dict, service: str | None, ip: str, labels: dict[str, str]):
        self.name, self.spec, self.service, self.ip, self.labels = name, spec, service, ip, labels
        self.container = spec["containers"][0] if spec.get("containers") else {}
        self.proc: subprocess.Popen | None = None
        self.ctr: str | None = None

    def port(self, name_or_number) -> int:
        for p in self.container.get("ports", []):
            if p["name"] == name_or_number or p["containerPort"] == name_or_number:
                return p["containerPort"]
        raise AssertionError(f"{self.name}: no port {name_or_number!r} declared")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in args: replaced when VAR is defined, `$$` escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def resolve_env(pod: Pod, secrets: dict[str, dict]) -> dict[str, str]:
    env = {}
    for e in pod.container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "fieldRef" in e["valueFrom"]:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "status.podIP": pod.ip}[field]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
        else:
            raise AssertionError(f"{pod.name}: an env source the test does not resolve: {e}")
    return env


@pytest.fixture(scope="module")
def cluster(image, request):
    if shutil.which("ip") is None:
        pytest.skip("iproute2 is not installed")
    helm = request.getfixturevalue("helm_latest")
    release = f"t{os.getpid() % 100000}"
    docs = rendered(helm, release)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    pods: list[Pod] = []
    for s in (d for d in docs if d["kind"] == "StatefulSet"):
        for i in range(s["spec"]["replicas"]):
            template = s["spec"]["template"]
            pods.append(Pod(f"{s['metadata']['name']}-{i}", template["spec"], s["spec"]["serviceName"], f"{SUBNET}.{10 + len(pods)}", template["metadata"]["labels"]))
    tests = [d for d in docs if d["kind"] == "Pod" and d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    assert len(tests) == 1, "the chart has one helm test pod"
    tester = Pod(tests[0]["metadata"]["name"], tests[0]["spec"], None, f"{SUBNET}.9", tests[0]["metadata"]["labels"])
    stranger = Pod(f"{release}-stranger", {}, None, f"{SUBNET}.8", {"app.kubernetes.io/name": "another-app"})
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policies, "the defaults render a NetworkPolicy"
    lan = f"{release}-lan"
    made: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="shimmer-chart-"))

    def sh(*cmd: str):
        out = run(list(cmd))
        assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr}"

    try:
        if run(["ip", "netns", "add", lan]).returncode != 0:
            pytest.skip("this kernel (or user) refuses network namespaces: `ip netns add` failed")
        made.append(lan)
        sh("ip", "-n", lan, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", lan, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        sh("ip", "-n", lan, "link", "set", "br0", "up")
        dns = Dns(lan, f"{SUBNET}.1", work)
        for k, p in enumerate([stranger, tester, *pods]):
            sh("ip", "netns", "add", p.name)
            made.append(p.name)
            veth = f"v{os.getpid() % 100000}x{k}"
            sh("ip", "link", "add", veth + "a", "type", "veth", "peer", "name", veth + "b")
            sh("ip", "link", "set", veth + "a", "netns", p.name)
            sh("ip", "link", "set", veth + "b", "netns", lan)
            sh("ip", "-n", lan, "link", "set", veth + "b", "master", "br0", "up")
            sh("ip", "-n", p.name, "addr", "add", f"{p.ip}/24", "dev", veth + "a")
            sh("ip", "-n", p.name, "link", "set", veth + "a", "up")
            sh("ip", "-n", p.name, "link", "set", "lo", "up")
            # `ip netns exec` mounts these over /etc (buildah copies them into the container).
            etc = Path("/etc/netns") / p.name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "resolv.conf").write_text(f"nameserver {SUBNET}.1\noptions timeout:1 attempts:2\n")
            (etc / "hosts").write_text("127.0.0.1 localhost\n")
        enforce_network_policies(policies, [stranger, tester, *pods])
        image_config = config(image)
        scale_up = pods[-1]
        assert scale_up.name.endswith(f"-worker-{WORKERS - 1}")
        first = [p for p in pods if p is not scale_up]
        publish_dns(first, services, dns)
        for p in first:
            start(p, image, image_config, secrets, work)
        yield first, tester, image_config, secrets, work, image, scale_up, services, dns, stranger
    finally:
        for p in [*pods, tester]:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.terminate()
                try:
                    p.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.proc.kill()
            if p.ctr:
                run([*BUILDAH, "rm", p.ctr])
        if "dns" in locals():
            dns.stop()
        for ns in made:
            run(["ip", "netns", "del", ns])
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"a selector this test does not enforce: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def enforce_network_policies(policies: list[dict], pods: list[Pod]):
    """What a CNI does with the rendered policies: each selected pod admits, in its namespace,
    only what some policy's ingress rules allow (sources by pod selector, ports by number or name,
    replies to its own connections); pods no policy selects admit everything."""
    allowed: dict[str, list[list[str]]] = {}
    for policy in policies:
        spec = policy["spec"]
        assert spec.get("policyTypes") == ["Ingress"], f"policy types this test does not enforce: {spec.get('policyTypes')}"
        for p in (q for q in pods if selects(spec["podSelector"], q.labels)):
            rules = allowed.setdefault(p.name, [])
            for rule in spec.get("ingress", []):
                sources: list[str | None] = [None]
                if "from" in rule:
                    sources = []
                    for peer in rule["from"]:
                        assert set(peer) == {"podSelector"}, f"a peer this test does not enforce: {peer}"
                        sources += [q.ip for q in pods if selects(peer["podSelector"], q.labels)]
                for port in rule.get("ports") or [{}]:
                    match = []
                    if "port" in port:
                        number = port["port"] if isinstance(port["port"], int) else p.port(port["port"])
                        match = ["-p", port.get("protocol", "TCP").lower(), "--dport", str(number)]
                    rules += [[*(["-s", src] if src else []), *match, "-j", "ACCEPT"] for src in sources]
    for p in pods:
        if p.name not in allowed:
            continue
        for rule in [["-i", "lo", "-j", "ACCEPT"], ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"], *allowed[p.name], ["-j", "DROP"]]:
            out = run(["ip", "netns", "exec", p.name, "iptables", "-A", "INPUT", *rule])
            assert out.returncode == 0, f"iptables {' '.join(rule)} in {p.name}: {out.stderr}"


def publish_dns(running: list[Pod], services: dict[str, dict], dns: "Dns"):
    """Cluster DNS for the pods that exist: each running pod under its headless Service, each
    headless Service's name for all its pods, the API Service's name for the coordinators."""
    hosts = []
    for p in running:
        hosts.append(f"{p.ip} {p.name}.{p.service}.{NAMESPACE}.svc.{DOMAIN}")
        hosts.append(f"{p.ip} {p.service}.{NAMESPACE}.svc.{DOMAIN}")
    for name, svc in services.items():
        if svc["spec"].get("clusterIP") != "None":
            component = svc["spec"]["selector"]["app.kubernetes.io/component"]
            hosts += [f"{p.ip} {name}.{NAMESPACE}.svc.{DOMAIN}" for p in running if p.service.endswith(f"-{component}")]
    dns.publish(hosts)


class Dns:
    """The cluster's DNS server: Debian's dnsmasq on the bridge, answering from a hosts file it
    re-reads on SIGHUP (names appear as pods start, as CoreDNS would serve them)."""

    def __init__(self, lan: str, ip: str, work: Path):
        self.file = work / "cluster-hosts"
        self.file.write_text("")
        dnsmasq = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        assert Path(dnsmasq).exists(), "dnsmasq is not installed (scripts/test installs Debian's dnsmasq-base)"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", lan, dnsmasq, "--keep-in-foreground", "--no-resolv", "--no-hosts", "--user=root", "--bind-interfaces",
             f"--listen-address={ip}", f"--addn-hosts={self.file}", f"--pid-file={work / 'dnsmasq.pid'}", "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=open(work / "dnsmasq.log", "w"))
        self.ip = ip

    def publish(self, lines: list[str]):
        self.file.write_text("\n".join(lines) + "\n")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


def start(p: Pod, image: str, image_config: dict, secrets: dict, work: Path, wait: bool = False) -> subprocess.CompletedProcess | None:
    """Runs the pod's container as a kubelet would: its volumes, env and args, in its namespace."""
    env = resolve_env(p, secrets)
    command = p.container.get("command") or image_config["Entrypoint"]
    args = p.container.get("args") if "args" in p.container else image_config["Cmd"]
    argv = [expand(a, env) for a in [*command, *args]]
    group = p.spec.get("securityContext", {}).get("fsGroup")
    mounts = []
    for m in p.container.get("volumeMounts", []):
        host = work / p.name / m["name"]
        host.mkdir(parents=True, exist_ok=True)
        if m["name"] == "tmp":
            host.chmod(0o1777)
        elif group is not None:
            os.chown(host, group, group)
        mounts += ["-v", f"{host}:{m['mountPath']}"]
    if p.ctr:
        run([*BUILDAH, "rm", p.ctr])
    out = run([*BUILDAH, "from", "--name", f"{p.name}-{uuid.uuid4().hex[:6]}", image])
    assert out.returncode == 0, out.stderr
    p.ctr = out.stdout.strip()
    cmd = ["ip", "netns", "exec", p.name, *BUILDAH, "run", "--isolation", "chroot", *mounts]
    for k, v in env.items():
        cmd += ["--env", f"{k}={v}"]
    cmd += [p.ctr, "--", *argv]
    if wait:
        return run(cmd, timeout=300)
    p.log = work / f"{p.name}.log"
    p.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(p.log, "w"))
    return None


def logs(pods: list[Pod]) -> str:
    return "\n".join(f"--- {p.name}\n{Path(p.log).read_text()[-2000:]}" for p in pods if getattr(p, "log", None))


def from_tester(tester: Pod, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run(["ip", "netns", "exec", tester.name, *cmd], timeout=timeout)


def connects(client: Pod, ip: str, port: int) -> bool:
    """Whether a TCP connection from the client's namespace to ip:port is accepted within 3 s."""
    probe = "import socket, sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()\nexcept OSError:\n sys.exit(1)"
    return from_tester(client, sys.executable, "-c", probe, ip, str(port)).returncode == 0


def cluster_status(tester: Pod, pods: list[Pod], secrets: dict) -> tuple[dict | None, str]:
    token = resolve_env(pods[0], secrets)["SHIMMER_JOIN_TOKEN"]
    worker0 = next(p for p in pods if p.name.endswith("-worker-0"))
    seed = f"{worker0.name}.{worker0.service}.{NAMESPACE}.svc.{DOMAIN}:7070"
    out = from_tester(tester, host_bin(), "cluster", "status", "--json", "--join", seed, "--join-token", token)
    return (json.loads(out.stdout), out.stdout) if out.returncode == 0 else (None, out.stderr)


def test_the_members_form_one_cluster_by_themselves(cluster):
    pods, tester, _, secrets, *_ = cluster
    token = resolve_env(pods[0], secrets)["SHIMMER_JOIN_TOKEN"]
    workers = [p for p in pods if "-worker-" in p.name]
    seed = f"{workers[0].name}.{workers[0].service}.{NAMESPACE}.svc.{DOMAIN}:7070"
    deadline, last = time.time() + 180, ""
    while time.time() < deadline:
        out = from_tester(tester, host_bin(), "cluster", "status", "--json", "--join", seed, "--join-token", token)
        if out.returncode == 0:
            v = json.loads(out.stdout)
            names = {m["name"] for m in v["members"]}
            placed = [p for p in v["placements"] if p["epoch"] >= 1 and p.get("proposed") is None]
            if len(names) == len(pods) and all(m["up"] for m in v["members"]) and placed:
                want = {f"{p.name}.{p.service}.{NAMESPACE}.svc.{DOMAIN}:7070" for p in pods}
                assert names == want, (names, want)
                assert sum(m["role"] == "voter" for m in v["members"]) == 3, v
                assert v["leader"] in names, v
                return
            last = out.stdout
        else:
            last = out.stderr
        for p in pods:
            assert p.proc.poll() is None, f"{p.name} exited ({p.proc.returncode}):\n{logs(pods)}"
        time.sleep(1)
    pytest.fail(f"no cluster of every pod with a placement within 180 s; last: {last}\n{logs(pods)}")


def test_every_probe_answers_on_the_port_it_names(cluster):
    pods, tester, *_ = cluster
    for p in pods:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = p.container[kind]["httpGet"]
            url = f"http://{p.ip}:{p.port(probe['port'])}{probe['path']}"
            deadline = time.time() + 180
            while True:
                out = from_tester(tester, host_bin(), "probe", url)
                if out.returncode == 0:
                    break
                assert time.time() < deadline, f"{p.name}'s {kind} ({url}) never passed: {out.stderr}\n{logs(pods)}"
                time.sleep(1)


def test_the_network_policy_keeps_the_control_plane_to_members_and_leaves_the_api_and_metrics_open(cluster):
    pods, tester, *_, stranger = cluster
    coordinator = next(p for p in pods if "-coordinator-" in p.name)
    worker = next(p for p in pods if "-worker-" in p.name)
    # The release's own pods (the helm test pod carries its labels) reach the control plane.
    assert connects(tester, worker.ip, worker.port("control")), "a member's pod could not reach a worker's control plane"
    # A pod of another app reaches the API and the metrics, not the control plane.
    assert connects(stranger, coordinator.ip, coordinator.port("api")), "the API is not open to other pods"
    assert connects(stranger, worker.ip, worker.port("http")), "a worker's metrics are not open to other pods"
    assert not connects(stranger, worker.ip, worker.port("control")), "another app's pod reached a worker's control plane"
    assert not connects(stranger, coordinator.ip, coordinator.port("control")), "another app's pod reached the coordinator's control plane"


def test_the_helm_test_pod_succeeds_and_answers_match_the_single_box(cluster):
    pods, tester, image_config, secrets, work, image, *_ = cluster
    done = start(tester, image, image_config, secrets, work, wait=True)
    assert done is not None and done.returncode == 0, f"the helm test pod failed: {done.stderr if done else ''}\n{logs(pods)}"
    api = next(a for a in tester.container["args"] if a.startswith("http://"))
    client = f"""
import json, sys, openai
c = openai.OpenAI(base_url="{api}/v1", api_key="none")
r = c.chat.completions.create(model=c.models.list().data[0].id, messages=[{{"role": "user", "content": sys.argv[1]}}], max_tokens=int(sys.argv[2]), temperature=0)
print(json.dumps({{"content": r.choices[0].message.content}}))
"""
    got = from_tester(tester, sys.executable, "-c", client, PROMPT, str(MAX_TOKENS), timeout=300)
    assert got.returncode == 0, got.stderr
    want = run([host_bin(), "generate", "--chat", "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json"], timeout=300)
    assert want.returncode == 0, want.stderr
    assert json.loads(got.stdout)["content"] == json.loads(want.stdout)["text"]


def test_a_scaled_up_worker_joins_and_the_placement_grows_with_the_same_answers(cluster):
    pods, tester, image_config, secrets, work, image, new, services, dns, _ = cluster
    before, said = cluster_status(tester, pods, secrets)
    assert before, said
    epoch = max(p["epoch"] for p in before["placements"])
    # `helm upgrade --set worker.replicas=4`: the StatefulSet's next pod, from the same template.
    pods.append(new)
    publish_dns(pods, services, dns)
    start(new, image, image_config, secrets, work)
    name = f"{new.name}.{new.service}.{NAMESPACE}.svc.{DOMAIN}:7070"
    deadline, last = time.time() + 180, said
    while time.time() < deadline:
        v, last = cluster_status(tester, pods, secrets)
        if v and any(m["name"] == name and m["up"] for m in v["members"]):
            placed = [p for p in v["placements"] if p["epoch"] > epoch and p.get("proposed") is None and name in p.get("workers", [])]
            if placed:
                break
        assert new.proc.poll() is None, f"{new.name} exited:\n{logs(pods)}"
        time.sleep(1)
    else:
        pytest.fail(f"the scaled-up worker never joined a placement within 180 s; last: {last}\n{logs(pods)}")
    # Ready once it has moved to that epoch itself (it may apply the activation a moment after
    # the leader answered): polled, as the kubelet polls a readiness probe.
    probe = new.container["readinessProbe"]["httpGet"]
    deadline = time.time() + 60
    while True:
        ready = from_tester(tester, host_bin(), "probe", f"http://{new.ip}:{new.port(probe['port'])}{probe['path']}")
        if ready.returncode == 0 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert ready.returncode == 0, f"{ready.stderr}\n{logs(pods)}"
    test_the_helm_test_pod_succeeds_and_answers_match_the_single_box(cluster)
