//! Chat templates rendered the way transformers renders them: Jinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, and a `tojson` that writes
//! what Python's `json.dumps` writes. Python string/dict methods (`.strip()`, `.items()`, …) come
//! from minijinja-contrib's pycompat layer.
//!
//! Where the template and tokens come from: `chat_template.jinja` if present (transformers gives
//! it precedence), else `tokenizer_config.json`'s `chat_template` (a string, or a list whose
//! `default` entry is used). `generation_config.json` adds stop ids.

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::LoadError;
use crate::json::Obj;
use crate::spec::read_json_file;

const MAX_TEMPLATE_BYTES: u64 = 1 << 20;
/// What one render may build, in minijinja's fuel (an instruction, or 64 bytes of strings or
/// list slots it creates): 4 M instructions and 256 MiB of values, plus room in proportion to
/// the conversation it renders. A template that doubles a string or a list 40 times is refused
/// with "ran out of fuel" long before it holds the machine's memory, and so is one that prints a
/// value holding another many times over (the print budget of the vendored minijinja).
const RENDER_FUEL: u64 = 4_000_000;
/// Bytes one `tojson` may write (it serializes values the template built, which fuel has
/// already paid for, but a nested structure can repeat one value many times over).
const MAX_TOJSON_BYTES: usize = 16 << 20;
const MAX_TOKENIZER_CONFIG_BYTES: u64 = 32 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.into(), content: content.into() }
    }
}

/// What `tokenizer_config.json`, `chat_template.jinja` and `generation_config.json` tell us.
#[derive(Debug, Clone, Default)]
pub struct ChatConfig {
    pub template: Option<String>,
    pub template_path: Option<PathBuf>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Stop ids declared by `generation_config.json`.
    pub generation_eos_ids: Vec<u32>,
}

