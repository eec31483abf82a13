//! `shimmer chat` in a real process: multi-turn over stdin, `/reset`, and leaving with Ctrl-C at
//! the prompt.

use std::io::{Read, Write};
use std::process::{Command, Stdio};

use shimmer_common::chat_template::Message;
use shimmer_tests::{fixture, shimmer, shimmer_bin};

/// ChatML (Qwen3-MoE), harmony (gpt-oss), GLM's and Kimi's layouts, each through its own template.
#[test]
fn chat_answers_like_generate_and_reset_clears_the_conversation() {
    for name in ["qwen3_moe", "gpt_oss", "glm_moe_dsa", "kimi_linear", "deepseek_v4", "inkling_text", "inkling2_text"] {
        chat_like_generate(name);
    }
}

fn chat_like_generate(name: &str) {
    let dir = fixture(name);
    let model = dir.to_str().unwrap();
    let mut child = Command::new(shimmer_bin())
        .args(["chat", "--model", model, "--temperature", "0", "--max-tokens", "16"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Who made the earth?\nAnd the sea?\n/reset\nWho made the earth?\n").unwrap();
    let out = shimmer_tests::wait_within(child, shimmer_tests::COMMAND_LIMIT);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);

    let single = shimmer(&["generate", "--model", model, "--prompt", "Who made the earth?", "--chat", "--temperature", "0", "--max-tokens", "16", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&single.stdout).unwrap();
    let answer = v["text"].as_str().unwrap();

    // Prompts are "› "; each answer follows one.
    let turns: Vec<&str> = stdout.split("› ").skip(1).collect();
    assert_eq!(turns.len(), 5, "{name}: {stdout}"); // 3 answers, the reset notice, the final prompt at EOF
    assert_eq!(turns[0].trim_end_matches('\n'), answer);
    assert!(turns[2].contains("(conversation cleared)"));
    // After /reset the same question gets the same answer as the first time.
    assert_eq!(turns[3].trim_end_matches('\n'), answer);
    // The second turn saw the first: it is the model's greedy answer to the whole conversation
    // (question, first answer, second question), not to the second question alone.
    let engine = shimmer_coordinator::Engine::load(&dir).unwrap();
    let opts =
        shimmer_coordinator::engine::GenerateOptions { max_tokens: 16, sampling: shimmer_coordinator::sampling::SamplingParams::default(), stop: vec![] };
    let answer_to = |messages: &[Message]| {
        let ids = engine.encode_chat(messages).unwrap();
        engine.generate(&mut engine.new_session(), &ids, &opts, |_| true).unwrap().text
    };
    let whole = answer_to(&[Message::new("user", "Who made the earth?"), Message::new("assistant", answer), Message::new("user", "And the sea?")]);
    let alone = answer_to(&[Message::new("user", "And the sea?")]);
    assert_eq!(turns[1].trim_end_matches('\n'), whole);
    assert_ne!(whole, alone, "{name}: the fixture must answer the second question differently without the first (else this proves nothing)");
}

#[test]
fn ctrl_c_at_the_prompt_leaves_the_chat() {
    let dir = fixture("mixtral");
    let mut child = Command::new(shimmer_bin())
        .args(["chat", "--model", dir.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Hold stdin open: EOF would also end the chat (with 0), and the test is about the signal.
    let stdin = child.stdin.take();
    // Wait for the banner, which is printed once the model is loaded and the handler installed.
    let mut stderr = child.stderr.take().unwrap();
    let mut buf = [0u8; 256];
    let n = stderr.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("shimmer chat"));
    let status = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let status = child.wait().unwrap();
    drop(stdin);
    assert_eq!(status.code(), Some(130));
}
