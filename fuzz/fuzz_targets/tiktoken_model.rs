#![no_main]
//! A tiktoken rank file (`tiktoken.model`) → ranks, then an encode/decode round trip; or, when
//! the input starts with a zero byte, the rest as text through the Kimi fixture's tokenizer
//! (the split pattern, special tokens and merges on arbitrary text).
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use shimmer_common::tokenizer::Tokenizer;

fn kimi() -> &'static Tokenizer {
    static KIMI: OnceLock<Tokenizer> = OnceLock::new();
    KIMI.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/kimi_linear");
        Tokenizer::from_dir(&dir).expect("the kimi_linear fixture's tokenizer loads")
    })
}

fuzz_target!(|data: &[u8]| {
    if let Some((0, text)) = data.split_first() {
        let text = String::from_utf8_lossy(text);
        if let Ok(ids) = kimi().encode(&text, false) {
            let back = kimi().decode(&ids, false).expect("ids the tokenizer made decode");
            assert_eq!(back, text, "encode then decode gives the text back");
        }
        return;
    }
    if shimmer_common::tiktoken::parse_ranks(data).is_err() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("shimmer-fuzz-tiktoken-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let config = r#"{"tokenizer_class": "TikTokenTokenizer"}"#;
    if std::fs::write(dir.join("tiktoken.model"), data).is_ok() && std::fs::write(dir.join("tokenizer_config.json"), config).is_ok() {
        if let Ok(t) = Tokenizer::from_dir(&dir) {
            let text = "In the beginning, ümlaut 日本語 <|reserved_token_300|>";
            if let Ok(ids) = t.encode(text, false) {
                let _ = t.decode(&ids, false);
            }
        }
    }
});
