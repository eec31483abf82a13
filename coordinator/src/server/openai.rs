//! The OpenAI-compatible HTTP API: request parsing and validation (every parameter checked and
//! named when wrong; parameters shimmer does not support refused with a 400 that names them,
//! never ignored), prompt rendering through the model's chat template, and the responses —
//! whole or streamed as server-sent events ending in `data: [DONE]`.
//!
//! Must never: run a forward pass (the batcher does), or answer a client's mistake with a 500.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::batcher::{Event, Job, SubmitError, TokenLogprob};
use super::chat_format::{ChatFormat, Parsed, ReasoningSyntax, Streamed, ToolSyntax};
use super::errors::ApiError;
use super::metrics::RequestTally;
use super::tools::{Call, ToolChoice, ToolSpec, Tools};
use super::AppState;
use crate::constraint::Grammar;
use crate::engine::{FinishReason, GenerateOptions};
use crate::sampling::SamplingParams;

/// Most tokens one request may ask for when it does not say (and the context allows).
const DEFAULT_MAX_TOKENS: usize = 256;
/// Most `top_logprobs` alternatives (OpenAI's limit).
const MAX_TOP_LOGPROBS: usize = 20;
/// Most stop strings (OpenAI's limit).
const MAX_STOPS: usize = 4;
/// Bytes in one stop string.
const MAX_STOP_BYTES: usize = 1024;

pub(crate) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// The JSON object of a request body, or the error naming what is wrong with it.
pub(crate) fn parse_body(body: Result<Bytes, BytesRejection>) -> Result<Map<String, Value>, ApiError> {
    let bytes = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "the request body is larger than the server accepts").code("request_too_large")
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")).code("invalid_json"))?;
    match value {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad_request("the body must be a JSON object")),
    }
}

/// An unsupported field set to what asks for nothing — `null`, or the field's own "off"
/// (`echo: false`, `logit_bias: {}`, `best_of: 1`, `suffix: ""`, `functions: []`,
/// `modalities: ["text"]`): accepted, as clients send such defaults.
fn asks_nothing(k: &str, v: &Value) -> bool {
    match (k, v) {
        (_, Value::Null) => true,
        ("echo", Value::Bool(false)) => true,
        ("logit_bias", Value::Object(m)) => m.is_empty(),
        ("best_of", Value::Number(n)) => n.as_u64() == Some(1),
        ("suffix", Value::String(s)) => s.is_empty(),
        ("functions", Value::Array(a)) => a.is_empty(),
        ("modalities", Value::Array(a)) => a.iter().all(|m| m == "text"),
        _ => false,
    }
}

/// Typed access to a request's fields, each error naming its parameter.
pub(crate) struct Params<'a>(pub(crate) &'a Map<String, Value>);

impl Params<'_> {
    pub(crate) fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    pub(crate) fn f32_in(&self, k: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if (lo as f64..=hi as f64).contains(&x) => Ok(Some(x as f32)),
                _ => Err(ApiError::param(k, format!("`{k}` must be a number in [{lo}, {hi}], got {v}"))),
            },
        }
    }

    pub(crate) fn usize_in(&self, k: &str, lo: usize, hi: usize) -> Result<Option<usize>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            // An integer, or a number with no fractional part (`4.0`), as JSON Schema counts them.
            Some(v) => match v.as_u64().or_else(|| v.as_f64().filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= hi as f64).map(|x| x as u64)) {
                Some(x) if (lo as u64..=hi as u64).contains(&x) => Ok(Some(x as usize)),
                _ => Err(ApiError::param(k, format!("`{k}` must be an integer in [{lo}, {hi}], got {v}"))),
            },
        }
    }

    pub(crate) fn bool(&self, k: &str) -> Result<bool, ApiError> {
        match self.get(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(ApiError::param(k, format!("`{k}` must be true or false, got {v}"))),
        }
    }

    pub(crate) fn str(&self, k: &str) -> Result<Option<&str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::param(k, format!("`{k}` must be a string, got {v}"))),
        }
    }

    /// `stop`: a string or a list of up to four.
    pub(crate) fn stops(&self) -> Result<Vec<String>, ApiError> {
        match self.get("stop") {
            Some(Value::String(s)) => stop_list("stop", &[Value::String(s.clone())], MAX_STOPS),
            Some(Value::Array(a)) => stop_list("stop", a, MAX_STOPS),
            None => Ok(Vec::new()),
            Some(_) => Err(ApiError::param("stop", format!("`stop` must be a string or a list of at most {MAX_STOPS} strings"))),
        }
    }

    /// Refuses every field that is not in `known`: unsupported ones by name, unknown ones as
    /// OpenAI does ("unrecognized request argument").
    pub(crate) fn only(&self, known: &[&str], unsupported: &[(&str, &str)]) -> Result<(), ApiError> {
        for k in self.0.keys() {
            if let Some((_, why)) = unsupported.iter().find(|(name, _)| name == k) {
                if asks_nothing(k, &self.0[k]) {
                    continue;
                }
                return Err(ApiError::param(k, format!("`{k}` is not supported: {why}")).code("unsupported_parameter"));
            }
            if !known.contains(&k.as_str()) {
                return Err(ApiError::param(k, format!("unrecognized request argument supplied: {k}")).code("unrecognized_argument"));
            }
        }
        Ok(())
    }
}