impl ChatConfig {
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let mut out = ChatConfig::default();
        let tc_path = dir.join("tokenizer_config.json");
        if tc_path.exists() {
            let value = read_json_file(&tc_path, MAX_TOKENIZER_CONFIG_BYTES)?;
            let Value::Object(map) = &value else {
                return Err(LoadError::malformed(&tc_path, "not a JSON object"));
            };
            out.bos_token = special_token(map.get("bos_token"));
            out.eos_token = special_token(map.get("eos_token"));
            match map.get("chat_template") {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) => {
                    out.template = Some(s.clone());
                    out.template_path = Some(tc_path.clone());
                }
                Some(Value::Array(list)) => {
                    let default = list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
                    match default.and_then(|t| t.get("template")).and_then(Value::as_str) {
                        Some(s) => {
                            out.template = Some(s.to_string());
                            out.template_path = Some(tc_path.clone());
                        }
                        None => {
                            return Err(LoadError::Field {
                                path: tc_path,
                                field: "chat_template".into(),
                                problem: "a list without a `default` template".into(),
                            })
                        }
                    }
                }
                Some(other) => {
                    return Err(LoadError::Field { path: tc_path, field: "chat_template".into(), problem: format!("expected a string or a list, got {other}") })
                }
            }
        }
        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.exists() {
            let meta = std::fs::metadata(&jinja_path).map_err(|e| LoadError::io(&jinja_path, e))?;
            if meta.len() > MAX_TEMPLATE_BYTES {
                return Err(LoadError::malformed(&jinja_path, "template is over the 1 MiB limit"));
            }
            out.template = Some(std::fs::read_to_string(&jinja_path).map_err(|e| LoadError::io(&jinja_path, e))?);
            out.template_path = Some(jinja_path);
        }
        let gc_path = dir.join("generation_config.json");
        if gc_path.exists() {
            let value = read_json_file(&gc_path, MAX_TEMPLATE_BYTES)?;
            let Value::Object(map) = &value else {
                return Err(LoadError::malformed(&gc_path, "not a JSON object"));
            };
            out.generation_eos_ids =
                Obj(map).ids("eos_token_id").map_err(|e| LoadError::Field { path: gc_path.clone(), field: e.field, problem: e.problem })?;
        }
        Ok(out)
    }

    /// Renders `messages` with the model's template, as `apply_chat_template(tokenize=False)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, LoadError> {
        let messages: Vec<Value> = messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
        self.render_json(&messages, None, add_generation_prompt)
    }

    /// `render` for messages as the API gives them (JSON: assistant `tool_calls`, `tool` role
    /// messages with `tool_call_id`) and the request's `tools`, as `apply_chat_template(messages,
    /// tools=...)` passes them to the template.
    pub fn render_json(&self, messages: &[Value], tools: Option<&Value>, add_generation_prompt: bool) -> Result<String, LoadError> {
        let (job, path) = self.job(messages, tools, add_generation_prompt)?;
        job.run().map_err(|e| LoadError::malformed(path, format!("chat template failed: {e}")))
    }

    /// What rendering `messages` takes, as data (so that another process can do it: the server
    /// renders in a sandbox process), and the template's file for errors.
    pub fn job(&self, messages: &[Value], tools: Option<&Value>, add_generation_prompt: bool) -> Result<(RenderJob, PathBuf), LoadError> {
        self.job_with(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// `job` with variables of the request's own for the template (`chat_template_kwargs`, e.g.
    /// `enable_thinking`); they never replace the ones `job` sets.
    pub fn job_with(
        &self,
        messages: &[Value],
        tools: Option<&Value>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<(RenderJob, PathBuf), LoadError> {
        let (Some(template), Some(path)) = (&self.template, &self.template_path) else {
            return Err(LoadError::malformed("tokenizer_config.json", "the model has no chat template"));
        };
        let job = RenderJob {
            template: template.clone(),
            messages: messages.to_vec(),
            tools: tools.cloned(),
            add_generation_prompt,
            bos_token: self.bos_token.clone(),
            eos_token: self.eos_token.clone(),
            extra: extra.clone(),
        };
        Ok((job, path.clone()))
    }

    /// Whether the template renders tool definitions and calls itself (it mentions `tools`);
    /// otherwise the server describes tools in a system message of its own.
    pub fn knows_tools(&self) -> bool {
        self.template.as_deref().is_some_and(|t| t.contains("tools") && t.contains("tool_call"))
    }
}

/// One render of a chat template: the template and everything it is given.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RenderJob {
    pub template: String,
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The request's own template variables (`chat_template_kwargs`).
    #[serde(default)]
    pub extra: serde_json::Map<String, Value>,
}

impl RenderJob {
    /// Renders in this process, under the fuel bound; the error as the template engine says it.
    pub fn run(&self) -> Result<String, String> {
        render_with(
            &self.template,
            &minijinja::value::Serde(&self.messages),
            self.tools.as_ref(),
            self.add_generation_prompt,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
            &self.extra,
        )
        .map_err(|e| e.to_string())
    }
}

/// `bos_token`/`eos_token` are a string or an AddedToken object with `content`.
fn special_token(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

pub fn render_template(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String, JinjaError> {
    render_with(template, &minijinja::value::Serde(messages), None, add_generation_prompt, bos_token, eos_token, &serde_json::Map::new())
}

fn render_with<M: serde::Serialize>(
    template: &str,
    messages: &minijinja::value::Serde<M>,
    tools: Option<&Value>,
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
    extra: &serde_json::Map<String, Value>,
) -> Result<String, JinjaError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    env.set_syntax(syntax);
    // A template is code from the checkpoint: bound the work and memory one render may use.
    let input_bytes =
        serde_json::to_string(&messages.0).map_or(0, |t| t.len()) + tools.map_or(0, |t| t.to_string().len()) + Value::Object(extra.clone()).to_string().len();
    env.set_fuel(Some(RENDER_FUEL + input_bytes as u64 / 8));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<JValue, JinjaError> { Err(JinjaError::new(ErrorKind::InvalidOperation, msg)) });
    env.add_function("strftime_now", |fmt: String| -> Result<JValue, JinjaError> {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        strftime_utc(&fmt, secs).map(JValue::from).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e))
    });
    env.add_filter("tojson", tojson_filter);
    let ctx = minijinja::context! {
        messages => JValue::from(minijinja::value::Serde(&messages.0)),
        tools => tools.map(|t| JValue::from(minijinja::value::Serde(t))),
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token.unwrap_or(""),
        eos_token => eos_token.unwrap_or(""),
        ..JValue::from(minijinja::value::Serde(extra))
    };
    env.render_str(template, ctx)
}

