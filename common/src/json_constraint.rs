//! JSON-schema-constrained generation: a schema (a documented subset of JSON Schema) compiled to
//! a character-level pushdown matcher. The server asks it, before each sampled token, which
//! tokens' text can extend the output, so what the model writes always parses as JSON and
//! validates against the schema (unless `max_tokens` cuts it short).
//!
//! Output is compact JSON: no whitespace outside strings, a schema object's properties in the
//! order the schema lists them, every listed property present (so `required` always holds).
//! Strings are at most `maxLength` characters (256 when the schema does not say), arrays at most
//! `maxItems` items (64), numbers at most 15 digits before and after the point — bounds that make
//! every value end.
//!
//! Supported keywords: `type` (one or a list), `properties`, `required`, `additionalProperties:
//! false`, `items`, `minItems`, `maxItems`, `minLength`, `maxLength`, `enum`, `const`, `anyOf`,
//! `oneOf` (alternatives must start with different characters), and the annotations `title`,
//! `description`, `default`, `examples`, `$schema`. Anything else is refused by name (a schema
//! keyword the output could break must not be ignored).
//!
//! Must never: accept a character that no valid continuation has, or end (`can_end`) where the
//! text so far is not a whole valid value. Size limits: schema text, nesting and node count.

use serde_json::Value;

pub const MAX_SCHEMA_BYTES: usize = 64 << 10;
const MAX_SCHEMA_DEPTH: usize = 32;
const MAX_NODES: usize = 4096;
/// Nesting of the output itself (free-form objects and arrays).
const MAX_STACK: usize = 64;
pub const DEFAULT_MAX_STRING: usize = 256;
pub const DEFAULT_MAX_ITEMS: usize = 64;
/// Characters the shortest output a schema allows may take: a schema demanding more (say
/// `minItems: 1000000000`) is refused, not accepted and cut off by `max_tokens`.
pub const MAX_MIN_OUTPUT: usize = 1 << 16;
const MAX_INT_DIGITS: usize = 15;
const MAX_FRAC_DIGITS: usize = 15;
// Two: with 15 digits before the point the largest is ~1e114, inside every parser's f64 range.
const MAX_EXP_DIGITS: usize = 2;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("schema at `{at}`: {problem}")]
pub struct SchemaError {
    pub at: String,
    pub problem: String,
}

fn err(at: &str, problem: impl Into<String>) -> SchemaError {
    SchemaError { at: if at.is_empty() { "/".into() } else { at.into() }, problem: problem.into() }
}

type NodeId = usize;

#[derive(Debug, Clone)]
enum Node {
    /// Any JSON value.
    Any,
    /// Properties in the schema's order, each written as `"name":` then its value; optional ones
    /// may be left out.
    Object {
        keys: Vec<String>,
        values: Vec<NodeId>,
        required: Vec<bool>,
    },
    /// Any keys, any values.
    FreeObject,
    Array {
        items: NodeId,
        min: usize,
        max: usize,
    },
    String {
        min: usize,
        max: usize,
    },
    Number {
        integer: bool,
    },
    /// Alternatives as canonical JSON text (`enum`, `const`, true/false/null).
    Literals(Vec<String>),
    /// Alternatives that start with different characters.
    Union(Vec<NodeId>),
    /// `prefix, value, suffix` alternatives told apart by their (prefix-free) prefixes: a tool
    /// call, `{"name":"N","arguments":` + N's arguments + `}`.
    Tagged(Vec<(String, NodeId, String)>),
}

const ANY: NodeId = 0;
/// `true`, `false`, `null`: the literals `Any` starts with t, f or n.
const ANY_LITERALS: NodeId = 1;

fn base_nodes() -> Vec<Node> {
    vec![Node::Any, Node::Literals(vec!["true".into(), "false".into(), "null".into()])]
}

#[derive(Debug, Clone)]
pub struct Schema {
    nodes: Vec<Node>,
    root: NodeId,
    /// Per node, the fewest characters a whole value of it takes.
    min_len: Vec<usize>,
}

impl Schema {
    /// `response_format: {"type": "json_object"}`: any JSON object.
    pub fn any_object() -> Schema {
        let mut nodes = base_nodes();
        nodes.push(Node::FreeObject);
        let mut s = Schema { root: nodes.len() - 1, nodes, min_len: Vec::new() };
        s.measure();
        s
    }

    /// One call of one of `tools` (name, parameters schema): `{"name":"N","arguments":ARGS}` with
    /// ARGS valid for N's parameters (an absent schema means any object).
    pub fn tool_call(tools: &[(String, Option<Value>)]) -> Result<Schema, SchemaError> {
        if tools.is_empty() {
            return Err(err("", "no tools to call"));
        }
        let mut s = Schema { nodes: base_nodes(), root: ANY, min_len: Vec::new() };
        let mut alts = Vec::with_capacity(tools.len());
        for (name, params) in tools {
            // Arguments are always an object: a schema that does not say (`{}`, `true`), like an
            // absent one, means any object.
            let args = match params.as_ref().map(|p| s.node(p, &format!("/{name}/parameters"), 0)).transpose()? {
                Some(id) if id != ANY => id,
                _ => s.push(Node::FreeObject, name)?,
            };
            if !s.first_chars(args).contains(&'{') || s.first_chars(args).len() != 1 {
                return Err(err(&format!("/{name}/parameters"), "a tool's parameters must be an object schema"));
            }
            alts.push((format!("{{\"name\":{},\"arguments\":", canonical(&Value::String(name.clone()))), args, "}".to_string()));
        }
        s.root = s.push(Node::Tagged(alts), "")?;
        s.measure();
        s.check_min_output()?;
        Ok(s)
    }

    pub fn compile(schema: &Value) -> Result<Schema, SchemaError> {
        let size = serde_json::to_string(schema).map(|s| s.len()).unwrap_or(usize::MAX);
        if size > MAX_SCHEMA_BYTES {
            return Err(err("", format!("the schema is {size} bytes; at most {MAX_SCHEMA_BYTES}")));
        }
        let mut s = Schema { nodes: base_nodes(), root: ANY, min_len: Vec::new() };
        s.root = s.node(schema, "", 0)?;
        s.measure();
        s.check_min_output()?;
        Ok(s)
    }

