//! The envelope a Raft message travels in between members: the cluster id, the sender's control
//! address (so a node that has not yet applied the membership can answer), then raft-rs's
//! protobuf bytes. Decoded only from connections that proved the cluster's token.
//!
//! Must never: read past the bytes given, or accept a field that is not UTF-8.

use protobuf::Message as _;
use raft::eraftpb::Message as RaftMessage;

/// Encodes `msg` from `from_addr` in cluster `cluster_id`.
pub fn encode(cluster_id: &str, from_addr: &str, msg: &RaftMessage) -> Vec<u8> {
    let body = msg.write_to_bytes().unwrap_or_default();
    let mut out = Vec::with_capacity(4 + cluster_id.len() + from_addr.len() + body.len());
    for s in [cluster_id, from_addr] {
        let n = s.len().min(u16::MAX as usize);
        out.extend_from_slice(&(n as u16).to_le_bytes());
        out.extend_from_slice(&s.as_bytes()[..n]);
    }
    out.extend_from_slice(&body);
    out
}

/// The cluster id, the sender's address and the message.
pub fn decode(b: &[u8]) -> Result<(String, String, RaftMessage), String> {
    let mut at = 0usize;
    let mut field = || -> Result<String, String> {
        let len_bytes: [u8; 2] = b.get(at..at + 2).ok_or("short envelope")?.try_into().map_err(|_| "short envelope")?;
        let n = u16::from_le_bytes(len_bytes) as usize;
        let s = b.get(at + 2..at + 2 + n).ok_or("short envelope")?;
        at += 2 + n;
        String::from_utf8(s.to_vec()).map_err(|_| "envelope field is not UTF-8".to_string())
    };
    let cluster = field()?;
    let from = field()?;
    let msg = RaftMessage::parse_from_bytes(&b[at..]).map_err(|e| format!("not a Raft message: {e}"))?;
    Ok((cluster, from, msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_garbage_is_refused() {
        let msg = RaftMessage { from: 7, to: 9, term: 3, ..Default::default() };
        let b = encode("cluster-1", "10.0.0.1:7070", &msg);
        let (c, f, m) = decode(&b).unwrap();
        assert_eq!((c.as_str(), f.as_str(), m), ("cluster-1", "10.0.0.1:7070", msg));
        for cut in 0..b.len() - 1 {
            let _ = decode(&b[..cut]);
        }
        assert!(decode(&b[..3]).is_err());
        assert!(decode(&[0xff, 0xff, 1]).is_err());
        assert!(decode(&[1, 0, 0xff, 0, 0]).unwrap_err().contains("UTF-8"));
    }
}
