//! Constrained decoding on `llguidance`: what a request may ask the output to be (JSON of a
//! schema, any JSON object, a regular expression, a Lark grammar, one of some strings, a call of
//! one of some tools), compiled against the model's vocabulary, and per sequence the state that
//! says which tokens may come next.
//!
//! The vocabulary is the tokenizer's exact bytes per token (`Tokenizer::vocabulary`), so a token
//! that ends inside a UTF-8 character is allowed wherever its bytes can continue the text: CJK
//! text and emoji can be written inside JSON strings. Special tokens are marked so no grammar
//! ever spells them; the end of text (any of the model's EOS ids) is allowed exactly where the
//! grammar is complete.
//!
//! A `Constraint`'s mask is a pure function of the tokens committed to it, so constrained
//! decoding stays deterministic; computing it is the costly part (a walk of the vocabulary's
//! trie), which is why `prepare` exists: the batcher calls it on another thread while the forward
//! pass runs, and sampling then takes the ready mask.
//!
//! Closing within the budget: beside the mask a constraint keeps a *plan*, bytes that complete
//! the grammar from where it stands (found by a bounded depth-first search over single-byte
//! tokens, closing characters first, on a copy of the matcher). Each byte of it is a token, so
//! the plan's length bounds the tokens the output still needs. While the plan fits the tokens
//! left, a token is allowed only if a plan still fits after it (`fits_after`); otherwise the
//! sequence follows its plan. So a JSON answer closes before `max_tokens` cuts it whenever the
//! budget can hold any whole answer — as shimmer's own JSON matcher did before llguidance.
//!
//! Must never: allow a token the grammar does not, or the end of text before the grammar is
//! complete; panic on a request's grammar (llguidance's errors and panics come back as
//! `GrammarError`); let one request's grammar or limits reach another's.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use shimmer_common::tokenizer::TokenBytes;

/// Largest grammar a request may give (its JSON schema, regex or Lark text), in bytes.
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;
/// Most strings a `choice` may list.
pub const MAX_CHOICES: usize = 1024;
/// Whitespace a JSON value may hold between two of its tokens: one space, or one line break and
/// up to 20 spaces or tabs of indentation — pretty-printing, never a run of blank lines
/// (llama.cpp's JSON grammars draw the same line; small models otherwise fill their budget with
/// newlines).
const JSON_WHITESPACE: &str = r"(?:\x20|\x0A[\x20\x09]{0,20})";

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (`response_format: json_object`).
    AnyObject,
    /// JSON valid against this schema (JSON Schema as Pydantic and OpenAI's clients emit it:
    /// `$ref`/`$defs`, `anyOf`, `pattern`, `format`, numeric and length bounds).
    JsonSchema(Value),
    /// Text the regular expression matches whole (Rust `regex` syntax).
    Regex(String),
    /// Text of a Lark grammar (llguidance's dialect: `start` is the whole output).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// One call `{"name": NAME, "arguments": ARGS}` of one of these tools, its arguments JSON
    /// valid against that tool's parameters (any object where it gives none).
    ToolCall(Vec<(String, Option<Value>)>),
    /// One call of one of these tools spelled as a family's chat format spells it (`CallShape`),
    /// its arguments valid against the tool's parameters.
    ShapedToolCall(Vec<(String, Option<Value>)>, Box<CallShape>),
}

/// How a chat format writes one tool call around the tool's name and its arguments. Each part is
/// a list of segments; a segment that is the text of one of the vocabulary's special tokens is
/// that token (as the model writes it), any other is literal text.
#[derive(Debug, Clone, PartialEq)]
pub struct CallShape {
    /// Once, before the call (a section's start).
    pub open: Vec<String>,
    pub before_name: Vec<String>,
    pub after_name: Vec<String>,
    pub arguments: ArgumentsShape,
    pub after_arguments: Vec<String>,
    /// Between two calls (a JSON array's comma).
    pub between: Vec<String>,
    /// Once, after the calls.
    pub close: Vec<String>,
    /// Most calls in one answer (at least one; more only where the format can hold several).
    pub most: usize,
}

/// How the arguments are written.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgumentsShape {
    /// One JSON object.
    Json,
    /// One pair per parameter, in the schema's order (required ones always, the others may be
    /// left out): `key_open NAME key_close value_open VALUE value_close`; a string parameter's
    /// value is its raw text (no `<`), any other its JSON.
    /// `json_key_close`: where a non-string value's key closes differently (DeepSeek's DSML
    /// says `string="false"` there).
    Pairs { key: [Vec<String>; 2], value: [Vec<String>; 2], json_key_close: Option<Vec<String>> },
}