    fn check_min_output(&self) -> Result<(), SchemaError> {
        let shortest = self.min_len[self.root];
        if shortest > MAX_MIN_OUTPUT {
            return Err(err("", format!("the shortest output this schema allows is over {MAX_MIN_OUTPUT} characters (check minItems and minLength)")));
        }
        Ok(())
    }

    /// Fills `min_len`. A node's parts are always compiled (pushed) before it.
    fn measure(&mut self) {
        let mut m = vec![0usize; self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            m[i] = match n {
                Node::Any => 1, // `0`
                Node::Object { keys, values, required } => {
                    let req: Vec<usize> = (0..keys.len()).filter(|i| required[*i]).collect();
                    req.iter().fold(2 + req.len().saturating_sub(1), |acc, i| acc.saturating_add(keys[*i].len().saturating_add(m[values[*i]])))
                }
                Node::FreeObject => 2,
                Node::Array { items, min, .. } => min.saturating_mul(m[*items]).saturating_add(min.saturating_sub(1)).saturating_add(2),
                Node::String { min, .. } => min.saturating_add(2),
                Node::Number { .. } => 1,
                Node::Literals(ls) => ls.iter().map(|l| l.chars().count()).min().unwrap_or(0),
                Node::Union(ids) => ids.iter().map(|i| m[*i]).min().unwrap_or(0),
                Node::Tagged(alts) => alts.iter().map(|(p, v, x)| m[*v].saturating_add(p.chars().count() + x.chars().count())).min().unwrap_or(0),
            };
        }
        self.min_len = m;
    }

    fn push(&mut self, n: Node, at: &str) -> Result<NodeId, SchemaError> {
        if self.nodes.len() >= MAX_NODES {
            return Err(err(at, format!("more than {MAX_NODES} schema nodes")));
        }
        self.nodes.push(n);
        Ok(self.nodes.len() - 1)
    }

    fn node(&mut self, v: &Value, at: &str, depth: usize) -> Result<NodeId, SchemaError> {
        if depth > MAX_SCHEMA_DEPTH {
            return Err(err(at, format!("nested deeper than {MAX_SCHEMA_DEPTH}")));
        }
        let obj = match v {
            Value::Bool(true) => return Ok(ANY),
            Value::Object(o) => o,
            _ => return Err(err(at, "a schema must be an object or `true`")),
        };
        const KNOWN: &[&str] = &[
            "type",
            "properties",
            "required",
            "additionalProperties",
            "items",
            "minItems",
            "maxItems",
            "minLength",
            "maxLength",
            "enum",
            "const",
            "anyOf",
            "oneOf",
            "title",
            "description",
            "default",
            "examples",
            "$schema",
        ];
        if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(err(at, format!("`{k}` is not supported by constrained decoding")));
        }
        let usize_of = |k: &str| -> Result<Option<usize>, SchemaError> {
            match obj.get(k) {
                None => Ok(None),
                Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| err(at, format!("`{k}` must be a non-negative integer"))),
            }
        };
        if let Some(c) = obj.get("const") {
            return self.push(Node::Literals(vec![canonical(c)]), at);
        }
        if let Some(e) = obj.get("enum") {
            let Value::Array(vals) = e else { return Err(err(at, "`enum` must be a list")) };
            if vals.is_empty() {
                return Err(err(at, "`enum` is empty: nothing could validate"));
            }
            return self.push(Node::Literals(vals.iter().map(canonical).collect()), at);
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(alts) = obj.get(key) {
                let Value::Array(alts) = alts else { return Err(err(at, format!("`{key}` must be a list"))) };
                if alts.is_empty() {
                    return Err(err(at, format!("`{key}` is empty")));
                }
                let ids = alts.iter().enumerate().map(|(i, a)| self.node(a, &format!("{at}/{key}/{i}"), depth + 1)).collect::<Result<Vec<_>, _>>()?;
                return self.union(ids, at);
            }
        }
        let types: Vec<&str> = match obj.get("type") {
            None => return Ok(if obj.contains_key("properties") { self.object(obj, at, depth)? } else { ANY }),
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) if ts.is_empty() => return Err(err(at, "`type` is an empty list: nothing could validate")),
            Some(Value::Array(ts)) => {
                ts.iter().map(|t| t.as_str().ok_or_else(|| err(at, "`type` must be a string or a list of strings"))).collect::<Result<_, _>>()?
            }
            Some(_) => return Err(err(at, "`type` must be a string or a list of strings")),
        };
        let mut ids = Vec::new();
        for t in &types {
            let id = match *t {
                "object" => self.object(obj, at, depth)?,
                "array" => {
                    let items = match obj.get("items") {
                        None => ANY,
                        Some(i) => self.node(i, &format!("{at}/items"), depth + 1)?,
                    };
                    let (min, max) =
                        (usize_of("minItems")?.unwrap_or(0), usize_of("maxItems")?.unwrap_or(DEFAULT_MAX_ITEMS.max(usize_of("minItems")?.unwrap_or(0))));
                    if min > max {
                        return Err(err(at, "minItems > maxItems"));
                    }
                    self.push(Node::Array { items, min, max }, at)?
                }
                "string" => {
                    let (min, max) =
                        (usize_of("minLength")?.unwrap_or(0), usize_of("maxLength")?.unwrap_or(DEFAULT_MAX_STRING.max(usize_of("minLength")?.unwrap_or(0))));
                    if min > max {
                        return Err(err(at, "minLength > maxLength"));
                    }
                    self.push(Node::String { min, max }, at)?
                }
                "number" => self.push(Node::Number { integer: false }, at)?,
                "integer" => self.push(Node::Number { integer: true }, at)?,
                "boolean" => self.push(Node::Literals(vec!["true".into(), "false".into()]), at)?,
                "null" => self.push(Node::Literals(vec!["null".into()]), at)?,
                other => return Err(err(at, format!("unknown type `{other}`"))),
            };
            ids.push(id);
        }
        if ids.len() == 1 {
            Ok(ids[0])
        } else {
            self.union(ids, at)
        }
    }

    fn object(&mut self, obj: &serde_json::Map<String, Value>, at: &str, depth: usize) -> Result<NodeId, SchemaError> {
        let Some(props) = obj.get("properties") else {
            if let Some(Value::Array(r)) = obj.get("required") {
                if !r.is_empty() {
                    return Err(err(at, "`required` without `properties`"));
                }
            }
            return self.push(Node::FreeObject, at);
        };
        let Value::Object(props) = props else { return Err(err(at, "`properties` must be an object")) };
        match obj.get("additionalProperties") {
            None | Some(Value::Bool(false)) => {}
            Some(_) => {
                return Err(err(at, "only `additionalProperties: false` is supported with `properties` (the output holds exactly the listed properties)"))
            }
        }
        let mut required_names = Vec::new();
        if let Some(r) = obj.get("required") {
            let Value::Array(r) = r else { return Err(err(at, "`required` must be a list")) };
            for name in r {
                let Some(name) = name.as_str() else { return Err(err(at, "`required` must list names")) };
                if !props.contains_key(name) {
                    return Err(err(at, format!("`{name}` is required but not among the properties")));
                }
                required_names.push(name);
            }
        }
        let mut keys = Vec::with_capacity(props.len());
        let mut values = Vec::with_capacity(props.len());
        let mut required = Vec::with_capacity(props.len());
        for (name, sub) in props {
            keys.push(format!("{}:", canonical(&Value::String(name.clone()))));
            values.push(self.node(sub, &format!("{at}/properties/{name}"), depth + 1)?);
            required.push(required_names.contains(&name.as_str()));
        }
        self.push(Node::Object { keys, values, required }, at)
    }

    fn union(&mut self, ids: Vec<NodeId>, at: &str) -> Result<NodeId, SchemaError> {
        let mut seen = String::new();
        for id in &ids {
            for c in self.first_chars(*id) {
                if seen.contains(c) {
                    return Err(err(at, format!("alternatives that can both start with `{c}` are not supported (they must differ in JSON type)")));
                }
                seen.push(c);
            }
        }
        self.push(Node::Union(ids), at)
    }

    fn first_chars(&self, id: NodeId) -> Vec<char> {
        match &self.nodes[id] {
            Node::Any => "{[\"-0123456789tfn".chars().collect(),
            Node::Object { .. } | Node::FreeObject => vec!['{'],
            Node::Array { .. } => vec!['['],
            Node::String { .. } => vec!['"'],
            Node::Number { .. } => "-0123456789".chars().collect(),
            Node::Literals(ls) => {
                let mut cs: Vec<char> = ls.iter().filter_map(|l| l.chars().next()).collect();
                cs.sort_unstable();
                cs.dedup();
                cs
            }
            Node::Union(ids) => ids.iter().flat_map(|i| self.first_chars(*i)).collect(),
            Node::Tagged(_) => vec!['{'],
        }
    }
}

