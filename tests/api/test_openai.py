"""The real `openai` Python client (pinned in requirements.txt) against a running `shimmer run`
on the demo model, plus raw HTTP for what a client library hides (SSE framing, error bodies)."""
import concurrent.futures as cf
import json
import signal
import subprocess
import time

import httpx
import openai
import pytest
from conftest import shimmer_bin

MODEL = "shimmer-demo"
PROMPT = [{"role": "user", "content": "And the LORD spake unto Moses, saying,"}]


def client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw)


def greedy(c, messages=PROMPT, max_tokens=24, **kw):
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].message.content


def test_models_lists_the_served_model(server):
    ids = [m.id for m in client(server).models.list().data]
    assert ids == [MODEL]


def test_plain_chat_answers_with_usage(server):
    r = client(server).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and len(choice.message.content) > 0
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_equals_the_whole_answer_and_reports_usage(server):
    c = client(server)
    whole = greedy(c, max_tokens=20)
    pieces, usage, finish = [], None, None
    for chunk in c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.finish_reason:
                finish = ch.finish_reason
    assert "".join(pieces) == whole
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0


def test_the_raw_stream_is_sse_ending_in_done(server):
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_greedy_tokens_are_the_same_alone_and_amid_other_requests(server):
    c = client(server)
    alone = greedy(c, max_tokens=32)
    others = [
        [{"role": "user", "content": "To be, or not to be"}],
        [{"role": "user", "content": "In the beginning God created"}],
        [{"role": "system", "content": "Answer in verse."}, {"role": "user", "content": "Shall I compare thee"}],
    ]
    with cf.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(greedy, c, PROMPT, 32)] + [pool.submit(greedy, c, m, 40) for m in others] + [pool.submit(greedy, c, PROMPT, 32)]
        results = [f.result() for f in futs]
    assert results[0] == alone and results[-1] == alone


def test_a_seed_makes_sampling_reproducible(server):
    c = client(server)
    kw = dict(model=MODEL, messages=PROMPT, max_tokens=24, temperature=1.0, top_p=0.95)
    a = c.chat.completions.create(seed=42, **kw).choices[0].message.content
    b = c.chat.completions.create(seed=42, **kw).choices[0].message.content
    others = {c.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should give different samples"


def test_stop_strings_end_the_answer_and_are_stripped(server):
    c = client(server)
    full = greedy(c, max_tokens=40)
    # A word the greedy answer contains after its start.
    word = next(w for w in full.split()[1:] if len(w) >= 3)
    r = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=40, temperature=0, stop=[word, "zzzz"])
    out = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert word not in out and full.startswith(out)


def test_logprobs_with_alternatives(server):
    r = client(server).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert tok.top_logprobs[0].token == tok.token and abs(tok.top_logprobs[0].logprob - tok.logprob) < 1e-6
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob >= tok.top_logprobs[2].logprob


def test_text_completions_take_strings_and_token_ids(server):
    c = client(server)
    a = c.completions.create(model=MODEL, prompt="And the LORD said", max_tokens=8, temperature=0)
    assert a.object == "text_completion" and len(a.choices[0].text) > 0
    ids = c.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4


def error_of(r):
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_client_mistakes_are_400s_that_say_what_is_wrong(server):
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=PROMPT)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=PROMPT, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=10_000_000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=PROMPT, extra_body={"frobnicate": 1})
    assert "frobnicate" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=PROMPT, temperature=7)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[])
    assert e.value.body["param"] == "messages"
    # A prompt longer than the context (the demo's is 1024 tokens).
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "and it came to pass " * 400}])
    assert e.value.body["code"] == "context_length_exceeded"
    r = httpx.post(url, content=b"x" * (5 << 20))
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and error_of(r)
    # A known path with a method it does not take: 405 with a body saying so, and `allow`.
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
    assert error_of(r)["code"] == "method_not_allowed" and "does not take GET" in error_of(r)["message"]
    r = httpx.delete(server.url + "/health")
    assert r.status_code == 405 and error_of(r)["code"] == "method_not_allowed"