/// What chat and text completions share: sampling, limits, stop strings, logprobs, streaming.
struct Common {
    model: String,
    stream: bool,
    include_usage: bool,
    max_tokens: Option<usize>,
    sampling: SamplingParams,
    stop: Vec<String>,
    presence_penalty: f32,
    frequency_penalty: f32,
    /// The grammar the output must follow, and the field that asked for it.
    constraint: Option<(&'static str, Grammar)>,
}

const COMMON_FIELDS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "user",
];

const UNSUPPORTED: &[(&str, &str)] = &[
    ("logit_bias", "token biases are not implemented"),
    ("functions", "function calling is not implemented"),
    ("function_call", "function calling is not implemented"),
    ("best_of", "only one candidate is generated"),
    ("suffix", "insertion is not implemented"),
    ("echo", "echoing the prompt is not implemented"),
    ("audio", "audio is not supported"),
    ("modalities", "only text is supported"),
    ("prediction", "predicted outputs are not supported"),
];

fn common(p: &Params<'_>, state: &AppState) -> Result<Common, ApiError> {
    let model = p.str("model")?.ok_or_else(|| ApiError::param("model", "`model` is required"))?.to_string();
    if model != state.model_id {
        // 404, as OpenAI's API and vLLM answer an unknown model.
        let e = ApiError::param("model", format!("the model `{model}` does not exist; this server serves `{}`", state.model_id));
        return Err(ApiError { status: StatusCode::NOT_FOUND, ..e }.code("model_not_found"));
    }
    if let Some(n) = p.get("n") {
        if n.as_u64() != Some(1) {
            return Err(ApiError::param("n", format!("`n` = {n} is not supported: one choice per request (n = 1)")).code("unsupported_parameter"));
        }
    }
    // Accepted and unused, but of the type OpenAI's API gives them.
    p.str("user")?;
    let stream = p.bool("stream")?;
    let include_usage = match p.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::param("stream_options", "`stream_options` is only allowed when `stream` is true"));
            }
            for k in o.keys() {
                if k != "include_usage" {
                    return Err(ApiError::param("stream_options", format!("unrecognized stream option `{k}`")));
                }
            }
            Params(o).bool("include_usage")?
        }
        Some(v) => return Err(ApiError::param("stream_options", format!("`stream_options` must be an object, got {v}"))),
    };
    let temperature = p.f32_in("temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let sampling = SamplingParams {
        temperature,
        top_p: top_p(p)?,
        top_k: top_k(p)?,
        min_p: p.f32_in("min_p", 0.0, 1.0)?.unwrap_or(0.0),
        repetition_penalty: p.f32_in("repetition_penalty", 0.01, 100.0)?.unwrap_or(1.0),
        seed: seed(p)?,
    };
    Ok(Common {
        model,
        stream,
        include_usage,
        max_tokens: None,
        sampling,
        stop: p.stops()?,
        presence_penalty: p.f32_in("presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        frequency_penalty: p.f32_in("frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        constraint: requested_grammar(p)?,
    })
}

/// Stop strings, for either API's field: at most `most`, each a non-empty string of at most
/// `MAX_STOP_BYTES` (an empty one would end every answer before it began).
pub(crate) fn stop_list(field: &str, items: &[Value], most: usize) -> Result<Vec<String>, ApiError> {
    if items.len() > most {
        return Err(ApiError::param(field, format!("`{field}` holds {} strings; at most {most} are allowed", items.len())));
    }
    items
        .iter()
        .map(|v| match v.as_str() {
            Some("") => Err(ApiError::param(field, format!("`{field}` holds an empty string, which would stop every answer at once"))),
            Some(s) if s.len() > MAX_STOP_BYTES => {
                Err(ApiError::param(field, format!("a `{field}` string is {} bytes; at most {MAX_STOP_BYTES} are allowed", s.len())))
            }
            Some(s) => Ok(s.to_string()),
            None => Err(ApiError::param(field, format!("`{field}` must hold strings, got {v}"))),
        })
        .collect()
}

// The sampling parameters both APIs share are read by these, once, so that a value means the
// same on either (a `top_p` of 0 once meant "no nucleus" on one and an error on the other).

/// `top_p` in (0, 1]; 1 when absent. 0 is refused, as vLLM refuses it: "the smallest set of
/// tokens holding 0 % of the mass" has no answer a client could rely on.
pub(crate) fn top_p(p: &Params) -> Result<f32, ApiError> {
    match p.f32_in("top_p", 0.0, 1.0)? {
        Some(x) if x <= 0.0 => Err(ApiError::param("top_p", "`top_p` must be greater than 0 (and at most 1)")),
        Some(x) => Ok(x),
        None => Ok(1.0),
    }
}

/// `top_k`: 0 (or absent) samples from every token.
pub(crate) fn top_k(p: &Params) -> Result<usize, ApiError> {
    Ok(p.usize_in("top_k", 0, 1 << 20)?.unwrap_or(0))
}

