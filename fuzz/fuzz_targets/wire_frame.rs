#![no_main]
//! Bytes off a QUIC stream → a data-plane frame: any input ends in a frame or a named error (with
//! the code a worker answers it with); a decoded frame re-encodes to itself.
use libfuzzer_sys::fuzz_target;
use shimmer_cluster::wire::{self, Frame};

fuzz_target!(|data: &[u8]| {
    let Ok(frame) = wire::decode(bytes::Bytes::copy_from_slice(data)) else { return };
    if let Frame::StatusReply { json, .. } = &frame {
        // A worker's status as the coordinator reads it: parsed or refused, never a panic.
        let _ = serde_json::from_str::<shimmer_cluster::WorkerStatus>(json);
    }
    let again = match &frame {
        Frame::Request(r) => r.encode(),
        Frame::Response(r) => r.encode(),
        Frame::Hint { layer, experts } => {
            let h = wire::Header::decode(data).expect("decoded once");
            wire::encode_hint(h.model, h.epoch, *layer, h.top_k, experts)
        }
        Frame::Error { request_id, code: Some(code), message } => wire::encode_error(*request_id, *code, message),
        Frame::Error { .. } => return,
        Frame::Status { request_id } => wire::encode_status_request(*request_id, 0, 0),
        Frame::StatusReply { request_id, json } => wire::encode_status_reply(*request_id, 0, 0, json).expect("a decoded status is within the limit"),
    };
    let back = wire::decode(again).expect("a re-encoded frame decodes");
    match (&frame, &back) {
        (Frame::Request(a), Frame::Request(b)) => {
            assert!(a.rows == b.rows && a.selections.iter().zip(&b.selections).all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits()))
        }
        (Frame::Response(a), Frame::Response(b)) => assert_eq!(a.sums, b.sums),
        (a, b) if !matches!(a, Frame::Request(_)) => assert_eq!(a, b),
        _ => panic!("kind changed"),
    }
});
