//! The Anthropic Messages API (`POST /v1/messages`): system prompts, text content blocks,
//! `stop_sequences`, streaming as named server-sent events (message_start, content_block_start,
//! content_block_delta, content_block_stop, message_delta, message_stop), `x-api-key`, and errors
//! in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`). Enough for the
//! official `anthropic` client and tools built on it.
//!
//! Must never: run a forward pass (the batcher does), or answer a client's mistake with a 500.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::batcher::{Event, Job};
use super::chat_format::Streamed;
use super::errors::ApiError;
use super::metrics::RequestTally;
use super::openai::{async_stream, authorize, encode_conversation, parse_body, rand_seed, seed, stop_list, submit, top_k, top_p, Params};

/// Stop sequences one request may give (OpenAI's API allows 4; Anthropic's documents no number).
const MAX_STOP_SEQUENCES: usize = 16;
use super::tools::{ToolChoice, ToolSpec, Tools};
use super::AppState;
use crate::engine::{FinishReason, GenerateOptions};
use crate::sampling::SamplingParams;

/// An error as Anthropic's API shapes it.
pub(crate) fn anthropic_error(e: ApiError) -> Response {
    let kind = match e.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    let mut r = (e.status, Json(json!({ "type": "error", "error": { "type": kind, "message": e.message } }))).into_response();
    if let Some(s) = e.retry_after_s {
        if let Ok(v) = s.to_string().parse() {
            r.headers_mut().insert("retry-after", v);
        }
    }
    r
}

fn stop_reason(finish: FinishReason, stop_sequence: &Option<String>) -> &'static str {
    match (finish, stop_sequence) {
        (FinishReason::Stop, Some(_)) => "stop_sequence",
        (FinishReason::Stop, None) => "end_turn",
        (FinishReason::Length, _) => "max_tokens",
        (FinishReason::Cancelled, _) => "end_turn",
    }
}

/// One Anthropic turn as chat-template messages: text blocks join into the message; an
/// assistant's `tool_use` blocks become its `tool_calls`; a user's `tool_result` blocks become
/// `tool` messages (before the user's own text, if any).
fn turn(role: &str, content: &Value, at: &str) -> Result<Vec<Value>, ApiError> {
    let blocks = match content {
        Value::String(s) => return Ok(vec![json!({ "role": role, "content": s })]),
        Value::Array(b) => b,
        other => return Err(ApiError::param(at, format!("`{at}` must be a string or a list of content blocks, got {other}"))),
    };
    let (mut text, mut calls, mut results) = (String::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let here = format!("{at}.{j}");
        match (b.get("type").and_then(Value::as_str), role) {
            (Some("text"), _) => text.push_str(b.get("text").and_then(Value::as_str).ok_or_else(|| ApiError::param(&here, "a text block needs `text`"))?),
            (Some("tool_use"), "assistant") => {
                let (Some(id), Some(name)) = (b.get("id").and_then(Value::as_str), b.get("name").and_then(Value::as_str)) else {
                    return Err(ApiError::param(&here, "a tool_use block needs `id` and `name`"));
                };
                calls.push(json!({ "id": id, "type": "function", "function": { "name": name, "arguments": b.get("input").cloned().unwrap_or(json!({})) } }));
            }
            (Some("tool_result"), "user") => {
                let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| ApiError::param(&here, "a tool_result block needs `tool_use_id`"))?;
                let body = match b.get("content") {
                    None => String::new(),
                    Some(c) => text_of(c, &format!("{here}.content"))?,
                };
                let body = if b.get("is_error") == Some(&Value::Bool(true)) { format!("Error: {body}") } else { body };
                results.push(json!({ "role": "tool", "tool_call_id": id, "content": body }));
            }
            _ => return Err(ApiError::param(&here, format!("a {role} turn cannot hold a block of type {}", super::openai::given(b.get("type"))))),
        }
    }
    let mut out = results;
    if !calls.is_empty() {
        out.push(json!({ "role": "assistant", "content": text, "tool_calls": calls }));
    } else if !text.is_empty() || out.is_empty() {
        out.push(json!({ "role": role, "content": text }));
    }
    Ok(out)
}