/// `seed`: any 64-bit integer (negative ones as OpenAI allows, taken as their bits); random
/// when absent.
pub(crate) fn seed(p: &Params) -> Result<u64, ApiError> {
    match p.get("seed") {
        None => Ok(rand_seed()),
        Some(v) => v.as_i64().map(|s| s as u64).or_else(|| v.as_u64()).ok_or_else(|| ApiError::param("seed", format!("`seed` must be an integer, got {v}"))),
    }
}

/// A value a request gave, as the client wrote it (JSON), for error messages; `nothing` when absent.
pub(crate) fn given(v: Option<&Value>) -> String {
    v.map_or_else(|| "nothing".to_string(), Value::to_string)
}

/// The grammar a request asks for, at most one of: OpenAI's `response_format` (`text`,
/// `json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `grammar` in
/// Lark, `choice`, `json_object`) and its older `guided_json`, `guided_regex`, `guided_grammar`
/// and `guided_choice`. Only the shape is checked here; compiling (`compile_grammar`) refuses
/// what llguidance cannot follow.
fn requested_grammar(p: &Params<'_>) -> Result<Option<(&'static str, Grammar)>, ApiError> {
    let mut found: Vec<(&'static str, Grammar)> = Vec::new();
    if let Some(g) = response_format(p)? {
        found.push(("response_format", g));
    }
    if let Some(so) = p.get("structured_outputs") {
        let Value::Object(o) = so else {
            return Err(ApiError::param("structured_outputs", format!("`structured_outputs` must be an object, got {so}")));
        };
        for (k, v) in o {
            let g = match k.as_str() {
                "json" => Some(json_schema_value("structured_outputs.json", v)?),
                "regex" => Some(Grammar::Regex(text_of("structured_outputs.regex", v)?)),
                "grammar" => Some(Grammar::Lark(text_of("structured_outputs.grammar", v)?)),
                "choice" => Some(Grammar::Choice(choices_of("structured_outputs.choice", v)?)),
                "json_object" => match v {
                    Value::Bool(true) => Some(Grammar::AnyObject),
                    Value::Bool(false) | Value::Null => None,
                    _ => {
                        return Err(ApiError::param(
                            "structured_outputs.json_object",
                            format!("`structured_outputs.json_object` must be true or false, got {v}"),
                        ))
                    }
                },
                _ => {
                    return Err(ApiError::param("structured_outputs", format!("unknown structured output `{k}`: json, regex, grammar, choice or json_object")))
                }
            };
            found.extend(g.map(|g| ("structured_outputs", g)));
        }
    }
    for (field, make) in [
        ("guided_json", json_schema_value as fn(&str, &Value) -> Result<Grammar, ApiError>),
        ("guided_regex", |f: &str, v: &Value| text_of(f, v).map(Grammar::Regex)),
        ("guided_grammar", |f: &str, v: &Value| text_of(f, v).map(Grammar::Lark)),
        ("guided_choice", |f: &str, v: &Value| choices_of(f, v).map(Grammar::Choice)),
    ] {
        if let Some(v) = p.get(field).filter(|v| !v.is_null()) {
            found.push((field, make(field, v)?));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(f, _)| *f).collect();
        return Err(ApiError::param(found[1].0, format!("one grammar per request: {} were given", names.join(" and "))));
    }
    Ok(found.pop())
}

/// A JSON schema given as an object or as its JSON text (vLLM takes both).
fn json_schema_value(field: &str, v: &Value) -> Result<Grammar, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(Grammar::JsonSchema(v.clone())),
        Value::String(s) => serde_json::from_str(s).map(Grammar::JsonSchema).map_err(|e| ApiError::param(field, format!("`{field}` is not JSON: {e}"))),
        _ => Err(ApiError::param(field, format!("`{field}` must be a JSON schema, got {v}"))),
    }
}

fn text_of(field: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| ApiError::param(field, format!("`{field}` must be a string, got {v}")))
}

fn choices_of(field: &str, v: &Value) -> Result<Vec<String>, ApiError> {
    let list = v.as_array().ok_or_else(|| ApiError::param(field, format!("`{field}` must be a list of strings, got {v}")))?;
    list.iter().map(|c| text_of(field, c)).collect()
}

/// `response_format`: text (no constraint), `json_object` (any JSON object) or `json_schema`
/// (JSON valid against the schema).
fn response_format(p: &Params<'_>) -> Result<Option<Grammar>, ApiError> {
    let Some(rf) = p.get("response_format") else { return Ok(None) };
    let bad = |m: String| ApiError::param("response_format", m);
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::AnyObject)),
        Some("json_schema") => {
            let Some(js) = rf.get("json_schema").filter(|v| v.is_object()) else {
                return Err(bad("`response_format.json_schema` must be an object with a `schema`".into()));
            };
            let Some(schema) = js.get("schema") else {
                return Err(bad("`response_format.json_schema.schema` is required".into()));
            };
            json_schema_value("response_format.json_schema.schema", schema).map(Some)
        }
        _ => Err(bad(format!("`response_format.type` must be text, json_object or json_schema, got {}", given(rf.get("type"))))),
    }
}

