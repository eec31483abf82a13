//! Each family's own way of writing tool calls and reasoning in an answer, read from its chat
//! template: which syntax the model was trained to emit, the `CallShape` that constrains a
//! required call to it, and the parse of an answer (whole, or growing as it streams) into
//! reasoning, content and calls.
//!
//! Syntaxes: Hermes/Qwen (`<tool_call>{"name": …, "arguments": …}</tool_call>`, also shimmer's own
//! bare JSON object for templates without tools), Qwen3-Coder's XML (`<function=NAME>` with
//! `<parameter=K>` blocks), DeepSeek-V3.2's DSML, GLM (`<tool_call>NAME` then
//! `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs), DeepSeek-V3.1
//! (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` inside a calls section), Kimi K2
//! (`<|tool_call_begin|>functions.NAME:i<|tool_call_argument_begin|>ARGS<|tool_call_end|>` inside
//! a section) and gpt-oss's harmony (`<|channel|>commentary to=functions.NAME … <|message|>ARGS`,
//! its `analysis` channel the reasoning, `final` the answer), Mistral's (`[TOOL_CALLS]` then a
//! JSON array of calls, or `[TOOL_CALLS]NAME[ARGS]{…}` per call). Reasoning elsewhere is
//! `<think>…</think>`, or everything up to `</think>` when the prompt already opened it.
//!
//! Must never: return a call of a tool the request did not list or arguments that are not a JSON
//! object (the answer is then content, as written); lose text (what is neither reasoning nor a
//! call is content); emit a streamed piece it later takes back (text that may be the start of a
//! marker is held until it is known).

use serde_json::Value;

use super::tools::{Call, Tools};
use crate::constraint::{ArgumentsShape, CallShape};

/// How the model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// One bare JSON call (shimmer's own instructions, for templates that do not render tools);
    /// `<tool_call>` blocks are read too.
    Json,
    /// `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` blocks (Qwen, Hermes).
    Hermes,
    /// Qwen3-Coder's XML: `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>`.
    QwenXml,
    Glm,
    DeepSeek,
    /// DeepSeek-V3.2's DSML: `<｜DSML｜invoke name="N">` with `<｜DSML｜parameter name="K"
    /// string="true|false">V</｜DSML｜parameter>` inside `<｜DSML｜function_calls>`.
    Dsml,
    Kimi,
    Harmony,
    /// Mistral's v3 tokenizers (Mixtral-8x22B-Instruct, Mistral-7B-Instruct-v0.3):
    /// `[TOOL_CALLS] [{"name": …, "arguments": …}, …]`.
    Mistral,
    /// Mistral's later tokenizers (v11 on): `[TOOL_CALLS]NAME[ARGS]{…}` per call.
    MistralArgs,
}

/// How the model writes its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningSyntax {
    None,
    /// `<think>…</think>`.
    ThinkTags,
    /// Harmony's `analysis` channel.
    Harmony,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatFormat {
    pub tools: ToolSyntax,
    pub reasoning: ReasoningSyntax,
}

/// An answer read back.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<Call>,
}

/// Most calls a constrained answer holds when parallel calls are allowed.
const PARALLEL_CALLS: usize = 4;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DSML_CALLS: &str = "<｜DSML｜function_calls>";
const DSML_CALLS_END: &str = "</｜DSML｜function_calls>";
const DSML_INVOKE_END: &str = "</｜DSML｜invoke>";
const DSML_PARAMETER_END: &str = "</｜DSML｜parameter>";
const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";
const HARMONY_MARKERS: [&str; 7] = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"];

impl ChatFormat {
    /// The format a chat template was written for, by the markers it renders.
    pub fn detect(template: Option<&str>) -> ChatFormat {
        let t = template.unwrap_or("");
        let tools = if t.contains("<|channel|>") {
            ToolSyntax::Harmony
        } else if t.contains(MISTRAL_CALLS) {
            if t.contains(MISTRAL_ARGS) {
                ToolSyntax::MistralArgs
            } else {
                ToolSyntax::Mistral
            }
        } else if t.contains("｜DSML｜") {
            ToolSyntax::Dsml
        } else if t.contains("<arg_key>") {
            ToolSyntax::Glm
        } else if t.contains("tool▁call▁begin") {
            ToolSyntax::DeepSeek
        } else if t.contains("<|tool_call_begin|>") {
            ToolSyntax::Kimi
        } else if t.contains("<function=") && t.contains("<parameter=") {
            ToolSyntax::QwenXml
        } else if t.contains("<tool_call>") {
            ToolSyntax::Hermes
        } else {
            ToolSyntax::Json
        };
        let reasoning = if tools == ToolSyntax::Harmony {
            ReasoningSyntax::Harmony
        } else if t.contains(THINK_CLOSE) {
            ReasoningSyntax::ThinkTags
        } else {
            ReasoningSyntax::None
        };
        ChatFormat { tools, reasoning }
    }

