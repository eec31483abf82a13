//! The data plane's frames (DESIGN.md §5): what a coordinator sends a worker for one MoE layer of
//! one batch, what comes back, one-way prefetch hints, and errors. A frame is a fixed 64-byte
//! little-endian header and a payload whose length the header states; tensors travel as raw
//! little-endian bytes (`bytes::Bytes`, so a payload is sliced, never copied, on the way in).
//!
//! Header: magic `SHMR`, version (1), kind, request id, model fingerprint (64-bit), placement
//! epoch, layer, rows, hidden, top-k, payload length, dtype (of the payload's tensor: f32
//! activations in a request, i64 fixed-point sums in a response, none otherwise — one per kind
//! today; the field is what lets a later version send, say, bf16 activations).
//!
//! Payloads — request: `rows × hidden` f32 activations, then `rows × top_k` (expert u32, weight
//! f32) pairs, expert `u32::MAX` for selections another node computes; response: `rows × hidden`
//! i64 fixed-point partial sums (`kernels::fixed`, so partial sums from any nodes add up
//! bit-identically in any order); hint: `rows × top_k` expert u32s; error: a u32 code and a UTF-8
//! message; status: nothing (a question); status reply: the worker's status as UTF-8 JSON
//! (`server::WorkerStatus`, at most `MAX_STATUS` bytes).
//!
//! Must never: trust a length it did not check against the limits, or allocate before checking.

use bytes::{Buf, BufMut, Bytes, BytesMut};

pub const MAGIC: [u8; 4] = *b"SHMR";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 64;
pub const MAX_ROWS: u32 = 1 << 16;
pub const MAX_HIDDEN: u32 = 1 << 16;
pub const MAX_TOP_K: u32 = 64;
pub const MAX_PAYLOAD: u64 = 512 << 20;
pub const MAX_ERROR_MESSAGE: usize = 4096;
pub const MAX_STATUS: u64 = 1 << 20;
/// A selection another node computes.
pub const NOT_MINE: u32 = shimmer_experts::ELSEWHERE;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Kind {
    Request = 1,
    Response = 2,
    Hint = 3,
    Error = 4,
    Status = 5,
    StatusReply = 6,
}

/// Error codes a worker answers on a stream (the stream ends; the connection stays).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    Malformed = 1,
    TooLarge = 2,
    WrongModel = 3,
    /// The placement epoch is not the worker's: the coordinator re-reads placement and retries.
    Moved = 4,
    /// The worker cannot load an expert it was asked for.
    Unavailable = 5,
    Internal = 6,
}

impl ErrorCode {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => ErrorCode::Malformed,
            2 => ErrorCode::TooLarge,
            3 => ErrorCode::WrongModel,
            4 => ErrorCode::Moved,
            5 => ErrorCode::Unavailable,
            6 => ErrorCode::Internal,
            _ => return None,
        })
    }
}

/// The payload tensor's element type (header offset 56).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Dtype {
    None = 0,
    F32 = 1,
    /// `kernels::fixed` accumulator units.
    I64Fixed = 2,
}

