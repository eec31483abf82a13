//! The constraint against a small vocabulary of its own: every byte, some words, a token that
//! ends inside a UTF-8 character, specials and two end-of-text ids.

use super::*;

const EOS: [u32; 2] = [300, 301];

/// Ids 0–255: the bytes; then words; 300/301 end of text; 302 a special; 303–309 padding.
fn vocabulary() -> Vocabulary {
    let mut tokens: Vec<TokenBytes> = (0..=255u8).map(|b| TokenBytes { bytes: vec![b], special: false }).collect();
    let words: &[&[u8]] = &[b"{\"", b"\":", b"name", b"true", b"\xe4\xb8", b"\xad\xe6\x96\x87", b"\", \"", b"  ", b"\n"];
    tokens.extend(words.iter().map(|w| TokenBytes { bytes: w.to_vec(), special: false }));
    tokens.resize(300, TokenBytes::default());
    tokens.push(TokenBytes { bytes: b"<|end|>".to_vec(), special: true });
    tokens.push(TokenBytes { bytes: b"<|eot|>".to_vec(), special: true });
    tokens.push(TokenBytes { bytes: b"<|im_start|>".to_vec(), special: true });
    Vocabulary::new(&tokens, 310, &EOS).expect("vocabulary")
}

fn id_of(bytes: &[u8]) -> u32 {
    if bytes.len() == 1 {
        return bytes[0] as u32;
    }
    let words: &[&[u8]] = &[b"{\"", b"\":", b"name", b"true", b"\xe4\xb8", b"\xad\xe6\x96\x87", b"\", \"", b"  ", b"\n"];
    256 + words.iter().position(|w| *w == bytes).expect("a word of the test vocabulary") as u32
}

/// Feeds `tokens`, each of which must be allowed; returns whether the end may come next.
fn feed(c: &mut Constraint, tokens: &[u32]) -> bool {
    for &t in tokens {
        let allowed = c.allowed().expect("mask");
        assert!(allowed.contains(t as usize), "token {t} should be allowed");
        c.commit(t).expect("commit");
    }
    let allowed = c.allowed().expect("mask");
    allowed.contains(EOS[0] as usize)
}