/// Anthropic's `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`, `any`,
/// `tool` with a name, `none`).
fn tools_of(p: &Params<'_>) -> Result<Option<Tools>, ApiError> {
    let list: Vec<ToolSpec> = match p.get("tools") {
        None => Vec::new(),
        Some(Value::Array(ts)) => ts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "custom") {
                    return Err(ApiError::param(
                        &format!("tools.{i}"),
                        format!("server tools ({}) are not supported; give `name`, `description` and `input_schema`", t["type"]),
                    ));
                }
                Ok(ToolSpec {
                    name: t.get("name").and_then(Value::as_str).unwrap_or("").into(),
                    description: t.get("description").and_then(Value::as_str).unwrap_or("").into(),
                    parameters: t.get("input_schema").cloned(),
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::param("tools", "`tools` must be a list")),
    };
    let choice = match p.get("tool_choice") {
        None if list.is_empty() => return Ok(None),
        None => ToolChoice::Auto,
        Some(c) => match (c.get("type").and_then(Value::as_str), c.get("name").and_then(Value::as_str)) {
            (Some("auto"), _) => ToolChoice::Auto,
            (Some("any"), _) => ToolChoice::Required,
            (Some("none"), _) => ToolChoice::None,
            (Some("tool"), Some(n)) => ToolChoice::Named(n.into()),
            _ => return Err(ApiError::param("tool_choice", "`tool_choice` must be {\"type\": auto | any | none} or {\"type\": \"tool\", \"name\": ...}")),
        },
    };
    Tools::new(list, choice, "tools").map(Some)
}

/// Text of a content field: a string, or a list of `{"type": "text", "text": …}` blocks.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some(kind @ ("tool_use" | "tool_result")), _) => {
                        return Err(ApiError::param(&format!("{at}[{j}]"), format!("`{kind}` blocks are not supported yet (tool use is not implemented)")))
                    }
                    _ => {
                        return Err(ApiError::param(
                            &format!("{at}[{j}]"),
                            format!("only text blocks are supported, got type {}", super::openai::given(b.get("type"))),
                        ))
                    }
                }
            }
            Ok(out)
        }
        other => Err(ApiError::param(at, format!("`{at}` must be a string or a list of text blocks, got {other}"))),
    }
}

pub async fn messages(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    match messages_inner(state, headers, body).await {
        Ok(r) => r,
        Err(e) => anthropic_error(e),
    }
}