impl Kind {
    /// The one dtype each kind carries in this version.
    pub fn dtype(self) -> Dtype {
        match self {
            Kind::Request => Dtype::F32,
            Kind::Response => Dtype::I64Fixed,
            _ => Dtype::None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub request_id: u64,
    pub model: u64,
    pub epoch: u64,
    pub layer: u32,
    pub rows: u32,
    pub hidden: u32,
    pub top_k: u32,
    pub payload_len: u64,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrameError {
    #[error("frame too short: {0} bytes, a header is {HEADER_LEN}")]
    Short(usize),
    #[error("not a shimmer frame (magic {0:02x?})")]
    Magic([u8; 4]),
    #[error("frame version {0}, this node speaks {VERSION}")]
    Version(u16),
    #[error("unknown frame kind {0}")]
    Kind(u16),
    #[error("dtype {got} is not what a {kind:?} frame carries ({want:?})")]
    Dtype { kind: Kind, got: u16, want: Dtype },
    #[error("{what} = {value} is over the limit {limit}")]
    Limit { what: &'static str, value: u64, limit: u64 },
    #[error("payload is {got} bytes, the header implies {want}")]
    PayloadLength { got: u64, want: u64 },
    #[error("error message is not UTF-8")]
    Utf8,
}

impl FrameError {
    /// The code a worker answers this with.
    pub fn code(&self) -> ErrorCode {
        match self {
            FrameError::Limit { .. } => ErrorCode::TooLarge,
            _ => ErrorCode::Malformed,
        }
    }
}

impl Header {
    /// The payload length this header's kind and sizes imply.
    pub fn expected_payload(&self) -> Option<u64> {
        let (rows, hidden, k) = (self.rows as u64, self.hidden as u64, self.top_k as u64);
        match self.kind {
            Kind::Request => Some(rows * hidden * 4 + rows * k * 8),
            Kind::Response => Some(rows * hidden * 8),
            Kind::Hint => Some(rows * k * 4),
            Kind::Status => Some(0),
            // Variable: checked against their own limits.
            Kind::Error | Kind::StatusReply => None,
        }
    }

    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(HEADER_LEN);
        out.put_slice(&MAGIC);
        out.put_u16_le(VERSION);
        out.put_u16_le(self.kind as u16);
        out.put_u64_le(self.request_id);
        out.put_u64_le(self.model);
        out.put_u64_le(self.epoch);
        out.put_u32_le(self.layer);
        out.put_u32_le(self.rows);
        out.put_u32_le(self.hidden);
        out.put_u32_le(self.top_k);
        out.put_u64_le(self.payload_len);
        out.put_u16_le(self.kind.dtype() as u16);
        out.put_bytes(0, HEADER_LEN - 58);
    }

    /// Reads and checks a header (limits included; the payload length is checked against the
    /// sizes here, before anything is allocated for it).
    pub fn decode(mut b: &[u8]) -> Result<Header, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Short(b.len()));
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        b.advance(4);
        let version = b.get_u16_le();
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let kind = match b.get_u16_le() {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Hint,
            4 => Kind::Error,
            5 => Kind::Status,
            6 => Kind::StatusReply,
            k => return Err(FrameError::Kind(k)),
        };
        let h = Header {
            kind,
            request_id: b.get_u64_le(),
            model: b.get_u64_le(),
            epoch: b.get_u64_le(),
            layer: b.get_u32_le(),
            rows: b.get_u32_le(),
            hidden: b.get_u32_le(),
            top_k: b.get_u32_le(),
            payload_len: b.get_u64_le(),
        };
        let dtype = b.get_u16_le();
        if dtype != kind.dtype() as u16 {
            return Err(FrameError::Dtype { kind, got: dtype, want: kind.dtype() });
        }
        for (what, value, limit) in [
            ("rows", h.rows as u64, MAX_ROWS as u64),
            ("hidden", h.hidden as u64, MAX_HIDDEN as u64),
            ("top_k", h.top_k as u64, MAX_TOP_K as u64),
            ("payload", h.payload_len, MAX_PAYLOAD),
        ] {
            if value > limit {
                return Err(FrameError::Limit { what, value, limit });
            }
        }
        match h.expected_payload() {
            Some(want) if want != h.payload_len => Err(FrameError::PayloadLength { got: h.payload_len, want }),
            None if h.kind == Kind::StatusReply => match h.payload_len > MAX_STATUS {
                true => Err(FrameError::Limit { what: "status payload", value: h.payload_len, limit: MAX_STATUS }),
                false => Ok(h),
            },
            None if h.payload_len < 4 || h.payload_len > 4 + MAX_ERROR_MESSAGE as u64 => {
                Err(FrameError::Limit { what: "error payload", value: h.payload_len, limit: 4 + MAX_ERROR_MESSAGE as u64 })
            }
            _ => Ok(h),
        }
    }
}

/// One MoE layer's work for a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub request_id: u64,
    pub model: u64,
    pub epoch: u64,
    pub layer: u32,
    pub hidden: u32,
    pub top_k: u32,
    /// `rows × hidden` f32, little-endian bytes.
    pub rows: Bytes,
    /// Per row, `top_k` (expert, weight); expert `NOT_MINE` for selections computed elsewhere.
    pub selections: Vec<(u32, f32)>,
}

impl Request {
    pub fn row_count(&self) -> u32 {
        (self.selections.len() / self.top_k.max(1) as usize) as u32
    }

    pub fn encode(&self) -> Bytes {
        let rows = self.row_count();
        let payload = self.rows.len() as u64 + self.selections.len() as u64 * 8;
        let mut out = BytesMut::with_capacity(HEADER_LEN + payload as usize);
        Header {
            kind: Kind::Request,
            request_id: self.request_id,
            model: self.model,
            epoch: self.epoch,
            layer: self.layer,
            rows,
            hidden: self.hidden,
            top_k: self.top_k,
            payload_len: payload,
        }
        .encode(&mut out);
        out.put_slice(&self.rows);
        for (e, w) in &self.selections {
            out.put_u32_le(*e);
            out.put_f32_le(*w);
        }
        out.freeze()
    }

    /// The activations as f32.
    pub fn activations(&self) -> Vec<f32> {
        self.rows.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
}

/// A worker's partial sums for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    pub request_id: u64,
    /// The model and placement epoch the worker computed under (the coordinator adds only sums
    /// made for its own model and the epoch it asked under).
    pub model: u64,
    pub epoch: u64,
    pub layer: u32,
    pub hidden: u32,
    pub sums: Vec<i64>,
}