fn tojson_filter(value: JValue, kwargs: minijinja::value::Kwargs) -> Result<JValue, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut json = bounded_json(&value)?;
    if sort_keys == Some(true) {
        sort_json_keys(&mut json);
    }
    let seps = match separators.as_deref() {
        None => None,
        Some([item, key]) => Some((item.as_str(), key.as_str())),
        Some(_) => return Err(JinjaError::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair")),
    };
    let mut out = String::new();
    python_json_with(&json, indent, seps, 0, &mut out);
    Ok(JValue::from_safe_string(out))
}

/// `value` as JSON, refused once its text would pass `MAX_TOJSON_BYTES` (so a template's value
/// that holds another many times over costs at most that much to write).
fn bounded_json(value: &JValue) -> Result<Value, JinjaError> {
    struct Capped(Vec<u8>);
    impl std::io::Write for Capped {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.0.len() + buf.len() > MAX_TOJSON_BYTES {
                return Err(std::io::Error::other("too large"));
            }
            self.0.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut out = Capped(Vec::new());
    if serde_json::to_writer(&mut out, value).is_err() {
        let why =
            if out.0.len() + 4096 >= MAX_TOJSON_BYTES { format!("the value is over {MAX_TOJSON_BYTES} bytes as JSON") } else { "the value is not JSON".into() };
        return Err(JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {why}")));
    }
    serde_json::from_slice(&out.0).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

fn sort_json_keys(v: &mut Value) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = std::mem::take(map).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut item) in entries {
                sort_json_keys(&mut item);
                map.insert(k, item);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(sort_json_keys),
        _ => {}
    }
}

/// `time.strftime(fmt)` in UTC for the directives chat templates use (a date line); any other
/// directive is an error naming it, not a silently different string.
pub fn strftime_utc(fmt: &str, unix_secs: i64) -> Result<String, String> {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{:03}", doy_in_year(year, month, day))),
            Some('%') => out.push('%'),
            other => return Err(format!("strftime_now: unsupported directive %{}", other.map(String::from).unwrap_or_default())),
        }
    }
    Ok(out)
}

fn doy_in_year(year: i64, month: i64, day: i64) -> i64 {
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    CUM[(month - 1) as usize] + day + i64::from(leap && month > 2)
}

/// Writes `v` as Python's `json.dumps(v, ensure_ascii=False, indent=indent)` does.
pub fn python_json(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    python_json_with(v, indent, None, level, out)
}

