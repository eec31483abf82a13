//! Each family's syntax read from answers written as its models write them, streamed pieces
//! adding up to the whole, and the constraint of a required call producing what the parse reads
//! back (walked over a vocabulary holding every format's markers as special tokens).

use serde_json::json;

use super::*;
use crate::constraint::Vocabulary;
use crate::server::tools::{ToolChoice, ToolSpec};
use shimmer_common::tokenizer::TokenBytes;

fn tools() -> Tools {
    Tools::new(
        vec![
            ToolSpec {
                name: "get_weather".into(),
                description: "Weather in a city.".into(),
                parameters: Some(json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})),
            },
            ToolSpec { name: "ping".into(), description: "".into(), parameters: None },
        ],
        ToolChoice::Auto,
        "tools",
    )
    .unwrap()
}

fn format(template: &str) -> ChatFormat {
    ChatFormat::detect(Some(template))
}

const GLM: &str = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<tool_call>{{ name }}<arg_key>k</arg_key><arg_value>v</arg_value></tool_call><think></think>";
const DEEPSEEK: &str = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ n }}<｜tool▁sep｜>{{ a }}<｜tool▁call▁end｜><｜tool▁calls▁end｜></think>";
const DSML: &str = "<｜DSML｜function_calls><｜DSML｜invoke name=\"{{ n }}\"><｜DSML｜parameter name=\"k\" string=\"true\">v</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls></think>";
const QWEN_XML: &str = "{% if tools %}<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>{% endif %}<think></think>";
const KIMI: &str = "<|tool_calls_section_begin|><|tool_call_begin|>{{ id }}<|tool_call_argument_begin|>{{ a }}<|tool_call_end|><|tool_calls_section_end|>";
const HARMONY: &str = "<|start|>assistant<|channel|>analysis<|message|>{{ m }}<|end|>";
const QWEN: &str = "{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}<think>\n\n</think>";
const MISTRAL: &str = "[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS][INST] {{ m }}[/INST][TOOL_CALLS] {{ calls|tojson }}</s>";
const MISTRAL_ARGS: &str = "[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS][INST]{{ m }}[/INST][TOOL_CALLS]{{ name }}[ARGS]{{ args|tojson }}</s>";

#[test]
fn templates_name_their_formats() {
    assert_eq!(format(GLM), ChatFormat { tools: ToolSyntax::Glm, reasoning: ReasoningSyntax::ThinkTags });
    assert_eq!(format(DEEPSEEK), ChatFormat { tools: ToolSyntax::DeepSeek, reasoning: ReasoningSyntax::ThinkTags });
    assert_eq!(format(KIMI), ChatFormat { tools: ToolSyntax::Kimi, reasoning: ReasoningSyntax::None });
    assert_eq!(format(QWEN_XML), ChatFormat { tools: ToolSyntax::QwenXml, reasoning: ReasoningSyntax::ThinkTags });
    assert_eq!(format(DSML), ChatFormat { tools: ToolSyntax::Dsml, reasoning: ReasoningSyntax::ThinkTags });
    assert_eq!(format(HARMONY), ChatFormat { tools: ToolSyntax::Harmony, reasoning: ReasoningSyntax::Harmony });
    assert_eq!(format(QWEN), ChatFormat { tools: ToolSyntax::Hermes, reasoning: ReasoningSyntax::ThinkTags });
    assert_eq!(format(MISTRAL), ChatFormat { tools: ToolSyntax::Mistral, reasoning: ReasoningSyntax::None });
    assert_eq!(format(MISTRAL_ARGS), ChatFormat { tools: ToolSyntax::MistralArgs, reasoning: ReasoningSyntax::None });
    assert_eq!(ChatFormat::detect(None), ChatFormat { tools: ToolSyntax::Json, reasoning: ReasoningSyntax::None });
    assert!(!ChatFormat::detect(None).keeps_special_tokens() && format(KIMI).keeps_special_tokens());
}

