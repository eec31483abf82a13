#![no_main]
//! Blob bytes → an expert's matrices: any length or content ends in Ok or a named error.
use libfuzzer_sys::fuzz_target;
use shimmer_common::quant::QuantScheme;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, blob)) = data.split_first() else { return };
    let scheme = [
        QuantScheme::Bf16,
        QuantScheme::Int8PerRow,
        QuantScheme::Int4 { group: 32 },
        QuantScheme::Int4 { group: 64 },
        QuantScheme::Int4 { group: 128 },
        QuantScheme::Mxfp4,
    ][sel as usize % 6];
    let shape = shimmer_common::expert_blob::BlobShape { hidden: 8 + (sel as usize >> 3) % 8 * 8, intermediate: 8, biased: sel & 0x80 != 0 };
    let _ = shimmer_common::expert_blob::decode(blob, scheme, shape, None, "fuzz");
    let (_, len) = shimmer_common::expert_blob::layout(scheme, shape);
    let mut padded = blob.to_vec();
    padded.resize(len, 0);
    let _ = shimmer_common::expert_blob::decode(&padded, scheme, shape, None, "fuzz");
});