impl CallShape {
    /// `{"name": NAME, "arguments": ARGS}`: shimmer's own format, for templates without one.
    pub fn json() -> CallShape {
        CallShape {
            open: vec![],
            before_name: vec!["{\"name\": \"".into()],
            after_name: vec!["\", \"arguments\": ".into()],
            arguments: ArgumentsShape::Json,
            after_arguments: vec!["}".into()],
            between: vec![],
            close: vec![],
            most: 1,
        }
    }

    fn bytes(&self) -> usize {
        let parts = [&self.open, &self.before_name, &self.after_name, &self.after_arguments, &self.between, &self.close];
        let pairs = match &self.arguments {
            ArgumentsShape::Json => 0,
            ArgumentsShape::Pairs { key, value, json_key_close } => key.iter().chain(value).chain(json_key_close).flatten().map(String::len).sum(),
        };
        parts.iter().flat_map(|p| p.iter()).map(String::len).sum::<usize>() + pairs
    }
}

impl Grammar {
    /// The size a request controls, bounded before anything is compiled.
    fn check_size(&self) -> Result<(), GrammarError> {
        let bytes = match self {
            Grammar::AnyObject => 0,
            Grammar::JsonSchema(v) => v.to_string().len(),
            Grammar::Regex(s) | Grammar::Lark(s) => s.len(),
            Grammar::Choice(c) => {
                if c.is_empty() || c.len() > MAX_CHOICES {
                    return Err(GrammarError(format!("a choice lists 1 to {MAX_CHOICES} strings, not {}", c.len())));
                }
                c.iter().map(String::len).sum()
            }
            Grammar::ToolCall(tools) => tools.iter().map(|(n, p)| n.len() + p.as_ref().map_or(0, |p| p.to_string().len())).sum(),
            Grammar::ShapedToolCall(tools, shape) => {
                shape.bytes() + tools.iter().map(|(n, p)| n.len() + p.as_ref().map_or(0, |p| p.to_string().len())).sum::<usize>()
            }
        };
        if bytes > MAX_GRAMMAR_BYTES {
            return Err(GrammarError(format!("the grammar is {bytes} bytes, over the {MAX_GRAMMAR_BYTES}-byte limit")));
        }
        Ok(())
    }

    /// `special`: the id of the special token with this text, if the vocabulary has one.
    fn to_llguidance(&self, special: &dyn Fn(&str) -> Option<u32>) -> Result<TopLevelGrammar, GrammarError> {
        self.check_size()?;
        Ok(match self {
            Grammar::AnyObject => TopLevelGrammar::from_json_schema(bounded_whitespace(json!({"type": "object"}))),
            Grammar::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError(format!("a JSON schema is an object (or true/false), not {schema}")));
                }
                TopLevelGrammar::from_json_schema(bounded_whitespace(schema.clone()))
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            Grammar::Choice(options) => {
                let alternatives: Vec<String> = options.iter().map(|o| lark_string(o)).collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alternatives.join(" | ")))
            }
            Grammar::ToolCall(tools) => TopLevelGrammar::from_lark(tool_call_lark(tools, &CallShape::json(), special)?),
            Grammar::ShapedToolCall(tools, shape) => TopLevelGrammar::from_lark(tool_call_lark(tools, shape, special)?),
        })
    }
}

/// Most calls one constrained answer may hold.
pub const MAX_CALLS: usize = 8;