/// A seed for requests that give none: different per request, as OpenAI's sampling is.
pub(crate) fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// `max_tokens` (or its newer name), bounded by what the context has left after the prompt
/// (`prompt_param` names where the prompt came from: `messages` or `prompt`).
fn max_tokens(p: &Params<'_>, names: &[&str], prompt_param: &str, prompt_len: usize, context: usize) -> Result<usize, ApiError> {
    if prompt_len >= context {
        return Err(ApiError::param(
            prompt_param,
            format!("the prompt is {prompt_len} tokens, and this model's context is {context}: nothing is left to generate"),
        )
        .code("context_length_exceeded"));
    }
    let left = context - prompt_len;
    let mut asked = None;
    for n in names {
        if let Some(v) = p.usize_in(n, 1, usize::MAX >> 1)? {
            asked = Some((n, v));
        }
    }
    match asked {
        Some((n, v)) if v > left => {
            Err(ApiError::param(n, format!("`{n}` = {v}, but the prompt ({prompt_len} tokens) leaves {left} of the model's {context}-token context"))
                .code("context_length_exceeded"))
        }
        Some((_, v)) => Ok(v),
        None => Ok(DEFAULT_MAX_TOKENS.min(left)),
    }
}

/// `messages` as the chat template takes them (JSON): roles system (or developer), user,
/// assistant (with `tool_calls`, their `arguments` parsed into objects as templates expect) and
/// tool (with `tool_call_id`); content a string or a list of text parts.
fn messages(p: &Params<'_>) -> Result<Vec<Value>, ApiError> {
    let Some(Value::Array(list)) = p.get("messages") else {
        return Err(ApiError::param("messages", "`messages` must be a non-empty list"));
    };
    if list.is_empty() {
        return Err(ApiError::param("messages", "`messages` must be a non-empty list"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(ApiError::param(&at, format!("`{at}` must be an object")));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some("developer") => "system",
            _ => {
                return Err(ApiError::param(
                    &format!("{at}.role"),
                    format!("`{at}.role` must be system, developer, user, assistant or tool, got {}", given(m.get("role"))),
                ));
            }
        };
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::param(
                                &format!("{at}.content[{j}]"),
                                format!("only text content parts are supported, got type {}", given(part.get("type"))),
                            ))
                        }
                    }
                }
                text
            }
            None | Some(Value::Null) if role == "assistant" => String::new(),
            other => {
                return Err(ApiError::param(
                    &format!("{at}.content"),
                    format!("`{at}.content` must be a string or a list of text parts, got {}", other.map_or("nothing".to_string(), |v| v.to_string())),
                ))
            }
        };
        let mut msg = json!({ "role": role, "content": content });
        if role == "assistant" {
            if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
                let Value::Array(calls) = calls else { return Err(ApiError::param(&format!("{at}.tool_calls"), "`tool_calls` must be a list")) };
                let mut parsed = Vec::with_capacity(calls.len());
                for (j, c) in calls.iter().enumerate() {
                    let (Some(name), args) = (c["function"]["name"].as_str(), &c["function"]["arguments"]) else {
                        return Err(ApiError::param(&format!("{at}.tool_calls[{j}]"), "a tool call needs `function.name` and `function.arguments`"));
                    };
                    let arguments = match args {
                        Value::String(s) => serde_json::from_str::<Value>(s)
                            .map_err(|e| ApiError::param(&format!("{at}.tool_calls[{j}].function.arguments"), format!("arguments are not JSON: {e}")))?,
                        Value::Object(_) => args.clone(),
                        _ => return Err(ApiError::param(&format!("{at}.tool_calls[{j}].function.arguments"), "arguments must be a JSON object (or its text)")),
                    };
                    parsed.push(
                        json!({ "id": c.get("id").cloned().unwrap_or(Value::Null), "type": "function", "function": { "name": name, "arguments": arguments } }),
                    );
                }
                msg["tool_calls"] = Value::Array(parsed);
            }
        }
        if role == "tool" {
            msg["tool_call_id"] =
                m.get("tool_call_id").cloned().ok_or_else(|| ApiError::param(&format!("{at}.tool_call_id"), "a tool message needs `tool_call_id`"))?;
            if let Some(n) = m.get("name") {
                msg["name"] = n.clone();
            }
        }
        out.push(msg);
    }
    Ok(out)
}

/// `tools` and `tool_choice` (OpenAI's function-tool shape).
fn tools_of(p: &Params<'_>) -> Result<Option<Tools>, ApiError> {
    let list = match p.get("tools") {
        None => Vec::new(),
        Some(Value::Array(ts)) => ts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let f = t
                    .get("function")
                    .filter(|_| t.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| ApiError::param(&format!("tools[{i}]"), "each tool must be {\"type\": \"function\", \"function\": {...}}"))?;
                Ok(ToolSpec {
                    name: f.get("name").and_then(Value::as_str).unwrap_or("").to_string(),
                    description: f.get("description").and_then(Value::as_str).unwrap_or("").to_string(),
                    parameters: f.get("parameters").cloned(),
                })
            })
            .collect::<Result<_, ApiError>>()?,
        Some(_) => return Err(ApiError::param("tools", "`tools` must be a list")),
    };
    let choice = match p.get("tool_choice") {
        None => {
            if list.is_empty() {
                return Ok(None);
            }
            ToolChoice::Auto
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => return Err(ApiError::param("tool_choice", format!("`tool_choice` must be none, auto, required or a named function, got `{other}`"))),
        },
        Some(v) => match v["function"]["name"].as_str() {
            Some(n) if v["type"] == "function" => ToolChoice::Named(n.to_string()),
            _ => return Err(ApiError::param("tool_choice", "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}")),
        },
    };
    Tools::new(list, choice, "tools").map(Some)
}