/// `python_json` with explicit `separators=(item, key)`, as `json.dumps` takes them.
pub fn python_json_with(v: &Value, indent: Option<usize>, separators: Option<(&str, &str)>, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let (item_sep, key_sep) = separators.unwrap_or(if indent.is_some() { (",", ": ") } else { (", ", ": ") });
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                python_json_with(item, indent, separators, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(key_sep);
                python_json_with(item, indent, separators, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(0.0);
            // Python prints floats with a decimal point or exponent, shortest round-trip digits.
            if f.fract() == 0.0 && f.abs() < 1e16 {
                out.push_str(&format!("{f:.1}"));
            } else {
                out.push_str(&format!("{f}"));
            }
        }
        // Strings, empty containers, numbers, bools and null serialise as serde_json does, which
        // matches Python with ensure_ascii=False for all of them.
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_matches_json_dumps() {
        let v: Value = serde_json::from_str(r#"{"b": [1, 2.5, "é"], "a": {}, "c": null, "d": true, "e": 3.0}"#).unwrap();
        let mut s = String::new();
        python_json(&v, None, 0, &mut s);
        // json.dumps({"b": [1, 2.5, "é"], "a": {}, "c": None, "d": True, "e": 3.0}, ensure_ascii=False)
        assert_eq!(s, r#"{"b": [1, 2.5, "é"], "a": {}, "c": null, "d": true, "e": 3.0}"#);
        let mut s = String::new();
        python_json(&serde_json::json!({"a": [1]}), Some(2), 0, &mut s);
        assert_eq!(s, "{\n  \"a\": [\n    1\n  ]\n}");
    }

    #[test]
    fn strftime_matches_python() {
        // time.strftime("%d %b %Y %A %j %H:%M:%S", time.gmtime(1764374400 + 3723)) (2025-11-29 01:02:03 UTC)
        assert_eq!(strftime_utc("%d %b %Y %A %j %H:%M:%S", 1_764_374_400 + 3723).unwrap(), "29 Nov 2025 Saturday 333 01:02:03");
        assert_eq!(strftime_utc("%B %d, %y %%", 951_782_400).unwrap(), "February 29, 00 %"); // 2000-02-29
        assert_eq!(strftime_utc("%a %m/%d/%Y", 0).unwrap(), "Thu 01/01/1970");
        assert!(strftime_utc("%Z", 0).unwrap_err().contains("%Z"));
    }

    #[test]
    fn tojson_takes_json_dumps_keywords() {
        let t = "{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=true) }}|{{ {'b': 1} | tojson(separators=[',', ':']) }}|{{ {'x': 1} | tojson(indent=2) }}";
        let out = render_template(t, &[], false, None, None).unwrap();
        assert_eq!(out, "{\"a\": [1, 2], \"b\": 1}|{\"b\":1}|{\n  \"x\": 1\n}");
    }

    /// Values that grow while printed (a value holding another twice, 40 deep: 2^40 items
    /// reached from a few instructions) fail the render in this process — printed, turned into a
    /// string, joined or pretty-printed: the print budget the vendored minijinja charges per item
    /// stops the walk, where fuel alone let it run out of memory. (How long each takes is in
    /// `third_party/minijinja/SHIMMER-PATCH.md`; a time is no test's business.)
    #[test]
    fn values_that_grow_while_printed_run_out_of_fuel_in_process() {
        let doubling = |step: &str, init: &str, show: &str| {
            format!("{{% set ns = namespace(x={init}) %}}{{% for i in range(40) %}}{{% set ns.x = {step} %}}{{% endfor %}}{show}")
        };
        let cases = [
            doubling("dict(a=ns.x, b=ns.x)", "{}", "{{ ns.x }}"),
            doubling("[ns.x, ns.x]", "[1]", "{{ ns.x }}"),
            doubling("[ns.x, ns.x]", "[1]", "{{ ns.x|pprint }}"),
            doubling("[ns.x, ns.x]", "['long string']", "{{ ns.x|string|length }}"),
            doubling("[ns.x, ns.x]", "[1]", "{{ (ns.x ~ '')|length }}"),
            doubling("[ns.x, ns.x]", "[1]", "{{ ns.x|join(',')|length }}"),
            doubling("[ns.x, ns.x]", "[1]", "{% set s = ns.x|string %}done"),
        ];
        for t in &cases {
            let err = render_template(t, &[], false, None, None).expect_err(t);
            assert!(err.to_string().contains("fuel"), "{t}: {err}");
        }
        // Outside a render, printing is unlimited again.
        let big = minijinja::Value::from((0..20_000).collect::<Vec<u32>>());
        assert_eq!(big.to_string().matches(", ").count(), 19_999);
        // What ordinary templates print is untouched, and a later render has its full budget.
        let nested = "{% set x = [1, 'a', {'k': [2, 3]}] %}{{ x }}|{{ x|string|length }}|{{ [x, x]|join(';') }}";
        assert_eq!(render_template(nested, &[], false, None, None).unwrap(), "[1, 'a', {'k': [2, 3]}]|23|[1, 'a', {'k': [2, 3]}];[1, 'a', {'k': [2, 3]}]");
    }

    #[test]
    fn template_features_render_like_jinja2() {
        let t = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\n<|{{ m.role }}|>{{ m.content.strip() }}{% if loop.last %}{% break %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let msgs = [Message::new("system", "sys"), Message::new("user", "  hi  ")];
        let out = render_template(t, &msgs, true, Some("<s>"), None).unwrap();
        assert_eq!(out, "<s><|user|>hi<|assistant|>");
        let err = render_template("{{ raise_exception('nope') }}", &msgs, false, None, None).unwrap_err();
        assert!(err.to_string().contains("nope"));
    }
}
