"""docs/openapi.json against the server: every path it lists answers, and schemathesis (pinned in
requirements.txt) sends what the schema allows — and, in its fuzzing phase, what it does not — to
a live `shimmer run`: no 5xx, every response in its documented status, content type and schema."""
import json
import subprocess
import sys
from pathlib import Path

import httpx

from conftest import ROOT

SPEC = ROOT / "docs" / "openapi.json"


def test_the_spec_lists_what_the_server_serves(server):
    spec = json.loads(SPEC.read_text())
    assert spec["openapi"].startswith("3.1")
    for path, ops in spec["paths"].items():
        for method in ops:
            r = httpx.request(method.upper(), server.url + path, json={} if method == "post" else None, timeout=30)
            assert r.status_code != 404 or "model" in r.text, (method, path, r.status_code, r.text[:200])
            assert r.status_code < 500, (method, path, r.text[:200])
    assert httpx.get(server.url + "/v1/not-an-endpoint").status_code == 404


def test_unsupported_fields_set_to_nothing_are_accepted_and_otherwise_refused(server):
    base = {"model": "shimmer-demo", "prompt": "The tide", "max_tokens": 2}
    for extra in ({"echo": False}, {"logit_bias": {}}, {"best_of": 1}, {"suffix": None}):
        r = httpx.post(server.url + "/v1/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
    for extra, field in (({"echo": True}, "echo"), ({"logit_bias": {"1": 5}}, "logit_bias"), ({"best_of": 2}, "best_of")):
        r = httpx.post(server.url + "/v1/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter" and r.json()["error"]["param"] == field, (extra, r.text)


def test_schemathesis_finds_no_server_error_and_no_response_off_the_spec(server, tmp_path):
    # The served model's name, which a generic spec cannot know, filled in so that generated
    # requests reach the model instead of ending at "unknown model".
    spec = json.loads(SPEC.read_text())
    served = httpx.get(server.url + "/v1/models").json()["data"][0]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"const": served["id"]}
    filled = tmp_path / "openapi.json"
    filled.write_text(json.dumps(spec))
    st = Path(sys.executable).parent / "st"
    out = subprocess.run(
        [str(st), "run", str(filled), "--url", server.url, "--checks", "all",
         # "Schema-valid request rejected" cannot hold where the API's rules span fields
         # (prompt + max_tokens within the context); every other check does.
         "--exclude-checks", "positive_data_acceptance",
         "--max-examples", "25", "--seed", "17", "--no-color", "--request-timeout", "120"],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]


def test_the_spec_is_what_its_source_makes():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "openapi.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
