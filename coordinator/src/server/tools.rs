//! Tool (function) calling, shared by the OpenAI and Anthropic APIs: the request's tools and
//! choice, the prompt they go into, the constraint that makes a required call well-formed, and
//! the parse of the model's output back into calls.
//!
//! Prompting: a template that renders tools itself (it mentions `tools` and `tool_call`, as
//! Qwen's and Hermes-style templates do) gets the tools and the calls and results as transformers
//! passes them (`arguments` as objects). Any other template gets a system message of ours that
//! lists the tools and the call format — `{"name": …, "arguments": {…}}` — with calls shown as
//! that JSON and results as user turns.
//!
//! Calling: `required` (any tool) and a named tool constrain the output to exactly one call whose
//! arguments validate against that tool's parameters (`constraint::Grammar::ToolCall`, compiled
//! with the request: a schema llguidance cannot follow is refused then);
//! `auto` lets the model choose, and an answer that is such a JSON object, or holds
//! `<tool_call>…</tool_call>` blocks of them, is returned as calls; `none` keeps the tools in the
//! prompt (so a conversation's prefix does not change) but the answer is text.
//!
//! Must never: return a call of a tool the request did not list, or arguments that are not JSON.

use crate::constraint::{CallShape, Grammar};
use serde_json::{json, Value};

use super::errors::ApiError;

#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub parameters: Option<Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Debug, Clone)]
pub struct Tools {
    pub list: Vec<ToolSpec>,
    pub choice: ToolChoice,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments object.
    pub arguments: Value,
}

const MAX_TOOLS: usize = 128;

impl Tools {
    /// Checks names (unique, non-empty), parameter schemas (objects describing an object: a
    /// call's arguments are one) and the choice.
    pub fn new(list: Vec<ToolSpec>, choice: ToolChoice, param: &str) -> Result<Tools, ApiError> {
        if list.len() > MAX_TOOLS {
            return Err(ApiError::param(param, format!("at most {MAX_TOOLS} tools")));
        }
        for (i, t) in list.iter().enumerate() {
            if t.name.is_empty() || t.name.len() > 64 || !t.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                return Err(ApiError::param(&format!("{param}[{i}]"), format!("tool name `{}` must be 1–64 characters of a-z, A-Z, 0-9, _ or -", t.name)));
            }
            if list[..i].iter().any(|o| o.name == t.name) {
                return Err(ApiError::param(&format!("{param}[{i}]"), format!("two tools are named `{}`", t.name)));
            }
            if let Some(p) = &t.parameters {
                let of_object = match p.get("type") {
                    None => true,
                    Some(Value::String(s)) => s == "object",
                    Some(Value::Array(a)) => a.iter().any(|s| s == "object"),
                    Some(_) => false,
                };
                if !p.is_object() || !of_object {
                    return Err(ApiError::param(
                        &format!("{param}[{i}]"),
                        format!("tool `{}`: `parameters` must be a JSON schema of an object (the arguments are one), got {p}", t.name),
                    ));
                }
            }
        }
        if let ToolChoice::Named(n) = &choice {
            if !list.iter().any(|t| &t.name == n) {
                return Err(ApiError::param("tool_choice", format!("`tool_choice` names `{n}`, which is not among the tools")));
            }
        }
        if choice != ToolChoice::None && list.is_empty() {
            return Err(ApiError::param("tool_choice", "a tool choice needs tools"));
        }
        Ok(Tools { list, choice })
    }

    /// Whether the answer may be a call (the tools are listed and the choice is not `none`).
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None && !self.list.is_empty()
    }

    /// The constraint for `required` and named choices: one call, written as `shape` says (the
    /// chat format's own syntax, `chat_format.rs`).
    pub fn constraint(&self, shape: CallShape) -> Option<Grammar> {
        let pick: Vec<(String, Option<Value>)> = match &self.choice {
            ToolChoice::Required => self.list.iter().map(|t| (t.name.clone(), t.parameters.clone())).collect(),
            ToolChoice::Named(n) => self.list.iter().filter(|t| &t.name == n).map(|t| (t.name.clone(), t.parameters.clone())).collect(),
            _ => return None,
        };
        Some(Grammar::ShapedToolCall(pick, Box::new(shape)))
    }

    /// The tools as a template expects them (OpenAI's function shape).
    pub fn for_template(&self) -> Value {
        Value::Array(self.list.iter().map(|t| json!({ "type": "function", "function": { "name": t.name, "description": t.description, "parameters": t.parameters.clone().unwrap_or(json!({"type": "object"})) } })).collect())
    }

    /// Our system message for templates that do not render tools.
    pub fn instructions(&self) -> String {
        let mut s = String::from("You can call these tools. To call one, answer with only a JSON object {\"name\": TOOL, \"arguments\": {…}}.\n");
        for t in &self.list {
            s.push_str(&format!("- {}: {} Parameters: {}\n", t.name, t.description, t.parameters.clone().unwrap_or(json!({"type": "object"}))));
        }
        s
    }

    /// The calls in a model's answer, if it made any (of listed tools only).
    pub fn parse(&self, text: &str) -> Option<Vec<Call>> {
        let one = |v: &Value| -> Option<Call> {
            let name = v.get("name")?.as_str()?;
            let arguments = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or(json!({}));
            let arguments = match arguments {
                Value::String(s) => serde_json::from_str(&s).ok()?,
                other => other,
            };
            (self.list.iter().any(|t| t.name == name) && arguments.is_object()).then(|| Call { name: name.to_string(), arguments })
        };
        let trimmed = text.trim();
        if let Ok(v) = serde_json::from_str::<Value>(trimmed) {
            return one(&v).map(|c| vec![c]);
        }
        let mut calls = Vec::new();
        let mut rest = trimmed;
        while let Some(start) = rest.find("<tool_call>") {
            let after = &rest[start + "<tool_call>".len()..];
            let end = after.find("</tool_call>")?;
            calls.push(one(&serde_json::from_str(after[..end].trim()).ok()?)?);
            rest = &after[end + "</tool_call>".len()..];
        }
        (!calls.is_empty()).then_some(calls)
    }
}

