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
    /// `vocabulary()`, built the first time a token's bytes are asked for.
    bytes: std::sync::OnceLock<Vec<TokenBytes>>,
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
            return Ok(Tokenizer { path: tiktoken.path().to_path_buf(), inner: Backend::TikToken(Box::new(tiktoken)), bytes: Default::default() });
        }
        let meta = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?;
        if meta.len() > MAX_TOKENIZER_BYTES {
            return Err(LoadError::malformed(&path, format!("{} bytes is over the {MAX_TOKENIZER_BYTES} byte limit", meta.len())));
        }
        let bytes = std::fs::read(&path).map_err(|e| LoadError::io(&path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| LoadError::malformed(&path, format!("does not parse as a tokenizer: {e}")))?;
        Ok(Tokenizer { inner: Backend::HuggingFace(Box::new(inner)), path, bytes: Default::default() })
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

/// A token as constrained decoding sees it: the bytes it adds to a text (mid-text, as decoding
/// joins tokens), and whether it is a special token — a control token that text never spells,
/// so no grammar can ask for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenBytes {
    pub bytes: Vec<u8>,
    pub special: bool,
}

/// How a `tokenizer.json`'s decoder turns a vocabulary entry into bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ByteForm {
    /// GPT-2's byte-to-character alphabet (`ByteLevel`).
    ByteLevel,
    /// SentencePiece's: `space` stands for a space, and with `byte_fallback` `<0xNN>` is byte NN
    /// (`Metaspace`, or a `Sequence` of `Replace`/`ByteFallback`/`Fuse`/`Strip`).
    Spaced { space: char, byte_fallback: bool },
}

impl ByteForm {
    /// The form `decoder` (the decoder's JSON) describes; `None` for one that is neither.
    fn of(decoder: &serde_json::Value) -> Option<ByteForm> {
        let kind = |d: &serde_json::Value| d.get("type").and_then(serde_json::Value::as_str).map(str::to_string);
        match kind(decoder)?.as_str() {
            "ByteLevel" => Some(ByteForm::ByteLevel),
            "Metaspace" => {
                let space = decoder.get("replacement").and_then(serde_json::Value::as_str).and_then(single_char).unwrap_or('\u{2581}');
                Some(ByteForm::Spaced { space, byte_fallback: false })
            }
            "Sequence" => {
                let parts = decoder.get("decoders").and_then(serde_json::Value::as_array)?;
                if parts.iter().any(|d| kind(d).as_deref() == Some("ByteLevel")) {
                    return Some(ByteForm::ByteLevel);
                }
                let byte_fallback = parts.iter().any(|d| kind(d).as_deref() == Some("ByteFallback"));
                let replace = parts.iter().find_map(|d| match kind(d).as_deref() {
                    Some("Replace") if d.get("content").and_then(serde_json::Value::as_str) == Some(" ") => {
                        d.get("pattern").and_then(|p| p.get("String")).and_then(serde_json::Value::as_str).and_then(single_char)
                    }
                    Some("Metaspace") => Some(d.get("replacement").and_then(serde_json::Value::as_str).and_then(single_char).unwrap_or('\u{2581}')),
                    _ => None,
                });
                (byte_fallback || replace.is_some()).then(|| ByteForm::Spaced { space: replace.unwrap_or('\u{2581}'), byte_fallback })
            }
            _ => None,
        }
    }

    fn bytes(self, token: &str, table: &[Option<u8>]) -> Option<Vec<u8>> {
        match self {
            ByteForm::ByteLevel => token.chars().map(|c| table.get(c as usize).copied().flatten()).collect(),
            ByteForm::Spaced { space, byte_fallback } => {
                if byte_fallback {
                    if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')).filter(|h| h.len() == 2) {
                        if let Ok(b) = u8::from_str_radix(hex, 16) {
                            return Some(vec![b]);
                        }
                    }
                }
                Some(token.replace(space, " ").into_bytes())
            }
        }
    }
}

fn single_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    let c = chars.next()?;
    chars.next().is_none().then_some(c)
}

/// GPT-2's byte-to-character alphabet inverted: the byte each character below U+0200 stands for
/// (printable Latin-1 for itself, every other byte for a character from U+0100 up, in byte order).
fn byte_level_table() -> Vec<Option<u8>> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut table = vec![None; 0x200];
    let mut next = 0x100usize;
    for b in 0..=255u32 {
        if printable(b) {
            table[b as usize] = Some(b as u8);
        } else {
            table[next] = Some(b as u8);
            next += 1;
        }
    }
    table
}