    pub fn name(&self) -> &'static str {
        match self.tools {
            ToolSyntax::Json => "json",
            ToolSyntax::Hermes => "hermes",
            ToolSyntax::QwenXml => "qwen-xml",
            ToolSyntax::Glm => "glm",
            ToolSyntax::DeepSeek => "deepseek",
            ToolSyntax::Dsml => "dsml",
            ToolSyntax::Kimi => "kimi",
            ToolSyntax::Harmony => "harmony",
            ToolSyntax::Mistral => "mistral",
            ToolSyntax::MistralArgs => "mistral-args",
        }
    }

    /// Whether answers must be decoded with their special tokens (the markers may be such
    /// tokens: Hermes' and shimmer's JSON never are).
    pub fn keeps_special_tokens(&self) -> bool {
        !matches!(self.tools, ToolSyntax::Json | ToolSyntax::Hermes) || self.reasoning != ReasoningSyntax::None
    }

    /// How calls are written, for the constraint of a required call; `parallel`: the answer may
    /// hold several (where the syntax can).
    pub fn call_shape(&self, parallel: bool) -> CallShape {
        let mut shape = self.one_call_shape();
        if parallel && !matches!(self.tools, ToolSyntax::Json | ToolSyntax::Harmony) {
            shape.most = PARALLEL_CALLS;
        }
        shape
    }

    fn one_call_shape(&self) -> CallShape {
        let v = |parts: &[&str]| parts.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        match self.tools {
            ToolSyntax::Json => CallShape::json(),
            ToolSyntax::Hermes => CallShape {
                open: vec![],
                before_name: v(&["<tool_call>", "\n{\"name\": \""]),
                after_name: v(&["\", \"arguments\": "]),
                arguments: ArgumentsShape::Json,
                after_arguments: v(&["}\n", "</tool_call>"]),
                between: vec![],
                close: vec![],
                most: 1,
            },
            ToolSyntax::QwenXml => CallShape {
                open: vec![],
                before_name: v(&["<tool_call>", "\n<function="]),
                after_name: v(&[">\n"]),
                arguments: ArgumentsShape::Pairs { key: [v(&["<parameter="]), v(&[">\n"])], value: [vec![], v(&["\n</parameter>\n"])], json_key_close: None },
                after_arguments: v(&["</function>\n", "</tool_call>"]),
                between: vec![],
                close: vec![],
                most: 1,
            },
            ToolSyntax::Glm => CallShape {
                open: vec![],
                before_name: v(&["<tool_call>"]),
                after_name: v(&["\n"]),
                arguments: ArgumentsShape::Pairs {
                    key: [v(&["<arg_key>"]), v(&["</arg_key>", "\n"])],
                    value: [v(&["<arg_value>"]), v(&["</arg_value>", "\n"])],
                    json_key_close: None,
                },
                after_arguments: v(&["</tool_call>"]),
                between: vec![],
                close: vec![],
                most: 1,
            },
            ToolSyntax::DeepSeek => CallShape {
                open: v(&[DS_CALLS_BEGIN]),
                before_name: v(&[DS_CALL_BEGIN]),
                after_name: v(&[DS_SEP]),
                arguments: ArgumentsShape::Json,
                after_arguments: v(&[DS_CALL_END]),
                between: vec![],
                close: v(&[DS_CALLS_END]),
                most: 1,
            },
            ToolSyntax::Dsml => CallShape {
                open: v(&[DSML_CALLS, "\n"]),
                before_name: v(&["<｜DSML｜invoke name=\""]),
                after_name: v(&["\">\n"]),
                arguments: ArgumentsShape::Pairs {
                    key: [v(&["<｜DSML｜parameter name=\""]), v(&["\" string=\"true\">"])],
                    value: [vec![], v(&[DSML_PARAMETER_END, "\n"])],
                    json_key_close: Some(v(&["\" string=\"false\">"])),
                },
                after_arguments: v(&[DSML_INVOKE_END, "\n"]),
                between: vec![],
                close: v(&[DSML_CALLS_END]),
                most: 1,
            },
            ToolSyntax::Kimi => CallShape {
                open: v(&[KIMI_SECTION_BEGIN]),
                before_name: v(&[KIMI_CALL_BEGIN, "functions."]),
                after_name: v(&[":0", KIMI_ARGS]),
                arguments: ArgumentsShape::Json,
                after_arguments: v(&[KIMI_CALL_END]),
                between: vec![],
                close: v(&[KIMI_SECTION_END]),
                most: 1,
            },
            ToolSyntax::Mistral => CallShape {
                open: v(&[MISTRAL_CALLS, " ["]),
                before_name: v(&["{\"name\": \""]),
                after_name: v(&["\", \"arguments\": "]),
                arguments: ArgumentsShape::Json,
                after_arguments: v(&["}"]),
                between: v(&[", "]),
                close: v(&["]"]),
                most: 1,
            },
            ToolSyntax::MistralArgs => CallShape {
                open: vec![],
                before_name: v(&[MISTRAL_CALLS]),
                after_name: v(&[MISTRAL_ARGS]),
                arguments: ArgumentsShape::Json,
                after_arguments: vec![],
                between: vec![],
                close: vec![],
                most: 1,
            },
            // A call ends the answer: its `<|call|>` is an end-of-text token the sampler takes.
            ToolSyntax::Harmony => CallShape {
                open: vec![],
                before_name: v(&["<|channel|>", "commentary to=functions."]),
                after_name: v(&[" ", "<|constrain|>", "json", "<|message|>"]),
                arguments: ArgumentsShape::Json,
                after_arguments: vec![],
                between: vec![],
                close: vec![],
                most: 1,
            },
        }
    }

    /// A whole answer read back. `in_reasoning`: the prompt ended inside an open `<think>`.
    /// Calls are read only with `tools` (and only of its tools); else call markup is content.
    pub fn parse(&self, text: &str, in_reasoning: bool, tools: Option<&Tools>) -> Parsed {
        let (reasoning, rest, harmony_calls) = self.split(text, in_reasoning, true);
        // Content is the answer's own text: trimmed only where markup was taken out of it.
        let mut out = Parsed { reasoning, content: rest.clone(), calls: vec![] };
        let Some(tools) = tools.filter(|t| t.active()) else {
            return out;
        };
        let found = match self.tools {
            ToolSyntax::Harmony => (!harmony_calls.is_empty()).then(|| (String::new(), harmony_calls.clone())),
            ToolSyntax::Json | ToolSyntax::Hermes => {
                tools.parse(&rest).map(|calls| (json_blocks_outside(&rest), calls.into_iter().map(|c| (c.name, c.arguments.to_string())).collect()))
            }
            ToolSyntax::Glm => glm_calls(&rest, tools),
            ToolSyntax::QwenXml => qwen_xml_calls(&rest, tools),
            ToolSyntax::Dsml => dsml_calls(&rest),
            ToolSyntax::Mistral => mistral_calls(&rest),
            ToolSyntax::MistralArgs => mistral_args_calls(&rest),
            ToolSyntax::DeepSeek => section_calls(&rest, DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, |body| {
                let (name, args) = body.split_once(DS_SEP)?;
                // DeepSeek-V3's older form: `function<sep>NAME\n```json\nARGS\n````.
                let (name, args) = match args.split_once("```json") {
                    Some((n, a)) if name.trim() == "function" => (n.trim(), a.trim().trim_end_matches("```")),
                    _ => (name.trim(), args),
                };
                Some((name.to_string(), args.trim().to_string()))
            }),
            ToolSyntax::Kimi => section_calls(&rest, KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_BEGIN, KIMI_CALL_END, |body| {
                let (id, args) = body.split_once(KIMI_ARGS)?;
                let name = id.trim().strip_prefix("functions.").unwrap_or(id.trim());
                let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
                Some((name.to_string(), args.trim().to_string()))
            }),
        };
        if let Some((content, raw)) = found {
            let calls: Option<Vec<Call>> = raw.into_iter().map(|(name, args)| call_of(tools, &name, &args)).collect();
            if let Some(calls) = calls.filter(|c| !c.is_empty()) {
                out.calls = calls;
                out.content = content.trim().to_string();
            }
        }
        out
    }

    /// Reasoning, the rest, and (harmony) the calls' raw (name, arguments). `complete: false`
    /// holds back a tail that may be the start of a marker, so what is returned only grows.
    fn split(&self, text: &str, in_reasoning: bool, complete: bool) -> (String, String, Vec<(String, String)>) {
        match self.reasoning {
            ReasoningSyntax::None => (String::new(), held(text, complete, &[]).to_string(), vec![]),
            ReasoningSyntax::ThinkTags => {
                let (reasoning, content) = think_split(text, in_reasoning, complete, &mut 0);
                (reasoning.to_string(), content.to_string(), vec![])
            }
            ReasoningSyntax::Harmony => harmony(held(text, complete, &HARMONY_MARKERS)),
        }
    }
}

