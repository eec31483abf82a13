#![no_main]
//! Chat template source → rendered text (bounded by minijinja fuel).
use libfuzzer_sys::fuzz_target;
use shimmer_common::chat_template::{render_template, Message};

fuzz_target!(|data: &[u8]| {
    if let Ok(src) = std::str::from_utf8(data) {
        let msgs = [Message::new("system", "s"), Message::new("user", "hi")];
        let _ = render_template(src, &msgs, true, Some("<s>"), Some("</s>"));
    }
});