def test_a_wrong_or_missing_key_is_401(make_server):
    s = make_server("--api-key", "sekrit")
    with pytest.raises(openai.AuthenticationError):
        client(s, api_key="wrong").models.list()
    r = httpx.get(s.url + "/v1/models")
    assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
    assert [m.id for m in client(s, api_key="sekrit").models.list().data] == [MODEL]
    # /health answers without a key, but only with details when authorised.
    assert httpx.get(s.url + "/health").json() == {"status": "ok"}
    assert "running" in httpx.get(s.url + "/health", headers={"authorization": "Bearer sekrit"}).json()


def test_a_full_queue_is_429_with_retry_after(make_server):
    s = make_server("--max-queue", "1", "--max-batch", "1")
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 200, "temperature": 0}

    def post():
        return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)

    with cf.ThreadPoolExecutor(6) as pool:
        rs = [f.result() for f in [pool.submit(post) for _ in range(6)]]
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 429 in codes, codes
    limited = next(r for r in rs if r.status_code == 429)
    assert limited.headers["retry-after"] == "1" and error_of(limited)["type"] == "rate_limit_error"


def running(server):
    return httpx.get(server.url + "/health").json()["running"]


def requests_total(server, outcome: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'shimmer_request_total{{outcome="{outcome}"}} '):
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_disconnects_cancels_its_generation(server):
    cancelled = requests_total(server, "cancelled")
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert running(server) >= 1
    deadline = time.time() + 10
    while running(server) > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert running(server) == 0
    # Counted once, as cancelled, on /metrics.
    deadline = time.time() + 10
    while requests_total(server, "cancelled") < cancelled + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert requests_total(server, "cancelled") == cancelled + 1


def test_sigterm_ends_running_streams_and_exits_cleanly(make_server):
    s = make_server()
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        s.proc.send_signal(signal.SIGTERM)
        rest = [l for l in lines if l.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"abort"' in l for l in rest)
    assert s.proc.wait(timeout=30) == 0


def test_load_32_concurrent_streams_for_30_seconds(make_server):
    s = make_server("--max-batch", "32", "--max-queue", "64")
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 48, "temperature": 0.8, "stream": True}
    deadline = time.time() + 30
    rss_start = s.rss_kb()

    def worker(k):
        done = errors = 0
        while time.time() < deadline:
            try:
                with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "seed": k * 1000 + done}, timeout=120) as r:
                    if r.status_code != 200:
                        errors += 1
                        continue
                    data = [l for l in r.iter_lines() if l.startswith("data: ")]
                if data and data[-1] == "data: [DONE]":
                    done += 1
                else:
                    errors += 1
            except httpx.HTTPError:
                errors += 1
        return done, errors

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(worker, range(32)))
    total, errors = sum(r[0] for r in results), sum(r[1] for r in results)
    assert errors == 0 and total >= 32, results
    # RSS stays bounded: finished requests leave nothing behind (KV freed).
    assert s.rss_kb() < rss_start + 400_000, (rss_start, s.rss_kb())
    assert running(s) == 0


def health(server):
    return httpx.get(server.url + "/health").json()


def test_the_next_chat_turn_reuses_the_cached_prefix_with_identical_tokens(server, make_server):
    c = client(server)
    turn1 = greedy(c, PROMPT, 16)
    turn2_messages = PROMPT + [{"role": "assistant", "content": turn1}, {"role": "user", "content": "And what said Moses?"}]
    before = health(server)["prefix_reused_tokens"]
    turn2 = greedy(c, turn2_messages, 16)
    assert health(server)["prefix_reused_tokens"] - before >= 10
    # The same conversation on a server that keeps no KV: the same tokens.
    cold = make_server("--kv-gb", "0")
    assert greedy(client(cold), turn2_messages, 16) == turn2
    assert health(cold)["prefix_hits"] == 0