/// `<think>…</think>` reasoning and the content after it, as slices of `text` (the reasoning is
/// everything up to `</think>` when `in_reasoning`: the prompt opened it). `close_from`: no
/// `</think>` starts before this offset — `Streamed` keeps it between pieces so that a long
/// answer is searched once, not once per token.
fn think_split<'a>(text: &'a str, in_reasoning: bool, complete: bool, close_from: &mut usize) -> (&'a str, &'a str) {
    let body_start = if in_reasoning {
        0
    } else {
        let t = text.trim_start();
        match t.strip_prefix(THINK_OPEN) {
            Some(b) => text.len() - b.len(),
            None if !complete && THINK_OPEN.starts_with(t) => return ("", ""),
            None => return ("", held(text, complete, &[THINK_OPEN])),
        }
    };
    let from = (*close_from).max(body_start);
    match text[from..].find(THINK_CLOSE) {
        Some(i) => {
            *close_from = from + i;
            (text[body_start..from + i].trim(), held(&text[from + i + THINK_CLOSE.len()..], complete, &[]).trim_start())
        }
        None => {
            // The next search starts where a `</think>` cut by this piece's end could begin.
            let mut next = text.len().saturating_sub(THINK_CLOSE.len() - 1).max(from);
            while !text.is_char_boundary(next) {
                next -= 1;
            }
            *close_from = next;
            (held(&text[body_start..], complete, &[THINK_CLOSE]).trim_start(), "")
        }
    }
}