/// The Lark text of one call of one of `tools`, spelled as `shape` says. Each tool's parameters
/// are a schema of their own (`%json`), so a `$ref` in one resolves against its own `$defs`.
fn tool_call_lark(tools: &[(String, Option<Value>)], shape: &CallShape, special: &dyn Fn(&str) -> Option<u32>) -> Result<String, GrammarError> {
    if tools.is_empty() {
        return Err(GrammarError("a tool call needs at least one tool".into()));
    }
    let seq = |parts: &[String]| -> String {
        parts.iter().filter(|p| !p.is_empty()).map(|p| special(p).map_or_else(|| lark_string(p), |id| format!("<[{id}]>"))).collect::<Vec<_>>().join(" ")
    };
    if shape.most == 0 || shape.most > MAX_CALLS {
        return Err(GrammarError(format!("an answer holds 1 to {MAX_CALLS} calls, not {}", shape.most)));
    }
    let calls = (0..tools.len()).map(|i| format!("call_{i}")).collect::<Vec<_>>().join(" | ");
    let more = format!(" ({} one)?", seq(&shape.between)).repeat(shape.most - 1);
    let mut rules = vec![format!("start: {} one{more} {}", seq(&shape.open), seq(&shape.close)), format!("one: {calls}")];
    for (i, (name, parameters)) in tools.iter().enumerate() {
        let schema = arguments_schema(parameters.as_ref());
        let mut args = format!("args_{i}");
        match &shape.arguments {
            ArgumentsShape::Json => rules.push(format!("args_{i}: %json {}", bounded_whitespace(schema))),
            ArgumentsShape::Pairs { key, value, json_key_close } => {
                let properties = schema.get("properties").and_then(Value::as_object).cloned().unwrap_or_default();
                let required: Vec<&str> =
                    schema.get("required").and_then(Value::as_array).map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
                let mut items = Vec::new();
                for (j, (param, param_schema)) in properties.iter().enumerate() {
                    rules.push(format!("value_{i}_{j}: {}", raw_value(param_schema)));
                    let is_string = param_schema.get("type").and_then(Value::as_str) == Some("string");
                    let key_close = match json_key_close {
                        Some(close) if !is_string => close,
                        _ => &key[1],
                    };
                    let pair = format!("{} {} {} {} value_{i}_{j} {}", seq(&key[0]), lark_string(param), seq(key_close), seq(&value[0]), seq(&value[1]));
                    items.push(if required.contains(&param.as_str()) { pair } else { format!("({pair})?") });
                }
                if items.is_empty() {
                    args.clear();
                } else {
                    rules.push(format!("args_{i}: {}", items.join(" ")));
                }
            }
        }
        rules.push(format!("call_{i}: {} {} {} {args} {}", seq(&shape.before_name), lark_string(name), seq(&shape.after_name), seq(&shape.after_arguments)));
    }
    Ok(rules.join("\n") + "\n")
}

/// A pair's value as Lark: a string parameter's raw text (no `<`, which starts the closing
/// marker) within its length bounds, or one of its enum's strings; any other parameter's JSON.
fn raw_value(schema: &Value) -> String {
    if schema.get("type").and_then(Value::as_str) != Some("string") {
        return format!("%json {}", bounded_whitespace(schema.clone()));
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        let texts: Vec<String> = options.iter().filter_map(Value::as_str).map(lark_string).collect();
        if !texts.is_empty() && texts.len() == options.len() {
            return texts.join(" | ");
        }
    }
    let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0).min(10_000);
    match schema.get("maxLength").and_then(Value::as_u64) {
        Some(max) => format!("/[^<]{{{min},{}}}/", max.clamp(min, 10_000)),
        None => format!("/[^<]{{{min},}}/"),
    }
}

/// A tool's arguments schema: its parameters, narrowed to objects (JSON Schema's keywords are
/// conjunctive, so `type: object` beside the others is their intersection with objects); no
/// parameters at all is OpenAI's function without parameters, an empty object. A call writes the
/// parameters the tool lists: where the schema lists `properties` and says nothing of
/// `additionalProperties`, others are not generated (as llama.cpp's JSON Schema grammars decide;
/// a schema listing none allows any object) — a model otherwise may invent keys whose free values
/// (numbers past f64, say) no tool could take.
fn arguments_schema(parameters: Option<&Value>) -> Value {
    match parameters {
        None => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        Some(Value::Object(p)) => {
            let mut p = p.clone();
            p.insert("type".into(), json!("object"));
            if p.contains_key("properties") {
                p.entry("additionalProperties").or_insert(json!(false));
            }
            Value::Object(p)
        }
        Some(_) => json!({"type": "object"}),
    }
}

/// `s` as a Lark string literal.
fn lark_string(s: &str) -> String {
    // A JSON string literal is a Lark one (same escapes).
    serde_json::to_string(s).unwrap_or_default()
}

