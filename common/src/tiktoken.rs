//! A tiktoken rank file (`tiktoken.model`) and byte-pair encoding over it — the tokenizer Moonshot
//! ships with its Kimi checkpoints instead of a `tokenizer.json`.
//!
//! Owns: parsing the rank file (one `base64(token bytes) rank` per line), the split pattern and
//! special-token layout of the tokenizer class that reads it (`tokenizer_config.json`'s
//! `tokenizer_class`), and encoding and decoding as that class does: the text cut into pieces of
//! at most 400 000 characters and runs of at most 25 000 (non-)whitespace characters; special
//! tokens found in the text by their exact spelling; between them, the pieces of the split
//! pattern (through `fancy-regex`, the engine tiktoken itself runs); a piece that is a token as a
//! whole is that token, otherwise its bytes are merged pair by pair, lowest rank first and
//! leftmost on ties. Decoding joins the tokens' bytes and reads them as UTF-8, U+FFFD for what is
//! not.
//!
//! Must never: allocate from a count the file states before bounding it, panic on any file or
//! text, or take quadratic time on a long piece (tiktoken's own merge loop rescans every pair
//! after each merge; here a heap finds the next merge).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::LoadError;

/// Largest rank file read; Kimi's (163 840 tokens) is 2.8 MB.
pub const MAX_RANK_FILE_BYTES: u64 = 64 << 20;
/// Most ranks a file may hold (o200k, the largest published, holds 200 000).
pub const MAX_RANKS: usize = 1 << 22;
/// Longest token, in bytes (the longest published ones are a few hundred).
pub const MAX_TOKEN_BYTES: usize = 1024;
/// Longest special-token spelling, in bytes.
pub const MAX_SPECIAL_BYTES: usize = 256;

/// What a tokenizer class that reads `tiktoken.model` adds to the file: its split pattern and how
/// many special-token ids follow the ranks.
struct TikTokenClass {
    name: &'static str,
    pattern: &'static str,
    special_ids: u32,
}

/// Moonshot's `TikTokenTokenizer` (`tokenization_kimi.py`, Kimi K2 and Kimi Linear): Han runs
/// apart, cased words without Han with an optional English contraction, up to three digits,
/// punctuation runs, newlines, spaces; 256 reserved special ids plus two after the ranks.
const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

const CLASSES: &[TikTokenClass] = &[TikTokenClass { name: "TikTokenTokenizer", pattern: KIMI_PATTERN, special_ids: 258 }];

/// The class's cuts before tiktoken sees the text (its Rust core is not safe past them).
const MAX_ENCODE_CHARS: usize = 400_000;
const MAX_RUN_CHARS: usize = 25_000;

pub struct TikToken {
    ranks: HashMap<Vec<u8>, u32>,
    /// Bytes of each rank, in rank order.
    tokens: Vec<Vec<u8>>,
    /// Spelling of each special id (`tokens.len() + i`), and whether decoding skips it.
    specials: Vec<(String, bool)>,
    special_ids: HashMap<String, u32>,
    /// Every special spelling, longest first (so that of two starting at one place the longer
    /// wins; the class leaves that to a hash map's order).
    special_matcher: fancy_regex::Regex,
    split: fancy_regex::Regex,
    path: PathBuf,
}