/// A value as the output writes it: compact JSON (object keys in their given order), every
/// non-ASCII character as a `\u` escape (a surrogate pair above U+FFFF). The matcher moves a
/// character at a time and the server offers tokens of whole characters, so a literal's `é` —
/// which a byte-level vocabulary may hold only as two partial-UTF-8 tokens — is written
/// `\u00e9`: the same JSON value, in characters every vocabulary has.
fn canonical(v: &Value) -> String {
    let text = serde_json::to_string(v).unwrap_or_default();
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum NumPart {
    Start,
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

#[derive(Debug, Clone)]
enum Frame {
    /// A value of this node, nothing of it read yet.
    Value(NodeId),
    /// A schema object. `prop`: the first property that may still come; `opened` once `{` is
    /// read; `first` until a property is written; `after_value` between a value and `,`/`}`;
    /// otherwise `key_pos` characters of a key are read, `alive[i]` for the keys still matching.
    Object {
        node: NodeId,
        prop: usize,
        opened: bool,
        first: bool,
        after_value: bool,
        key_pos: usize,
        alive: Vec<bool>,
    },
    /// A free object: `{`, then `"key":value` pairs.
    FreeObject {
        opened: bool,
        count: usize,
        stage: FreeStage,
    },
    Array {
        opened: bool,
        items: NodeId,
        min: usize,
        max: usize,
        count: usize,
        after_value: bool,
    },
    /// A string; `opened` once its quote is read.
    Str {
        opened: bool,
        len: usize,
        min: usize,
        max: usize,
        escape: Escape,
    },
    Num {
        integer: bool,
        part: NumPart,
        digits: usize,
    },
    /// Literal alternatives, `pos` characters in; `alive[i]`: alternative i still matches.
    Lit {
        node: NodeId,
        pos: usize,
        alive: Vec<bool>,
    },
    /// A tagged value: reading the prefixes (`chosen: None`, `pos` bytes in), or, once one is
    /// whole and its value read, `pos` bytes of its suffix.
    Tagged {
        node: NodeId,
        pos: usize,
        alive: Vec<bool>,
        chosen: Option<usize>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum FreeStage {
    /// After `{` or `,`: a key (or `}` right after `{`).
    Key,
    /// After the key: `:`.
    Colon,
    /// After a value: `,` or `}`.
    AfterValue,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Escape {
    None,
    Backslash,
    /// `\u` and this many hex digits; `d` if the first was `d`/`D` (then no surrogate: the
    /// second must be 0–7, as a lone surrogate is not valid JSON text to strict parsers).
    Hex(u8, bool),
}

enum Step {
    /// Consumed; the frame continues.
    Took,
    /// Consumed, and the frame's value is complete.
    Done,
    /// The frame's value was already complete; the character belongs to the parent.
    Pass,
    Reject,
}

/// Where a constrained generation stands: feed it the output's characters; ask it what may come.
#[derive(Debug, Clone)]
pub struct Matcher {
    schema: std::sync::Arc<Schema>,
    stack: Vec<Frame>,
}

impl Matcher {
    pub fn new(schema: std::sync::Arc<Schema>) -> Self {
        let root = schema.root;
        Matcher { schema, stack: vec![Frame::Value(root)] }
    }

    /// Whether the text so far is a whole value of the schema (generation may stop here).
    pub fn can_end(&self) -> bool {
        match self.stack.as_slice() {
            [] => true,
            [Frame::Num { part, .. }] => matches!(part, NumPart::Zero | NumPart::Int | NumPart::Frac | NumPart::Exp),
            [Frame::Lit { node, pos, alive }] => self.lit_complete(*node, *pos, alive),
            _ => false,
        }
    }

    /// The fewest characters that complete the value from here (0 when it may end now).
    pub fn min_to_finish(&self) -> usize {
        let ml = &self.schema.min_len;
        self.stack
            .iter()
            .map(|f| match f {
                Frame::Value(n) => ml[*n],
                Frame::Str { opened: false, min, .. } => min + 2,
                Frame::Str { len, min, escape, .. } => {
                    let pending = match escape {
                        Escape::None => 0,
                        Escape::Backslash => 1,
                        Escape::Hex(n, _) => 4 - *n as usize,
                    };
                    pending + min.saturating_sub(*len + usize::from(pending > 0)) + 1
                }
                Frame::Num { part, .. } => match part {
                    NumPart::Zero | NumPart::Int | NumPart::Frac | NumPart::Exp => 0,
                    _ => 1,
                },
                Frame::Lit { node, pos, alive } => match &self.schema.nodes[*node] {
                    Node::Literals(ls) => ls.iter().zip(alive).filter(|(_, a)| **a).map(|(l, _)| l[*pos..].chars().count()).min().unwrap_or(0),
                    _ => 0,
                },
                Frame::Object { node, prop, opened, first, after_value, key_pos, alive } => {
                    let Node::Object { keys, values, required } = &self.schema.nodes[*node] else { return 0 };
                    let prop_len = |i: usize| keys[i].len() + ml[values[i]];
                    // Required properties from `from` on, each with its comma.
                    let required_rest = |from: usize| (from..keys.len()).filter(|i| required[*i]).map(|i| 1 + prop_len(i)).sum::<usize>();
                    if !*opened {
                        ml[*node]
                    } else if *after_value {
                        required_rest(*prop) + 1
                    } else if *key_pos == 0 {
                        // Right after `{` (nothing needed if all is optional) or `,` (a property must follow).
                        let need = required_rest(*prop);
                        if need > 0 {
                            need - 1 + 1
                        } else if *first {
                            1
                        } else {
                            (*prop..keys.len()).map(prop_len).min().unwrap_or(0) + 1
                        }
                    } else {
                        (0..keys.len()).filter(|i| alive[*i]).map(|i| keys[i].len() - *key_pos + ml[values[i]] + required_rest(i + 1)).min().unwrap_or(0) + 1
                    }
                }
                Frame::Tagged { node, pos, alive, chosen } => match &self.schema.nodes[*node] {
                    Node::Tagged(alts) => match chosen {
                        Some(i) => alts[*i].2[*pos..].chars().count(),
                        None => (0..alts.len())
                            .filter(|i| alive[*i])
                            .map(|i| alts[i].0[*pos..].chars().count() + ml[alts[i].1] + alts[i].2.chars().count())
                            .min()
                            .unwrap_or(0),
                    },
                    _ => 0,
                },
                Frame::FreeObject { opened: false, .. } => 2,
                Frame::FreeObject { count, stage, .. } => match stage {
                    FreeStage::Key if *count == 0 => 1,
                    FreeStage::Key => 5,   // `"":0}`
                    FreeStage::Colon => 3, // `:0}` (the key's string counts itself)
                    FreeStage::AfterValue => 1,
                },
                Frame::Array { opened: false, items, min, .. } => 2 + min * ml[*items] + min.saturating_sub(1),
                Frame::Array { items, min, count, after_value, .. } => {
                    let item = ml[*items];
                    if *after_value {
                        min.saturating_sub(*count) * (1 + item) + 1
                    } else if *count == 0 {
                        min * item + min.saturating_sub(1) + 1
                    } else {
                        item + min.saturating_sub(*count + 1) * (1 + item) + 1
                    }
                }
            })
            .sum()
    }

    /// Whether nothing more can be written (the value is complete and cannot grow).
    pub fn is_finished(&self) -> bool {
        self.stack.is_empty()
    }

    /// Feeds `text`; false (and the matcher unchanged in meaning: drop it) if any character is
    /// not a valid continuation.
    pub fn feed(&mut self, text: &str) -> bool {
        text.chars().all(|c| self.advance(c))
    }

    /// Whether `text` can follow what was fed so far.
    pub fn accepts(&self, text: &str) -> bool {
        let mut m = self.clone();
        m.feed(text)
    }

    fn lit_complete(&self, node: NodeId, pos: usize, alive: &[bool]) -> bool {
        let Node::Literals(ls) = &self.schema.nodes[node] else { return false };
        ls.iter().zip(alive).any(|(l, a)| *a && l.len() == pos)
    }

    pub fn advance(&mut self, c: char) -> bool {
        loop {
            let Some(top) = self.stack.last_mut() else { return false };
            let step = match top {
                Frame::Value(node) => {
                    let node = *node;
                    match self.start(node, c) {
                        Some(frame) => {
                            self.stack.pop();
                            self.stack.push(frame);
                            // The first character of the new frame.
                            continue;
                        }
                        None => Step::Reject,
                    }
                }
                Frame::Str { opened, len, min, max, escape } => {
                    if *opened {
                        Self::string_step(c, len, *min, *max, escape)
                    } else if c == '"' {
                        *opened = true;
                        Step::Took
                    } else {
                        Step::Reject
                    }
                }
                Frame::Num { integer, part, digits } => Self::number_step(c, *integer, part, digits),
                Frame::Lit { node, pos, alive } => {
                    let Node::Literals(ls) = &self.schema.nodes[*node] else { return false };
                    let complete = ls.iter().zip(alive.iter()).any(|(l, a)| *a && l.len() == *pos);
                    let next: Vec<bool> = ls.iter().zip(alive.iter()).map(|(l, a)| *a && l[*pos..].starts_with(c)).collect();
                    if next.iter().any(|a| *a) {
                        *pos += c.len_utf8();
                        *alive = next;
                        let p = *pos;
                        let more = ls.iter().zip(alive.iter()).any(|(l, a)| *a && l.len() > p);
                        if more {
                            Step::Took
                        } else {
                            Step::Done
                        }
                    } else if complete {
                        Step::Pass
                    } else {
                        Step::Reject
                    }
                }
                Frame::Object { node, prop, opened, first, after_value, key_pos, alive } => {
                    let Node::Object { keys, values, required } = &self.schema.nodes[*node] else { return false };
                    let rest_optional = required[*prop..].iter().all(|r| !r);
                    // Keys that may come next: from `prop` up to the first required one.
                    let candidates = |prop: usize| -> Vec<bool> {
                        let last = (prop..keys.len()).find(|i| required[*i]).unwrap_or(keys.len().saturating_sub(1));
                        (0..keys.len()).map(|i| i >= prop && i <= last).collect()
                    };
                    if !*opened {
                        if c == '{' {
                            *opened = true;
                            *key_pos = 0;
                            *alive = candidates(*prop);
                            Step::Took
                        } else {
                            Step::Reject
                        }
                    } else if *after_value {
                        if c == ',' && *prop < keys.len() {
                            *after_value = false;
                            *key_pos = 0;
                            *alive = candidates(*prop);
                            Step::Took
                        } else if c == '}' && rest_optional {
                            Step::Done
                        } else {
                            Step::Reject
                        }
                    } else if *key_pos == 0 && *first && c == '}' && rest_optional {
                        Step::Done
                    } else {
                        let pos = *key_pos;
                        let next: Vec<bool> = keys.iter().zip(alive.iter()).map(|(k, a)| *a && k[pos..].starts_with(c)).collect();
                        if !next.iter().any(|a| *a) {
                            Step::Reject
                        } else {
                            *key_pos += c.len_utf8();
                            *alive = next;
                            // Keys end in `":` and so none is a prefix of another.
                            if let Some(i) = (0..keys.len()).find(|i| alive[*i] && keys[*i].len() == *key_pos) {
                                let value = values[i];
                                *prop = i + 1;
                                *first = false;
                                *after_value = true;
                                self.stack.push(Frame::Value(value));
                            }
                            Step::Took
                        }
                    }
                }
                Frame::Tagged { node, pos, alive, chosen } => {
                    let Node::Tagged(alts) = &self.schema.nodes[*node] else { return false };
                    match *chosen {
                        Some(i) => {
                            let suffix = &alts[i].2;
                            if suffix[*pos..].starts_with(c) {
                                *pos += c.len_utf8();
                                if *pos == suffix.len() {
                                    Step::Done
                                } else {
                                    Step::Took
                                }
                            } else {
                                Step::Reject
                            }
                        }
                        None => {
                            let p = *pos;
                            let next: Vec<bool> = alts.iter().zip(alive.iter()).map(|((prefix, _, _), a)| *a && prefix[p..].starts_with(c)).collect();
                            if !next.iter().any(|a| *a) {
                                Step::Reject
                            } else {
                                *pos += c.len_utf8();
                                *alive = next;
                                if let Some(i) = (0..alts.len()).find(|i| alive[*i] && alts[*i].0.len() == *pos) {
                                    *chosen = Some(i);
                                    *pos = 0;
                                    let value = alts[i].1;
                                    self.stack.push(Frame::Value(value));
                                }
                                Step::Took
                            }
                        }
                    }
                }
                Frame::FreeObject { opened: opened @ false, .. } => {
                    if c == '{' {
                        *opened = true;
                        Step::Took
                    } else {
                        Step::Reject
                    }
                }
                Frame::FreeObject { count, stage, .. } => match (*stage, c) {
                    (FreeStage::Key, '}') if *count == 0 => Step::Done,
                    (FreeStage::Key, '"') if *count < DEFAULT_MAX_ITEMS => {
                        *stage = FreeStage::Colon;
                        self.stack.push(Frame::Str { opened: true, len: 0, min: 0, max: DEFAULT_MAX_STRING, escape: Escape::None });
                        Step::Took
                    }
                    (FreeStage::Colon, ':') => {
                        *stage = FreeStage::AfterValue;
                        *count += 1;
                        if self.stack.len() >= MAX_STACK {
                            return false;
                        }
                        self.stack.push(Frame::Value(ANY));
                        Step::Took
                    }
                    (FreeStage::AfterValue, ',') if *count < DEFAULT_MAX_ITEMS => {
                        *stage = FreeStage::Key;
                        Step::Took
                    }
                    (FreeStage::AfterValue, '}') => Step::Done,
                    _ => Step::Reject,
                },
                Frame::Array { opened: opened @ false, .. } => {
                    if c == '[' {
                        *opened = true;
                        Step::Took
                    } else {
                        Step::Reject
                    }
                }
                Frame::Array { items, min, max, count, after_value, .. } => {
                    let (items, min, max) = (*items, *min, *max);
                    if *after_value {
                        match c {
                            ',' if *count < max => {
                                *after_value = false;
                                Step::Took
                            }
                            ']' if *count >= min => Step::Done,
                            _ => Step::Reject,
                        }
                    } else if *count == 0 && c == ']' && min == 0 {
                        Step::Done
                    } else if *count >= max {
                        Step::Reject
                    } else {
                        *count += 1;
                        *after_value = true;
                        if self.stack.len() >= MAX_STACK {
                            return false;
                        }
                        self.stack.push(Frame::Value(items));
                        continue; // the character starts the item
                    }
                }
            };
            match step {
                Step::Took => return true,
                Step::Done => {
                    self.stack.pop();
                    return true;
                }
                Step::Pass => {
                    self.stack.pop();
                    continue;
                }
                Step::Reject => return false,
            }
        }
    }

    /// The frame a value of `node` becomes when it starts with `c` (not yet consumed), if any.
    fn start(&self, node: NodeId, c: char) -> Option<Frame> {
        match &self.schema.nodes[node] {
            Node::Any => match c {
                '{' if self.stack.len() < MAX_STACK => Some(Frame::FreeObject { opened: false, count: 0, stage: FreeStage::Key }),
                '[' if self.stack.len() < MAX_STACK => {
                    Some(Frame::Array { opened: false, items: ANY, min: 0, max: DEFAULT_MAX_ITEMS, count: 0, after_value: false })
                }
                '"' => Some(Frame::Str { opened: false, len: 0, min: 0, max: DEFAULT_MAX_STRING, escape: Escape::None }),
                '-' | '0'..='9' => Some(Frame::Num { integer: false, part: NumPart::Start, digits: 0 }),
                't' | 'f' | 'n' => self.start(ANY_LITERALS, c),
                _ => None,
            },
            Node::Object { .. } => {
                (c == '{').then_some(Frame::Object { node, prop: 0, opened: false, first: true, after_value: false, key_pos: 0, alive: Vec::new() })
            }
            Node::FreeObject => (c == '{').then_some(Frame::FreeObject { opened: false, count: 0, stage: FreeStage::Key }),
            Node::Array { items, min, max } => {
                (c == '[').then_some(Frame::Array { opened: false, items: *items, min: *min, max: *max, count: 0, after_value: false })
            }
            Node::String { min, max } => (c == '"').then_some(Frame::Str { opened: false, len: 0, min: *min, max: *max, escape: Escape::None }),
            Node::Number { integer } => matches!(c, '-' | '0'..='9').then_some(Frame::Num { integer: *integer, part: NumPart::Start, digits: 0 }),
            Node::Literals(ls) => {
                let alive: Vec<bool> = ls.iter().map(|l| l.starts_with(c)).collect();
                alive.iter().any(|a| *a).then_some(Frame::Lit { node, pos: 0, alive: ls.iter().map(|_| true).collect() })
            }
            Node::Union(ids) => ids.iter().find(|i| self.schema.first_chars(**i).contains(&c)).and_then(|i| self.start(*i, c)),
            Node::Tagged(alts) => (c == '{').then(|| Frame::Tagged { node, pos: 0, alive: vec![true; alts.len()], chosen: None }),
        }
    }

    fn string_step(c: char, len: &mut usize, min: usize, max: usize, escape: &mut Escape) -> Step {
        match *escape {
            Escape::Backslash => {
                if c == 'u' {
                    *escape = Escape::Hex(0, false);
                    Step::Took
                } else if "\"\\/bfnrt".contains(c) {
                    *escape = Escape::None;
                    *len += 1;
                    Step::Took
                } else {
                    Step::Reject
                }
            }
            Escape::Hex(n, d) => {
                let surrogate = n == 1 && d && !('0'..='7').contains(&c);
                if c.is_ascii_hexdigit() && !surrogate {
                    if n == 3 {
                        *escape = Escape::None;
                        *len += 1;
                    } else {
                        *escape = Escape::Hex(n + 1, n == 0 && c.eq_ignore_ascii_case(&'d'));
                    }
                    Step::Took
                } else {
                    Step::Reject
                }
            }
            Escape::None => match c {
                '"' if *len >= min => Step::Done,
                '"' => Step::Reject,
                _ if *len >= max => Step::Reject,
                '\\' => {
                    *escape = Escape::Backslash;
                    Step::Took
                }
                c if (c as u32) < 0x20 => Step::Reject,
                _ => {
                    *len += 1;
                    Step::Took
                }
            },
        }
    }

    fn number_step(c: char, integer: bool, part: &mut NumPart, digits: &mut usize) -> Step {
        use NumPart::*;
        let digit = c.is_ascii_digit();
        let next = match (*part, c) {
            (Start, '-') => Some(Minus),
            // `-0` is a float to strict parsers: integers never start that way.
            (Minus, '0') if integer => None,
            (Start | Minus, '0') => Some(Zero),
            (Start | Minus, _) if digit => Some(Int),
            (Int, _) if digit && *digits < MAX_INT_DIGITS => Some(Int),
            (Zero | Int, '.') if !integer => Some(Dot),
            (Dot, _) if digit => Some(Frac),
            (Frac, _) if digit && *digits < MAX_FRAC_DIGITS => Some(Frac),
            (Zero | Int | Frac, 'e' | 'E') if !integer => Some(E),
            (E, '+' | '-') => Some(ESign),
            (E | ESign, _) if digit => Some(Exp),
            (Exp, _) if digit && *digits < MAX_EXP_DIGITS => Some(Exp),
            _ => None,
        };
        match next {
            Some(p) => {
                *digits = if p == *part { *digits + 1 } else { usize::from(digit) };
                *part = p;
                Step::Took
            }
            None if matches!(*part, Zero | Int | Frac | Exp) => Step::Pass,
            None => Step::Reject,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::Arc;

    fn matcher(schema: Value) -> Matcher {
        Matcher::new(Arc::new(Schema::compile(&schema).unwrap_or_else(|e| panic!("{e}"))))
    }

    /// A plain validator for the supported subset, written independently of the matcher.
    fn validates(s: &Value, v: &Value) -> bool {
        if s == &json!(true) || s == &json!({}) {
            return true;
        }
        if let Some(c) = s.get("const") {
            return c == v;
        }
        if let Some(Value::Array(e)) = s.get("enum") {
            return e.contains(v);
        }
        for k in ["anyOf", "oneOf"] {
            if let Some(Value::Array(alts)) = s.get(k) {
                let n = alts.iter().filter(|a| validates(a, v)).count();
                return if k == "oneOf" { n == 1 } else { n >= 1 };
            }
        }
        let types: Vec<&str> = match s.get("type") {
            Some(Value::String(t)) => vec![t],
            Some(Value::Array(ts)) => ts.iter().filter_map(|t| t.as_str()).collect(),
            _ => vec!["object"],
        };
        types.iter().any(|t| match (*t, v) {
            ("object", Value::Object(o)) => {
                let props = s.get("properties").and_then(Value::as_object);
                let required = s.get("required").and_then(Value::as_array).map_or(vec![], |r| r.iter().filter_map(|x| x.as_str()).collect());
                required.iter().all(|r| o.contains_key(*r))
                    && o.iter().all(|(k, x)| match props {
                        Some(p) => p.get(k).is_some_and(|ps| validates(ps, x)),
                        None => true,
                    })
            }
            ("array", Value::Array(a)) => {
                let min = s.get("minItems").and_then(Value::as_u64).unwrap_or(0) as usize;
                let max = s.get("maxItems").and_then(Value::as_u64).map_or(usize::MAX, |m| m as usize);
                a.len() >= min && a.len() <= max && a.iter().all(|x| s.get("items").is_none_or(|i| validates(i, x)))
            }
            ("string", Value::String(x)) => {
                let n = x.chars().count();
                n >= s.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize
                    && n <= s.get("maxLength").and_then(Value::as_u64).map_or(usize::MAX, |m| m as usize)
            }
            ("number", Value::Number(_)) => true,
            ("integer", Value::Number(n)) => n.is_i64() || n.is_u64(),
            ("boolean", Value::Bool(_)) => true,
            ("null", Value::Null) => true,
            _ => false,
        })
    }

    fn schemas() -> Vec<Value> {
        vec![
            json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}, "ok": {"type": "boolean"}}, "required": ["name", "age"]}),
            json!({"type": "object", "properties": {"kind": {"enum": ["cat", "dog", 3, null]}, "score": {"type": "number"}, "note": {"type": ["string", "null"], "maxLength": 8}}}),
            json!({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"x": {"const": "é\"\\"}}}]}, "minItems": 1, "maxItems": 4}),
            json!({"type": "object"}),
            json!(true),
            json!({"type": "object", "properties": {}}),
            json!({"type": "string", "minLength": 2, "maxLength": 3}),
        ]
    }

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: usize) -> usize {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % n
        }
    }

    #[test]
    fn every_random_walk_through_the_matcher_is_valid_json_of_the_schema() {
        let alphabet: Vec<char> = (0x20u8..0x7f).map(|b| b as char).chain(['é', '\n', '\u{1F600}']).collect();
        for (si, schema) in schemas().into_iter().enumerate() {
            for seed in 0..60u64 {
                let mut rng = Lcg(seed * 7919 + si as u64);
                let mut m = matcher(schema.clone());
                let mut text = String::new();
                for _ in 0..4000 {
                    if m.is_finished() || (m.can_end() && rng.next(8) == 0) {
                        break;
                    }
                    let ok: Vec<char> = alphabet.iter().copied().filter(|c| m.accepts(&c.to_string())).collect();
                    assert!(!ok.is_empty() || m.can_end(), "schema {si} seed {seed}: dead end after {text:?}");
                    if ok.is_empty() {
                        break;
                    }
                    let c = ok[rng.next(ok.len())];
                    assert!(m.advance(c));
                    text.push(c);
                }
                if !m.can_end() {
                    continue; // the step budget ran out mid-value (a long free-form walk)
                }
                let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("schema {si} seed {seed}: {text:?} does not parse: {e}"));
                assert!(validates(&schema, &v), "schema {si} seed {seed}: {text} does not validate against {schema}");
            }
        }
    }

    #[test]
    fn a_walk_that_always_moves_closer_finishes_within_the_promised_length() {
        // From any point of a random walk, taking characters that lower `min_to_finish` ends the
        // value in at most that many characters (what the server relies on near `max_tokens`).
        let alphabet: Vec<char> = (0x20u8..0x7f).map(|b| b as char).chain(['é']).collect();
        for (si, schema) in schemas().into_iter().enumerate() {
            for seed in 0..40u64 {
                let mut rng = Lcg(seed * 31 + si as u64);
                let mut m = matcher(schema.clone());
                let mut text = String::new();
                for _ in 0..rng.next(60) {
                    let ok: Vec<char> = alphabet.iter().copied().filter(|c| m.accepts(&c.to_string())).collect();
                    if ok.is_empty() || m.is_finished() {
                        break;
                    }
                    let c = ok[rng.next(ok.len())];
                    m.advance(c);
                    text.push(c);
                }
                let promised = m.min_to_finish();
                let mut steps = 0;
                while !m.can_end() {
                    let d = m.min_to_finish();
                    let c = alphabet.iter().copied().find(|c| {
                        let mut n = m.clone();
                        n.advance(*c) && n.min_to_finish() < d
                    });
                    let c = c.unwrap_or_else(|| panic!("schema {si} seed {seed}: no step closer from {text:?} (distance {d})"));
                    m.advance(c);
                    text.push(c);
                    steps += 1;
                }
                assert!(steps <= promised, "schema {si} seed {seed}: {steps} > {promised} for {text:?}");
                let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
                assert!(validates(&schema, &v), "{text}");
            }
        }
    }

    #[test]
    fn valid_texts_are_accepted_and_invalid_ones_refused() {
        let s = schemas().remove(0);
        let m = matcher(s.clone());
        assert!(m.accepts(r#"{"name":"Moses","age":120,"tags":["a","bc"],"ok":true}"#));
        let mut done = m.clone();
        assert!(done.feed(r#"{"name":"Moses","age":120,"tags":[],"ok":false}"#) && done.can_end() && done.is_finished());
        for bad in [
            r#"{"age":1"#,
            r#"{"name":"Moses","age":1.5"#,
            r#"{"name":"abcdefghijklmn"#,
            r#"{ "name""#,
            r#"{"name":"a","age":01"#,
            r#"{"name":"a","age":1,"tags":["a","b","c","d""#,
            "[",
            r#"{"name":"a\q"#,
        ] {
            assert!(!m.accepts(bad), "accepted {bad}");
        }
        let mut n = matcher(json!({"type": "number"}));
        assert!(n.feed("-12.5e+3") && n.can_end() && !n.is_finished());
        assert!(!matcher(json!({"type": "number"})).accepts("1.e5"));
        let mut e = matcher(json!({"enum": [1, 10, "x"]}));
        assert!(e.feed("1") && e.can_end() && e.accepts("0") && !e.accepts("2"));
        let o = Matcher::new(Arc::new(Schema::any_object()));
        assert!(o.accepts(r#"{"a":[1,{"b":null}],"c":"d"}"#) && !o.accepts("[") && !o.accepts("\"x\""));
    }

    #[test]
    fn a_tool_call_names_one_tool_and_gives_arguments_valid_for_it() {
        let tools = vec![
            ("get_weather".to_string(), Some(json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}))),
            ("get_time".to_string(), Some(json!({"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}))),
            ("ping".to_string(), None),
        ];
        let m = Matcher::new(Arc::new(Schema::tool_call(&tools).unwrap()));
        assert!(m.accepts(r#"{"name":"get_weather","arguments":{"city":"Ur"}}"#));
        assert!(m.accepts(r#"{"name":"get_time","arguments":{}}"#));
        assert!(m.accepts(r#"{"name":"ping","arguments":{"x":[1]}}"#));
        assert!(!m.accepts(r#"{"name":"get_time","arguments":{"city""#), "arguments of another tool");
        assert!(!m.accepts(r#"{"name":"nope""#));
        let mut done = m.clone();
        assert!(done.feed(r#"{"name":"get_time","arguments":{"zone":"CET"}}"#) && done.is_finished());
        // Random walks always end in a call of a listed tool with valid arguments.
        let alphabet: Vec<char> = (0x20u8..0x7f).map(|b| b as char).collect();
        for seed in 0..30u64 {
            let mut rng = Lcg(seed);
            let mut m = m.clone();
            let mut text = String::new();
            while !m.is_finished() && text.len() < 2000 {
                let ok: Vec<char> = alphabet.iter().copied().filter(|c| m.accepts(&c.to_string())).collect();
                let c = ok[rng.next(ok.len())];
                m.advance(c);
                text.push(c);
            }
            if !m.is_finished() {
                continue;
            }
            let v: Value = serde_json::from_str(&text).unwrap();
            let (name, args) = (v["name"].as_str().unwrap(), &v["arguments"]);
            let schema = tools.iter().find(|(n, _)| n == name).unwrap().1.clone().unwrap_or(json!({"type": "object"}));
            assert!(validates(&schema, args), "{text}");
        }
        assert!(Schema::tool_call(&[("x".into(), Some(json!({"type": "string"})))]).is_err());
    }

    #[test]
    fn unsupported_or_impossible_schemas_are_refused_by_name() {
        let cases = [
            (json!({"type": "string", "pattern": "a+"}), "pattern"),
            (json!({"$ref": "#/x"}), "$ref"),
            (json!({"anyOf": [{"type": "object"}, {"type": "object", "properties": {"a": true}}]}), "start with `{`"),
            (json!({"type": "object", "properties": {"a": true}, "additionalProperties": true}), "additionalProperties"),
            (json!({"type": "object", "properties": {"a": true}, "required": ["b"]}), "`b` is required"),
            (json!({"type": "stringy"}), "stringy"),
            (json!({"enum": []}), "empty"),
            (json!({"type": "array", "minItems": 3, "maxItems": 2}), "minItems"),
            (json!(42), "object"),
            (json!({"type": []}), "empty list"),
            (json!({"type": "object", "properties": {"a": {"type": []}}}), "empty list"),
            // Demands more than any answer could hold: refused, not cut off by max_tokens.
            (json!({"type": "array", "minItems": 1_000_000_000u64}), "shortest output"),
            (json!({"type": "string", "minLength": 1_000_000_000u64}), "shortest output"),
            (json!({"type": "array", "minItems": 300, "items": {"type": "array", "minItems": 300}}), "shortest output"),
            (json!({"type": "array", "minItems": u64::MAX, "items": {"type": "array", "minItems": u64::MAX}}), "shortest output"),
        ];
        for (schema, needle) in cases {
            let e = Schema::compile(&schema).expect_err(&schema.to_string()).to_string();
            assert!(e.contains(needle), "{schema}: {e}");
        }
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(Schema::compile(&deep).unwrap_err().to_string().contains("deeper"));
    }

    #[test]
    fn non_ascii_literals_are_written_as_escapes_that_parse_to_the_same_value() {
        let schema = json!({"type": "object", "properties": {"café": {"const": "naïve 日本 😀"}, "k": {"enum": ["ü", 1]}}, "required": ["café", "k"]});
        let mut m = matcher(schema.clone());
        let text = r#"{"caf\u00e9":"na\u00efve \u65e5\u672c \ud83d\ude00","k":"\u00fc"}"#;
        assert!(m.feed(text) && m.can_end(), "{text}");
        let v: Value = serde_json::from_str(text).unwrap();
        assert_eq!(v, json!({"café": "naïve 日本 😀", "k": "ü"}));
        assert!(validates(&schema, &v));
        // Every character the matcher offers along the way is ASCII.
        let mut m = matcher(schema);
        for c in text.chars() {
            assert!(c.is_ascii() && m.advance(c));
        }
    }

    #[test]
    fn a_tools_parameters_that_say_nothing_mean_any_object_as_an_absent_schema_does() {
        for params in [None, Some(json!({})), Some(json!(true)), Some(json!({"type": "object"}))] {
            let s = std::sync::Arc::new(Schema::tool_call(&[("f".into(), params.clone())]).unwrap());
            let mut m = Matcher::new(s.clone());
            assert!(m.feed(r#"{"name":"f","arguments":{"x":[1]}}"#) && m.can_end(), "{params:?}");
            assert!(!Matcher::new(s).feed(r#"{"name":"f","arguments":3"#), "{params:?}: arguments must be an object");
        }
    }
}