fn bytes_of(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Samples allowed tokens with a small deterministic generator (never the end while anything
/// else is allowed, until `min_len` bytes) until the grammar is complete; the text.
fn walk(c: &mut Constraint, seed: u64, min_len: usize) -> String {
    let mut state = seed;
    let mut out = Vec::new();
    for _ in 0..2000 {
        if c.is_finished() {
            break;
        }
        let allowed = c.allowed().expect("mask");
        let choices: Vec<usize> = (0..310).filter(|&t| allowed.contains(t)).collect();
        assert!(!choices.is_empty(), "a grammar that is not finished allows some token");
        let ends = choices.iter().any(|t| EOS.contains(&(*t as u32)));
        let text: Vec<usize> = choices.iter().copied().filter(|t| !EOS.contains(&(*t as u32))).collect();
        if ends && (text.is_empty() || out.len() >= min_len) {
            break;
        }
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let t = text[(state >> 33) as usize % text.len()];
        assert!(t < 300, "a special token was allowed: {t}");
        out.extend(if t < 256 { vec![t as u8] } else { tokens_bytes(t) });
        c.commit(t as u32).expect("commit");
    }
    String::from_utf8(out).expect("the constrained text is UTF-8")
}

fn tokens_bytes(t: usize) -> Vec<u8> {
    let words: &[&[u8]] = &[b"{\"", b"\":", b"name", b"true", b"\xe4\xb8", b"\xad\xe6\x96\x87", b"\", \"", b"  ", b"\n"];
    words[t - 256].to_vec()
}

#[test]
fn a_token_inside_a_utf8_character_continues_a_json_string() {
    let v = vocabulary();
    let mut c = v.compile(&Grammar::JsonSchema(json!({"type": "string"}))).unwrap();
    // `"` then 中 split across two tokens (the second also starts 文), then `"`.
    let done = feed(&mut c, &[b'"' as u32, id_of(b"\xe4\xb8"), id_of(b"\xad\xe6\x96\x87"), b'"' as u32]);
    assert!(done, "a whole string may end");
    let mut c = v.compile(&Grammar::JsonSchema(json!({"type": "string"}))).unwrap();
    feed(&mut c, &[b'"' as u32, id_of(b"\xe4\xb8")]);
    let allowed = c.allowed().unwrap();
    assert!(!allowed.contains(b'"' as usize), "a string cannot close inside a character");
    assert!(!allowed.contains(EOS[0] as usize));
}

#[test]
fn the_end_comes_only_where_the_value_is_whole_and_specials_never() {
    let v = vocabulary();
    let mut c = v.compile(&Grammar::AnyObject).unwrap();
    let allowed = c.allowed().unwrap();
    assert!(!allowed.contains(EOS[0] as usize) && !allowed.contains(EOS[1] as usize));
    assert!(!allowed.contains(302), "a special token is never text");
    assert!(!allowed.contains(305), "ids past the tokenizer are never allowed");
    assert!(allowed.contains(id_of(b"{\"") as usize));
    assert!(!feed(&mut c, &bytes_of("{\"a\": 1")));
    assert!(feed(&mut c, &bytes_of("}")));
    let allowed = c.allowed().unwrap();
    assert!(allowed.contains(EOS[1] as usize), "every end-of-text id ends it");
    assert!(c.is_finished() || !allowed.contains(b'x' as usize));
}

#[test]
fn pydantic_style_schemas_with_refs_anyof_pattern_and_format() {
    // As Pydantic 2 emits `class Order(BaseModel): id: Annotated[str, Field(pattern=...)];
    // item: Item; note: Optional[str]; when: datetime; qty: conint(ge=1, le=9)` with
    // `extra="forbid"`.
    let schema = json!({
        "$defs": {"Item": {"properties": {"name": {"title": "Name", "type": "string", "maxLength": 6}, "tag": {"enum": ["a", "b"], "title": "Tag", "type": "string"}}, "required": ["name", "tag"], "title": "Item", "type": "object", "additionalProperties": false}},
        "properties": {
            "id": {"pattern": "^[A-Z]{2}[0-9]{3}$", "title": "Id", "type": "string"},
            "item": {"$ref": "#/$defs/Item"},
            "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}], "default": null, "title": "Note"},
            "when": {"format": "date-time", "title": "When", "type": "string"},
            "qty": {"maximum": 9, "minimum": 1, "title": "Qty", "type": "integer"}
        },
        "required": ["id", "item", "when", "qty"],
        "additionalProperties": false,
        "title": "Order",
        "type": "object"
    });
    let v = vocabulary();
    for seed in 0..12 {
        let mut c = v.compile(&Grammar::JsonSchema(schema.clone())).unwrap();
        let text = walk(&mut c, seed, 0);
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        let id = value["id"].as_str().unwrap();
        assert!(id.len() == 5 && id[..2].chars().all(|c| c.is_ascii_uppercase()) && id[2..].chars().all(|c| c.is_ascii_digit()), "{text}");
        assert!(value["item"]["name"].as_str().unwrap().chars().count() <= 6, "{text}");
        assert!(["a", "b"].contains(&value["item"]["tag"].as_str().unwrap()), "{text}");
        assert!(value.get("note").is_none_or(|n| n.is_null() || n.as_str().is_some_and(|s| s.chars().count() <= 4)), "{text}");
        let when = value["when"].as_str().unwrap();
        assert!(when.len() >= 20 && when.as_bytes()[4] == b'-' && when.as_bytes()[10].eq_ignore_ascii_case(&b'T'), "a date-time: {when}");
        assert!((1..=9).contains(&value["qty"].as_i64().unwrap()), "{text}");
    }
}

#[test]
fn a_tool_call_names_one_tool_and_its_arguments_follow_its_own_schema() {
    let v = vocabulary();
    let weather = json!({"$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}}, "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"], "type": "object"});
    let tools = vec![("weather".to_string(), Some(weather)), ("time".to_string(), None)];
    let mut names = std::collections::BTreeSet::new();
    for seed in 0..16 {
        let mut c = v.compile(&Grammar::ToolCall(tools.clone())).unwrap();
        let text = walk(&mut c, seed, 0);
        assert!(text.starts_with("{\"name\": \""), "{text}");
        let call: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            // Valid JSON serde_json will not hold (an exponent past f64's range): the grammar
            // allows every JSON number, as it should.
            Err(e) if e.to_string().contains("out of range") => continue,
            Err(e) => panic!("{text:?}: {e}"),
        };
        let name = call["name"].as_str().unwrap().to_string();
        match name.as_str() {
            "weather" => {
                assert!(["c", "f"].contains(&call["arguments"]["unit"].as_str().unwrap()), "{text}");
                // Only the listed parameters: the schema does not allow others.
                assert!(call["arguments"].as_object().unwrap().keys().all(|k| k == "unit"), "{text}");
            }
            "time" => assert!(call["arguments"].is_object(), "{text}"),
            other => panic!("a tool nobody listed: {other}"),
        }
        names.insert(name);
    }
    assert_eq!(names.len(), 2, "either tool may be called");
}

#[test]
fn regex_lark_and_choice() {
    let v = vocabulary();
    let mut c = v.compile(&Grammar::Regex("(yes|no)-[0-9]{2}".into())).unwrap();
    assert!(feed(&mut c, &bytes_of("no-42")));
    let mut c = v.compile(&Grammar::Regex("(yes|no)-[0-9]{2}".into())).unwrap();
    let allowed = c.allowed().unwrap();
    assert!(allowed.contains(b'y' as usize) && allowed.contains(b'n' as usize) && !allowed.contains(b'x' as usize));
    let lark = "start: item (\",\" item)*\nitem: /[a-c]+/\n";
    let mut c = v.compile(&Grammar::Lark(lark.into())).unwrap();
    assert!(feed(&mut c, &bytes_of("ab,c")));
    let mut c = v.compile(&Grammar::Choice(vec!["red".into(), "green \"light\"".into()])).unwrap();
    assert!(feed(&mut c, &bytes_of("green \"light\"")));
    assert!(c.is_finished() || !c.allowed().unwrap().contains(b' ' as usize));
}

#[test]
fn bad_grammars_are_refused_by_name() {
    let v = vocabulary();
    let refuse = |g: Grammar| match v.compile(&g) {
        Ok(_) => panic!("{g:?} compiled"),
        Err(e) => e.0,
    };
    let e = refuse(Grammar::JsonSchema(json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]})));
    assert!(e.contains("Missing"), "{e}");
    let e = refuse(Grammar::Regex("(unclosed".into()));
    assert!(!e.is_empty());
    let e = refuse(Grammar::Lark("start: nothing_defined\n".into()));
    assert!(e.contains("nothing_defined"), "{e}");
    let e = refuse(Grammar::JsonSchema(json!("a string")));
    assert!(e.contains("JSON schema"), "{e}");
    let e = refuse(Grammar::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1)));
    assert!(e.contains("limit"), "{e}");
    let e = refuse(Grammar::Choice(Vec::new()));
    assert!(e.contains("choice"), "{e}");
    let e = refuse(Grammar::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})));
    assert!(!e.is_empty());
}