def test_metrics_are_prometheus_text_with_the_request_series(server):
    greedy(client(server), max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for series in ["shimmer_num_requests_running", "shimmer_num_requests_waiting", "shimmer_time_to_first_token_seconds_bucket", "shimmer_inter_token_latency_seconds_bucket", "shimmer_request_queue_time_seconds_count", "shimmer_e2e_request_latency_seconds_count", "shimmer_prompt_tokens_total", "shimmer_generation_tokens_total", 'shimmer_request_total{outcome="success"}', "shimmer_kv_cache_usage_perc"]:
        assert series in text, series


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "tribe": {"enum": ["Judah", "Levi", "Benjamin"]},
        "sayings": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "prophet": {"type": "boolean"},
        "spouse": {"type": ["string", "null"], "maxLength": 16},
    },
    "required": ["name", "age", "tribe"],
    "additionalProperties": False,
}


def test_json_schema_output_always_parses_and_validates(server):
    import jsonschema

    c = client(server)
    # Down to budgets where the value must close early (it always fits 40 tokens here).
    for seed, max_tokens in [(1, 200), (2, 200), (3, 40), (4, 40), (5, 60)]:
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell of a prophet of Israel."}], max_tokens=max_tokens, temperature=0.9, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        )
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)  # raises if the output breaks the schema
        assert r.usage.completion_tokens <= max_tokens