/// A rendered conversation: its ids, and how the answer to it is read.
pub(crate) struct Prompt {
    pub ids: Vec<u32>,
    pub format: ChatFormat,
    /// The template ended the prompt inside an open `<think>`: the answer starts as reasoning.
    pub in_reasoning: bool,
}

/// The prompt for a conversation with (or without) tools: rendered by the template itself when it
/// knows tools, else with our tool instructions and plain turns (`tools.rs`). `extra`: the
/// request's `chat_template_kwargs`.
pub(crate) fn encode_conversation(state: &AppState, msgs: Vec<Value>, tools: Option<&Tools>, extra: &Map<String, Value>) -> Result<Prompt, ApiError> {
    let has_tool_turns = msgs.iter().any(|m| m.get("tool_calls").is_some() || m["role"] == "tool");
    let engine = &state.engine;
    let mut format = ChatFormat::detect(engine.chat.template.as_deref());
    if !engine.chat.knows_tools() {
        // Our own instructions ask for shimmer's JSON call.
        format.tools = ToolSyntax::Json;
    }
    let rendered = match tools {
        // The tools stay in the prompt with `tool_choice: none` too (the conversation's prefix, and
        // so its cached KV, does not change with the choice).
        Some(t) if !t.list.is_empty() && engine.chat.knows_tools() => engine.encode_chat_with(&msgs, Some(&t.for_template()), extra),
        Some(t) if !t.list.is_empty() => engine.encode_chat_with(&super::tools::plain_messages(msgs, t), None, extra),
        _ if has_tool_turns && !engine.chat.knows_tools() => {
            let none = Tools { list: Vec::new(), choice: ToolChoice::None };
            engine.encode_chat_with(&super::tools::plain_messages(msgs, &none), None, extra)
        }
        _ => engine.encode_chat_with(&msgs, None, extra),
    };
    let (ids, text) = rendered.map_err(|e| match e {
        crate::engine::EngineError::Input(why) => ApiError::param("messages", why),
        e => ApiError::param("messages", format!("cannot render the chat template: {e}")),
    })?;
    let in_reasoning = format.reasoning == ReasoningSyntax::ThinkTags && {
        let tail = text.trim_end();
        tail.ends_with("<think>")
    };
    Ok(Prompt { ids, format, in_reasoning })
}

/// `chat_template_kwargs`: variables of the request's own for the template (vLLM's field), an
/// object.
pub(crate) fn template_kwargs(p: &Params<'_>) -> Result<Map<String, Value>, ApiError> {
    match p.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(m)) => Ok(m.clone()),
        Some(v) => Err(ApiError::param("chat_template_kwargs", format!("`chat_template_kwargs` must be an object, got {v}"))),
    }
}

fn logprobs_request(p: &Params<'_>, chat: bool) -> Result<Option<usize>, ApiError> {
    if chat {
        let on = p.bool("logprobs")?;
        let top = p.usize_in("top_logprobs", 0, MAX_TOP_LOGPROBS)?;
        if top.is_some() && !on {
            return Err(ApiError::param("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
        }
        Ok(on.then_some(top.unwrap_or(0)))
    } else {
        // Completions: `logprobs` is the number of alternatives (0–5).
        p.usize_in("logprobs", 0, 5)
    }
}

/// Checks the API key when the server has any (`Authorization: Bearer KEY` or `x-api-key`).
pub(crate) fn authorize(headers: &HeaderMap, keys: &[String]) -> Result<(), ApiError> {
    if keys.is_empty() {
        return Ok(());
    }
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    let Some(given) = given else {
        return Err(ApiError::new(StatusCode::UNAUTHORIZED, "no API key given (send `Authorization: Bearer KEY`)")
            .kind("authentication_error")
            .code("invalid_api_key"));
    };
    use subtle::ConstantTimeEq;
    // Every key is compared, each in constant time for its length.
    let ok = keys.iter().fold(0u8, |acc, k| acc | k.as_bytes().ct_eq(given.as_bytes()).unwrap_u8());
    if ok == 1 {
        Ok(())
    } else {
        Err(ApiError::new(StatusCode::UNAUTHORIZED, "incorrect API key").kind("authentication_error").code("invalid_api_key"))
    }
}

pub(crate) fn submit(state: &AppState, job: Job) -> Result<(), ApiError> {
    state.batcher.submit(job).map_err(|e| match e {
        SubmitError::QueueFull(_) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string()).kind("rate_limit_error").code("queue_full").retry_after(1),
        SubmitError::ShuttingDown => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).kind("server_error"),
    })
}