impl Response {
    pub fn encode(&self) -> Bytes {
        let (model, epoch) = (self.model, self.epoch);
        let rows = (self.sums.len() / self.hidden.max(1) as usize) as u32;
        let mut out = BytesMut::with_capacity(HEADER_LEN + self.sums.len() * 8);
        Header {
            kind: Kind::Response,
            request_id: self.request_id,
            model,
            epoch,
            layer: self.layer,
            rows,
            hidden: self.hidden,
            top_k: 0,
            payload_len: self.sums.len() as u64 * 8,
        }
        .encode(&mut out);
        for v in &self.sums {
            out.put_i64_le(*v);
        }
        out.freeze()
    }
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    Request(Request),
    Response(Response),
    Hint { layer: u32, experts: Vec<u32> },
    Error { request_id: u64, code: Option<ErrorCode>, message: String },
    Status { request_id: u64 },
    StatusReply { request_id: u64, json: String },
}

pub fn encode_status_request(request_id: u64, model: u64, epoch: u64) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN);
    Header { kind: Kind::Status, request_id, model, epoch, layer: 0, rows: 0, hidden: 0, top_k: 0, payload_len: 0 }.encode(&mut out);
    out.freeze()
}

/// `json` longer than `MAX_STATUS` is the caller's bug; it is refused here rather than sent.
pub fn encode_status_reply(request_id: u64, model: u64, epoch: u64, json: &str) -> Option<Bytes> {
    if json.len() as u64 > MAX_STATUS {
        return None;
    }
    let mut out = BytesMut::with_capacity(HEADER_LEN + json.len());
    Header { kind: Kind::StatusReply, request_id, model, epoch, layer: 0, rows: 0, hidden: 0, top_k: 0, payload_len: json.len() as u64 }.encode(&mut out);
    out.put_slice(json.as_bytes());
    Some(out.freeze())
}

pub fn encode_hint(model: u64, epoch: u64, layer: u32, top_k: u32, experts: &[u32]) -> Bytes {
    let rows = (experts.len() / top_k.max(1) as usize) as u32;
    let mut out = BytesMut::with_capacity(HEADER_LEN + experts.len() * 4);
    Header { kind: Kind::Hint, request_id: 0, model, epoch, layer, rows, hidden: 0, top_k, payload_len: experts.len() as u64 * 4 }.encode(&mut out);
    for e in experts {
        out.put_u32_le(*e);
    }
    out.freeze()
}

pub fn encode_error(request_id: u64, code: ErrorCode, message: &str) -> Bytes {
    let mut msg = message.as_bytes();
    if msg.len() > MAX_ERROR_MESSAGE {
        let mut cut = MAX_ERROR_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        msg = &message.as_bytes()[..cut];
    }
    let mut out = BytesMut::with_capacity(HEADER_LEN + 4 + msg.len());
    Header { kind: Kind::Error, request_id, model: 0, epoch: 0, layer: 0, rows: 0, hidden: 0, top_k: 0, payload_len: 4 + msg.len() as u64 }.encode(&mut out);
    out.put_u32_le(code as u32);
    out.put_slice(msg);
    out.freeze()
}

