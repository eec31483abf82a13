//! The control service's gRPC codec: a message is its bytes, unchanged. tonic bounds each message
//! (`MAX_MESSAGE_BYTES`) before the codec sees it.

use bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::Status;

/// The largest control message either side accepts (a state snapshot of a large cluster).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

#[derive(Debug, Default, Clone, Copy)]
pub struct BytesCodec;

#[derive(Debug, Default, Clone, Copy)]
pub struct BytesEncoder;

#[derive(Debug, Default, Clone, Copy)]
pub struct BytesDecoder;

impl Codec for BytesCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = BytesEncoder;
    type Decoder = BytesDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        BytesEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        BytesDecoder
    }
}

impl Encoder for BytesEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for BytesDecoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut out = vec![0u8; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}