fn logprob_json(engine: &crate::Engine, lp: &TokenLogprob) -> Value {
    let token = |id: u32| engine.tokenizer.decode(&[id], false).unwrap_or_default();
    let entry = |id: u32, logprob: f32| {
        let t = token(id);
        // The token's own bytes (part of a character, where it is one), not its lossy text's.
        let bytes = engine.tokenizer.token_bytes(id).map_or_else(|| t.as_bytes().to_vec(), <[u8]>::to_vec);
        json!({ "token": t, "logprob": logprob, "bytes": bytes })
    };
    let mut v = entry(lp.id, lp.logprob);
    v["top_logprobs"] = Value::Array(lp.top.iter().map(|(id, l)| entry(*id, *l)).collect());
    v
}

pub async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    match chat_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(state: Arc<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    authorize(&headers, &state.api_keys)?;
    let obj = parse_body(body)?;
    let p = Params(&obj);
    let mut known = COMMON_FIELDS.to_vec();
    known.extend([
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "store",
        "metadata",
        "service_tier",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
    ]);
    p.only(&known, UNSUPPORTED)?;
    let mut c = common(&p, &state)?;
    let msgs = messages(&p)?;
    let logprobs = logprobs_request(&p, true)?;
    let tools = tools_of(&p)?;
    let parallel = match p.get("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => return Err(ApiError::param("parallel_tool_calls", format!("`parallel_tool_calls` must be true or false, got {v}"))),
    };
    let extra = template_kwargs(&p)?;
    let prompt = encode_conversation(&state, msgs, tools.as_ref(), &extra)?;
    if let Some(grammar) = tools.as_ref().and_then(|t| t.constraint(prompt.format.call_shape(parallel))) {
        if let Some((field, _)) = &c.constraint {
            return Err(ApiError::param(field, format!("`{field}` cannot be combined with a required or named `tool_choice` (the answer is a tool call)")));
        }
        c.constraint = Some(("tools", grammar));
    }
    c.max_tokens = Some(max_tokens(&p, &["max_tokens", "max_completion_tokens"], "messages", prompt.ids.len(), state.engine.spec.max_position_embeddings)?);
    // Under a grammar the answer is what the grammar allows from its first token, even where the
    // prompt opened a `<think>`: it is not read as reasoning.
    let reading = Reading {
        format: prompt.format,
        in_reasoning: prompt.in_reasoning && c.constraint.is_none(),
        calling: tools.filter(|t| t.active()).map(|t| CallParse { tools: Arc::new(t), parallel }),
    };
    run(state, c, prompt.ids, logprobs, Some(reading)).await
}

pub async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    match completions_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(state: Arc<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    authorize(&headers, &state.api_keys)?;
    let obj = parse_body(body)?;
    let p = Params(&obj);
    let mut known = COMMON_FIELDS.to_vec();
    known.extend(["prompt", "logprobs"]);
    p.only(&known, UNSUPPORTED)?;
    let mut c = common(&p, &state)?;
    let logprobs = logprobs_request(&p, false)?;
    let vocab = state.engine.spec.vocab_size;
    let ids_of = |v: &Vec<Value>| -> Result<Vec<u32>, ApiError> {
        v.iter()
            .map(|t| {
                t.as_u64()
                    .filter(|t| (*t as usize) < vocab)
                    .map(|t| t as u32)
                    .ok_or_else(|| ApiError::param("prompt", format!("token id {t} is not in the vocabulary (size {vocab})")))
            })
            .collect()
    };
    let prompt = match p.get("prompt") {
        Some(Value::String(s)) => state.engine.encode_prompt(s).map_err(|e| ApiError::param("prompt", e.to_string()))?,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => ids_of(a)?,
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => state.engine.encode_prompt(s).map_err(|e| ApiError::param("prompt", e.to_string()))?,
            Value::Array(ids) if !ids.is_empty() => ids_of(ids)?,
            _ => return Err(ApiError::param("prompt", "`prompt` must be a string, a list of token ids, or a list holding one of those")),
        },
        Some(Value::Array(a)) if a.len() > 1 => {
            return Err(ApiError::param("prompt", "several prompts in one request are not supported (send one per request)").code("unsupported_parameter"))
        }
        _ => return Err(ApiError::param("prompt", "`prompt` must be a string, a list of token ids, or a list holding one of those")),
    };
    if prompt.is_empty() {
        return Err(ApiError::param("prompt", "the prompt is empty"));
    }
    c.max_tokens = Some(max_tokens(&p, &["max_tokens"], "prompt", prompt.len(), state.engine.spec.max_position_embeddings)?);
    run(state, c, prompt, logprobs, None).await
}

/// How a chat answer is read: its reasoning, and its calls when tools may be called.
struct Reading {
    format: ChatFormat,
    in_reasoning: bool,
    calling: Option<CallParse>,
}

