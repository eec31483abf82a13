//! The model's tokenizer: its `tokenizer.json` through the `tokenizers` crate, or, where a
//! checkpoint ships a tiktoken rank file instead (Kimi's `tiktoken.model`), shimmer's own
//! byte-pair encoder over it (`crate::tiktoken`). Callers see one type either way.

use std::path::{Path, PathBuf};

use crate::error::LoadError;
use crate::tiktoken::TikToken;

/// Largest `tokenizer.json` we parse; real ones reach ~30 MB (large multilingual vocabularies).
pub const MAX_TOKENIZER_BYTES: u64 = 128 << 20;

pub struct Tokenizer {
    inner: Backend,
    path: PathBuf,
}

enum Backend {
    HuggingFace(Box<tokenizers::Tokenizer>),
    TikToken(Box<TikToken>),
}

impl Tokenizer {
    /// `dir/tokenizer.json`, or `dir/tiktoken.model` when there is no `tokenizer.json` (as
    /// transformers prefers the former when both are there).
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() && dir.join("tiktoken.model").exists() {
            let tiktoken = TikToken::from_dir(dir)?;
            return Ok(Tokenizer { path: tiktoken.path().to_path_buf(), inner: Backend::TikToken(Box::new(tiktoken)) });
        }
        let meta = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?;
        if meta.len() > MAX_TOKENIZER_BYTES {
            return Err(LoadError::malformed(&path, format!("{} bytes is over the {MAX_TOKENIZER_BYTES} byte limit", meta.len())));
        }
        let bytes = std::fs::read(&path).map_err(|e| LoadError::io(&path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| LoadError::malformed(&path, format!("does not parse as a tokenizer: {e}")))?;
        Ok(Tokenizer { inner: Backend::HuggingFace(Box::new(inner)), path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS etc.),
    /// which a rendered chat template must not get a second time.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, LoadError> {
        match &self.inner {
            Backend::HuggingFace(t) => {
                let enc = t.encode(text, add_special_tokens).map_err(|e| LoadError::malformed(&self.path, format!("cannot encode text: {e}")))?;
                Ok(enc.get_ids().to_vec())
            }
            Backend::TikToken(t) => t.encode(text),
        }
    }

    /// Whether `text` certainly holds more than `limit` tokens, found without tokenizing it whole:
    /// it is counted in pieces of at most `PIECE_BYTES` cut at whitespace, and a cut can change
    /// the count by a few tokens, so each cut is allowed `SLACK_PER_CUT` (never a refusal of a
    /// text that fits). Tokenizing costs ~100 bytes of memory per byte of text at once; this
    /// costs that per piece.
    pub fn certainly_more_than(&self, text: &str, limit: usize) -> Result<bool, LoadError> {
        const PIECE_BYTES: usize = 64 << 10;
        const SLACK_PER_CUT: usize = 8;
        let (mut counted, mut cuts, mut rest) = (0usize, 0usize, text);
        while !rest.is_empty() {
            let mut end = rest.len().min(PIECE_BYTES);
            while !rest.is_char_boundary(end) {
                end -= 1;
            }
            if end < rest.len() {
                // Cut before a whitespace character (where pre-tokenizers cut too), when the piece has one.
                if let Some(ws) = rest[..end].rfind(char::is_whitespace).filter(|&w| w > 0) {
                    end = ws;
                }
                cuts += 1;
            }
            counted += self.encode(&rest[..end], false)?.len();
            if counted > limit + cuts * SLACK_PER_CUT {
                return Ok(true);
            }
            rest = &rest[end..];
        }
        Ok(false)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, LoadError> {
        match &self.inner {
            Backend::HuggingFace(t) => t.decode(ids, skip_special_tokens).map_err(|e| LoadError::malformed(&self.path, format!("cannot decode ids: {e}"))),
            Backend::TikToken(t) => t.decode(ids, skip_special_tokens),
        }
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Backend::HuggingFace(t) => t.token_to_id(token),
            Backend::TikToken(t) => t.token_to_id(token),
        }
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Backend::HuggingFace(t) => t.get_vocab_size(true),
            Backend::TikToken(t) => t.vocab_size(),
        }
    }
}