/// `text` less a tail that may be the start of one of `markers` (when not `complete`).
fn held<'a>(text: &'a str, complete: bool, markers: &[&str]) -> &'a str {
    if complete {
        return text;
    }
    let mut cut = text.len();
    for m in markers {
        for k in (1..m.len()).rev() {
            if m.is_char_boundary(k) && text.ends_with(&m[..k]) {
                cut = cut.min(text.len() - k);
                break;
            }
        }
    }
    &text[..cut]
}

/// Harmony messages: `[<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`
/// ended by `<|end|>`, `<|call|>`, `<|return|>` or the answer's end.
fn harmony(text: &str) -> (String, String, Vec<(String, String)>) {
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
    let mut rest = text;
    // Text before the first channel (a model that skipped the header) is content.
    if let Some(i) = rest.find("<|channel|>") {
        content.push_str(rest[..i].trim_start_matches("<|start|>assistant"));
        rest = &rest[i..];
    } else {
        content.push_str(rest);
        rest = "";
    }
    while let Some(after) = rest.strip_prefix("<|channel|>") {
        let Some(m) = after.find("<|message|>") else {
            break; // a header still being written
        };
        let header = &after[..m];
        let body_start = &after[m + "<|message|>".len()..];
        let end = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"].iter().filter_map(|e| body_start.find(e)).min().unwrap_or(body_start.len());
        let body = &body_start[..end];
        let channel = header.split_whitespace().next().unwrap_or("");
        let recipient = header.split_whitespace().find_map(|w| w.strip_prefix("to="));
        match (channel, recipient) {
            (_, Some(r)) => calls.push((r.strip_prefix("functions.").unwrap_or(r).to_string(), body.trim().to_string())),
            ("analysis", None) => reasoning.push_str(body),
            _ => content.push_str(body),
        }
        rest = &body_start[end..];
        for marker in ["<|end|>", "<|call|>", "<|return|>"] {
            rest = rest.strip_prefix(marker).unwrap_or(rest);
        }
        rest = rest.strip_prefix("<|start|>").map_or(rest, |r| r.strip_prefix("assistant").unwrap_or(r));
    }
    (reasoning.trim().to_string(), content, calls)
}