def test_json_object_output_is_an_object_even_when_tokens_run_short(server):
    c = client(server)
    for seed in range(4):
        r = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12 + 6 * seed, temperature=1.0, seed=seed, response_format={"type": "json_object"})
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_bad_grammars_are_refused_by_name(server):
    c = client(server)
    for schema, needle in [
        ({"type": "string", "pattern": "(unclosed"}, "regex"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]}, "Missing"),
        ({"type": []}, "Unsatisfiable"),
        ({"type": "object", "properties": {"a": {"type": []}}, "required": ["a"]}, "Unsatisfiable"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=PROMPT, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        body = e.value.body
        assert needle in body["message"] and body["code"] == "invalid_grammar" and body["param"] == "response_format", (schema, body)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=PROMPT, response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format"
    for extra, param in [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"guided_grammar": "start: undefined_rule\n"}, "guided_grammar"),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_pydantic_models_as_response_format_and_as_tools(server):
    """What Pydantic emits — `$defs`/`$ref`, `anyOf` with null, `pattern`, `format`, bounds —
    through the client's own helpers: `parse(response_format=Model)` and
    `pydantic_function_tool(Model)`, both strict."""
    import datetime
    import typing

    import jsonschema
    import pydantic

    class Item(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        kind: typing.Literal["ram", "ewe", "goat"]

    class Offering(pydantic.BaseModel):
        code: str = pydantic.Field(pattern=r"^[A-Z]{2}[0-9]{3}$")
        items: list[Item] = pydantic.Field(min_length=1, max_length=2)
        day: datetime.date
        count: int = pydantic.Field(ge=1, le=7)
        note: typing.Optional[str] = pydantic.Field(default=None, max_length=20)

    c = client(server)
    schema = Offering.model_json_schema()
    for seed in range(4):
        r = c.chat.completions.parse(model=MODEL, messages=PROMPT, max_tokens=160, temperature=0.9, seed=seed, response_format=Offering)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        offering = choice.message.parsed  # the client validated it with Pydantic
        assert isinstance(offering, Offering) and isinstance(offering.day, datetime.date)
        jsonschema.validate(json.loads(choice.message.content), schema)
    tool = openai.pydantic_function_tool(Offering, name="bring_offering")
    for stream in (False, True):
        kw = dict(model=MODEL, messages=PROMPT, tools=[tool], tool_choice="required", max_tokens=160, temperature=0.9, seed=7)
        if stream:
            args = "".join(d.function.arguments or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices for d in (ch.choices[0].delta.tool_calls or []))
        else:
            call = c.chat.completions.create(**kw).choices[0].message.tool_calls[0]
            assert call.function.name == "bring_offering"
            args = call.function.arguments
        Offering.model_validate_json(args)
        jsonschema.validate(json.loads(args), tool["function"]["parameters"])


def test_non_ascii_text_inside_json_strings(server):
    """Characters the demo's vocabulary has no token for are written byte by byte — tokens that
    end inside a UTF-8 character — and come back whole."""
    import jsonschema

    c = client(server)
    schema = {
        "type": "object",
        "properties": {"名前": {"type": "string", "pattern": "^[\u4e00-\u9fff]{2,4}$"}, "mood": {"type": "string", "pattern": "^[😀-😎]{1,3}$"}, "ville": {"type": "string", "maxLength": 8}},
        "required": ["名前", "mood", "ville"],
        "additionalProperties": False,
    }
    for seed in range(3):
        for stream in (False, True):
            kw = dict(model=MODEL, messages=PROMPT, max_tokens=120, temperature=1.0, seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
            if stream:
                text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
            else:
                text = c.chat.completions.create(**kw).choices[0].message.content
            value = json.loads(text)
            jsonschema.validate(value, schema)
            assert all(0x4E00 <= ord(ch) <= 0x9FFF for ch in value["名前"])


def test_regex_grammar_and_choice_outputs(server):
    import re

    c = client(server)

    def ask(extra, **kw):
        r = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=kw.pop("max_tokens", 40), temperature=1.0, seed=kw.pop("seed", 1), extra_body=extra)
        return r.choices[0].message.content, r.choices[0].finish_reason

    for seed in range(3):
        text, finish = ask({"structured_outputs": {"regex": "(Aaron|Moses) (spake|went) [0-9]{1,3} times"}}, seed=seed)
        assert re.fullmatch("(Aaron|Moses) (spake|went) [0-9]{1,3} times", text) and finish == "stop", text
        text, _ = ask({"guided_regex": "[a-z]{3}-[0-9]{2}"}, seed=seed)
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text
        text, _ = ask({"guided_choice": ["Judah", "Levi", "Benjamin"]}, seed=seed)
        assert text in ("Judah", "Levi", "Benjamin")
        # llguidance's Lark: a list of one to three tribes.
        grammar = 'start: tribe (", " tribe){0,2}\ntribe: "Dan" | "Gad" | "Asher"\n'
        text, _ = ask({"structured_outputs": {"grammar": grammar}}, seed=seed)
        assert re.fullmatch("(Dan|Gad|Asher)(, (Dan|Gad|Asher)){0,2}", text), text
        text, _ = ask({"guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}, seed=seed)
        assert len(json.loads(text)) == 2


def test_schemas_that_once_failed_mid_answer_are_refused_or_answered(server):
    import jsonschema

    c = client(server)

    def ask(schema, **kw):
        return c.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=80, temperature=0.8, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **kw
        )

    # No answer could fit the budget: cut by it (`length`), never a 500.
    for schema in [{"type": "array", "minItems": 1_000_000_000}, {"type": "string", "minLength": 100_000}]:
        assert ask(schema).choices[0].finish_reason == "length"
    # Non-ASCII constants and property names: answered, and the answer is the schema's value.
    for schema in [
        {"const": "café"},
        {"type": "object", "properties": {"größe": {"type": "integer"}, "名前": {"enum": ["ヨセフ", "モーセ"]}}, "required": ["größe", "名前"]},
        {"type": "array", "items": {"const": "😀"}, "minItems": 2, "maxItems": 2},
    ]:
        for stream in (False, True):
            if stream:
                text = "".join(ch.choices[0].delta.content or "" for ch in ask(schema, stream=True) if ch.choices)
            else:
                text = ask(schema).choices[0].message.content
            jsonschema.validate(json.loads(text), schema)


def test_tools_without_parameters_or_with_an_empty_schema_take_any_object(server):
    c = client(server)
    for fn in [{"name": "ping"}, {"name": "ping", "parameters": {}}, {"name": "ping", "parameters": {"type": "object"}}]:
        r = c.chat.completions.create(model=MODEL, messages=PROMPT, tools=[{"type": "function", "function": fn}], tool_choice="required", max_tokens=40, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "ping" and isinstance(json.loads(call.function.arguments), dict), fn


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]},
    },
}
CENSUS = {"type": "function", "function": {"name": "count_people", "description": "Number the tribes.", "parameters": {"type": "object", "properties": {"tribe": {"type": "string", "maxLength": 12}}}}}