#[test]
fn answers_are_read_in_each_syntax() {
    let t = tools();
    let call = |name: &str, args: Value| Call { name: name.into(), arguments: args };

    let glm = "<think>Rain is likely.</think>\nLet me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Ur</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>ping\n</tool_call>";
    let p = format(GLM).parse(glm, false, Some(&t));
    assert_eq!(p.reasoning, "Rain is likely.");
    assert_eq!(p.content, "Let me check.");
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ur", "days": 3})), call("ping", json!({}))]);
    // A string parameter stays a string even when it reads as JSON.
    let p = format(GLM).parse("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n</tool_call>", false, Some(&t));
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "42"}))]);

    let ds = "The answer needs data.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Ai\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>ping<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let p = format(DEEPSEEK).parse(ds, true, Some(&t));
    assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("The answer needs data.", "Checking."));
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ai"})), call("ping", json!({}))]);
    let old =
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Ur\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(format(DEEPSEEK).parse(old, false, Some(&t)).calls, vec![call("get_weather", json!({"city": "Ur"}))]);

    let dsml = "Looking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Ur</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"ping\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
    let p = format(DSML).parse(dsml, false, Some(&t));
    assert_eq!(p.content, "Looking.");
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ur", "days": 2})), call("ping", json!({}))]);

    let xml = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
    let p = format(QWEN_XML).parse(xml, false, Some(&t));
    assert_eq!(p.content, "Checking.");
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "New York", "days": 2}))]);

    let kimi = "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Ur\"}<|tool_call_end|><|tool_call_begin|>functions.ping:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
    let p = format(KIMI).parse(kimi, false, Some(&t));
    assert_eq!(p.content, "Sure.");
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ur"})), call("ping", json!({}))]);

    let harmony = "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Ur\"}";
    let p = format(HARMONY).parse(harmony, false, Some(&t));
    assert_eq!(p.reasoning, "User wants weather.");
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ur"}))]);
    let answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hot and dry.";
    let p = format(HARMONY).parse(answer, false, Some(&t));
    assert_eq!((p.reasoning.as_str(), p.content.as_str(), p.calls.len()), ("Easy.", "Hot and dry.", 0));

    let mistral = "Checking. [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Ur\", \"days\": 2}}, {\"name\": \"ping\", \"arguments\": {}, \"id\": \"a1b2c3d4e\"}]";
    let p = format(MISTRAL).parse(mistral, false, Some(&t));
    assert_eq!(p.content, "Checking.");
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ur", "days": 2})), call("ping", json!({}))]);
    // Arguments as a string holding the object, as some of Mistral's templates render them.
    let p = format(MISTRAL).parse("[TOOL_CALLS] [{\"name\": \"ping\", \"arguments\": \"{}\"}]", false, Some(&t));
    assert_eq!(p.calls, vec![call("ping", json!({}))]);

    let args = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Ur\"}[TOOL_CALLS]ping[CALL_ID]x7[ARGS]{}";
    let p = format(MISTRAL_ARGS).parse(args, false, Some(&t));
    assert_eq!(p.content, "");
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ur"})), call("ping", json!({}))]);

    let qwen = "<think>\nHmm.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Ur\"}}\n</tool_call>";
    let p = format(QWEN).parse(qwen, false, Some(&t));
    assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("Hmm.", ""));
    assert_eq!(p.calls, vec![call("get_weather", json!({"city": "Ur"}))]);
}

#[test]
fn what_is_not_a_call_of_a_listed_tool_stays_content() {
    let t = tools();
    let unknown = "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>";
    let p = format(GLM).parse(unknown, false, Some(&t));
    assert!(p.calls.is_empty());
    assert_eq!(p.content, unknown);
    let bad_json =
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.ping:0<|tool_call_argument_begin|>{oops<|tool_call_end|><|tool_calls_section_end|>";
    assert!(format(KIMI).parse(bad_json, false, Some(&t)).calls.is_empty());
    let unclosed = "[TOOL_CALLS] [{\"name\": \"ping\", \"arguments\": {}";
    let p = format(MISTRAL).parse(unclosed, false, Some(&t));
    assert_eq!((p.calls.len(), p.content.as_str()), (0, unclosed));
    // Without tools, call markup is text like any other.
    let p = format(GLM).parse("<tool_call>ping\n</tool_call>", false, None);
    assert_eq!((p.calls.len(), p.content.as_str()), (0, "<tool_call>ping\n</tool_call>"));
    // An unclosed thought is all reasoning (the answer ran out of tokens while thinking).
    let p = format(QWEN).parse("<think>Still going", false, None);
    assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("Still going", ""));
}

#[test]
fn streamed_pieces_add_up_to_the_whole_and_are_never_taken_back() {
    let cases = [
        (format(QWEN), false, "<think>\nFirst I weigh it.\n</think>\n\nThe answer is 4."),
        (format(DEEPSEEK), true, "Reasoning here</think>Final <b>text</b>."),
        // A false start of the closing tag, multi-byte text at the pieces' edges.
        (format(QWEN), false, "  <think>x </thin y 數學</think>\n答案 </think> <b>"),
        (format(QWEN), false, "No thought, 數 <think> inside."),
        (format(HARMONY), false, "<|channel|>analysis<|message|>Think <|sta|>.<|end|><|start|>assistant<|channel|>final<|message|>Done."),
        (ChatFormat::detect(None), false, "plain <think> text"),
    ];
    for (f, in_reasoning, text) in cases {
        let whole = f.parse(text, in_reasoning, None);
        for step in [1, 2, 3, 7] {
            let mut s = Streamed::new(f, in_reasoning);
            let (mut reasoning, mut content) = (String::new(), String::new());
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                let (r, c) = s.push(&piece.iter().collect::<String>());
                reasoning.push_str(&r);
                content.push_str(&c);
            }
            let (r, c) = s.finish();
            reasoning.push_str(&r);
            content.push_str(&c);
            assert_eq!(reasoning.trim(), whole.reasoning, "{text:?} in pieces of {step}");
            assert_eq!(content.trim(), whole.content, "{text:?} in pieces of {step}");
            assert_eq!(s.text(), text);
        }
    }
}