/// `text` without its `<tool_call>…</tool_call>` blocks (or empty if it is one bare JSON call).
fn json_blocks_outside(text: &str) -> String {
    if serde_json::from_str::<Value>(text.trim()).is_ok() {
        return String::new();
    }
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("<tool_call>") {
        out.push_str(&rest[..start]);
        match rest[start..].find("</tool_call>") {
            Some(end) => rest = &rest[start + end + "</tool_call>".len()..],
            None => {
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// Calls inside `begin … end` sections, each `call_begin BODY call_end`, read by `one`; the text
/// outside the sections is content.
fn section_calls(
    text: &str,
    begin: &str,
    end: &str,
    call_begin: &str,
    call_end: &str,
    one: impl Fn(&str) -> Option<(String, String)>,
) -> Option<(String, Vec<(String, String)>)> {
    let start = text.find(begin).or_else(|| text.find(call_begin))?;
    let mut content = text[..start].to_string();
    let mut rest = &text[start..];
    rest = rest.strip_prefix(begin).unwrap_or(rest);
    let mut calls = Vec::new();
    while let Some(i) = rest.find(call_begin) {
        let body = &rest[i + call_begin.len()..];
        let stop = body.find(call_end).unwrap_or(body.len());
        calls.push(one(&body[..stop])?);
        rest = body.get(stop + call_end.len()..).unwrap_or("");
    }
    if let Some(i) = rest.find(end) {
        content.push_str(&rest[i + end.len()..]);
    }
    Some((content, calls))
}

/// GLM's `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>…</tool_call>` blocks: a
/// value is a string where the tool's schema says so, else JSON (text when it is not).
fn glm_calls(text: &str, tools: &Tools) -> Option<(String, Vec<(String, String)>)> {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("<tool_call>") {
        content.push_str(&rest[..start]);
        let block = &rest[start + "<tool_call>".len()..];
        let stop = block.find("</tool_call>").unwrap_or(block.len());
        let body = &block[..stop];
        rest = block.get(stop + "</tool_call>".len()..).unwrap_or("");
        let name = body.split("<arg_key>").next().unwrap_or("").trim().to_string();
        let schema = tools.list.iter().find(|t| t.name == name).and_then(|t| t.parameters.clone());
        let mut args = serde_json::Map::new();
        let mut pairs = body;
        while let Some(k) = pairs.find("<arg_key>") {
            let after = &pairs[k + "<arg_key>".len()..];
            let key_end = after.find("</arg_key>")?;
            let key = after[..key_end].trim().to_string();
            let v = after.find("<arg_value>")? + "<arg_value>".len();
            let value_end = after[v..].find("</arg_value>").map_or(after.len(), |e| v + e);
            let raw = &after[v..value_end];
            args.insert(key.clone(), typed_value(schema.as_ref(), &key, raw));
            pairs = after.get(value_end + "</arg_value>".len()..).unwrap_or("");
        }
        calls.push((name, Value::Object(args).to_string()));
    }
    content.push_str(rest);
    (!calls.is_empty()).then_some((content, calls))
}

/// Qwen3-Coder's `<tool_call>` blocks of `<function=NAME>` with `<parameter=K>\nV\n</parameter>`:
/// a value is a string where the tool's schema says so, else JSON (text when it is not).
fn qwen_xml_calls(text: &str, tools: &Tools) -> Option<(String, Vec<(String, String)>)> {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("<tool_call>") {
        content.push_str(&rest[..start]);
        let block = &rest[start + "<tool_call>".len()..];
        let stop = block.find("</tool_call>").unwrap_or(block.len());
        let body = &block[..stop];
        rest = block.get(stop + "</tool_call>".len()..).unwrap_or("");
        let f = body.find("<function=")? + "<function=".len();
        let name_end = body[f..].find('>')? + f;
        let name = body[f..name_end].trim().to_string();
        let schema = tools.list.iter().find(|t| t.name == name).and_then(|t| t.parameters.clone());
        let mut args = serde_json::Map::new();
        let mut params = &body[name_end..];
        while let Some(p) = params.find("<parameter=") {
            let k = p + "<parameter=".len();
            let key_end = params[k..].find('>')? + k;
            let key = params[k..key_end].trim().to_string();
            let value_end = params[key_end..].find("</parameter>").map_or(params.len(), |e| key_end + e);
            let raw = params[key_end + 1..value_end].strip_prefix('\n').unwrap_or(&params[key_end + 1..value_end]);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            args.insert(key.clone(), typed_value(schema.as_ref(), &key, raw));
            params = params.get(value_end + "</parameter>".len()..).unwrap_or("");
        }
        calls.push((name, Value::Object(args).to_string()));
    }
    content.push_str(rest);
    (!calls.is_empty()).then_some((content, calls))
}

/// A raw parameter value: the text itself where the schema types the parameter a string, else its
/// JSON (the text where it is not JSON).
fn typed_value(schema: Option<&Value>, key: &str, raw: &str) -> Value {
    let pointer = format!("/properties/{}/type", key.replace('~', "~0").replace('/', "~1"));
    if schema.and_then(|s| s.pointer(&pointer)).and_then(Value::as_str) == Some("string") {
        Value::String(raw.to_string())
    } else {
        serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
    }
}

/// DSML blocks: `<｜DSML｜invoke name="N">` … `</｜DSML｜invoke>`, each parameter
/// `<｜DSML｜parameter name="K" string="true">raw text</｜DSML｜parameter>` or `string="false"` and
/// JSON; the text outside `<｜DSML｜function_calls>` is content.
fn dsml_calls(text: &str) -> Option<(String, Vec<(String, String)>)> {
    let start = text.find(DSML_CALLS)?;
    let mut content = text[..start].to_string();
    let section = &text[start + DSML_CALLS.len()..];
    let (section, after) = match section.find(DSML_CALLS_END) {
        Some(e) => (&section[..e], &section[e + DSML_CALLS_END.len()..]),
        None => (section, ""),
    };
    content.push_str(after);
    let attribute = |tag: &str, name: &str| -> Option<String> {
        let at = tag.find(&format!("{name}=\""))? + name.len() + 2;
        Some(tag[at..at + tag[at..].find('"')?].to_string())
    };
    let mut calls = Vec::new();
    let mut rest = section;
    while let Some(i) = rest.find("<｜DSML｜invoke ") {
        let open_end = rest[i..].find('>')? + i;
        let name = attribute(&rest[i..open_end], "name")?;
        let body_end = rest[open_end..].find(DSML_INVOKE_END).map_or(rest.len(), |e| open_end + e);
        let mut body = &rest[open_end + 1..body_end];
        let mut args = serde_json::Map::new();
        while let Some(p) = body.find("<｜DSML｜parameter ") {
            let tag_end = body[p..].find('>')? + p;
            let tag = &body[p..tag_end];
            let key = attribute(tag, "name")?;
            let value_end = body[tag_end..].find(DSML_PARAMETER_END).map_or(body.len(), |e| tag_end + e);
            let raw = &body[tag_end + 1..value_end];
            let value =
                if attribute(tag, "string").as_deref() == Some("false") { serde_json::from_str(raw.trim()).ok()? } else { Value::String(raw.to_string()) };
            args.insert(key, value);
            body = body.get(value_end + DSML_PARAMETER_END.len()..).unwrap_or("");
        }
        calls.push((name, Value::Object(args).to_string()));
        rest = rest.get(body_end + DSML_INVOKE_END.len()..).unwrap_or("");
    }
    (!calls.is_empty()).then_some((content, calls))
}

/// The JSON value at the start of `text` (after whitespace) and the text after it.
fn leading_json(text: &str) -> Option<(Value, &str)> {
    let text = text.trim_start();
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    let value = values.next()?.ok()?;
    Some((value, &text[values.byte_offset()..]))
}

/// Mistral's v3 form: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (arguments an
/// object, or a string holding one); the text before and after it is content.
fn mistral_calls(text: &str) -> Option<(String, Vec<(String, String)>)> {
    let start = text.find(MISTRAL_CALLS)?;
    let (value, after) = leading_json(&text[start + MISTRAL_CALLS.len()..])?;
    let items = match value {
        Value::Array(items) => items,
        one @ Value::Object(_) => vec![one],
        _ => return None,
    };
    let calls = items
        .iter()
        .map(|item| {
            let name = item.get("name")?.as_str()?.to_string();
            let args = match item.get("arguments") {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => String::new(),
            };
            Some((name, args))
        })
        .collect::<Option<Vec<_>>>()?;
    Some((format!("{}{after}", &text[..start]), calls))
}

/// Mistral's later form: `[TOOL_CALLS]NAME[ARGS]{…}` per call (a `[CALL_ID]id` after the name
/// where the tokenizer has one); the text before the first and after the last is content.
fn mistral_args_calls(text: &str) -> Option<(String, Vec<(String, String)>)> {
    let start = text.find(MISTRAL_CALLS)?;
    let mut calls = Vec::new();
    let mut rest = &text[start..];
    while let Some(call) = rest.trim_start().strip_prefix(MISTRAL_CALLS) {
        let at = call.find(MISTRAL_ARGS)?;
        let name = call[..at].split(MISTRAL_CALL_ID).next().unwrap_or("").trim().to_string();
        let (args, after) = leading_json(&call[at + MISTRAL_ARGS.len()..])?;
        calls.push((name, args.to_string()));
        rest = after;
    }
    Some((format!("{}{rest}", &text[..start]), calls))
}

/// A call of a listed tool whose arguments are a JSON object.
fn call_of(tools: &Tools, name: &str, args: &str) -> Option<Call> {
    let arguments: Value = if args.trim().is_empty() { Value::Object(Default::default()) } else { serde_json::from_str(args.trim()).ok()? };
    (tools.list.iter().any(|t| t.name == name) && arguments.is_object()).then(|| Call { name: name.to_string(), arguments })
}

/// An answer as it streams: the reasoning and content each new piece adds, never taken back.
pub struct Streamed {
    format: ChatFormat,
    in_reasoning: bool,
    text: String,
    reasoning_sent: usize,
    content_sent: usize,
    /// `think_split`'s search hint.
    close_from: usize,
}

impl Streamed {
    pub fn new(format: ChatFormat, in_reasoning: bool) -> Streamed {
        Streamed { format, in_reasoning, text: String::new(), reasoning_sent: 0, content_sent: 0, close_from: 0 }
    }

    /// Adds a piece of the answer; returns the new reasoning and the new content.
    pub fn push(&mut self, piece: &str) -> (String, String) {
        self.text.push_str(piece);
        if self.format.reasoning == ReasoningSyntax::None {
            // No marker to wait for: the piece is content as it is (and the whole answer need not
            // be read again on every token).
            self.content_sent = self.text.len();
            return (String::new(), piece.to_string());
        }
        self.read(false)
    }

    /// The answer is whole: whatever was held back.
    pub fn finish(&mut self) -> (String, String) {
        self.read(true)
    }

    /// The reasoning and content not sent yet. Think tags are read from slices of the answer
    /// (only the new piece is searched and copied); harmony re-reads its messages.
    fn read(&mut self, complete: bool) -> (String, String) {
        if self.format.reasoning == ReasoningSyntax::ThinkTags {
            let (reasoning, content) = think_split(&self.text, self.in_reasoning, complete, &mut self.close_from);
            return delta(&mut self.reasoning_sent, &mut self.content_sent, reasoning, content);
        }
        let (reasoning, content, _) = self.format.split(&self.text, self.in_reasoning, complete);
        delta(&mut self.reasoning_sent, &mut self.content_sent, &reasoning, &content)
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}

/// What of `reasoning` and `content` lies past what was sent, and the sent lengths advanced.
fn delta(reasoning_sent: &mut usize, content_sent: &mut usize, reasoning: &str, content: &str) -> (String, String) {
    let r = reasoning.get(*reasoning_sent..).unwrap_or("").to_string();
    let c = content.get(*content_sent..).unwrap_or("").to_string();
    *reasoning_sent = (*reasoning_sent).max(reasoning.len());
    *content_sent = (*content_sent).max(content.len());
    (r, c)
}

#[cfg(test)]
mod tests;