async fn messages_inner(state: Arc<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    authorize(&headers, &state.api_keys)?;
    let obj = parse_body(body)?;
    let p = Params(&obj);
    p.only(
        &[
            "model",
            "messages",
            "system",
            "max_tokens",
            "stop_sequences",
            "stream",
            "temperature",
            "top_p",
            "top_k",
            "metadata",
            "seed",
            "tools",
            "tool_choice",
            "thinking",
        ],
        &[("mcp_servers", "MCP is not supported")],
    )?;
    let model = p.str("model")?.ok_or_else(|| ApiError::param("model", "`model` is required"))?.to_string();
    if model != state.model_id {
        return Err(ApiError::new(StatusCode::NOT_FOUND, format!("model: {model} (this server serves `{}`)", state.model_id)));
    }
    let max_tokens = p.usize_in("max_tokens", 1, usize::MAX >> 1)?.ok_or_else(|| ApiError::param("max_tokens", "`max_tokens` is required"))?;
    let mut msgs: Vec<Value> = Vec::new();
    if let Some(system) = p.get("system") {
        msgs.push(json!({ "role": "system", "content": text_of(system, "system")? }));
    }
    let Some(Value::Array(list)) = p.get("messages") else {
        return Err(ApiError::param("messages", "`messages` must be a non-empty list"));
    };
    if list.is_empty() {
        return Err(ApiError::param("messages", "`messages` must be a non-empty list"));
    }
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages.{i}");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(ApiError::param(
                    &format!("{at}.role"),
                    format!("`{at}.role` must be user or assistant, got {}", super::openai::given(m.get("role"))),
                ))
            }
        };
        msgs.extend(turn(role, m.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?);
    }
    let tools = tools_of(&p)?;
    let stops: Vec<String> = match p.get("stop_sequences") {
        None => Vec::new(),
        Some(Value::Array(a)) => stop_list("stop_sequences", a, MAX_STOP_SEQUENCES)?,
        Some(_) => return Err(ApiError::param("stop_sequences", "`stop_sequences` must be a list of strings")),
    };
    let sampling = SamplingParams {
        temperature: p.f32_in("temperature", 0.0, 1.0)?.unwrap_or(1.0),
        top_p: top_p(&p)?,
        top_k: top_k(&p)?,
        seed: seed(&p)?,
        ..SamplingParams::default()
    };
    let stream = p.bool("stream")?;
    // `thinking: {type: enabled | disabled}` reaches the template as Qwen's and GLM's
    // `enable_thinking` (the budget is the answer's `max_tokens`).
    let mut extra = serde_json::Map::new();
    match p.get("thinking") {
        None | Some(Value::Null) => {}
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled") => drop(extra.insert("enable_thinking".into(), json!(true))),
            Some("disabled") => drop(extra.insert("enable_thinking".into(), json!(false))),
            _ => return Err(ApiError::param("thinking", format!("`thinking` must be {{\"type\": \"enabled\" | \"disabled\"}}, got {t}"))),
        },
    }
    let prompt = encode_conversation(&state, msgs, tools.as_ref(), &extra)?;
    // `tool_choice.disable_parallel_tool_use`: at most one call.
    let parallel = p.get("tool_choice").and_then(|c| c.get("disable_parallel_tool_use")).and_then(Value::as_bool) != Some(true);
    let constraint = match tools.as_ref().and_then(|t| t.constraint(prompt.format.call_shape(parallel))) {
        Some(grammar) => Some(super::compile_grammar(&state, "tools", grammar).await?),
        None => None,
    };
    // Under a grammar the answer is what the grammar allows from its first token.
    let (format, in_reasoning) = (prompt.format, prompt.in_reasoning && constraint.is_none());
    let prompt = prompt.ids;
    let calling = tools.filter(Tools::active);
    let context = state.engine.spec.max_position_embeddings;
    if prompt.len() + max_tokens > context {
        return Err(ApiError::param("max_tokens", format!("prompt ({} tokens) + max_tokens ({max_tokens}) > the model's context ({context})", prompt.len())));
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    let input_tokens = prompt.len();
    submit(
        &state,
        Job {
            prompt,
            opts: GenerateOptions { max_tokens, sampling, stop: stops },
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
            constraint,
            events: tx,
            submitted: Instant::now(),
            keep_special_tokens: format.keeps_special_tokens(),
        },
    )?;
    let id = format!("msg_{:016x}", rand_seed());
    let t0 = Instant::now();
    let mut tally = Some(RequestTally::new(state.metrics.clone()));

    if !stream {
        let mut text = String::new();
        let (finish, output_tokens, stop_sequence) = loop {
            match rx.recv().await {
                Some(Event::Text { text: t, .. }) => {
                    if text.is_empty() && !t.is_empty() {
                        state.metrics.first_token(t0.elapsed());
                    }
                    text.push_str(&t)
                }
                Some(Event::Done { finish, completion_tokens, stop_sequence, .. }) => break (finish, completion_tokens, stop_sequence),
                Some(Event::Error { fault, message }) => {
                    if let Some(t) = tally.take() {
                        t.finish(false);
                    }
                    return Err(ApiError::from_fault(fault, message));
                }
                None => return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the request was dropped (server shutting down)")),
            }
        };
        if let Some(t) = tally.take() {
            t.finish(true);
        }
        let parsed = format.parse(&text, in_reasoning, calling.as_ref());
        let mut blocks = Vec::new();
        if !parsed.reasoning.is_empty() {
            blocks.push(json!({ "type": "thinking", "thinking": parsed.reasoning, "signature": "" }));
        }
        if !parsed.content.is_empty() || parsed.calls.is_empty() {
            blocks.push(json!({ "type": "text", "text": parsed.content }));
        }
        blocks.extend(parsed.calls.iter().map(tool_use_block));
        let reason = if parsed.calls.is_empty() { stop_reason(finish, &stop_sequence) } else { "tool_use" };
        let content = Value::Array(blocks);
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": { "input_tokens": input_tokens, "output_tokens": output_tokens },
        }))
        .into_response());
    }

    let metrics = state.metrics.clone();
    let stream = async_stream(move |out: mpsc::UnboundedSender<SseEvent>| async move {
        let start = json!({ "type": "message_start", "message": { "id": id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": { "input_tokens": input_tokens, "output_tokens": 0 } } });
        let _ = out.send(named("message_start", start));
        // Blocks open as their text arrives: thinking, then the answer's text; with tools the
        // text is held until it is known whether the answer is a call.
        let holding = calling.is_some();
        let mut streamed = Streamed::new(format, in_reasoning);
        let mut blocks = Blocks { index: 0, open: None };
        let mut first = true;
        loop {
            match rx.recv().await {
                Some(Event::Text { text, .. }) => {
                    if text.is_empty() {
                        continue;
                    }
                    if first {
                        metrics.first_token(t0.elapsed());
                        first = false;
                    }
                    let (reasoning, content) = streamed.push(&text);
                    let sent = blocks.send(&out, "thinking", &reasoning) && (holding || blocks.send(&out, "text", &content));
                    if !sent {
                        return; // the client left: dropping `rx` cancels the generation
                    }
                }
                Some(Event::Done { finish, completion_tokens, stop_sequence, .. }) => {
                    if let Some(t) = tally.take() {
                        t.finish(true);
                    }
                    let mut reason = stop_reason(finish, &stop_sequence);
                    let (reasoning, content) = streamed.finish();
                    blocks.send(&out, "thinking", &reasoning);
                    if holding {
                        let parsed = format.parse(streamed.text(), in_reasoning, calling.as_ref());
                        blocks.send(&out, "text", &parsed.content);
                        if !parsed.calls.is_empty() {
                            reason = "tool_use";
                        } else if blocks.index == 0 && blocks.open.is_none() {
                            blocks.start(&out, "text");
                        }
                        for call in &parsed.calls {
                            blocks.stop(&out);
                            let mut block = tool_use_block(call);
                            let input = block["input"].take();
                            block["input"] = json!({});
                            let i = blocks.index;
                            let _ = out.send(named("content_block_start", json!({ "type": "content_block_start", "index": i, "content_block": block })));
                            let _ = out.send(named("content_block_delta", json!({ "type": "content_block_delta", "index": i, "delta": { "type": "input_json_delta", "partial_json": input.to_string() } })));
                            let _ = out.send(named("content_block_stop", json!({ "type": "content_block_stop", "index": i })));
                            blocks.index += 1;
                        }
                    } else {
                        blocks.send(&out, "text", &content);
                        if blocks.index == 0 && blocks.open.is_none() {
                            blocks.start(&out, "text");
                        }
                    }
                    blocks.stop(&out);
                    let _ = out.send(named("message_delta", json!({ "type": "message_delta", "delta": { "stop_reason": reason, "stop_sequence": stop_sequence }, "usage": { "output_tokens": completion_tokens } })));
                    let _ = out.send(named("message_stop", json!({ "type": "message_stop" })));
                    return;
                }
                Some(Event::Error { message: e, .. }) => {
                    if let Some(t) = tally.take() {
                        t.finish(false);
                    }
                    let _ = out.send(named("error", json!({ "type": "error", "error": { "type": "api_error", "message": e } })));
                    return;
                }
                None => return,
            }
        }
    });
    Ok(Sse::new(stream.map(Ok::<_, Infallible>)).into_response())
}

fn named(name: &str, data: Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

/// The streamed content blocks: the open one (thinking or text) and the next index.
struct Blocks {
    index: usize,
    open: Option<&'static str>,
}

impl Blocks {
    fn start(&mut self, out: &mpsc::UnboundedSender<SseEvent>, kind: &'static str) -> bool {
        let block = if kind == "thinking" { json!({ "type": "thinking", "thinking": "", "signature": "" }) } else { json!({ "type": "text", "text": "" }) };
        self.open = Some(kind);
        out.send(named("content_block_start", json!({ "type": "content_block_start", "index": self.index, "content_block": block }))).is_ok()
    }

    fn stop(&mut self, out: &mpsc::UnboundedSender<SseEvent>) {
        if self.open.take().is_some() {
            let _ = out.send(named("content_block_stop", json!({ "type": "content_block_stop", "index": self.index })));
            self.index += 1;
        }
    }

    /// `text` into a block of `kind` (closing another kind's block first); false if the client left.
    fn send(&mut self, out: &mpsc::UnboundedSender<SseEvent>, kind: &'static str, text: &str) -> bool {
        if text.is_empty() {
            return true;
        }
        if self.open != Some(kind) {
            self.stop(out);
            if !self.start(out, kind) {
                return false;
            }
        }
        let delta = if kind == "thinking" { json!({ "type": "thinking_delta", "thinking": text }) } else { json!({ "type": "text_delta", "text": text }) };
        out.send(named("content_block_delta", json!({ "type": "content_block_delta", "index": self.index, "delta": delta }))).is_ok()
    }
}

/// A call as Anthropic's `tool_use` block.
fn tool_use_block(call: &super::tools::Call) -> Value {
    json!({ "type": "tool_use", "id": format!("toolu_{:016x}", rand_seed()), "name": call.name, "input": call.arguments })
}