impl Reading {
    fn parse(&self, text: &str) -> Parsed {
        let mut p = self.format.parse(text, self.in_reasoning, self.calling.as_ref().map(|c| &*c.tools));
        if let Some(c) = &self.calling {
            if !c.parallel {
                p.calls.truncate(1);
            }
        }
        p
    }
}

/// How a chat answer is read for tool calls.
struct CallParse {
    tools: Arc<Tools>,
    /// `parallel_tool_calls`: false keeps only the first call.
    parallel: bool,
}

/// OpenAI's `tool_calls` for an answer's calls (arguments as JSON text, as the API gives them).
fn tool_calls_json(calls: &[Call], with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({ "id": format!("call_{:016x}", rand_seed()), "type": "function", "function": { "name": c.name, "arguments": c.arguments.to_string() } });
                if with_index {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

/// Submits the request and answers it whole or as a stream.
/// `reading`: a chat answer's (`None`: a completion, plain text).
async fn run(state: Arc<AppState>, c: Common, prompt: Vec<u32>, logprobs: Option<usize>, reading: Option<Reading>) -> Result<Response, ApiError> {
    let chat = reading.is_some();
    let constraint = match c.constraint.clone() {
        Some((field, grammar)) => Some(super::compile_grammar(&state, field, grammar).await?),
        None => None,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let opts = GenerateOptions { max_tokens: c.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS), sampling: c.sampling.clone(), stop: c.stop.clone() };
    let prompt_len = prompt.len();
    submit(
        &state,
        Job {
            prompt,
            opts,
            presence_penalty: c.presence_penalty,
            frequency_penalty: c.frequency_penalty,
            logprobs,
            constraint,
            events: tx,
            submitted: Instant::now(),
            keep_special_tokens: reading.as_ref().is_some_and(|r| r.format.keeps_special_tokens()),
        },
    )?;
    let id = format!("{}-{:016x}", if chat { "chatcmpl" } else { "cmpl" }, rand_seed());
    let created = now_secs();
    let object = if chat { "chat.completion" } else { "text_completion" };
    let t0 = Instant::now();
    let mut tally = Some(RequestTally::new(state.metrics.clone()));

    if !c.stream {
        let (mut text, mut lps) = (String::new(), Vec::new());
        let (finish, completion_tokens) = loop {
            match rx.recv().await {
                Some(Event::Text { text: t, logprobs }) => {
                    if text.is_empty() && !t.is_empty() {
                        state.metrics.first_token(t0.elapsed());
                    }
                    text.push_str(&t);
                    lps.extend(logprobs);
                }
                Some(Event::Done { finish, completion_tokens, .. }) => break (finish, completion_tokens),
                Some(Event::Error { fault, message }) => {
                    if let Some(t) = tally.take() {
                        t.finish(false);
                    }
                    return Err(ApiError::from_fault(fault, message));
                }
                None => {
                    if let Some(t) = tally.take() {
                        t.finish(false);
                    }
                    return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the request was dropped (server shutting down)").kind("server_error"));
                }
            }
        };
        if let Some(t) = tally.take() {
            t.finish(true);
        }
        let usage = json!({ "prompt_tokens": prompt_len, "completion_tokens": completion_tokens, "total_tokens": prompt_len + completion_tokens });
        let choice = if chat {
            let lp = logprobs.map(|_| json!({ "content": lps.iter().map(|l| logprob_json(&state.engine, l)).collect::<Vec<_>>() }));
            let parsed = reading.as_ref().map(|r| r.parse(&text)).unwrap_or_default();
            let mut message = json!({ "role": "assistant", "content": parsed.content });
            if !parsed.reasoning.is_empty() {
                message["reasoning_content"] = json!(parsed.reasoning);
            }
            let mut finish_reason = finish_str(finish);
            if !parsed.calls.is_empty() {
                if parsed.content.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = tool_calls_json(&parsed.calls, false);
                finish_reason = "tool_calls";
            }
            json!({ "index": 0, "message": message, "logprobs": lp, "finish_reason": finish_reason })
        } else {
            json!({ "index": 0, "text": text, "logprobs": logprobs.map(|_| completion_logprobs(&state.engine, &lps)), "finish_reason": finish_str(finish) })
        };
        return Ok(Json(json!({ "id": id, "object": object, "created": created, "model": c.model, "choices": [choice], "usage": usage, "system_fingerprint": state.engine.fingerprint })).into_response());
    }

    // Streaming: chunks as text becomes final, the finish reason, usage if asked, then [DONE].
    let chunk_object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let model = c.model.clone();
    let include_usage = c.include_usage;
    let engine = state.engine.clone();
    let metrics = state.metrics.clone();
    let chunk = move |choice: Value, usage: Option<Value>| {
        let mut v = json!({ "id": id, "object": chunk_object, "created": created, "model": model, "choices": choice });
        if include_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        SseEvent::default().data(v.to_string())
    };
    let stream = async_stream(move |out: mpsc::UnboundedSender<SseEvent>| async move {
        if chat {
            let _ = out.send(chunk(json!([{ "index": 0, "delta": { "role": "assistant", "content": "" }, "logprobs": null, "finish_reason": null }]), None));
        }
        let mut first = true;
        // Reasoning streams as it comes; with tools the content is held until it is known
        // whether the answer is a call.
        let mut streamed = reading.as_ref().map(|r| Streamed::new(r.format, r.in_reasoning));
        let holding = reading.as_ref().is_some_and(|r| r.calling.is_some());
        let delta_chunk = |reasoning: String, content: String, lp: Option<Value>| -> Option<SseEvent> {
            let mut delta = Map::new();
            if !reasoning.is_empty() {
                delta.insert("reasoning_content".into(), json!(reasoning));
            }
            if !content.is_empty() {
                delta.insert("content".into(), json!(content));
            }
            (!delta.is_empty() || lp.is_some()).then(|| chunk(json!([{ "index": 0, "delta": delta, "logprobs": lp, "finish_reason": null }]), None))
        };
        loop {
            match rx.recv().await {
                Some(Event::Text { text, logprobs: lps }) => {
                    if first && !text.is_empty() {
                        metrics.first_token(t0.elapsed());
                        first = false;
                    }
                    let choice = if let Some(s) = streamed.as_mut() {
                        let (reasoning, content) = s.push(&text);
                        let content = if holding { String::new() } else { content };
                        let lp = logprobs.map(|_| json!({ "content": lps.iter().map(|l| logprob_json(&engine, l)).collect::<Vec<_>>() }));
                        if let Some(event) = delta_chunk(reasoning, content, lp) {
                            if out.send(event).is_err() {
                                return; // the client left; dropping `rx` cancels the generation
                            }
                        }
                        continue;
                    } else {
                        json!([{ "index": 0, "text": text, "logprobs": logprobs.map(|_| completion_logprobs(&engine, &lps)), "finish_reason": null }])
                    };
                    if out.send(chunk(choice, None)).is_err() {
                        return; // the client left; dropping `rx` cancels the generation
                    }
                }
                Some(Event::Done { finish, completion_tokens, .. }) => {
                    if let Some(t) = tally.take() {
                        t.finish(true);
                    }
                    let mut finish_reason = finish_str(finish);
                    if let (Some(s), Some(r)) = (streamed.as_mut(), reading.as_ref()) {
                        let (reasoning, content) = s.finish();
                        if holding {
                            let parsed = r.parse(s.text());
                            if let Some(event) = delta_chunk(reasoning, String::new(), None) {
                                let _ = out.send(event);
                            }
                            let mut delta = json!({});
                            if !parsed.content.is_empty() {
                                delta["content"] = json!(parsed.content);
                            }
                            if !parsed.calls.is_empty() {
                                finish_reason = "tool_calls";
                                delta["tool_calls"] = tool_calls_json(&parsed.calls, true);
                            }
                            let _ = out.send(chunk(json!([{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": null }]), None));
                        } else if let Some(event) = delta_chunk(reasoning, content, None) {
                            let _ = out.send(event);
                        }
                    }
                    let choice = if chat {
                        json!([{ "index": 0, "delta": {}, "logprobs": null, "finish_reason": finish_reason }])
                    } else {
                        json!([{ "index": 0, "text": "", "logprobs": null, "finish_reason": finish_str(finish) }])
                    };
                    let _ = out.send(chunk(choice, None));
                    if include_usage {
                        let usage =
                            json!({ "prompt_tokens": prompt_len, "completion_tokens": completion_tokens, "total_tokens": prompt_len + completion_tokens });
                        let _ = out.send(chunk(json!([]), Some(usage)));
                    }
                    break;
                }
                Some(Event::Error { message: e, .. }) => {
                    if let Some(t) = tally.take() {
                        t.finish(false);
                    }
                    let _ = out
                        .send(SseEvent::default().data(json!({ "error": { "message": e, "type": "server_error", "param": null, "code": null } }).to_string()));
                    break;
                }
                None => break,
            }
        }
        let _ = out.send(SseEvent::default().data("[DONE]"));
    });
    Ok(Sse::new(stream.map(Ok::<_, Infallible>)).into_response())
}

/// Completions' older logprobs shape.
fn completion_logprobs(engine: &crate::Engine, lps: &[TokenLogprob]) -> Value {
    let tok = |id: u32| engine.tokenizer.decode(&[id], false).unwrap_or_default();
    json!({
        "tokens": lps.iter().map(|l| tok(l.id)).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(id, lp)| (tok(*id), json!(lp))).collect::<Map<String, Value>>()).collect::<Vec<_>>(),
        "text_offset": Value::Array(Vec::new()),
    })
}

/// A stream fed by a task: the producer gets a sender, the consumer the events (ends when the
/// producer finishes; dropping the consumer makes the producer's sends fail).
pub(crate) fn async_stream<F, Fut>(produce: F) -> impl futures_util::Stream<Item = SseEvent>
where
    F: FnOnce(mpsc::UnboundedSender<SseEvent>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(produce(tx));
    tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
}

pub async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&headers, &state.api_keys) {
        return e.into_response();
    }
    Json(json!({ "object": "list", "data": [{ "id": state.model_id, "object": "model", "created": state.created, "owned_by": "shimmer", "max_model_len": state.engine.spec.max_position_embeddings }] })).into_response()
}
