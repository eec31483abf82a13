"""The real `anthropic` Python client (pinned in requirements.txt) against `shimmer run`'s
Messages API on the demo model."""
import anthropic
import httpx
import pytest

MODEL = "shimmer-demo"
MESSAGES = [{"role": "user", "content": "And the LORD spake unto Moses, saying,"}]


def client(server, key="none"):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=120)


def test_a_message_with_a_system_prompt(server):
    r = client(server).messages.create(model=MODEL, max_tokens=16, system="Speak as the prophets.", messages=MESSAGES, extra_body={"temperature": 0})
    assert r.type == "message" and r.role == "assistant"
    assert r.content[0].type == "text" and len(r.content[0].text) > 0
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 16


def test_streaming_gives_named_events_and_the_same_text(server):
    c = client(server)
    whole = c.messages.create(model=MODEL, max_tokens=20, messages=MESSAGES, extra_body={"temperature": 0}).content[0].text
    with c.messages.stream(model=MODEL, max_tokens=20, messages=MESSAGES, extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    events = []
    body = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        events = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_is_reported(server):
    c = client(server)
    full = c.messages.create(model=MODEL, max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0}).content[0].text
    word = next(w for w in full.split()[1:] if len(w) >= 3)
    r = c.messages.create(model=MODEL, max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0}, stop_sequences=[word])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert word not in r.content[0].text


def test_errors_in_anthropics_shape(server, make_server):
    c = client(server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=0, messages=MESSAGES)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="claude-nonexistent", max_tokens=8, messages=MESSAGES)
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    s = make_server("--api-key", "k1")
    with pytest.raises(anthropic.AuthenticationError):
        client(s, "k2").messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
    ok = client(s, "k1").messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
    assert ok.content[0].text


WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}


def test_a_tool_use_round_trip(server):
    import jsonschema

    c = client(server)
    ask = [{"role": "user", "content": "What is the weather in Jerusalem?"}]
    r = c.messages.create(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert r.stop_reason == "tool_use"
    use = r.content[0]
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    follow = ask + [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Hot and dry."}]},
    ]
    r2 = c.messages.create(model=MODEL, max_tokens=16, messages=follow, tools=[WEATHER], tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert r2.content[0].type == "text" and r2.content[0].text
    # Streamed, the same call arrives as a tool_use block with its input as JSON deltas.
    with c.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"
    assert final.content[0].input == use.input


# Each sampling parameter both APIs take, side by side: a value either API refuses, the other
# refuses too (naming the same field); a value both take means the same on both.
SHARED = [
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": "x"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
]


def _both(server, extra, stop_field_value=None):
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **extra}
    msgs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **extra}
    if stop_field_value is not None:
        chat["stop"], msgs["stop_sequences"] = stop_field_value
    a = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
    b = httpx.post(server.url + "/v1/messages", json=msgs, timeout=120)
    return a, b


@pytest.mark.parametrize("extra,field", SHARED, ids=[str(e) for e, _ in SHARED])
def test_a_sampling_value_one_api_refuses_the_other_refuses_too(server, extra, field):
    a, b = _both(server, extra)
    assert a.status_code == 400 and b.status_code == 400, (a.text, b.text)
    assert field in a.json()["error"]["message"] and field in b.json()["error"]["message"], (a.text, b.text)
    assert a.json()["error"].get("param") == field


def test_empty_or_too_many_stop_strings_are_refused_by_both_apis(server):
    for stops in ([""], ["a", ""]):
        a, b = _both(server, {}, (stops, stops))
        assert a.status_code == 400 and b.status_code == 400 and "empty" in a.text and "empty" in b.text, (a.text, b.text)
    a, b = _both(server, {}, (["s"] * 5, ["s"] * 17))
    assert a.status_code == 400 and b.status_code == 400, (a.text, b.text)
    assert "at most 4" in a.text and "at most 16" in b.text


def test_the_same_sampling_values_give_the_same_answer_on_both_apis(server):
    # Only the ranges of the reference APIs differ: temperature up to 2 on OpenAI's, up to 1 on
    # Anthropic's.
    for extra in ({"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7}, {"temperature": 1, "top_p": 0.01, "seed": -3}, {"temperature": 0}):
        a, b = _both(server, extra)
        assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
        assert a.json()["choices"][0]["message"]["content"] == b.json()["content"][0]["text"], extra
    a, b = _both(server, {"temperature": 1.5, "seed": 1})
    assert a.status_code == 200 and b.status_code == 400 and "temperature" in b.text