#[test]
fn whitespace_between_tokens_is_a_space_or_a_line_and_its_indent() {
    let v = vocabulary();
    let mut c = v.compile(&Grammar::AnyObject).unwrap();
    feed(&mut c, &bytes_of("{"));
    feed(&mut c, &[b' ' as u32]);
    let allowed = c.allowed().unwrap();
    assert!(!allowed.contains(b' ' as usize) && !allowed.contains(b'\n' as usize), "one space, no more");
    let mut c = v.compile(&Grammar::AnyObject).unwrap();
    feed(&mut c, &bytes_of("{\n"));
    for _ in 0..20 {
        feed(&mut c, &[b' ' as u32]);
    }
    let allowed = c.allowed().unwrap();
    assert!(!allowed.contains(b' ' as usize) && !allowed.contains(b'\n' as usize), "an indent of at most 20, one line break");
    assert!(feed(&mut c, &bytes_of("\"k\": [1,\n  2\n]}")), "pretty-printed JSON is whole");
}

#[test]
fn prepared_masks_are_the_masks() {
    let v = vocabulary();
    let mut a = v.compile(&Grammar::AnyObject).unwrap();
    let mut b = v.compile(&Grammar::AnyObject).unwrap();
    for t in bytes_of("{\"k\": [1, ") {
        a.prepare();
        let (ma, mb) = (a.allowed().unwrap(), b.allowed().unwrap());
        assert_eq!((0..310).filter(|&i| ma.contains(i)).collect::<Vec<_>>(), (0..310).filter(|&i| mb.contains(i)).collect::<Vec<_>>());
        a.commit(t).unwrap();
        b.commit(t).unwrap();
    }
}

#[test]
fn a_vocabulary_without_end_of_text_is_refused() {
    let tokens = vec![TokenBytes { bytes: b"a".to_vec(), special: false }];
    assert!(Vocabulary::new(&tokens, 1, &[]).is_err());
    assert!(Vocabulary::new(&tokens, 1, &[7]).is_err());
}

/// Bytes of a token of the test vocabulary.
fn bytes_of_token(t: u32) -> Vec<u8> {
    if t < 256 {
        vec![t as u8]
    } else {
        tokens_bytes(t as usize)
    }
}

