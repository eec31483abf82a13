"""`shimmer chat --url`: the terminal chat against a running server, streaming."""
import subprocess

import openai

from conftest import shimmer_bin

MODEL = "shimmer-demo"


def test_terminal_chat_against_a_server_gives_the_servers_answer(server):
    line = "And the LORD said unto Moses"
    out = subprocess.run([shimmer_bin(), "chat", "--url", server.url, "--temperature", "0", "--max-tokens", "16"], input=line + "\n/reset\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    want = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": line}], max_tokens=16, temperature=0).choices[0].message.content
    assert want and want in out.stdout
    assert "conversation cleared" in out.stdout
    assert MODEL in out.stderr


def test_terminal_chat_reports_a_refused_key(make_server):
    s = make_server("--api-key", "right")
    out = subprocess.run([shimmer_bin(), "chat", "--url", s.url, "--api-key", "wrong"], input="hello\n", capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "401" in out.stderr and "incorrect API key" in out.stderr
    ok = subprocess.run([shimmer_bin(), "chat", "--url", s.url, "--api-key", "right", "--max-tokens", "4"], input="hello\n", capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
