#![no_main]
//! A GGUF file as `shimmer convert --from` reads it: the header parses or is refused with a named
//! error, never a panic or an allocation the file's size does not back; every tensor of a header
//! that parses lies inside the file and dequantises; its family's config, its tensors' places and
//! its tokenizer are built or refused by name.
use libfuzzer_sys::fuzz_target;
use shimmer_common::families::gguf_dialect;
use shimmer_common::gguf::{dequantize, Gguf, Meta};

fuzz_target!(|data: &[u8]| {
    match Gguf::parse(data) {
        Ok(header) => {
            for t in &header.tensors {
                assert!(t.start + t.bytes <= data.len(), "{} lies outside the file", t.name);
                let values = dequantize(t.kind, &data[t.start..t.start + t.bytes]);
                assert_eq!(values.len(), t.elements(), "{}", t.name);
            }
            if let Ok(meta) = Meta::new(&header.metadata, &header.tensors) {
                if let Ok(dialect) = gguf_dialect(&meta) {
                    if let Err(e) = dialect.config(&meta) {
                        assert!(!e.is_empty());
                    }
                    for t in &header.tensors {
                        let _ = dialect.tensor(&t.name, &meta);
                    }
                }
                if let Err(e) = shimmer_store::gguf_import::tokenizer_of(&meta) {
                    assert!(!e.is_empty());
                }
            }
        }
        Err(e) => assert!(!e.is_empty()),
    }
});
