//! Prefix caching: the KV of finished requests, kept under a byte budget so that a request whose
//! prompt starts the same way (the next turn of a chat, a shared system prompt) starts from it
//! instead of prefilling again. A sans-IO structure: it holds sessions and decides, the batcher
//! asks.
//!
//! Reuse cannot change an answer: a cached prefix holds exactly the keys and values prefilling
//! would compute (chunking invariance, `tests/tests/invariance.rs`).
//!
//! Must never: hand out KV for tokens that differ from the prompt's, or exceed its budget after
//! an insert.

use crate::engine::Session;

pub struct PrefixCache {
    budget_bytes: usize,
    /// Sessions with the tick they were last used (least recently used goes first).
    entries: Vec<(Session, u64)>,
    tick: u64,
    pub hits: u64,
    pub reused_tokens: u64,
}

impl PrefixCache {
    pub fn new(budget_bytes: usize) -> Self {
        PrefixCache { budget_bytes, entries: Vec::new(), tick: 0, hits: 0, reused_tokens: 0 }
    }

    /// What the kept sessions hold in memory (their slots are shrunk to fit when kept, so this
    /// is what they count, not up to twice it — the soak run's creep, docs/benchmarks.md).
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|(s, _)| s.cache.held_bytes()).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A copy of the cached session sharing the longest prefix with `prompt`, cut to that prefix
    /// but never to the whole prompt (the last prompt token must be computed: its logits give the
    /// first new token). `None` when nothing shares a token.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<Session> {
        let limit = prompt.len().saturating_sub(1);
        let (best, common) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, (s, _))| (i, s.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit)))
            .max_by_key(|(_, c)| *c)?;
        if common == 0 {
            return None;
        }
        self.tick += 1;
        self.entries[best].1 = self.tick;
        let mut s = self.entries[best].0.clone();
        // A recurrent model goes back to its last checkpoint at or before `common`.
        let kept = s.cache.truncate(common);
        if kept == 0 {
            return None;
        }
        s.tokens.truncate(kept);
        self.hits += 1;
        self.reused_tokens += kept as u64;
        Some(s)
    }

    /// Keeps a finished request's session (its KV covers `session.tokens`). Entries it extends
    /// are dropped (it holds all they hold); then the least recently used go until the budget holds.
    pub fn insert(&mut self, mut session: Session) {
        session.cache.shrink_to_fit();
        // Where the next turn of this conversation can come back to (a recurrent state's turn
        // boundary; nothing for attention-only models).
        session.cache.checkpoint();
        if session.tokens.is_empty() || session.cache.held_bytes() > self.budget_bytes {
            return;
        }
        self.entries.retain(|(s, _)| !(s.tokens.len() <= session.tokens.len() && session.tokens.starts_with(&s.tokens)));
        if self.entries.iter().any(|(s, _)| s.tokens.starts_with(&session.tokens)) {
            return; // something already holds all of it
        }
        self.tick += 1;
        self.entries.push((session, self.tick));
        while self.bytes() > self.budget_bytes {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, (_, t))| *t).map(|(i, _)| i) else { break };
            self.entries.swap_remove(oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shimmer_model::kv_cache::KvCache;

    fn session(tokens: &[u32]) -> Session {
        let mut cache = KvCache::new(1, 2, 2, 64);
        for t in tokens {
            cache.append(0, &[*t as f32, 0.0], &[0.0, *t as f32]);
            cache.commit(1);
        }
        Session { cache, tokens: tokens.to_vec() }
    }

    #[test]
    fn the_longest_shared_prefix_is_reused_but_never_the_whole_prompt() {
        let mut c = PrefixCache::new(1 << 20);
        c.insert(session(&[1, 2, 3, 4, 5]));
        c.insert(session(&[1, 2, 9]));
        let s = c.lookup(&[1, 2, 3, 4, 7, 8]).unwrap();
        assert_eq!(s.tokens, vec![1, 2, 3, 4]);
        assert_eq!(s.cache.len(), 4);
        assert_eq!(s.cache.layer(0, 3..4).0, &[4.0, 0.0]);
        // The same prompt again: all but its last token.
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]).unwrap().tokens, vec![1, 2, 3, 4]);
        assert!(c.lookup(&[7, 1, 2]).is_none());
        assert_eq!(c.hits, 2);
    }

    #[test]
    fn an_extension_replaces_its_prefix_and_the_budget_evicts_the_least_recent() {
        let per_token = session(&[1]).cache.bytes();
        let mut c = PrefixCache::new(per_token * 8);
        c.insert(session(&[1, 2]));
        c.insert(session(&[1, 2, 3, 4])); // the next chat turn extends the first
        assert_eq!(c.len(), 1);
        c.insert(session(&[5, 6, 7]));
        assert_eq!(c.len(), 2);
        c.lookup(&[1, 2, 3, 9]); // touches the first entry
        c.insert(session(&[8, 9, 10])); // 4 + 3 + 3 > 8: the least recently used ([5, 6, 7]) goes
        assert!(c.bytes() <= per_token * 8);
        assert!(c.lookup(&[5, 6, 7, 1]).is_none());
        assert!(c.lookup(&[1, 2, 3, 4, 1]).is_some());
        // A session larger than the budget is not kept.
        c.insert(session(&[1; 20]));
        assert!(c.bytes() <= per_token * 8);
    }

    #[test]
    fn a_kept_session_holds_only_what_it_counts() {
        let mut s = session(&[1, 2, 3, 4, 5, 6, 7, 8]);
        // A session given out by `lookup` keeps the longer one's room after its cut.
        s.cache.truncate(3);
        s.tokens.truncate(3);
        assert!(s.cache.held_bytes() > s.cache.bytes());
        let mut c = PrefixCache::new(1 << 20);
        c.insert(s);
        assert_eq!(c.bytes(), c.entries[0].0.cache.bytes(), "the kept slots are shrunk to what they hold");
        let mut again = c.lookup(&[1, 2, 3, 9]).unwrap();
        assert_eq!(again.tokens, vec![1, 2, 3]);
        let (k, v) = again.cache.layer(0, 0..3);
        assert_eq!((k.to_vec(), v.to_vec()), (vec![1.0, 0.0, 2.0, 0.0, 3.0, 0.0], vec![0.0, 1.0, 0.0, 2.0, 0.0, 3.0]), "the same KV after the shrink");
        again.cache.shrink_to_fit();
    }
}