def test_a_tool_call_round_trip(server):
    import jsonschema

    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Jerusalem?"}]
    r = c.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CENSUS], tool_choice="required", max_tokens=60, temperature=0.7, seed=5)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "count_people") and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "count_people": CENSUS}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # The result goes back as a `tool` message; the model answers in text.
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}, {"role": "tool", "tool_call_id": call.id, "content": "Hot and dry, 31 C."}]
    r2 = c.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, CENSUS], tool_choice="none", max_tokens=20, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.content
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_a_named_tool_choice_calls_that_tool_also_when_streamed(server):
    c = client(server)
    ask = [{"role": "user", "content": "Number the tribe of Levi."}]
    named = {"type": "function", "function": {"name": "count_people"}}
    r = c.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CENSUS], tool_choice=named, max_tokens=40, temperature=0)
    whole = r.choices[0].message.tool_calls[0]
    assert whole.function.name == "count_people"
    calls, finish = [], None
    for chunk in c.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, CENSUS], tool_choice=named, max_tokens=40, temperature=0, stream=True):
        for ch in chunk.choices:
            if ch.delta.tool_calls:
                calls.extend(ch.delta.tool_calls)
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "count_people" and json.loads(calls[0].function.arguments) == json.loads(whole.function.arguments)


def test_bad_tool_requests_are_400s(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=PROMPT, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=PROMPT, tools=[{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}], tool_choice="required")
    assert "object" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])


def test_penalties_change_a_repetitive_greedy_answer(server):
    c = client(server)
    plain = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=60, temperature=0)
    words = plain.choices[0].message.content.split()
    assert len(words) > len(set(words)), "the greedy answer repeats words (the premise)"
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        pen = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=60, temperature=0, **kw).choices[0].message.content.split()
        assert pen != words, kw
        assert len(set(pen)) / len(pen) > len(set(words)) / len(words), f"{kw}: more distinct words"


def test_error_messages_quote_what_the_client_sent_never_debug_text(server):
    cases = [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 'got "wizard"'),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, "got nothing"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 'got type "image_url"'),
        ("/v1/chat/completions", {"model": MODEL, "messages": PROMPT, "response_format": {"type": 7}}, "got 7"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "wizard", "content": "hi"}]}, 'got "wizard"'),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 'type "image"'),
    ]
    for path, body, says in cases:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        message = r.json()["error"]["message"]
        assert says in message and "Some(" not in message and "None" not in message, (body, message)


def test_an_over_long_prompt_is_blamed_on_where_it_came_from(server):
    long = "and it came to pass " * 400
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


GROWING_TEMPLATES = {
    # A value that holds another twice, forty levels deep, printed: 2^40 items reached from a few
    # instructions. The print budget (vendored minijinja) runs it out of fuel.
    "printed": ("{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x|pprint }}", {}, "ran out of fuel"),
    # 64 MiB of string, within the fuel, in a render sandbox held to 64 MiB: the sandbox stops it.
    "sandboxed": ("{% set ns = namespace(x='ab') %}{% for i in range(25) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}", {"SHIMMER_RENDER_MEMORY_MIB": "64"}, "more than the 64 MiB a render may use"),
}


@pytest.mark.parametrize("case", sorted(GROWING_TEMPLATES))
def test_a_template_that_grows_without_bound_fails_its_request_and_the_server_stays_up(make_server, tmp_path, case):
    import shutil

    from conftest import ROOT

    template, env, why = GROWING_TEMPLATES[case]
    model = tmp_path / "model"
    shutil.copytree(ROOT / "tests" / "fixtures" / "qwen3_moe", model)
    (model / "chat_template.jinja").write_text(template)
    s = make_server("--model", str(model), "--no-usage", env=env)
    c = client(s)
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model="model", messages=PROMPT, max_tokens=4)
        assert e.value.status_code == 400, (e.value.status_code, e.value.body)
        assert "chat template failed" in e.value.body["message"] and why in e.value.body["message"], e.value.body
    assert s.proc.poll() is None, "the server died"
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    # What needs no template still answers.
    r = c.completions.create(model="model", prompt="The tide", max_tokens=4, temperature=0)
    assert r.choices[0].text is not None and r.usage.completion_tokens == 4