/// Every byte, every format's markers as special tokens, two end-of-text ids.
fn vocabulary() -> (Vocabulary, usize, Vec<TokenBytes>) {
    let mut tokens: Vec<TokenBytes> = (0..=255u8).map(|b| TokenBytes { bytes: vec![b], special: false }).collect();
    let specials = [
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|constrain|>",
        DS_CALLS_BEGIN,
        DS_CALLS_END,
        DS_CALL_BEGIN,
        DS_SEP,
        DS_CALL_END,
        KIMI_SECTION_BEGIN,
        KIMI_SECTION_END,
        KIMI_CALL_BEGIN,
        KIMI_ARGS,
        KIMI_CALL_END,
        MISTRAL_CALLS,
        MISTRAL_ARGS,
    ];
    tokens.extend(specials.iter().map(|s| TokenBytes { bytes: s.as_bytes().to_vec(), special: true }));
    // GLM's markers are ordinary added tokens.
    tokens.extend(
        ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
            .iter()
            .map(|s| TokenBytes { bytes: s.as_bytes().to_vec(), special: false }),
    );
    let n = tokens.len();
    let v = Vocabulary::new(&tokens, n, &[1, 2]).expect("vocabulary"); // \x01 and \x02 end the text
    (v, n, tokens)
}

#[test]
fn a_required_call_is_written_in_the_family_syntax_and_reads_back() {
    let (v, n, tokens) = vocabulary();
    let t = tools();
    let pick: Vec<(String, Option<Value>)> = t.list.iter().map(|s| (s.name.clone(), s.parameters.clone())).collect();
    for template in [GLM, DEEPSEEK, DSML, QWEN_XML, KIMI, HARMONY, QWEN, MISTRAL, MISTRAL_ARGS] {
        let f = format(template);
        let mut names = std::collections::BTreeSet::new();
        let mut several = false;
        for seed in 0..32u64 {
            let mut c = v
                .compile(&crate::constraint::Grammar::ShapedToolCall(pick.clone(), Box::new(f.call_shape(seed % 2 == 1))))
                .unwrap_or_else(|e| panic!("{}: {e}", f.name()));
            let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut text = Vec::new();
            let mut used_special = false;
            for _ in 0..400 {
                if c.is_finished() {
                    break;
                }
                let allowed = c.allowed().expect("mask");
                let choices: Vec<usize> = (3..n).filter(|&t| allowed.contains(t)).collect();
                if choices.is_empty() {
                    assert!(allowed.contains(1), "{}: nothing allowed before the end", f.name());
                    break;
                }
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Prefer ending strings and objects early, so walks stay short.
                let pick = choices
                    .iter()
                    .copied()
                    .find(|&t| state % 3 == 0 && (tokens[t].bytes == b"\"" || tokens[t].bytes == b"}" || tokens[t].bytes.starts_with(b"</")))
                    .unwrap_or(choices[(state % choices.len() as u64) as usize]);
                used_special |= tokens[pick].special;
                text.extend_from_slice(&tokens[pick].bytes);
                c.commit(pick as u32).expect("commit");
            }
            let text = String::from_utf8_lossy(&text).to_string();
            let p = f.parse(&text, false, Some(&t));
            let Some(call) = p.calls.first() else {
                // Arguments serde_json cannot hold (a number past f64's range) are the grammar's
                // right; anything else must read back.
                assert!(text.contains('e') || text.contains('E'), "{}: {text:?} did not read back as a call", f.name());
                continue;
            };
            let most = if seed % 2 == 1 && !matches!(f.tools, ToolSyntax::Json | ToolSyntax::Harmony) { PARALLEL_CALLS } else { 1 };
            assert!((1..=most).contains(&p.calls.len()), "{}: {} calls in {text:?}", f.name(), p.calls.len());
            several |= p.calls.len() > 1;
            if call.name == "get_weather" {
                assert!(call.arguments["city"].is_string(), "{}: {text:?}", f.name());
            }
            if matches!(f.tools, ToolSyntax::DeepSeek | ToolSyntax::Kimi | ToolSyntax::Harmony | ToolSyntax::Mistral | ToolSyntax::MistralArgs) {
                assert!(used_special, "{}: the markers are written as the special tokens", f.name());
            }
            names.insert(call.name.clone());
        }
        assert_eq!(names.len(), 2, "{}: either tool may be called", f.name());
        if !matches!(f.tools, ToolSyntax::Json | ToolSyntax::Harmony) {
            assert!(several, "{}: parallel answers may hold several calls", f.name());
        }
    }
}
