"""Each family's own tool-call and reasoning syntax through the real `openai` and `anthropic`
clients: a fixture model given a chat template written the way that family's templates render
tools, calls and results (GLM's `<arg_key>/<arg_value>`, DeepSeek-V3.1's tool-call tokens,
DeepSeek-V3.2's DSML, Kimi K2's sections, gpt-oss's harmony channels, Qwen's `<tool_call>` JSON,
Qwen3-Coder's XML, and Mistral's `[TOOL_CALLS]` in its JSON-array and `[ARGS]` forms). A required call is
constrained to the family's syntax (the raw tokens, seen through logprobs, show its markers) and
read back as `tool_calls` / `tool_use`, streamed and not, several in one answer where the syntax
holds several; the result is fed back through the template; reasoning comes back as
`reasoning_content` / thinking blocks.
"""
import json
import shutil

import anthropic
import openai
import pytest
from conftest import ROOT

GLM = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    "Call a tool as <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}\n"
    "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}"
    "</tool_call>{% endfor %}{% elif m.role == 'tool' %}<|observation|>\n<tool_response>{{ m.content }}</tool_response>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}{% endif %}"
)
DEEPSEEK = (
    "{% if tools %}## Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content or '' }}{% if m.tool_calls %}<｜tool▁calls▁begin｜>"
    "{% for c in m.tool_calls %}<｜tool▁call▁begin｜>{{ c.function.name }}<｜tool▁sep｜>{{ c.function.arguments | tojson }}<｜tool▁call▁end｜>{% endfor %}"
    "<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)
DSML = (
    "{% if tools %}## Tools\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content or '' }}{% if m.tool_calls %}\n\n<｜DSML｜function_calls>\n"
    "{% for c in m.tool_calls %}<｜DSML｜invoke name=\"{{ c.function.name }}\">\n{% for k, v in c.function.arguments.items() %}"
    "<｜DSML｜parameter name=\"{{ k }}\" string=\"{{ 'true' if v is string else 'false' }}\">{{ v if v is string else v | tojson }}</｜DSML｜parameter>\n"
    "{% endfor %}</｜DSML｜invoke>\n{% endfor %}</｜DSML｜function_calls>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜User｜><function_results>{{ m.content }}</function_results>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)
QWEN_XML = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call one as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}"
    "<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KIMI = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}{% if m.tool_calls %}<|tool_calls_section_begin|>"
    "{% for c in m.tool_calls %}<|tool_call_begin|>functions.{{ c.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>{{ c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% endif %}<|im_end|>{% elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
HERMES = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
HARMONY = (
    "<|start|>system<|message|>You are a model.{% if tools %}\n# Tools\n{{ tools | tojson }}{% endif %}<|end|>"
    "{% for m in messages %}{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
MISTRAL = (
    "<s>{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}"
    "{% endfor %}]</s>{% else %}{{ m.content }}</s>{% endif %}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
MISTRAL_ARGS = (
    "<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
# family: (the fixture whose weights and tokenizer run it, its template, how its calls begin)
FORMATS = {
    "glm": ("qwen3_moe", GLM, ("<tool_call>ping\n</tool_call>", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>")),
    "deepseek": ("qwen3_moe", DEEPSEEK, ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>",)),
    "dsml": ("qwen3_moe", DSML, ("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"",)),
    "kimi": ("qwen3_moe", KIMI, ("<|tool_calls_section_begin|><|tool_call_begin|>functions.",)),
    "qwen_xml": ("qwen3_moe", QWEN_XML, ("<tool_call>\n<function=",)),
    "hermes": ("qwen3_moe", HERMES, ('<tool_call>\n{"name": "',)),
    "mistral": ("qwen3_moe", MISTRAL, ('[TOOL_CALLS] [{"name": "',)),
    "mistral_args": ("qwen3_moe", MISTRAL_ARGS, ("[TOOL_CALLS]",)),
    # gpt-oss's tokenizer holds harmony's markers as special tokens.
    "harmony": ("gpt_oss", HARMONY, ("<|channel|>commentary to=functions.",)),
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping", "description": "Is it up?", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Ur?"}]


def model_dir(tmp_path, family):
    fixture, template, _ = FORMATS[family]
    d = tmp_path / family
    shutil.copytree(ROOT / "tests" / "fixtures" / fixture, d)
    (d / "chat_template.jinja").write_text(template)
    # The fixtures' contexts (256) are shorter than a prompt listing tools in this tiny vocabulary.
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (d / "config.json").write_text(json.dumps(config))
    return d


def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def check_call(name, args):
    assert name in ("get_weather", "ping"), name
    assert isinstance(args, dict), args
    if name == "get_weather":
        assert isinstance(args["city"], str) and len(args["city"]) <= 12, args
        assert "days" not in args or (isinstance(args["days"], int) and 1 <= args["days"] <= 9), args


def streamed_calls(stream):
    """Tool calls and the finish reason from a stream, the deltas joined by index."""
    calls, finish, raw = {}, None, []
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        if choice.logprobs and choice.logprobs.content:
            raw.extend(choice.logprobs.content)
    return [calls[i] for i in sorted(calls)], finish, raw_text(raw)


def raw_text(tokens):
    """The answer as the model wrote it, special tokens and all: its tokens' bytes."""
    return bytes(b for t in tokens for b in t.bytes).decode("utf-8", errors="replace")


@pytest.mark.parametrize("family", list(FORMATS))
def test_required_calls_in_the_family_syntax_come_back_as_tool_calls(make_server, tmp_path, family):
    s = make_server("--model", str(model_dir(tmp_path, family)), "--no-usage")
    c = oai(s)
    marker = FORMATS[family][2]
    most = 0
    first = None
    for seed in range(16):
        # Hot sampling: whether to add another call is then nearly a coin toss for this random model.
        r = c.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed, temperature=2.0,
                                      max_tokens=300, logprobs=True)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (choice.message.content, raw_text(choice.logprobs.content))
        raw = raw_text(choice.logprobs.content)
        assert raw.startswith(marker), f"the answer is written in {family}'s syntax: {raw!r}"
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
        for name, args in calls:
            check_call(name, args)
        most = max(most, len(calls))
        first = first or choice.message
        if seed >= 3 and most >= 2:
            break
        if seed >= 3:
            continue
        # The same answer streamed: the same calls.
        stream = c.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed, temperature=2.0,
                                           max_tokens=300, logprobs=True, stream=True)
        got, finish, streamed_raw = streamed_calls(stream)
        assert finish == "tool_calls"
        assert [(g["name"], json.loads(g["arguments"])) for g in got] == calls
        assert streamed_raw == raw
    if family != "harmony":  # a harmony call ends the answer
        assert most >= 2, f"{family}: parallel answers may hold several calls"
    # One call only, of the named tool.
    r = c.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                  parallel_tool_calls=False, seed=1, temperature=1.0, max_tokens=160)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    # The result fed back through the template: the model answers in text.
    call = first.tool_calls[0]
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": call.function.arguments}}]}, {"role": "tool", "tool_call_id": call.id, "content": "Hot and dry."}]
    r = c.chat.completions.create(model=family, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    grown = r.usage.prompt_tokens
    plain = c.chat.completions.create(model=family, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0)
    assert grown > plain.usage.prompt_tokens, "the call and its result are in the prompt"


@pytest.mark.parametrize("family", ["glm", "kimi", "harmony", "mistral"])
def test_anthropic_tool_use_in_the_family_syntax_and_a_result_fed_back(make_server, tmp_path, family):
    s = make_server("--model", str(model_dir(tmp_path, family)), "--no-usage")
    c = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = c.messages.create(model=family, max_tokens=160, messages=ASK, tools=tools, tool_choice={"type": "any"}, extra_body={"seed": 3})
    assert r.stop_reason == "tool_use"
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses
    for u in uses:
        check_call(u.name, u.input)
    with c.messages.stream(model=family, max_tokens=160, messages=ASK, tools=tools, tool_choice={"type": "any"}, extra_body={"seed": 3}) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    turn = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": uses[0].name, "input": uses[0].input}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Hot and dry."}]}]
    r = c.messages.create(model=family, max_tokens=8, messages=turn, tools=tools, tool_choice={"type": "none"})
    # GLM's prompt opens a thought: the answer may be (all) thinking.
    assert r.stop_reason in ("end_turn", "max_tokens") and all(b.type in ("text", "thinking") for b in r.content), r


def test_reasoning_comes_back_apart_from_the_answer(make_server, tmp_path):
    """Qwen-style: the model opens `<think>` itself (a grammar makes this random model do so);
    GLM-style: the prompt opened it, so the answer is reasoning until `</think>`, and
    `chat_template_kwargs` turns thinking off; harmony: the analysis channel."""
    hermes = make_server("--model", str(model_dir(tmp_path, "hermes")), "--no-usage")
    c = oai(hermes)
    grammar = 'start: "<think>" /[a-z]{3,12}( [a-z]{2,10}){1,3}/ "</think>" /[a-z]{3,12}( [a-z]{2,10}){1,3}/'
    r = c.chat.completions.create(model="hermes", messages=ASK, seed=5, temperature=1.0, max_tokens=100, extra_body={"structured_outputs": {"grammar": grammar}})
    m = r.choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in m.content and m.content, m
    stream = c.chat.completions.create(model="hermes", messages=ASK, seed=5, temperature=1.0, max_tokens=100, stream=True,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    parts = {"reasoning_content": "", "content": ""}
    for chunk in stream:
        delta = chunk.choices[0].delta
        parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        parts["content"] += delta.content or ""
    assert (parts["reasoning_content"].strip(), parts["content"].strip()) == (reasoning, m.content)

    glm = make_server("--model", str(model_dir(tmp_path, "glm")), "--no-usage")
    c = oai(glm)
    r = c.chat.completions.create(model="glm", messages=ASK, seed=2, temperature=1.0, max_tokens=12)
    m = r.choices[0].message
    assert m.model_extra.get("reasoning_content"), m
    off = c.chat.completions.create(model="glm", messages=ASK, seed=2, temperature=1.0, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not off.choices[0].message.model_extra.get("reasoning_content") and off.choices[0].message.content
    assert off.usage.prompt_tokens > r.usage.prompt_tokens, "`<think></think>` is in the prompt"
    # Anthropic: the same reasoning as a thinking block, whole and streamed.
    a = anthropic.Anthropic(base_url=glm.url, api_key="none", max_retries=0, timeout=120)
    msg = a.messages.create(model="glm", max_tokens=12, messages=ASK, extra_body={"seed": 2}, thinking={"type": "enabled", "budget_tokens": 1024})
    thinking = [b for b in msg.content if b.type == "thinking"]
    assert thinking and thinking[0].thinking == m.model_extra["reasoning_content"]
    with a.messages.stream(model="glm", max_tokens=12, messages=ASK, extra_body={"seed": 2}, thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        final = s.get_final_message()
    assert [b.thinking for b in final.content if b.type == "thinking"] == [thinking[0].thinking]

    harmony = make_server("--model", str(model_dir(tmp_path, "harmony")), "--no-usage")
    c = oai(harmony)
    grammar = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,12}( [a-z]{2,10}){1,3}/ <|end|> <|start|> "assistant" '
               '<|channel|> "final" <|message|> /[a-z]{3,12}( [a-z]{2,10}){1,3}/')
    r = c.chat.completions.create(model="harmony", messages=ASK, seed=4, temperature=1.0, max_tokens=100, extra_body={"structured_outputs": {"grammar": grammar}})
    m = r.choices[0].message
    assert m.model_extra.get("reasoning_content") and m.content and "<|" not in m.content, m