/// `schema` with whitespace between its tokens bounded (`JSON_WHITESPACE`), unless the request
/// set llguidance's own options (`x-guidance`).
fn bounded_whitespace(mut schema: Value) -> Value {
    if let Some(map) = schema.as_object_mut() {
        if !map.contains_key("x-guidance") {
            map.insert("x-guidance".into(), json!({ "whitespace_flexible": true, "whitespace_pattern": JSON_WHITESPACE }));
        }
    }
    schema
}

/// Most bytes a plan may hold, and most steps its search may take (each a try of one byte).
const MAX_PLAN_BYTES: usize = 1024;
const MAX_PLAN_STEPS: usize = 8192;
/// Bytes the search follows at most from one place (the first that the grammar takes, in
/// `plan_byte_order`): free text and numbers take almost any byte, and following each would
/// make the search exponential where a closing byte is what ends them.
const PLAN_BRANCHES: usize = 3;

/// The order the plan's search tries bytes in: what closes JSON first (quotes, brackets,
/// separators, the shortest values), then the rest of printable ASCII, then every other byte.
fn plan_byte_order() -> Vec<u8> {
    let first = b"\"}],:0nultrefas 123456789";
    let mut order: Vec<u8> = first.to_vec();
    order.extend((0x20..0x7f).filter(|b| !first.contains(b)));
    order.extend((0..=255u8).filter(|b| !(0x20..0x7f).contains(b)));
    order
}

/// The model's vocabulary as llguidance reads it, and the compiler that holds it. Built once
/// per model; shared by every request.
pub struct Vocabulary {
    factory: ParserFactory,
    shared: Arc<Shared>,
}

/// What every constraint of one vocabulary reads.
struct Shared {
    env: TokEnv,
    size: usize,
    /// The token of each single byte, where the vocabulary has one (the plan's steps).
    byte_tokens: Vec<Option<u32>>,
    order: Vec<u8>,
    /// Special tokens (and end-of-text ones) by their text: a `CallShape` segment equal to one is
    /// written as that token.
    specials: std::collections::HashMap<Vec<u8>, u32>,
}

struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Only used to spell fixed text as tokens; greedy is enough, as shimmer never forces
    /// tokens (every token is sampled under the mask).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

impl Vocabulary {
    /// `tokens` by id (the tokenizer's), for a model with `logits` outputs (ids past the
    /// tokenizer's are never allowed; the tokenizer's past the model's never exist) and these
    /// end-of-text ids.
    pub fn new(tokens: &[TokenBytes], logits: usize, eos: &[u32]) -> Result<Vocabulary, GrammarError> {
        let size = u32::try_from(logits).map_err(|_| GrammarError(format!("a vocabulary of {logits} tokens is too large")))?;
        let words: Vec<Vec<u8>> = (0..logits)
            .map(|id| match tokens.get(id) {
                Some(t) if t.special || eos.contains(&(id as u32)) => {
                    // llguidance's marker: a special token is never text.
                    let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    b.extend_from_slice(&t.bytes);
                    b
                }
                Some(t) => t.bytes.clone(),
                None => Vec::new(),
            })
            .collect();
        let eos: Vec<u32> = eos.iter().copied().filter(|&e| (e as usize) < logits).collect();
        let Some(&first_eos) = eos.first() else {
            return Err(GrammarError(format!("the model names no end-of-text id below its {logits} logits")));
        };
        let trie = std::panic::catch_unwind(|| TokTrie::from(&TokRxInfo::new(size, first_eos), &words).with_eos_tokens(&eos))
            .map_err(|_| GrammarError("the vocabulary cannot be indexed for constrained decoding".into()))?;
        let mut specials = std::collections::HashMap::new();
        for (id, w) in words.iter().enumerate() {
            if let Some((&TokTrie::SPECIAL_TOKEN_MARKER, text)) = w.split_first() {
                specials.entry(text.to_vec()).or_insert(id as u32);
            }
        }
        let mut byte_tokens = vec![None; 256];
        for (id, w) in words.iter().enumerate() {
            if let [b] = w.as_slice() {
                byte_tokens[*b as usize].get_or_insert(id as u32);
            }
        }
        let env: TokEnv = Arc::new(Env { trie });
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &llguidance::earley::SlicedBiasComputer::general_slices())
            .map_err(|e| GrammarError(format!("cannot prepare the vocabulary for constrained decoding: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits { verbose_errors: false, ..ParserLimits::default() };
        Ok(Vocabulary { factory, shared: Arc::new(Shared { env, size: logits, byte_tokens, order: plan_byte_order(), specials }) })
    }

    /// A fresh constraint for `grammar`: compiling it is where a bad or unsupported grammar is
    /// refused, naming the problem.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint, GrammarError> {
        let specials = &self.shared.specials;
        let top = grammar.to_llguidance(&|text: &str| specials.get(text.as_bytes()).copied())?;
        let parser = self.factory.create_parser(top).map_err(|e| GrammarError(clean(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError(clean(&e)));
        }
        Ok(Constraint { matcher, mask: None, plan: None, plan_retry: 0, shared: self.shared.clone() })
    }
}

/// llguidance's message on one line, at most 600 bytes of it.
fn clean(message: &str) -> String {
    let mut line = message.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > 600 {
        let mut end = 600;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push('…');
    }
    line
}

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the next token, when computed ahead (`prepare`).
    mask: Option<Result<SimpleVob, GrammarError>>,
    /// Bytes that complete the grammar from here, when known (`None`: not searched yet, or
    /// none was found within the search's bounds).
    plan: Option<Vec<u8>>,
    /// Tokens to commit before searching again, after a search that found nothing (a grammar
    /// whose shortest completion is long costs the whole search every time).
    plan_retry: usize,
    shared: Arc<Shared>,
}

/// How far from the end of its budget a sequence starts checking its tokens (`near_end`).
pub const CLOSING_WINDOW: usize = 512;

/// Tokens between searches for a plan while none is found.
const PLAN_RETRY_TOKENS: usize = 32;

impl Constraint {
    /// Computes the next token's mask and the plan now, so that `allowed` finds them ready (run
    /// beside the forward pass). Nothing is computed twice.
    pub fn prepare(&mut self) {
        if self.mask.is_none() {
            self.mask = Some(self.compute());
        }
        if self.plan.is_none() && self.plan_retry == 0 {
            self.plan = self.search_plan(None, MAX_PLAN_BYTES);
            if self.plan.is_none() {
                self.plan_retry = PLAN_RETRY_TOKENS;
            }
        }
    }

