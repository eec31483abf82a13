//! The one checksum and fingerprint hash shimmer uses: xxh3, 64 bits.
//!
//! Owns: checksums of expert blobs, session files and the demo model, and the fingerprints of
//! checkpoints and containers. One function (and its streaming form) so that a file written by one
//! part of shimmer is checked by another with the same algorithm.
//!
//! Must never: be used where an adversary chooses the bytes and a collision would matter (it is
//! not cryptographic; the cluster's authentication is HMAC in the transport).

/// xxh3-64 of `bytes`.
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// xxh3-64 over bytes fed in pieces; the same value as `xxh3` of their concatenation.
pub struct Hasher(xxhash_rust::xxh3::Xxh3);

impl Hasher {
    pub fn new() -> Self {
        Hasher(xxhash_rust::xxh3::Xxh3::new())
    }
    pub fn feed(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub fn finish(&self) -> u64 {
        self.0.digest()
    }
}

impl Default for Hasher {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot_and_binds_every_byte() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        for cut in [0, 1, 7, 64, 240, 241, 4096, data.len()] {
            let mut h = Hasher::new();
            h.feed(&data[..cut]);
            h.feed(&data[cut..]);
            assert_eq!(h.finish(), xxh3(&data), "cut at {cut}");
        }
        for at in [0, 1, 5_000, data.len() - 1] {
            let mut flipped = data.clone();
            flipped[at] ^= 1;
            assert_ne!(xxh3(&flipped), xxh3(&data), "a flipped byte at {at} must change the sum");
        }
        assert_ne!(xxh3(&data[..data.len() - 1]), xxh3(&data), "a cut file must change the sum");
    }
}
