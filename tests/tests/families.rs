//! The family registry and the fixtures agree: every family shimmer registers
//! (`shimmer_common::families::FAMILIES`) has an oracle fixture, and every fixture is of a
//! registered family — so the tests that iterate the fixtures cover every family. And every
//! fixture's tokenizer gives constrained decoding each token's exact bytes.

use std::path::PathBuf;

use shimmer_common::families::FAMILIES;
use shimmer_common::ModelSpec;
use shimmer_tests::{fixture, fixtures};

#[test]
fn every_registered_family_has_an_oracle_fixture_and_every_fixture_a_family() {
    let of_fixtures: Vec<(&str, &str)> = fixtures().into_iter().map(|name| (name, ModelSpec::from_dir(&fixture(name)).unwrap().architecture)).collect();
    for family in FAMILIES {
        assert!(of_fixtures.iter().any(|(_, a)| *a == family.architecture), "{} has no oracle fixture (tests/oracle/make_fixtures.py)", family.architecture);
    }
    for (name, architecture) in &of_fixtures {
        assert!(FAMILIES.iter().any(|f| f.architecture == *architecture), "fixture {name} is of {architecture}, which no family file registers");
    }
    assert!(of_fixtures.len() >= FAMILIES.len());
}

/// Every fixture's tokenizer (byte-level BPE, and Kimi's `tiktoken.model`) as constrained
/// decoding reads it: the bytes of a text's tokens, joined, are the text's bytes — characters
/// split across tokens included — and the chat format's special tokens are marked special.
#[test]
fn every_tokenizers_token_bytes_spell_its_texts() {
    let texts = ["And the LORD spake unto Moses, saying,", "naïve café — 東京の天気は晴れ 😀🦀", "  {\"key\": [1, 2.5e-3, null]}\n\ttabs"];
    let mut dirs: Vec<PathBuf> = fixtures().into_iter().map(fixture).collect();
    dirs.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/demo"));
    for dir in dirs {
        let tok = shimmer_common::tokenizer::Tokenizer::from_dir(&dir).unwrap();
        let vocab = tok.vocabulary().unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        assert_eq!(vocab.len(), tok.vocab_size(), "{}", dir.display());
        for text in texts {
            let ids = tok.encode(text, false).unwrap();
            let mut joined = Vec::new();
            for id in &ids {
                let t = &vocab[*id as usize];
                assert!(!t.special, "{}: text encodes to special token {id}", dir.display());
                joined.extend_from_slice(&t.bytes);
            }
            assert_eq!(String::from_utf8_lossy(&joined), text, "{}", dir.display());
        }
        let specials = vocab.iter().filter(|t| t.special).count();
        assert!(specials > 0, "{}: no special token is marked", dir.display());
    }
}