    fn compute(&mut self) -> Result<SimpleVob, GrammarError> {
        let matcher = &mut self.matcher;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| matcher.compute_mask_or_eos())) {
            Ok(mask) => mask.map_err(|e| GrammarError(clean(&e.to_string()))),
            Err(_) => Err(GrammarError("the grammar's matcher failed computing the next token's mask".into())),
        }
    }

    /// Which tokens may come next (the model's EOS ids where the grammar is complete).
    pub fn allowed(&mut self) -> Result<Allowed, GrammarError> {
        let mask = match self.mask.take() {
            Some(m) => m?,
            None => self.compute()?,
        };
        Ok(Allowed { mask, size: self.shared.size })
    }

    /// Bytes that complete the grammar after `first` (a token) from here, at most `limit` of
    /// them: a depth-first search over single-byte tokens on a copy of the matcher.
    fn search_plan(&self, first: Option<u32>, limit: usize) -> Option<Vec<u8>> {
        let mut m = self.matcher.clone();
        if let Some(t) = first {
            if m.try_consume_tokens(&[t]).ok()? != 1 {
                return None;
            }
        }
        let mut path = Vec::new();
        let mut steps = 0usize;
        let found = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.extend_plan(&mut m, &mut path, limit, &mut steps))).unwrap_or(false);
        found.then_some(path)
    }

    fn extend_plan(&self, m: &mut Matcher, path: &mut Vec<u8>, limit: usize, steps: &mut usize) -> bool {
        if m.is_stopped() || m.is_accepting().unwrap_or(false) {
            return !m.is_error();
        }
        if path.len() >= limit {
            return false;
        }
        // Bytes the grammar forces (a required key's name, a constant) are taken whole: there is
        // nothing else to try.
        let forced = m.compute_ff_bytes();
        if !forced.is_empty() {
            let mut taken = 0;
            for &b in forced.iter().take(limit - path.len()) {
                let Some(t) = self.shared.byte_tokens[b as usize] else { break };
                *steps += 1;
                if m.try_consume_tokens(&[t]).ok() != Some(1) {
                    break;
                }
                path.push(b);
                taken += 1;
            }
            if taken == forced.len() && self.extend_plan(m, path, limit, steps) {
                return true;
            }
            path.truncate(path.len() - taken);
            if m.rollback(taken).is_err() {
                // The copy cannot go back: end the search.
                *steps = MAX_PLAN_STEPS;
            }
            return false;
        }
        let mut branches = 0;
        for &b in &self.shared.order {
            let Some(t) = self.shared.byte_tokens[b as usize] else { continue };
            if *steps >= MAX_PLAN_STEPS || branches == PLAN_BRANCHES {
                return false;
            }
            *steps += 1;
            if m.try_consume_tokens(&[t]).ok() == Some(1) {
                branches += 1;
                path.push(b);
                if self.extend_plan(m, path, limit, steps) {
                    return true;
                }
                path.pop();
                if m.rollback(1).is_err() {
                    *steps = MAX_PLAN_STEPS;
                    return false;
                }
            }
        }
        false
    }

    /// The plan, when one is known: bytes that complete the grammar from here.
    pub fn plan(&self) -> Option<&[u8]> {
        self.plan.as_deref()
    }

    /// Whether, with `left` tokens left, each token must be checked against closing in time
    /// (`fits_after`): when a plan is known and the budget is within `CLOSING_WINDOW` of it. One
    /// token can open structure whose closing takes many bytes (an object's required keys), so
    /// the window is wide; outside it nothing is checked.
    pub fn near_end(&self, left: usize) -> bool {
        self.plan.as_ref().is_some_and(|plan| left <= plan.len() + CLOSING_WINDOW)
    }

    /// Whether, after `token`, a plan of at most `budget` bytes completes the grammar. A token
    /// that follows the plan keeps what is left of it; any other is searched for on a copy (the
    /// plan found is kept for `commit`).
    pub fn fits_after(&mut self, token: u32, budget: usize) -> bool {
        if self.shared.env.tok_trie().eos_tokens().contains(&token) {
            return true;
        }
        let bytes = self.shared.env.tok_trie().token(token).to_vec();
        if let Some(plan) = &self.plan {
            if !bytes.is_empty() && plan.starts_with(&bytes) && plan.len() - bytes.len() <= budget {
                return true;
            }
        }
        match self.search_plan(Some(token), budget) {
            Some(p) => {
                // Kept with the token it was found for (`commit` takes the token's bytes off).
                self.plan = Some([bytes, p].concat());
                true
            }
            None => false,
        }
    }

    /// The tokens that follow the plan (a prefix of its bytes), for when nothing else fits.
    pub fn plan_tokens(&self) -> Option<Allowed> {
        let plan = self.plan.as_ref()?;
        let mut mask = SimpleVob::alloc(self.shared.size);
        for t in self.shared.env.tok_trie().all_prefixes(plan) {
            if (t as usize) < self.shared.size {
                mask.allow_token(t);
            }
        }
        (mask.num_set() > 0).then_some(Allowed { mask, size: self.shared.size })
    }

    /// Moves past `token` (one the mask allowed).
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        self.mask = None;
        self.plan_retry = self.plan_retry.saturating_sub(1);
        let bytes = self.shared.env.tok_trie().token(token);
        self.plan = match self.plan.take() {
            Some(plan) if !bytes.is_empty() && plan.starts_with(bytes) => Some(plan[bytes.len()..].to_vec()),
            _ => None,
        };
        let matcher = &mut self.matcher;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| matcher.consume_token(token))) {
            Ok(done) => done.map_err(|e| GrammarError(clean(&e.to_string()))),
            Err(_) => Err(GrammarError(format!("the grammar's matcher failed taking token {token}"))),
        }
    }

    /// Whether the grammar is complete and nothing may follow (the output is whole).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// A mask over the model's logits.
pub struct Allowed {
    mask: SimpleVob,
    size: usize,
}

impl Allowed {
    pub fn contains(&self, token: usize) -> bool {
        token < self.size && token < self.mask.len() && self.mask.get(token)
    }

    /// Sets every logit the mask forbids to −∞; whether any finite logit is left.
    pub fn apply(&self, logits: &mut [f32]) -> bool {
        let mut any = false;
        for (t, l) in logits.iter_mut().enumerate() {
            if self.contains(t) {
                any |= l.is_finite();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        any
    }

    pub fn count(&self) -> usize {
        self.mask.num_set()
    }

    /// The lowest id allowed (0 when none is).
    pub fn first(&self) -> u32 {
        self.mask.first_bit_set().map_or(0, |t| t as u32)
    }
}

#[cfg(test)]
mod tests;