impl TikToken {
    /// Reads `dir/tiktoken.model` with the class and special tokens `dir/tokenizer_config.json`
    /// names.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let tc_path = dir.join("tokenizer_config.json");
        let config = crate::spec::read_json_file(&tc_path, 32 << 20)?;
        let field = |field: &str, problem: String| LoadError::Field { path: tc_path.clone(), field: field.into(), problem };
        let class_name = config.get("tokenizer_class").and_then(Value::as_str).unwrap_or("");
        let Some(class) = CLASSES.iter().find(|c| c.name == class_name) else {
            let known: Vec<&str> = CLASSES.iter().map(|c| c.name).collect();
            return Err(field(
                "tokenizer_class",
                format!("`{class_name}` is not a tokenizer class shimmer reads `tiktoken.model` for (known: {})", known.join(", ")),
            ));
        };
        let path = dir.join("tiktoken.model");
        let meta = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?;
        if meta.len() > MAX_RANK_FILE_BYTES {
            return Err(LoadError::malformed(&path, format!("{} bytes is over the {MAX_RANK_FILE_BYTES} byte limit", meta.len())));
        }
        let bytes = std::fs::read(&path).map_err(|e| LoadError::io(&path, e))?;
        let tokens = parse_ranks(&bytes).map_err(|problem| LoadError::malformed(&path, problem))?;
        let base = tokens.len() as u32;
        let mut named: HashMap<u32, (String, bool)> = HashMap::new();
        if let Some(decoder) = config.get("added_tokens_decoder") {
            let Value::Object(entries) = decoder else {
                return Err(field("added_tokens_decoder", "expected an object of id → token".into()));
            };
            for (key, entry) in entries {
                let id: u32 = key.parse().map_err(|_| field("added_tokens_decoder", format!("`{key}` is not a token id")))?;
                if id < base || id - base >= class.special_ids {
                    return Err(field(
                        "added_tokens_decoder",
                        format!(
                            "id {id} is outside the special ids {base}..{} that {} gives after the {base} ranks of {}",
                            base + class.special_ids,
                            class.name,
                            path.display()
                        ),
                    ));
                }
                let content =
                    entry.get("content").and_then(Value::as_str).ok_or_else(|| field("added_tokens_decoder", format!("id {id} has no `content` string")))?;
                if content.is_empty() || content.len() > MAX_SPECIAL_BYTES {
                    return Err(field("added_tokens_decoder", format!("id {id}: a special token of {} bytes (1..={MAX_SPECIAL_BYTES})", content.len())));
                }
                let special = entry.get("special").and_then(Value::as_bool).unwrap_or(false);
                named.insert(id, (content.to_string(), special));
            }
        }
        let mut specials = Vec::with_capacity(class.special_ids as usize);
        let mut special_ids = HashMap::new();
        for i in 0..class.special_ids {
            let id = base + i;
            let (content, skip) = named.remove(&id).unwrap_or_else(|| (format!("<|reserved_token_{id}|>"), false));
            if special_ids.insert(content.clone(), id).is_some() {
                return Err(field("added_tokens_decoder", format!("`{content}` names two special ids")));
            }
            specials.push((content, skip));
        }
        let mut spellings: Vec<&str> = specials.iter().map(|(s, _)| s.as_str()).collect();
        spellings.sort_by_key(|s| Reverse(s.len()));
        let alternation: Vec<String> = spellings.iter().map(|s| fancy_regex::escape(s).into_owned()).collect();
        let special_matcher =
            fancy_regex::Regex::new(&alternation.join("|")).map_err(|e| field("added_tokens_decoder", format!("special tokens do not form a pattern: {e}")))?;
        let split = fancy_regex::Regex::new(class.pattern).map_err(|e| LoadError::malformed(&path, format!("split pattern: {e}")))?;
        let ranks = tokens.iter().enumerate().map(|(rank, t)| (t.clone(), rank as u32)).collect();
        Ok(TikToken { ranks, tokens, specials, special_ids, special_matcher, split, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text`, special-token spellings included as their ids (the class encodes with
    /// every special allowed). Adds no BOS: the class has no post-processor.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LoadError> {
        let mut out = Vec::new();
        for chunk in char_chunks(text, MAX_ENCODE_CHARS) {
            for run in whitespace_runs(chunk, MAX_RUN_CHARS) {
                self.encode_allowing_specials(run, &mut out)?;
            }
        }
        Ok(out)
    }

    fn encode_allowing_specials(&self, text: &str, out: &mut Vec<u32>) -> Result<(), LoadError> {
        let mut start = 0;
        loop {
            let special = self.special_matcher.find_from_pos(text, start).map_err(|e| self.regex_error(e))?;
            let end = special.as_ref().map_or(text.len(), |m| m.start());
            for piece in self.split.find_iter(&text[start..end]) {
                let piece = piece.map_err(|e| self.regex_error(e))?.as_str().as_bytes();
                match self.ranks.get(piece) {
                    Some(&rank) => out.push(rank),
                    None => self.merge(piece, out),
                }
            }
            match special {
                Some(m) => {
                    // The matcher only matches the spellings the map holds.
                    let id = self
                        .special_ids
                        .get(m.as_str())
                        .copied()
                        .ok_or_else(|| LoadError::malformed(&self.path, format!("`{}` is not a special token", m.as_str())))?;
                    out.push(id);
                    start = m.end();
                }
                None => return Ok(()),
            }
        }
    }

    fn regex_error(&self, e: fancy_regex::Error) -> LoadError {
        LoadError::malformed(&self.path, format!("cannot split the text: {e}"))
    }

    /// Byte-pair merges of one piece: the adjacent pair whose joined bytes have the lowest rank
    /// is joined first, the leftmost of equal ranks; until no adjacent pair is a token.
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        let n = piece.len();
        // Parts are linked by their start offsets; `next[s]` is where the part at `s` ends.
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        let rank_of = |a: usize, b: usize| self.ranks.get(&piece[a..b]).copied();
        for s in 0..n.saturating_sub(1) {
            if let Some(r) = rank_of(s, s + 2) {
                heap.push(Reverse((r, s, s + 2)));
            }
        }
        while let Some(Reverse((_, s, end))) = heap.pop() {
            // Stale unless `s` still starts a part and the part after it still ends at `end`.
            if !alive[s] || next[s] >= n || next[next[s]] != end {
                continue;
            }
            let gone = next[s];
            alive[gone] = false;
            next[s] = end;
            if end < n {
                prev[end] = s;
                if let Some(r) = rank_of(s, next[end]) {
                    heap.push(Reverse((r, s, next[end])));
                }
            }
            let p = prev[s];
            if p != usize::MAX {
                if let Some(r) = rank_of(p, end) {
                    heap.push(Reverse((r, p, end)));
                }
            }
        }
        let mut s = 0;
        while s < n {
            // Every single byte has a rank (checked when the file was read), so every part does.
            out.push(self.ranks.get(&piece[s..next[s]]).copied().unwrap_or(0));
            s = next[s];
        }
    }

    /// The text of `ids`: their bytes read as UTF-8 (U+FFFD for what is not); with
    /// `skip_special_tokens`, without the specials `tokenizer_config.json` marks special.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, LoadError> {
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(t) = self.tokens.get(id as usize) {
                bytes.extend_from_slice(t);
                continue;
            }
            match self.specials.get((id as usize).wrapping_sub(self.tokens.len())) {
                Some((_, true)) if skip_special_tokens => {}
                Some((content, _)) => bytes.extend_from_slice(content.as_bytes()),
                None => return Err(LoadError::malformed(&self.path, format!("token id {id} is beyond the vocabulary of {}", self.vocab_size()))),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The id of a token as transformers spells it: a special token's text, or a rank's bytes in
    /// GPT-2's byte-to-character alphabet (as the class's vocabulary shows them).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.special_ids.get(token) {
            return Some(id);
        }
        let bytes: Option<Vec<u8>> = token.chars().map(byte_of_char).collect();
        self.ranks.get(&bytes?).copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len() + self.specials.len()
    }

    /// Every id's bytes: a rank's own, a special's spelling (marked special).
    pub fn vocabulary(&self) -> Vec<crate::tokenizer::TokenBytes> {
        let ranks = self.tokens.iter().map(|t| crate::tokenizer::TokenBytes { bytes: t.clone(), special: false });
        let specials = self.specials.iter().map(|(s, _)| crate::tokenizer::TokenBytes { bytes: s.as_bytes().to_vec(), special: true });
        ranks.chain(specials).collect()
    }
}

/// Ranks in rank order from the file's lines; every rank from 0 to the count once, every single
/// byte a token.
pub fn parse_ranks(file: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let lines = file.split(|&b| b == b'\n').map(|l| l.strip_suffix(b"\r").unwrap_or(l)).filter(|l| !l.is_empty());
    // A line is at least 4 bytes ("AA== 0" is 6): the count is bounded by the file's size.
    let mut by_rank: Vec<Option<Vec<u8>>> = Vec::new();
    let mut seen: HashMap<Vec<u8>, u32> = HashMap::new();
    for (i, line) in lines.enumerate() {
        let lineno = i + 1;
        let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
        let (Some(token), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(format!("line {lineno}: expected `base64-token rank`"));
        };
        let token = decode_base64(token).ok_or_else(|| format!("line {lineno}: the token is not valid base64"))?;
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
            return Err(format!("line {lineno}: a token of {} bytes (1..={MAX_TOKEN_BYTES})", token.len()));
        }
        let rank: usize = std::str::from_utf8(rank)
            .ok()
            .filter(|r| r.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|r| r.parse().ok())
            .ok_or_else(|| format!("line {lineno}: the rank is not a non-negative integer"))?;
        if rank >= MAX_RANKS {
            return Err(format!("line {lineno}: rank {rank} is over the {MAX_RANKS} limit"));
        }
        if rank >= by_rank.len() {
            by_rank.resize(rank + 1, None);
        }
        if by_rank[rank].is_some() {
            return Err(format!("line {lineno}: rank {rank} is given twice"));
        }
        if let Some(other) = seen.insert(token.clone(), rank as u32) {
            return Err(format!("line {lineno}: the token of rank {rank} is also rank {other}"));
        }
        by_rank[rank] = Some(token);
    }
    if by_rank.is_empty() {
        return Err("no ranks".into());
    }
    let count = by_rank.len();
    let tokens: Vec<Vec<u8>> = by_rank
        .into_iter()
        .enumerate()
        .map(|(rank, t)| t.ok_or_else(|| format!("rank {rank} is missing (ranks must run from 0 to {})", count - 1)))
        .collect::<Result<_, _>>()?;
    if let Some(b) = (0..=255u8).find(|b| !seen.contains_key(&[*b][..])) {
        return Err(format!("byte 0x{b:02x} is not a token (every single byte must be one)"));
    }
    Ok(tokens)
}

fn decode_base64(text: &[u8]) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    if !text.len().is_multiple_of(4) {
        return None;
    }
    let body = text.strip_suffix(b"==").or_else(|| text.strip_suffix(b"=")).unwrap_or(text);
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.chunks(4) {
        let mut acc = 0u32;
        for &c in chunk {
            acc = acc << 6 | value(c)?;
        }
        match chunk.len() {
            4 => out.extend_from_slice(&[(acc >> 16) as u8, (acc >> 8) as u8, acc as u8]),
            3 => out.extend_from_slice(&[(acc >> 10) as u8, (acc >> 2) as u8]),
            2 => out.push((acc >> 4) as u8),
            _ => return None,
        }
    }
    Some(out)
}

/// `text` in pieces of at most `max` characters.
fn char_chunks(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.char_indices().nth(max).map_or(rest.len(), |(i, _)| i);
        let (head, tail) = rest.split_at(end);
        rest = tail;
        Some(head)
    })
}

/// Python's `str.isspace`: Unicode White_Space, and the information separators U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `text` cut wherever a run of whitespace or of non-whitespace grows past `max` characters, as
/// the class cuts before tiktoken (one piece for an empty text).
fn whitespace_runs(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut run_len = 0usize;
    let mut run_is_space = text.chars().next().is_some_and(is_python_space);
    let mut piece_start = 0;
    for (i, c) in text.char_indices() {
        let space = is_python_space(c);
        if space != run_is_space {
            run_len = 1;
            run_is_space = space;
        } else {
            run_len += 1;
            if run_len > max {
                out.push(&text[piece_start..i]);
                piece_start = i;
                run_len = 1;
            }
        }
    }
    out.push(&text[piece_start..]);
    out
}

/// The byte GPT-2's byte-to-character alphabet shows as `c`: printable Latin-1 stands for itself,
/// every other byte for a character from U+0100 up, in byte order.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let code = c as u32;
    if code < 0x100 {
        return printable(code).then_some(code as u8);
    }
    let index = code - 0x100;
    (0..=255u32).filter(|&b| !printable(b)).nth(index as usize).map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode_line(token: &[u8], rank: usize) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut s = String::new();
        for chunk in token.chunks(3) {
            let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
            let v = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
            for k in 0..4 {
                if k <= chunk.len() {
                    s.push(ALPHABET[(v >> (18 - 6 * k) & 63) as usize] as char);
                } else {
                    s.push('=');
                }
            }
        }
        format!("{s} {rank}\n")
    }

    fn rank_file(extra: &[&[u8]]) -> String {
        let mut out = String::new();
        for b in 0..=255u8 {
            out += &encode_line(&[b], b as usize);
        }
        for (i, t) in extra.iter().enumerate() {
            out += &encode_line(t, 256 + i);
        }
        out
    }

    fn dir_with(ranks: &str, config: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tiktoken.model"), ranks).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
        dir
    }

    const CONFIG: &str = r#"{"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": {
        "260": {"content": "[EOS]", "special": true}, "261": {"content": "<|im_end|>", "special": true}}}"#;

    #[test]
    fn base64_round_trips_every_length() {
        for len in 1..8 {
            let token: Vec<u8> = (0..len).map(|i| (i * 37 + 200) as u8).collect();
            let line = encode_line(&token, 0);
            let b64 = line.split(' ').next().unwrap();
            assert_eq!(decode_base64(b64.as_bytes()).unwrap(), token);
        }
        assert_eq!(decode_base64(b"QQ"), None, "unpadded");
        assert_eq!(decode_base64(b"Q!=="), None, "outside the alphabet");
    }

    #[test]
    fn merges_lowest_rank_first_and_leftmost_on_ties() {
        // "ab" (256) and "bc" (257) compete in "abc": "ab" is lower, so a|bc never forms.
        let dir = dir_with(&rank_file(&[b"ab", b"bc", b"abc", b"bcd"]), CONFIG);
        let tt = TikToken::from_dir(dir.path()).unwrap();
        // "abcd" is not a token: ab+c (256, 99)… then "abc" (258) forms from ab|c, leaving d.
        assert_eq!(tt.encode("abcd").unwrap(), vec![258, b'd' as u32]);
        // A piece that is a token as a whole is that token at once.
        assert_eq!(tt.encode("abc").unwrap(), vec![258]);
        // Equal ranks cannot happen between different byte strings; the leftmost of two equal
        // pairs ("ab" twice) merges first and both merge.
        assert_eq!(tt.encode("abab").unwrap(), vec![256, 256]);
        assert_eq!(tt.decode(&tt.encode("abcd abab").unwrap(), false).unwrap(), "abcd abab");
    }

    #[test]
    fn specials_are_found_in_text_and_skipped_only_when_marked() {
        let dir = dir_with(&rank_file(&[b"ab", b"bc", b"abc", b"bcd"]), CONFIG);
        let tt = TikToken::from_dir(dir.path()).unwrap();
        assert_eq!(tt.vocab_size(), 260 + 258);
        let ids = tt.encode("ab[EOS]c<|reserved_token_262|>").unwrap();
        assert_eq!(ids, vec![256, 260, b'c' as u32, 262]);
        assert_eq!(tt.decode(&ids, true).unwrap(), "abc<|reserved_token_262|>");
        assert_eq!(tt.token_to_id("<|im_end|>"), Some(261));
        assert_eq!(tt.token_to_id("Ġab"), None);
        assert_eq!(tt.token_to_id("Ġ"), Some(b' ' as u32));
        assert_eq!(tt.token_to_id("ab"), Some(256));
        assert!(tt.decode(&[518], false).is_err());
    }

    #[test]
    fn a_long_run_merges_in_n_log_n_and_matches_a_direct_rescan() {
        let dir = dir_with(&rank_file(&[b"aa", b"aaaa", b"aaaaaaaa", b"ba", b"aab"]), r#"{"tokenizer_class": "TikTokenTokenizer"}"#);
        let tt = TikToken::from_dir(dir.path()).unwrap();
        for text in ["aaaaaaaaaaaaaaaaaaaaab", "baaaaab", "aab", "abaaba"] {
            let mut ours = Vec::new();
            tt.merge(text.as_bytes(), &mut ours);
            assert_eq!(ours, rescan_merge(&tt, text.as_bytes()), "{text}");
        }
        // 100 000 bytes of one letter: quadratic rescans would take minutes.
        let long = "a".repeat(100_000);
        let ids = tt.encode(&long).unwrap();
        assert_eq!(tt.decode(&ids, false).unwrap(), long);
    }

    /// tiktoken's loop, spelled directly: rescan every adjacent pair after each merge.
    fn rescan_merge(tt: &TikToken, piece: &[u8]) -> Vec<u32> {
        let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
        loop {
            let best =
                (0..parts.len().saturating_sub(1)).filter_map(|i| tt.ranks.get(&[parts[i].clone(), parts[i + 1].clone()].concat()).map(|&r| (r, i))).min();
            let Some((_, i)) = best else { break };
            let right = parts.remove(i + 1);
            parts[i].extend(right);
        }
        parts.iter().map(|p| tt.ranks[p]).collect()
    }

    #[test]
    fn long_runs_are_cut_as_the_class_cuts() {
        let text = format!("{}{}", " ".repeat(7), "x".repeat(12));
        assert_eq!(whitespace_runs(&text, 5), vec!["     ", "  xxxxx", "xxxxx", "xx"]);
        assert_eq!(whitespace_runs("", 5), vec![""]);
        assert_eq!(char_chunks("ab日本語", 2).collect::<Vec<_>>(), vec!["ab", "日本", "語"]);
    }

    #[test]
    fn bad_files_are_refused_by_name() {
        let bad = [
            ("QQ== x\n", "rank is not"),
            ("QQ==\n", "expected"),
            ("QQ== 0\nQQ== 1\n", "also rank"),
            ("QQ== 0\nQg== 0\n", "given twice"),
            ("QQ== 5000000\n", "over the"),
            ("QQ== 1\n", "rank 0 is missing"),
            ("QQ== 0\n", "byte 0x00 is not a token"),
            ("", "no ranks"),
        ];
        for (file, want) in bad {
            let err = parse_ranks(file.as_bytes()).unwrap_err();
            assert!(err.contains(want), "{file:?}: {err}");
        }
        let dir = dir_with(&rank_file(&[]), r#"{"tokenizer_class": "Other"}"#);
        let err = TikToken::from_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("tokenizer_class") && err.contains("Other"), "{err}");
        let dir = dir_with(&rank_file(&[]), r#"{"tokenizer_class": "TikTokenTokenizer", "added_tokens_decoder": {"12": {"content": "x"}}}"#);
        let err = TikToken::from_dir(dir.path()).err().unwrap().to_string();
        assert!(err.contains("outside the special ids 256..514"), "{err}");
    }
}