/// Decodes a whole frame (header and payload).
pub fn decode(frame: Bytes) -> Result<Frame, FrameError> {
    let h = Header::decode(&frame)?;
    let payload = frame.slice(HEADER_LEN..);
    if payload.len() as u64 != h.payload_len {
        return Err(FrameError::PayloadLength { got: payload.len() as u64, want: h.payload_len });
    }
    Ok(match h.kind {
        Kind::Request => {
            let act = (h.rows as usize) * (h.hidden as usize) * 4;
            let rows = payload.slice(..act);
            let mut sel = &payload[act..];
            let mut selections = Vec::with_capacity(h.rows as usize * h.top_k as usize);
            while sel.has_remaining() {
                selections.push((sel.get_u32_le(), sel.get_f32_le()));
            }
            Frame::Request(Request {
                request_id: h.request_id,
                model: h.model,
                epoch: h.epoch,
                layer: h.layer,
                hidden: h.hidden,
                top_k: h.top_k,
                rows,
                selections,
            })
        }
        Kind::Response => {
            let mut p = &payload[..];
            let mut sums = Vec::with_capacity(payload.len() / 8);
            while p.has_remaining() {
                sums.push(p.get_i64_le());
            }
            Frame::Response(Response { request_id: h.request_id, model: h.model, epoch: h.epoch, layer: h.layer, hidden: h.hidden, sums })
        }
        Kind::Hint => {
            let mut p = &payload[..];
            let mut experts = Vec::with_capacity(payload.len() / 4);
            while p.has_remaining() {
                experts.push(p.get_u32_le());
            }
            Frame::Hint { layer: h.layer, experts }
        }
        Kind::Error => {
            let mut p = &payload[..];
            let code = ErrorCode::from_u32(p.get_u32_le());
            let message = std::str::from_utf8(p).map_err(|_| FrameError::Utf8)?.to_string();
            Frame::Error { request_id: h.request_id, code, message }
        }
        Kind::Status => Frame::Status { request_id: h.request_id },
        Kind::StatusReply => Frame::StatusReply { request_id: h.request_id, json: std::str::from_utf8(&payload).map_err(|_| FrameError::Utf8)?.to_string() },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Request {
        let (rows, hidden, k) = (3u32, 5u32, 2u32);
        let act: Vec<u8> = (0..rows * hidden).flat_map(|i| (i as f32 * 0.25 - 1.0).to_le_bytes()).collect();
        Request {
            request_id: 7,
            model: 0xdead_beef,
            epoch: 3,
            layer: 11,
            hidden,
            top_k: k,
            rows: Bytes::from(act),
            selections: vec![(1, 0.5), (NOT_MINE, 0.5), (4, 0.25), (9, 0.75), (NOT_MINE, 1.0), (0, -0.0)],
        }
    }

    #[test]
    fn every_frame_kind_round_trips() {
        let r = request();
        assert_eq!(decode(r.encode()).unwrap(), Frame::Request(r.clone()));
        assert_eq!(request().activations()[1], -0.75);
        let resp = Response { request_id: 7, model: 1, epoch: 2, layer: 11, hidden: 5, sums: (0..15).map(|i| i * -123_456_789_012).collect() };
        assert_eq!(decode(resp.encode()).unwrap(), Frame::Response(resp));
        assert_eq!(decode(encode_hint(1, 2, 4, 2, &[3, 5, 7, 9])).unwrap(), Frame::Hint { layer: 4, experts: vec![3, 5, 7, 9] });
        assert_eq!(
            decode(encode_error(9, ErrorCode::Moved, "epoch 3 ≠ 4")).unwrap(),
            Frame::Error { request_id: 9, code: Some(ErrorCode::Moved), message: "epoch 3 ≠ 4".into() }
        );
        assert_eq!(decode(encode_status_request(5, 1, 2)).unwrap(), Frame::Status { request_id: 5 });
        assert_eq!(
            decode(encode_status_reply(5, 1, 2, "{\"name\":\"w\"}").unwrap()).unwrap(),
            Frame::StatusReply { request_id: 5, json: "{\"name\":\"w\"}".into() }
        );
        assert!(encode_status_reply(5, 1, 2, &" ".repeat(MAX_STATUS as usize + 1)).is_none());
        // A long message is cut at a character boundary, within the limit.
        let long = "é".repeat(MAX_ERROR_MESSAGE);
        let Frame::Error { message, .. } = decode(encode_error(1, ErrorCode::Internal, &long)).unwrap() else { panic!() };
        assert!(message.len() <= MAX_ERROR_MESSAGE && long.starts_with(&message));
    }

    #[test]
    fn bad_frames_are_named_errors_before_any_allocation() {
        let good = request().encode();
        assert_eq!(decode(good.slice(..10)), Err(FrameError::Short(10)));
        let mut b = good.to_vec();
        b[0] = b'X';
        assert!(matches!(decode(Bytes::from(b)), Err(FrameError::Magic(_))));
        let mut b = good.to_vec();
        b[4] = 9;
        assert_eq!(decode(Bytes::from(b)), Err(FrameError::Version(9)));
        let mut b = good.to_vec();
        b[6] = 77;
        assert_eq!(decode(Bytes::from(b)), Err(FrameError::Kind(77)));
        // Activations of a dtype this version does not send (bf16 = 3, say).
        let mut b = good.to_vec();
        b[56] = 3;
        assert_eq!(decode(Bytes::from(b)), Err(FrameError::Dtype { kind: Kind::Request, got: 3, want: Dtype::F32 }));
        // rows = 2^31: refused by the limit, not by trying to allocate.
        let mut b = good.to_vec();
        b[36..40].copy_from_slice(&(1u32 << 31).to_le_bytes());
        let e = decode(Bytes::from(b)).unwrap_err();
        assert!(matches!(e, FrameError::Limit { what: "rows", .. }) && e.code() == ErrorCode::TooLarge);
        // A header whose sizes disagree with its stated payload, and a truncated payload.
        let mut b = good.to_vec();
        b[48..56].copy_from_slice(&3u64.to_le_bytes());
        assert!(matches!(decode(Bytes::from(b)), Err(FrameError::PayloadLength { .. })));
        assert!(matches!(decode(good.slice(..good.len() - 1)), Err(FrameError::PayloadLength { .. })));
        let mut b = encode_error(1, ErrorCode::Internal, "ok").to_vec();
        let n = b.len();
        b[n - 1] = 0xff;
        assert_eq!(decode(Bytes::from(b)), Err(FrameError::Utf8));
    }
}
