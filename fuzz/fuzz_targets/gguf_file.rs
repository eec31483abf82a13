#![no_main]
//! A GGUF file as `shimmer convert --from` reads it: the header parses or is refused with a named
//! error, never a panic or an allocation the file's size does not back; every tensor of a header
//! that parses lies inside the file and dequantises.
use libfuzzer_sys::fuzz_target;
use shimmer_common::gguf::{dequantize, Gguf};

fuzz_target!(|data: &[u8]| {
    match Gguf::parse(data) {
        Ok(header) => {
            for t in &header.tensors {
                assert!(t.start + t.bytes <= data.len(), "{} lies outside the file", t.name);
                let values = dequantize(t.kind, &data[t.start..t.start + t.bytes]);
                assert_eq!(values.len(), t.elements(), "{}", t.name);
            }
        }
        Err(e) => assert!(!e.is_empty()),
    }
});