/// Converts the conversation for a template that does not render tools: our instructions as
/// (or before) the system message, calls as their JSON, results as user turns.
pub fn plain_messages(messages: Vec<Value>, tools: &Tools) -> Vec<Value> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    let mut instructions = Some(tools.instructions());
    for m in messages {
        let role = m["role"].as_str().unwrap_or("user").to_string();
        let content = m["content"].as_str().unwrap_or("").to_string();
        match role.as_str() {
            "system" => {
                let text = match instructions.take() {
                    Some(i) => format!("{content}\n\n{i}"),
                    None => content,
                };
                out.push(json!({ "role": "system", "content": text }));
            }
            "assistant" if m.get("tool_calls").is_some_and(|c| c.is_array()) => {
                let calls: Vec<String> = m["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| json!({ "name": c["function"]["name"], "arguments": c["function"]["arguments"] }).to_string())
                    .collect();
                out.push(
                    json!({ "role": "assistant", "content": if content.is_empty() { calls.join("\n") } else { format!("{content}\n{}", calls.join("\n")) } }),
                );
            }
            "tool" => {
                let who = m.get("name").and_then(Value::as_str).or_else(|| m.get("tool_call_id").and_then(Value::as_str)).unwrap_or("the tool");
                out.push(json!({ "role": "user", "content": format!("Result of {who}: {content}") }));
            }
            _ => out.push(json!({ "role": role, "content": content })),
        }
    }
    if let Some(i) = instructions {
        out.insert(0, json!({ "role": "system", "content": i.trim_end() }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: ToolChoice) -> Tools {
        Tools::new(
            vec![
                ToolSpec {
                    name: "get_weather".into(),
                    description: "Weather in a city.".into(),
                    parameters: Some(json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
                },
                ToolSpec { name: "ping".into(), description: "".into(), parameters: None },
            ],
            choice,
            "tools",
        )
        .unwrap()
    }

    #[test]
    fn calls_are_parsed_from_json_answers_and_tool_call_blocks_of_listed_tools_only() {
        let t = tools(ToolChoice::Auto);
        assert_eq!(
            t.parse(r#" {"name":"get_weather","arguments":{"city":"Ur"}} "#),
            Some(vec![Call { name: "get_weather".into(), arguments: json!({"city": "Ur"}) }])
        );
        assert_eq!(
            t.parse(
                r#"<tool_call>{"name": "ping", "arguments": "{}"}</tool_call> and <tool_call>{"name":"get_weather","arguments":{"city":"Ai"}}</tool_call>"#
            )
            .map(|c| c.len()),
            Some(2)
        );
        assert_eq!(t.parse(r#"{"name":"rm_rf","arguments":{}}"#), None);
        assert_eq!(t.parse("The weather is fine."), None);
        assert_eq!(t.parse(r#"{"name":"ping","arguments":[1]}"#), None);
    }

    #[test]
    fn bad_tool_lists_are_refused_by_name() {
        let e = Tools::new(vec![ToolSpec { name: "a b".into(), description: "".into(), parameters: None }], ToolChoice::Auto, "tools").unwrap_err();
        assert!(e.message.contains("a b"));
        let dup = vec![ToolSpec { name: "x".into(), description: "".into(), parameters: None }; 2];
        assert!(Tools::new(dup, ToolChoice::Auto, "tools").unwrap_err().message.contains("two tools"));
        let e = Tools::new(vec![ToolSpec { name: "x".into(), description: "".into(), parameters: Some(json!({"type": "string"})) }], ToolChoice::Auto, "tools")
            .unwrap_err();
        assert!(e.message.contains("object"), "{}", e.message);
        let e = Tools::new(vec![ToolSpec { name: "x".into(), description: "".into(), parameters: Some(json!([1])) }], ToolChoice::Auto, "tools").unwrap_err();
        assert!(e.message.contains("object"), "{}", e.message);
        // What the old matcher refused (`pattern`) is a schema like any other now.
        let pattern = json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}});
        assert!(Tools::new(vec![ToolSpec { name: "x".into(), description: "".into(), parameters: Some(pattern) }], ToolChoice::Auto, "tools").is_ok());
        assert!(Tools::new(vec![], ToolChoice::Named("x".into()), "tools").is_err());
    }

    #[test]
    fn templates_without_tools_get_instructions_and_plain_turns() {
        let t = tools(ToolChoice::Required);
        let msgs = vec![
            json!({"role": "user", "content": "Weather in Ur?"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Ur"}}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "hot"}),
        ];
        let out = plain_messages(msgs, &t);
        assert_eq!(out[0]["role"], "system");
        assert!(out[0]["content"].as_str().unwrap().contains("get_weather"));
        assert_eq!(
            out[2]["content"],
            r#"{"arguments":{"city":"Ur"},"name":"get_weather"}"#
                .replace(r#"{"arguments":{"city":"Ur"},"name":"get_weather"}"#, &json!({"name": "get_weather", "arguments": {"city": "Ur"}}).to_string())
        );
        assert_eq!(out[3], json!({"role": "user", "content": "Result of call_1: hot"}));
        assert!(t.constraint(CallShape::json()).is_some() && tools(ToolChoice::Auto).constraint(CallShape::json()).is_none());
    }
}
