//! The cluster's join token, k3s-style: `SHM1<ca-sha256>::<secret>` carries the hash of the
//! cluster CA's certificate with the shared secret, so a joining node authenticates the cluster
//! (the control plane's certificate must chain to that CA) as well as proving the secret. A plain
//! shared secret works too, without the CA pin.
//!
//! Must never: accept a secret shorter than [`MIN_SECRET_CHARS`] characters or with fewer than
//! [`MIN_DISTINCT_CHARS`] distinct ones; print the secret in an error.

use std::fmt;

pub const PREFIX: &str = "SHM1";
pub const MIN_SECRET_CHARS: usize = 16;
pub const MIN_DISTINCT_CHARS: usize = 8;
/// A token longer than this is refused before anything is done with it.
pub const MAX_TOKEN_BYTES: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("the join token is over {MAX_TOKEN_BYTES} bytes")]
    TooLong,
    #[error("the join token's secret must be at least {MIN_SECRET_CHARS} characters with at least {MIN_DISTINCT_CHARS} distinct ones")]
    Weak,
    #[error("a SHM1 join token is `SHM1<64 hex digits of the CA's SHA-256>::<secret>`; this one's CA hash is not 64 hex digits")]
    BadCaHash,
}

/// A parsed join token: the secret, and the CA pin when the token carries one.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterToken {
    secret: String,
    ca_sha256: Option<[u8; 32]>,
}

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterToken").field("ca_sha256", &self.ca_sha256.map(hex)).finish_non_exhaustive()
    }
}

impl ClusterToken {
    pub fn parse(token: &str) -> Result<ClusterToken, TokenError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(TokenError::TooLong);
        }
        let (secret, ca_sha256) = match token.strip_prefix(PREFIX).and_then(|rest| rest.split_once("::")) {
            Some((hash, secret)) => (secret, Some(parse_hex32(hash).ok_or(TokenError::BadCaHash)?)),
            None => (token, None),
        };
        check_secret(secret)?;
        Ok(ClusterToken { secret: secret.to_string(), ca_sha256 })
    }

    /// The token for a cluster whose CA certificate (DER) is `ca_der`, with this secret.
    pub fn pinned(secret: &str, ca_der: &[u8]) -> Result<ClusterToken, TokenError> {
        check_secret(secret)?;
        Ok(ClusterToken { secret: secret.to_string(), ca_sha256: Some(sha256(ca_der)) })
    }

    /// The shared secret every proof is keyed with (the same for the plain and the SHM1 form).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    pub fn ca_sha256(&self) -> Option<[u8; 32]> {
        self.ca_sha256
    }

    /// The token as a user types it.
    pub fn to_token_string(&self) -> String {
        match self.ca_sha256 {
            Some(h) => format!("{PREFIX}{}::{}", hex(h), self.secret),
            None => self.secret.clone(),
        }
    }
}

fn check_secret(secret: &str) -> Result<(), TokenError> {
    let distinct: std::collections::BTreeSet<char> = secret.chars().collect();
    if secret.chars().count() < MIN_SECRET_CHARS || distinct.len() < MIN_DISTINCT_CHARS {
        return Err(TokenError::Weak);
    }
    Ok(())
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, bytes).as_ref());
    out
}

pub fn hex(bytes: [u8; 32]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_pinned_tokens_round_trip_and_weak_ones_are_refused() {
        let plain = ClusterToken::parse("a-long-shared-secret-of-yours").unwrap();
        assert_eq!(plain.ca_sha256(), None);
        assert_eq!(plain.to_token_string(), "a-long-shared-secret-of-yours");
        let pinned = ClusterToken::pinned(plain.secret(), b"a CA certificate").unwrap();
        let text = pinned.to_token_string();
        assert!(text.starts_with("SHM1") && text.ends_with("::a-long-shared-secret-of-yours"), "{text}");
        let back = ClusterToken::parse(&text).unwrap();
        assert_eq!(back, pinned);
        assert_eq!(back.secret(), plain.secret());
        assert_eq!(ClusterToken::parse("short"), Err(TokenError::Weak));
        // Long enough but only a few distinct characters.
        assert_eq!(ClusterToken::parse("abababababababababab"), Err(TokenError::Weak));
        assert_eq!(ClusterToken::parse("SHM1abcd::a-long-shared-secret-of-yours"), Err(TokenError::BadCaHash));
        assert_eq!(ClusterToken::parse(&"x".repeat(MAX_TOKEN_BYTES + 1)), Err(TokenError::TooLong));
        // The secret never appears in Debug output.
        assert!(!format!("{back:?}").contains("shared-secret"));
    }
}