def _raw(server, data: bytes, wait: float = 10.0):
    """Sends `data` on a fresh connection; what comes back until the server closes or `wait`
    passes, and when the connection closed (None: still open)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(server.url)
    s = socket.create_connection((u.hostname, u.port), timeout=wait)
    s.sendall(data)
    got, start, closed_at = b"", time.time(), None
    s.settimeout(0.2)
    while time.time() - start < wait:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        if not chunk:
            closed_at = time.time() - start
            break
        got += chunk
    s.close()
    return got, closed_at


def test_keys_before_bodies_and_deadlines_for_slow_or_idle_connections(make_server):
    s = make_server("--api-key", "k1", "--header-timeout-s", "2", "--body-timeout-s", "2")
    head = lambda key, length: (  # noqa: E731
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    # A wrong key is refused at once, with none of its (never sent) 4 MB body read.
    got, _ = _raw(s, head("wrong", 4_000_000), wait=3)
    assert got.startswith(b"HTTP/1.1 401"), got[:200]
    # A declared body over the limit: 413 at once.
    got, _ = _raw(s, head("k1", 5_000_000), wait=3)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    # Headers that overflow the connection's read buffer (64 KiB a read): 431, before the API
    # sees them.
    got, _ = _raw(s, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (200 << 10) + b"\r\n\r\n", wait=5)
    assert got.startswith(b"HTTP/1.1 431"), got[:200]
    # A body that stops coming: 408 after --body-timeout-s.
    started = time.time()
    got, _ = _raw(s, head("k1", 100) + b'{"model": "shimmer-demo",', wait=8)
    assert got.startswith(b"HTTP/1.1 408") and b"did not arrive" in got, got[:300]
    assert 1.5 < time.time() - started < 7
    # Headers that never finish, and a connection that says nothing: closed after
    # --header-timeout-s.
    for data in (b"GET /health HTTP/1.1\r\nHost: x\r\n", b""):
        got, closed = _raw(s, data, wait=8)
        assert closed is not None and 1.5 < closed < 7, (data, got, closed)
    # An idle keep-alive connection after a request: closed too.
    got, closed = _raw(s, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", wait=8)
    assert got.startswith(b"HTTP/1.1 200") and closed is not None and 1.5 < closed < 7, (got, closed)
    # Anthropic's API answers in its own shape.
    r = httpx.post(s.url + "/v1/messages", headers={"x-api-key": "wrong"}, json={"model": "shimmer-demo", "max_tokens": 4, "messages": PROMPT})
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    # And the server still serves.
    ok = httpx.post(s.url + "/v1/chat/completions", headers={"Authorization": "Bearer k1"}, json={"model": "shimmer-demo", "max_tokens": 4, "messages": PROMPT}, timeout=60)
    assert ok.status_code == 200, ok.text


def _hold(server, data: bytes):
    """A connection that sent `data` and is kept open (closed by the caller)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(server.url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(data)
    return s


def _answered_at(sock, wait: float) -> tuple[bytes, float | None]:
    """What the server says on `sock` and when its first bytes came (None: nothing in `wait`)."""
    import socket

    sock.settimeout(0.1)
    got, start, first = b"", time.time(), None
    while time.time() - start < wait:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            if first is not None and b"\r\n\r\n" in got:
                break
            continue
        if not chunk:
            break
        if first is None:
            first = time.time()
        got += chunk
    return got, first


def test_connections_beyond_max_connections_wait_until_one_closes(make_server):
    s = make_server("--max-connections", "3", "--header-timeout-s", "3")
    idle = [_hold(s, b"") for _ in range(3)]
    time.sleep(0.2)
    started = time.time()
    fourth = _hold(s, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    got, first = _answered_at(fourth, wait=10)
    # Served only once the idle connections were closed (their header deadline, 3 s) — not at once.
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert first is not None and first - started > 1.5, first - started
    for c in [*idle, fourth]:
        c.close()
    r = httpx.post(s.url + "/health", timeout=10)
    assert r.status_code == 405  # still serving (and /health takes GET)
    bad = subprocess.run([shimmer_bin(), "run", "--max-connections", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--max-connections must be from 1 to 65536, got 0" in bad.stderr, bad.stderr


def test_request_bodies_in_flight_are_bounded_across_connections(make_server):
    s = make_server("--body-timeout-s", "4")
    head = lambda length: (  # noqa: E731
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    # 32 bodies of the largest size announced and not sent: the budget (32 x 4 MiB) is held.
    holders = [_hold(s, head(4 << 20)) for _ in range(32)]
    time.sleep(1.0)
    body = json.dumps({"model": MODEL, "messages": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    started = time.time()
    small = _hold(s, head(len(body)) + body)
    got, first = _answered_at(small, wait=20)
    # A small, whole request waits for room (until the holders time out with 408), then answers.
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    assert first is not None and first - started > 1.5, first - started
    timed_out = [_answered_at(h, wait=10)[0] for h in holders]
    assert all(t.startswith(b"HTTP/1.1 408") for t in timed_out), [t[:40] for t in timed_out]
    for c in [*holders, small]:
        c.close()
    # No body (a GET) and small bodies need no room beyond their size: answered at once.
    assert httpx.get(s.url + "/v1/models", timeout=10).status_code == 200


def test_a_prompt_far_longer_than_the_context_is_refused_before_it_is_tokenized(server):
    text = "And the LORD spake unto Moses, saying, " * 100_000  # 3.9 MB, just under the body limit
    for path, body, field in [
        ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}, "messages"),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}, None),
    ]:
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 400, (path, r.text[:300])
        message = r.json()["error"]["message"]
        assert "counted in pieces" in message and "context" in message, (path, message)
        if field:
            assert r.json()["error"]["param"] == field
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "qwen3_next", "glm_moe_dsa", "kimi_linear", "deepseek_v4", "inkling_text", "inkling2_text"])
def test_each_family_chats_through_the_api_with_its_own_template(make_server, family):
    """The API renders a conversation with the family's own template (harmony for gpt-oss,
    ChatML for the Qwens, GLM's and Kimi's layouts) to exactly the ids transformers renders (the fixture's oracle), and
    answers as `shimmer generate` does on those ids."""
    from conftest import ROOT

    model = ROOT / "tests" / "fixtures" / family
    oracle = json.loads((model / "oracle.json").read_text())
    render = next(c for c in oracle["chat"] if c["add_generation_prompt"])
    s = make_server("--model", str(model), "--no-usage")
    r = client(s).chat.completions.create(model=family, messages=render["messages"], max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(render["ids"]), (r.usage, render["ids"])
    ids = ",".join(str(i) for i in render["ids"])
    out = subprocess.run([shimmer_bin(), "generate", "--model", str(model), "--prompt-ids", ids, "--max-tokens", "8",
                          "--temperature", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert r.choices[0].message.content == json.loads(out.stdout)["text"]


def test_concurrent_requests_on_a_recurrent_model_answer_as_each_alone(make_server):
    """Several conversations batched together on a model with a recurrent state (Qwen3-Next's
    Gated DeltaNet) each get the answer they get alone: every sequence keeps its own state
    through batched prefill and decode, and reuse of a cached prefix goes back to a checkpoint."""
    from conftest import ROOT

    model = ROOT / "tests" / "fixtures" / "qwen3_next"
    s = make_server("--model", str(model), "--no-usage")
    c = client(s)
    questions = ["Who made the heaven and the earth?", "And the LORD spake unto Moses", "Blessed are the meek", "In the beginning"]

    def ask(q):
        r = c.chat.completions.create(model="qwen3_next", messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0)
        return r.choices[0].message.content

    alone = [ask(q) for q in questions]
    with cf.ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(ask, questions * 2))
    assert together == alone * 2
    # A second turn reuses the first's cached prefix (back to a checkpoint) and answers as a fresh
    # server does.
    turn = [{"role": "user", "content": questions[0]}, {"role": "assistant", "content": alone[0]}, {"role": "user", "content": "And the sea?"}]
    again = c.chat.completions.create(model="qwen3_next", messages=turn, max_tokens=16, temperature=0).choices[0].message.content
    fresh = make_server("--model", str(model), "--no-usage")
    assert client(fresh).chat.completions.create(model="qwen3_next", messages=turn, max_tokens=16, temperature=0).choices[0].message.content == again
