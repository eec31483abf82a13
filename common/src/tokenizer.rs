//! The model's `tokenizer.json` (through the `tokenizers` crate) and the special tokens its
//! `tokenizer_config.json` names.

use std::path::{Path, PathBuf};

use crate::error::LoadError;

/// Largest `tokenizer.json` we parse; real ones reach ~30 MB (large multilingual vocabularies).
pub const MAX_TOKENIZER_BYTES: u64 = 128 << 20;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("tokenizer.json");
        let meta = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?;
        if meta.len() > MAX_TOKENIZER_BYTES {
            return Err(LoadError::malformed(&path, format!("{} bytes is over the {MAX_TOKENIZER_BYTES} byte limit", meta.len())));
        }
        let bytes = std::fs::read(&path).map_err(|e| LoadError::io(&path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| LoadError::malformed(&path, format!("does not parse as a tokenizer: {e}")))?;
        Ok(Tokenizer { inner, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS etc.),
    /// which a rendered chat template must not get a second time.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, LoadError> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| LoadError::malformed(&self.path, format!("cannot encode text: {e}")))?;
        Ok(enc.get_ids().to_vec())
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
        self.inner.decode(ids, skip_special_tokens).map_err(|e| LoadError::malformed(&self.path, format!("cannot decode ids: {e}")))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
