"""The Helm chart (charts/shimmer), with Helm 3 and Helm 4 (conftest.py).

`helm lint --strict` passes on the defaults; `helm template` over a matrix of values (the
defaults, a single box, a LAN-like cluster with an API key and an Ingress, GPU workers, a Hugging
Face checkpoint converted at start, a Gateway API route) renders objects that every one validate,
strictly, against the Kubernetes OpenAPI schemas of three versions (PyPI's kubernetes-validate);
bad values are refused by values.schema.json with a message naming the value; and the defaults
render a cluster that can form: a generated join token every member reads, one node that may
bootstrap (worker 0, as the others name it), the same seeds for everyone, probes on the ports the
containers declare, a quorum-keeping disruption budget and a `helm test` hook.
"""
import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/shimmer"
K8S_VERSIONS = ["1.30.0", "1.33.0", "1.37.0"]
# Kinds outside Kubernetes itself (CRDs): checked against their CRDs' schemas instead
# (validate_crds.mjs).
CRD_KINDS = {"HTTPRoute", "ServiceMonitor", "PrometheusRule"}
MONITORING_CRDS = ["--api-versions", "monitoring.coreos.com/v1/ServiceMonitor", "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]

MATRIX = {
    "defaults": [],
    "single-box": ["--set", "worker.replicas=1", "--set", "raft.maxVoters=1", "--set", "raft.replicas=1", "--set", "podDisruptionBudget.enabled=false"],
    "lan-like": ["--set", "worker.replicas=5", "--set", "coordinator.replicas=2", "--set", "apiKeys.value=sk-local-test-key", "--set", "ingress.enabled=true",
                 "--set", "ingress.className=nginx", "--set", "service.type=LoadBalancer"],
    "gpu": ["--set", "worker.gpus=1", "--set-json", 'worker.resources={"limits":{"memory":"64Gi"},"requests":{"cpu":"8"}}', "--set", "worker.ramGb=48"],
    "hf-model": ["--set", "model.source=hf", "--set-json", 'model.hf.volume={"persistentVolumeClaim":{"claimName":"hf-models","readOnly":true}}',
                 "--set", "model.hf.path=Qwen3-30B-A3B", "--set", "model.hf.quant=int4-g32", "--set", "worker.persistence.enabled=false"],
    "monitoring-crds": [*MONITORING_CRDS, "--set", "monitoring.vllmNames=true", "--set-json", 'monitoring.serviceMonitor.labels={"release":"kube-prometheus"}'],
    "metrics-key": [*MONITORING_CRDS, "--set", "metricsApiKey.value=scrape-me-please", "--set", "monitoring.vllmNames=true"],
    "gateway": ["--set", "httpRoute.enabled=true", "--set-json", 'httpRoute.parentRefs=[{"name":"gateway","namespace":"gateways"}]',
                "--set-json", 'httpRoute.hostnames=["llm.example.com"]', "--set", "networkPolicy.enabled=false"],
}


def render(helm: Path, *args: str) -> list[dict]:
    out = subprocess.run([str(helm), "template", "rel", str(CHART), "--namespace", "llm", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def refused(helm: Path, *args: str) -> str:
    out = subprocess.run([str(helm), "template", "rel", str(CHART), *args], capture_output=True, text=True)
    assert out.returncode != 0, f"helm template {' '.join(args)} rendered:\n{out.stdout[:2000]}"
    return out.stderr


def test_lint_strict_passes_on_the_defaults(helm):
    out = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_every_rendered_object_validates_against_three_kubernetes_versions(helm, crd_validator, case):
    docs = render(helm, *MATRIX[case])
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Service", "Secret"} <= kinds, kinds
    crds = [d for d in docs if d["kind"] in CRD_KINDS]
    ok, said = crd_validator(crds)
    assert ok, f"{case}: {said}"
    assert said.count("ok ") == len(crds), said
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{case}: {doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes {version}: {e}")


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def args_of(statefulset: dict) -> list[str]:
    return statefulset["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_defaults_render_a_cluster_that_can_form(helm):
    docs = render(helm)
    sets, services, secrets = by_kind(docs, "StatefulSet"), by_kind(docs, "Service"), by_kind(docs, "Secret")
    worker, coordinator = sets["rel-shimmer-worker"], sets["rel-shimmer-coordinator"]
    assert worker["spec"]["replicas"] == 3 and coordinator["spec"]["replicas"] == 1
    token = base64.b64decode(secrets["rel-shimmer-join-token"]["data"]["token"]).decode()
    assert len(token) >= 16 and len(set(token)) >= 8, "a generated token the members accept"
    again = base64.b64decode(by_kind(render(helm), "Secret")["rel-shimmer-join-token"]["data"]["token"]).decode()
    assert again != token, "each install generates its own token: none is fixed in the chart"
    for s in (worker, coordinator):
        spec = s["spec"]["template"]["spec"]
        c = spec["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["SHIMMER_JOIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "rel-shimmer-join-token", "key": "token"}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        headless = services[s["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
        args = args_of(s)
        assert flag(args, "--advertise") == f"$(POD_NAME).{s['spec']['serviceName']}.llm.svc.cluster.local"
        # Every probe's port is one the container declares.
        ports = {p["name"]: p for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] in ports, (s["metadata"]["name"], probe)
        assert spec["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    # One node may start the cluster: worker 0, by the name it advertises; everyone has the same
    # seeds, which name both headless Services.
    w_args, c_args = args_of(worker), args_of(coordinator)
    bootstrap = flag(w_args, "--bootstrap-on")
    assert bootstrap == flag(w_args, "--advertise").replace("$(POD_NAME)", "rel-shimmer-worker-0")
    assert flag(c_args, "--bootstrap-on") == bootstrap
    assert flag(w_args, "--join") == flag(c_args, "--join")
    seeds = flag(w_args, "--join").split(",")
    assert seeds == [f"dns:rel-shimmer-{c}.llm.svc.cluster.local:7070" for c in ("worker", "coordinator")]
    assert "--bootstrap" not in w_args + c_args
    readiness = worker["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/ready"
    # The API Service selects the coordinators, on the port their container serves.
    api = services["rel-shimmer"]
    assert api["spec"]["selector"]["app.kubernetes.io/component"] == "coordinator"
    pdb = by_kind(docs, "PodDisruptionBudget")["rel-shimmer"]
    assert pdb["spec"]["maxUnavailable"] == 1 and "app.kubernetes.io/component" not in pdb["spec"]["selector"]["matchLabels"]
    test_pod = by_kind(docs, "Pod")["rel-shimmer-test-chat"]
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["args"][:2] == ["probe", "--chat"]
    assert "http://rel-shimmer.llm.svc.cluster.local:8080" in test_pod["spec"]["containers"][0]["args"]
    assert not by_kind(docs, "Ingress") and not by_kind(docs, "HTTPRoute"), "Ingress and HTTPRoute are off by default"


def test_values_shape_what_renders(helm):
    gpu = by_kind(render(helm, *MATRIX["gpu"]), "StatefulSet")["rel-shimmer-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 1}
    assert flag(gpu["args"], "--ram-gb") == "48"
    hf = by_kind(render(helm, *MATRIX["hf-model"]), "StatefulSet")["rel-shimmer-worker"]["spec"]["template"]["spec"]
    init = hf["initContainers"][0]
    assert init["args"][:5] == ["convert", "--from", "/hf/Qwen3-30B-A3B", "--to", "/data/model"] and flag(init["args"], "--quant") == "int4-g32"
    assert flag(hf["containers"][0]["args"], "--model") == "/data/model"
    assert {"name": "data", "emptyDir": {}} in hf["volumes"]
    lan = render(helm, *MATRIX["lan-like"])
    coord = by_kind(lan, "StatefulSet")["rel-shimmer-coordinator"]["spec"]["template"]["spec"]["containers"][0]
    key = {e["name"]: e for e in coord["env"]}["SHIMMER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert base64.b64decode(by_kind(lan, "Secret")[key["name"]]["data"][key["key"]]).decode() == "sk-local-test-key"
    assert by_kind(lan, "Ingress")["rel-shimmer"]["spec"]["ingressClassName"] == "nginx"
    route = by_kind(render(helm, *MATRIX["gateway"]), "HTTPRoute")["rel-shimmer"]
    assert route["spec"]["parentRefs"] == [{"name": "gateway", "namespace": "gateways"}] and route["spec"]["hostnames"] == ["llm.example.com"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": "rel-shimmer", "port": 8080}]


@pytest.mark.parametrize(
    "args, paths",
    [
        (["--set", "worker.replicas=0"], ["worker.replicas"]),
        (["--set", "joinToken.value=short"], ["joinToken.value"]),
        (["--set", "model.source=gguf"], ["model.source"]),
        (["--set", "model.source=hf"], ["model.hf.volume", "model.hf.path"]),
        (["--set", "raft.maxVoters=9"], ["raft.maxVoters"]),
        (["--set", "worker.ramGb=lots"], ["worker.ramGb"]),
        (["--set", "worker.persistence.size=20 gigs"], ["worker.persistence.size"]),
        (["--set", "httpRoute.enabled=true"], ["httpRoute.parentRefs"]),
        (["--set", "workers.replicas=3"], ["workers"]),
        (["--set", "monitoring.serviceMonitor.interval=often"], ["monitoring.serviceMonitor.interval"]),
    ],
    ids=["no-workers", "short-token", "unknown-source", "hf-without-volume", "too-many-voters", "ram-not-a-number", "size-not-a-quantity", "route-without-gateway", "misspelt-key", "interval-not-a-duration"],
)
def test_bad_values_are_refused_naming_the_value(helm, args, paths):
    err = refused(helm, *args)
    assert "values don't meet the specifications of the schema" in err, err
    for path in paths:
        # Helm 3 writes worker.replicas, Helm 4 /worker/replicas.
        assert re.search(r"[./ ']?".join(map(re.escape, path.split("."))), err), f"{args}: the error does not name {path}: {err}"


def test_monitoring_objects_render_whenever_their_crds_exist_and_carry_the_tested_rules(helm):
    plain = render(helm)
    assert not by_kind(plain, "ServiceMonitor") and not by_kind(plain, "PrometheusRule"), "no CRDs, no monitoring objects"
    docs = render(helm, *MATRIX["monitoring-crds"])
    monitor = by_kind(docs, "ServiceMonitor")["rel-shimmer"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    ports = [e["port"] for e in monitor["spec"]["endpoints"]]
    assert ports == ["api", "http", "api"], ports
    # The ports the endpoints name are the headless Services' ports for each kind of member.
    services = by_kind(docs, "Service")
    assert {"api"} <= {p["name"] for p in services["rel-shimmer-coordinator"]["spec"]["ports"]}
    assert {"http"} <= {p["name"] for p in services["rel-shimmer-worker"]["spec"]["ports"]}
    vllm = monitor["spec"]["endpoints"][2]["metricRelabelings"]
    assert re.fullmatch(vllm[0]["regex"], "shimmer_num_requests_waiting") and not re.fullmatch(vllm[0]["regex"], "shimmer_raft_term")
    assert vllm[1]["replacement"] == "vllm:$1"
    rules = by_kind(docs, "PrometheusRule")["rel-shimmer"]["spec"]
    assert rules == yaml.safe_load((CHART / "files/alerts.yaml").read_text()), "the PrometheusRule carries files/alerts.yaml unchanged"
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert alerts == {"ShimmerWorkerDown", "ShimmerNoRaftLeader", "ShimmerRaftQuorumAtRisk", "ShimmerTimeToFirstTokenHigh", "ShimmerExpertFailoversRising", "ShimmerStoreReadErrors"}
    dashboards = {n: d for n, d in by_kind(docs, "ConfigMap").items() if d["metadata"]["labels"].get("grafana_dashboard") == "1"}
    keys = sorted(k for d in dashboards.values() for k in d["data"])
    assert keys == ["cluster.json", "experts.json", "serving.json"], keys
    for d in dashboards.values():
        ((key, text),) = d["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / key).read_text())
    off = render(helm, "--set", "monitoring.dashboards.enabled=false")
    assert not [d for d in by_kind(off, "ConfigMap").values() if "grafana_dashboard" in d["metadata"]["labels"]]


def test_a_metrics_key_reaches_every_member_and_the_service_monitor(helm):
    docs = render(helm, *MATRIX["metrics-key"])
    secrets = by_kind(docs, "Secret")
    refs = []
    for name in ("rel-shimmer-coordinator", "rel-shimmer-worker"):
        env = {e["name"]: e for e in by_kind(docs, "StatefulSet")[name]["spec"]["template"]["spec"]["containers"][0]["env"]}
        refs.append(env["SHIMMER_METRICS_API_KEY"]["valueFrom"]["secretKeyRef"])
    endpoints = by_kind(docs, "ServiceMonitor")["rel-shimmer"]["spec"]["endpoints"]
    assert len(endpoints) == 3
    refs += [e["authorization"]["credentials"] for e in endpoints]
    assert all(e["authorization"]["type"] == "Bearer" for e in endpoints)
    for ref in refs:
        assert base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode() == "scrape-me-please", ref
    # A Secret of the user's: named, not created.
    theirs = render(helm, *MONITORING_CRDS, "--set", "metricsApiKey.existingSecret=ops-metrics")
    assert "rel-shimmer-metrics-api-key" not in by_kind(theirs, "Secret")
    endpoint = by_kind(theirs, "ServiceMonitor")["rel-shimmer"]["spec"]["endpoints"][0]
    assert endpoint["authorization"]["credentials"] == {"name": "ops-metrics", "key": "metrics-api-key"}
    # Without one, nothing asks for a key.
    plain = render(helm, *MONITORING_CRDS)
    assert all("authorization" not in e for e in by_kind(plain, "ServiceMonitor")["rel-shimmer"]["spec"]["endpoints"])
    env = by_kind(plain, "StatefulSet")["rel-shimmer-worker"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "SHIMMER_METRICS_API_KEY" not in {e["name"] for e in env}


def test_the_dashboards_are_what_their_source_makes():
    out = subprocess.run([sys.executable, str(ROOT / "deploy/monitoring/dashboards.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_alert_rule_passes_its_promtool_unit_tests():
    promtool = shutil.which("promtool")
    assert promtool, "promtool comes with Debian's prometheus package (scripts/test installs it)"
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=ROOT / "deploy/monitoring", capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