/// A random walk as the batcher samples: within a budget of `budget` tokens, checking each
/// token near the end against the plan and following the plan when it must.
fn walk_within(c: &mut Constraint, seed: u64, budget: usize) -> (String, bool) {
    let mut state = seed;
    let mut out = Vec::new();
    for used in 0..budget {
        if c.is_finished() {
            return (String::from_utf8(out).unwrap(), true);
        }
        c.prepare();
        let left = budget - used;
        let near = c.near_end(left);
        let allowed = c.allowed().unwrap();
        let choices: Vec<u32> = (0..310u32).filter(|&t| allowed.contains(t as usize) && !EOS.contains(&t)).collect();
        if allowed.contains(EOS[0] as usize) && (choices.is_empty() || state.is_multiple_of(5)) {
            return (String::from_utf8(out).unwrap(), true);
        }
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut t = choices[(state >> 33) as usize % choices.len()];
        if near && !c.fits_after(t, left - 1) {
            let plan = c.plan_tokens().expect("a plan's tokens");
            let options: Vec<u32> = (0..310u32).filter(|&t| plan.contains(t as usize)).collect();
            t = options[(state >> 40) as usize % options.len()];
        }
        out.extend(bytes_of_token(t));
        c.commit(t).unwrap();
    }
    let whole = c.is_finished() || c.allowed().unwrap().contains(EOS[0] as usize);
    (String::from_utf8_lossy(&out).into_owned(), whole)
}

#[test]
fn a_plan_completes_the_grammar_from_where_it_stands() {
    let v = vocabulary();
    let mut c = v.compile(&Grammar::AnyObject).unwrap();
    feed(&mut c, &bytes_of("{\"ab"));
    c.prepare();
    let plan = c.plan.clone().expect("a plan");
    assert!(plan.len() <= 5, "a short way to close: {:?}", String::from_utf8_lossy(&plan));
    assert!(feed(&mut c, &plan.iter().map(|&b| b as u32).collect::<Vec<_>>()), "the plan completes the object");
}

#[test]
fn answers_close_within_any_budget_that_can_hold_one() {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}, "n": {"type": "integer"}},
        "required": ["name", "tags"],
        "additionalProperties": false
    });
    let v = vocabulary();
    // `{"name":"","tags":[]}` is 21 bytes, the shortest answer.
    for budget in [21, 24, 30, 45, 80] {
        for seed in 0..8 {
            let mut c = v.compile(&Grammar::JsonSchema(schema.clone())).unwrap();
            let (text, whole) = walk_within(&mut c, seed, budget);
            assert!(whole, "budget {budget}, seed {seed}: {text:?} is not whole");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(value["name"].is_string() && value["tags"].is_array(), "{text}");
        }
    }
    // Required keys the plan must spell (the grammar forces them, so the search takes them whole),
    // nested in an array of at least two.
    let nested = json!({"type": "array", "minItems": 2, "items": {
        "type": "object", "properties": {"zebra_crossing_count": {"type": "integer"}, "yak": {"enum": ["wool", "milk"]}},
        "required": ["zebra_crossing_count", "yak"], "additionalProperties": false}});
    let shortest = r#"[{"zebra_crossing_count":0,"yak":"wool"},{"zebra_crossing_count":0,"yak":"wool"}]"#.len();
    for budget in [shortest, shortest + 10, 150] {
        for seed in 0..6 {
            let mut c = v.compile(&Grammar::JsonSchema(nested.clone())).unwrap();
            let (text, whole) = walk_within(&mut c, seed, budget);
            assert!(whole, "budget {budget}, seed {seed}: {text:?} is not whole");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(value.as_array().is_some_and(|a| a.len() >= 2), "{text}");
        }
    }
    for budget in [2, 5, 9] {
        let mut c = v.compile(&Grammar::AnyObject).unwrap();
        let (text, whole) = walk_within(&mut c, budget as u64, budget);
        assert!(whole && serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()), "budget {budget}: {text:?}");
    }
}

#[test]
fn plan_search_cost() {
    // Not an assertion of speed: the figure the batcher's closing check costs, printed.
    let v = vocabulary();
    let mut c = v.compile(&Grammar::AnyObject).unwrap();
    feed(&mut c, &bytes_of("{\"k\": [[{\"x\": \"abc"));
    let t0 = std::time::Instant::now();
    let n = 50;
    for _ in 0..n {
        assert!(c.search_plan(None, MAX_PLAN_BYTES).is_some());
    }
    eprintln!("plan search: {:.1} µs", t0.elapsed().as_secs_f64() * 1e6 / n as f64);
}