impl Tokenizer {
    /// Every id's `TokenBytes`, indexed by id (`vocab_size()` of them). Byte-level and
    /// SentencePiece vocabularies give each token's exact bytes — a token that is part of a UTF-8
    /// character is that part. Any other decoder's tokens are taken as their decoded text (a
    /// tokenizer without byte tokens has no partial characters to lose).
    /// The exact bytes token `id` stands for (`vocabulary()`'s entry, kept after the first
    /// call), e.g. for logprobs' `bytes`: a token inside a UTF-8 character is that part of it.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        if self.bytes.get().is_none() {
            let table = self.vocabulary().ok()?;
            let _ = self.bytes.set(table);
        }
        self.bytes.get()?.get(id as usize).map(|t| t.bytes.as_slice())
    }

    pub fn vocabulary(&self) -> Result<Vec<TokenBytes>, LoadError> {
        match &self.inner {
            Backend::TikToken(t) => Ok(t.vocabulary()),
            Backend::HuggingFace(t) => {
                let size = t.get_vocab_size(true);
                let mut out = vec![TokenBytes::default(); size];
                let decoder = serde_json::to_value(t.get_decoder()).unwrap_or(serde_json::Value::Null);
                let form = ByteForm::of(&decoder);
                let table = byte_level_table();
                let added = t.get_added_tokens_decoder();
                for (token, id) in t.get_vocab(false) {
                    // An added token's entry in the model's vocabulary too (DeepSeek's specials)
                    // is read as the added token it is.
                    if added.contains_key(&id) {
                        continue;
                    }
                    let Some(slot) = out.get_mut(id as usize) else { continue };
                    let bytes = match form {
                        Some(form) => form.bytes(&token, &table).ok_or_else(|| {
                            LoadError::malformed(
                                &self.path,
                                format!("token {id} ({token:?}) has a character outside the byte-level alphabet its decoder reads"),
                            )
                        })?,
                        None => t.decode(&[id], false).map_err(|e| LoadError::malformed(&self.path, format!("cannot decode token {id}: {e}")))?.into_bytes(),
                    };
                    slot.bytes = bytes;
                }
                for (id, added) in added {
                    if let Some(slot) = out.get_mut(id as usize) {
                        *slot = TokenBytes { bytes: added.content.into_bytes(), special: added.special };
                    }
                }
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod vocabulary_tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2s_alphabet() {
        let table = byte_level_table();
        assert_eq!(table['a' as usize], Some(b'a'));
        assert_eq!(table[0x120], Some(b' ')); // 'Ġ'
        assert_eq!(table[0x10a], Some(b'\n')); // 'Ċ'
        assert_eq!(table.iter().flatten().count(), 256);
        let mut seen: Vec<u8> = table.iter().flatten().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256, "every byte once");
    }

    #[test]
    fn decoders_are_read_by_kind() {
        use serde_json::json;
        assert_eq!(ByteForm::of(&json!({"type": "ByteLevel"})), Some(ByteForm::ByteLevel));
        let llama = json!({"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]});
        let form = ByteForm::of(&llama).unwrap();
        assert_eq!(form, ByteForm::Spaced { space: '▁', byte_fallback: true });
        let table = byte_level_table();
        assert_eq!(form.bytes("<0xE4>", &table), Some(vec![0xe4]));
        assert_eq!(form.bytes("▁Hello", &table), Some(b" Hello".to_vec()));
        assert_eq!(form.bytes("<0xZZ>", &table), Some(b"<0xZZ>".to_vec()), "not a byte token: its text");
        assert_eq!(ByteForm::of(&json!({"type": "Metaspace", "replacement": "▁"})), Some(ByteForm::Spaced { space: '▁', byte_fallback: false }));
        assert_eq!(ByteForm::of(&json!({"type": "WordPiece"})), None);
        assert_eq!(ByteForm::ByteLevel.bytes("Ġh中", &table), None, "中 is not in the alphabet");
        assert_eq!(ByteForm::ByteLevel.bytes("ĠhÃ©", &table), Some(" hé".as_bytes().to_vec()));
    }
}
