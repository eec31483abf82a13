"""Writes docs/openapi.json, the OpenAPI description of shimmer's HTTP API (docs/api.md), from the
request and response shapes below; `--check` fails when the file is not what this makes.
tests/api/test_openapi.py runs it with --check and holds the server to the file (schemathesis)."""
import json
import sys
from pathlib import Path

err = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
anth_err = {"type": "object", "required": ["type", "error"], "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
def errors(schema_ref, codes=(400, 401, 404, 408, 413, 429, 500, 503)):
    return {str(c): {"description": desc, "content": {"application/json": {"schema": {"$ref": schema_ref}}}} for c, desc in
            [(400, "a bad request, named"), (401, "a missing or wrong key"), (404, "no such endpoint"), (408, "the body came too slowly"), (413, "the body is too large"),
             (429, "the wait queue is full"), (500, "the generation failed here"), (503, "shutting down, or an expert no worker can serve")] if c in codes}
usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {k: {"type": "integer", "minimum": 0} for k in ["prompt_tokens", "completion_tokens", "total_tokens"]}}
finish = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", "abort", None]}
sampling = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 100},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 1024}, {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1, "maxLength": 1024}}]},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1},
}
chat_req = {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
    "model": {"type": "string"},
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": {"type": "string"}}}},
    **sampling,
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "n": {"const": 1}, "user": {"type": "string"},
}}
chat_resp = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"}, "model": {"type": "string"},
    "system_fingerprint": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "finish_reason": finish, "logprobs": {"type": ["object", "null"]},
        "message": {"type": "object", "required": ["role"], "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}, "tool_calls": {"type": "array"}}}}}},
    "usage": usage}}
comp_req = {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
    "model": {"type": "string"},
    "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
    **sampling, "logprobs": {"type": "integer", "minimum": 0, "maximum": 5}, "echo": {"const": False}, "logit_bias": {"type": "object", "maxProperties": 0}, "best_of": {"const": 1}, "n": {"const": 1}, "user": {"type": "string"}}}
comp_resp = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"}, "model": {"type": "string"}, "system_fingerprint": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": finish, "logprobs": {"type": ["object", "null"]}}}},
    "usage": usage}}
msg_req = {"type": "object", "required": ["model", "max_tokens", "messages"], "additionalProperties": False, "properties": {
    "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"enum": ["user", "assistant"]}, "content": {"type": "string"}}}},
    "system": {"type": "string"},
    "stop_sequences": {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1, "maxLength": 1024}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1}, "top_p": sampling["top_p"], "top_k": sampling["top_k"], "seed": sampling["seed"],
    "stream": {"type": "boolean"}}}
msg_resp = {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"], "properties": {
    "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": {"type": "string"},
    "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "tool_use"]}}}},
    "stop_reason": {"type": ["string", "null"], "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]}, "stop_sequence": {"type": ["string", "null"]},
    "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {"input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}}}}
sse = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}
def nullable_optionals(req):
    # The server takes `null` for any optional field as its absence (as OpenAI's API does).
    for k, v in list(req["properties"].items()):
        if k not in req.get("required", []):
            req["properties"][k] = {"anyOf": [v, {"type": "null"}]}
    return req
def post(summary, req, resp, err_ref):
    req = nullable_optionals(req)
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": req}}},
                     "responses": {"200": {"description": "the answer (server-sent events when `stream` is true)", "content": {"application/json": {"schema": resp}, **sse}}, **errors(err_ref)}}}
spec = {
    "openapi": "3.1.0",
    "info": {"title": "shimmer", "version": "0.1.0", "description": "shimmer's HTTP API (docs/api.md): OpenAI-compatible chat and text completions, Anthropic's Messages API, health and metrics. Checked against the server by tests/api/test_openapi.py (schemathesis)."},
    "paths": {
        "/v1/chat/completions": post("A chat completion", chat_req, chat_resp, "#/components/schemas/Error"),
        "/v1/completions": post("A text completion", comp_req, comp_resp, "#/components/schemas/Error"),
        "/v1/messages": post("A message (Anthropic's API)", msg_req, msg_resp, "#/components/schemas/AnthropicError"),
        "/v1/models": {"get": {"summary": "The served model", "responses": {"200": {"description": "one model", "content": {"application/json": {"schema": {
            "type": "object", "required": ["object", "data"], "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"], "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "max_model_len": {"type": "integer"}}}}}}}}},
            **errors("#/components/schemas/Error", (401,))}}},
        "/health": {"get": {"summary": "Liveness and the batcher's counts", "responses": {"200": {"description": "serving", "content": {"application/json": {"schema": {
            "type": "object", "required": ["status", "model"], "properties": {"status": {"const": "ok"}, "model": {"type": "string"}, "running": {"type": "integer"}, "waiting": {"type": "integer"}}}}}},
            "503": {"description": "shutting down", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus text", "responses": {"200": {"description": "the series", "content": {"text/plain": {"schema": {"type": "string"}}}},
            "401": {"description": "--metrics-api-key is set and not given", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}},
    },
    "components": {"schemas": {"Error": err, "AnthropicError": anth_err}},
}
text = json.dumps(spec, indent=1) + "\n"
target = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
if "--check" in sys.argv:
    sys.exit(0 if target.read_text() == text else f"{target} is not what {__file__} makes: run it")
target.write_text(text)
