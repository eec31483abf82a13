#![no_main]
//! Bytes from an authenticated peer's `Raft` RPC → the envelope (cluster id, sender, raft-rs
//! message): any input ends in Ok or an error; what decodes encodes back to bytes that decode
//! to the same message. "The same" is in raft-rs's known fields (protobuf's text form): protobuf
//! 2 keeps unknown fields in a map whose empty and absent states compare unequal and whose order
//! is not kept, and raft-rs never reads them.
use libfuzzer_sys::fuzz_target;
use shimmer_control::envelope;

fuzz_target!(|data: &[u8]| {
    let Ok((cluster, from, msg)) = envelope::decode(data) else { return };
    let again = envelope::encode(&cluster, &from, &msg);
    let (c2, f2, m2) = envelope::decode(&again).expect("an encoded envelope decodes");
    assert_eq!((c2, f2, format!("{m2:?}")), (cluster, from, format!("{msg:?}")));
});
