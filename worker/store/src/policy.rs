//! Expert-cache policies, sans-IO (DESIGN.md §2): a policy is told each demand access and each
//! lookahead hint, in order, and decides what stays resident. It never reads a file and never
//! sees a clock; the store's I/O shell carries out its decisions. Replaying routing traces through
//! these policies measures them against Belady's optimum (`belady_hits`).

use std::collections::{BTreeSet, HashMap};

/// (MoE layer position, expert).
pub type Key = (u16, u16);

pub trait CachePolicy {
    fn name(&self) -> String;
    /// A demand access; returns whether `key` was resident. A miss makes it resident.
    fn access(&mut self, key: Key) -> bool;
    /// A hint that `key` is likely needed soon; returns whether the policy loaded it (a prefetch
    /// read). Hints never evict a pinned expert.
    fn hint(&mut self, _key: Key) -> bool {
        false
    }
    fn is_resident(&self, key: Key) -> bool;
}

/// The order in which one batch's accesses to a layer reach the policy: experts already resident
/// first (refreshed before anything is evicted), then the misses. Without it, a miss early in the
/// batch could evict an expert the same batch is about to use. The store and the trace replay
/// both use it, so the replay measures the policy as shipped.
pub fn batch_order(policy: &dyn CachePolicy, keys: &mut [Key]) {
    keys.sort_by_key(|k| !policy.is_resident(*k));
}

/// Per-layer LRU over a fixed number of slots per layer, with an optional pinned set per layer
/// (reserved slots of that layer's budget: a pinned expert is read on its first use and never
/// evicted after, so the replay starts from a cold cache like every other policy) and optional
/// prefetch on hints.
pub struct LayerLru {
    slots_per_layer: usize,
    /// Per layer: unpinned residents with their last-use tick.
    resident: Vec<Vec<(u16, u64)>>,
    pinned: Vec<Vec<u16>>,
    pins_loaded: std::collections::HashSet<Key>,
    prefetch: bool,
    prefetch_min_free: usize,
    /// Prefetched experts not yet used by a demand access.
    prefetched: HashMap<Key, HintStep>,
    /// Per layer and kind of step: how often its hints came true — prefetches while the layer
    /// prefetches, and held-back hints (`shadow`) while it does not, so a layer's predictions
    /// keep being judged without a read.
    record: Vec<[HintRecord; 2]>,
    /// Per layer: hints held back, with the layer's miss count when each was made and the kind of
    /// step that made it. One counts as used if its expert is accessed before the layer has
    /// missed `free_slots` more times (about as long as a prefetched expert would have stayed
    /// resident); older ones count as unused.
    shadow: Vec<Vec<(u16, u64, HintStep)>>,
    misses: Vec<u64>,
    tick: u64,
    label: String,
}

/// Below this share of its hints come true, a layer holds them back (judged, not read): a wasted
/// prefetch costs a read and evicts an expert that may have been needed.
pub const PREFETCH_MIN_USEFUL: f64 = 0.5;
/// Hints a layer judges (unread) before it first reads one.
const PREFETCH_WARMUP: f64 = 16.0;

impl LayerLru {
    pub fn new(layers: usize, slots_per_layer: usize) -> Self {
        LayerLru {
            slots_per_layer,
            resident: vec![Vec::new(); layers],
            pinned: vec![Vec::new(); layers],
            pins_loaded: Default::default(),
            prefetch: false,
            prefetch_min_free: 1,
            prefetched: Default::default(),
            record: vec![[HintRecord::default(); 2]; layers],
            shadow: vec![Vec::new(); layers],
            misses: vec![0; layers],
            tick: 0,
            label: "LRU".into(),
        }
    }

    /// Pins the given experts per layer (at most the layer's slots).
    pub fn with_pins(mut self, pinned: Vec<Vec<u16>>) -> Self {
        self.pinned = pinned
            .into_iter()
            .map(|mut p| {
                p.truncate(self.slots_per_layer);
                p
            })
            .collect();
        self.label = format!("{}+pins", self.label);
        self
    }

    /// Prefetch on hints, in layers with at least `min_free_slots` unpinned slots: with fewer
    /// than one token's selections (top-k), a prefetched expert is evicted by the very demand
    /// accesses it was meant to serve, so hints there would only add reads.
    pub fn with_prefetch(mut self, min_free_slots: usize) -> Self {
        self.prefetch = true;
        self.prefetch_min_free = min_free_slots;
        self.label = format!("{}+prefetch", self.label);
        self
    }

    fn free_slots(&self, layer: usize) -> usize {
        self.slots_per_layer - self.pinned[layer].len()
    }

    fn touch_or_load(&mut self, key: Key) -> bool {
        self.decide(key).hit
    }

    /// A demand access with the full decision: whether it hit, and which key (if any) it evicted
    /// to make room. A miss with no unpinned slot in the layer is not made resident (`kept` false):
    /// the expert is used once and dropped.
    pub fn decide(&mut self, (layer, e): Key) -> Decision {
        self.tick += 1;
        let l = layer as usize;
        if let Some(step) = self.prefetched.remove(&(layer, e)) {
            self.record[l][step as usize].used += 1.0;
        }
        if let Some(i) = self.shadow[l].iter().position(|(x, ..)| *x == e) {
            let (_, _, step) = self.shadow[l].swap_remove(i);
            self.record[l][step as usize].used += 1.0;
        }
        if self.pinned[l].contains(&e) {
            let hit = !self.pins_loaded.insert((layer, e));
            return Decision { hit, kept: true, evicted: None };
        }
        if let Some(slot) = self.resident[l].iter_mut().find(|(x, _)| *x == e) {
            slot.1 = self.tick;
            return Decision { hit: true, kept: true, evicted: None };
        }
        self.misses[l] += 1;
        let (now, window) = (self.misses[l], self.free_slots(l) as u64);
        // A held-back hint whose expert a prefetch would have lost by now came out wrong.
        self.shadow[l].retain(|(_, at, _)| now - at <= window);
        if self.free_slots(l) == 0 {
            return Decision { hit: false, kept: false, evicted: None };
        }
        let mut evicted = None;
        if self.resident[l].len() >= self.free_slots(l) {
            let oldest = self.resident[l].iter().enumerate().min_by_key(|(_, (_, t))| *t).map(|(i, _)| i).unwrap_or(0);
            let victim = (layer, self.resident[l].swap_remove(oldest).0);
            self.prefetched.remove(&victim);
            evicted = Some(victim);
        }
        self.resident[l].push((e, self.tick));
        Decision { hit: false, kept: true, evicted }
    }

    /// A lookahead hint with the full decision: `Some` when the policy wants the expert read now
    /// (prefetch on, not resident, a slot available, the layer's hints from this kind of step
    /// mostly right), with what that evicts.
    pub fn decide_hint(&mut self, key: Key, step: HintStep) -> Option<Decision> {
        let l = key.0 as usize;
        if !self.prefetch || self.free_slots(l) < self.prefetch_min_free.max(1) {
            return None;
        }
        if step == HintStep::Pins {
            let d = self.decide(key);
            return (!d.hit && d.kept).then_some(d);
        }
        // Adaptive: a layer acts on its hints only while they mostly come true — a wasted read
        // costs the disk time a needed one waits for, and evicts an expert that may be needed;
        // a wrong hint's refresh of a resident expert keeps it over one that is needed. Until
        // then (from the start, and whenever they stop coming true) it judges them without acting,
        // so it starts, and resumes, when they prove right.
        let record = self.record[l][step as usize];
        let trusted = record.issued >= PREFETCH_WARMUP && record.used >= PREFETCH_MIN_USEFUL * record.issued;
        if self.is_resident(key) {
            if trusted {
                // About to be used: refreshed, never re-read.
                self.tick += 1;
                if let Some(slot) = self.resident[l].iter_mut().find(|(x, _)| *x == key.1) {
                    slot.1 = self.tick;
                }
            }
            return None;
        }
        if !trusted {
            if !self.shadow[l].iter().any(|(x, ..)| *x == key.1) {
                self.shadow[l].push((key.1, self.misses[l], step));
                self.record[l][step as usize].count();
            }
            return None;
        }
        let d = self.decide(key);
        if d.hit || !d.kept {
            return None;
        }
        self.prefetched.insert(key, step);
        self.record[l][step as usize].count();
        Some(d)
    }

    pub fn is_resident(&self, (layer, e): Key) -> bool {
        let l = layer as usize;
        self.pins_loaded.contains(&(layer, e)) || self.resident.get(l).is_some_and(|r| r.iter().any(|(x, _)| *x == e))
    }

    /// Drops `key` (its read failed): the next access is a miss again.
    pub fn forget(&mut self, (layer, e): Key) {
        self.pins_loaded.remove(&(layer, e));
        self.prefetched.remove(&(layer, e));
        if let Some(s) = self.shadow.get_mut(layer as usize) {
            s.retain(|(x, ..)| *x != e);
        }
        if let Some(r) = self.resident.get_mut(layer as usize) {
            r.retain(|(x, _)| *x != e);
        }
    }

    pub fn pinned(&self) -> &[Vec<u16>] {
        &self.pinned
    }
}

/// The kind of step a hint came from. A step of many rows (a prompt, a batch) predicts the union
/// of its rows' choices, which near-uniform routers make easy to hit; one row's prediction is
/// judged on its own record, or a prompt's success would switch on prefetching that decode wastes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HintStep {
    OneRow = 0,
    ManyRows = 1,
    /// Not a prediction: the learned pins read at start. Always read, never judged.
    Pins = 2,
}

impl HintStep {
    pub fn of_rows(rows: usize) -> Self {
        if rows > 1 {
            HintStep::ManyRows
        } else {
            HintStep::OneRow
        }
    }
}

/// Hints judged and hints that came true, halved together as they grow so recent behaviour
/// counts most.
#[derive(Debug, Clone, Copy, Default)]
struct HintRecord {
    issued: f64,
    used: f64,
}

impl HintRecord {
    fn count(&mut self) {
        self.issued += 1.0;
        if self.issued >= 64.0 {
            self.issued /= 2.0;
            self.used /= 2.0;
        }
    }
}

/// What the policy decided about one access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub hit: bool,
    /// The expert stays resident after this access.
    pub kept: bool,
    pub evicted: Option<Key>,
}

impl CachePolicy for LayerLru {
    fn name(&self) -> String {
        self.label.clone()
    }
    fn access(&mut self, key: Key) -> bool {
        self.touch_or_load(key)
    }
    fn hint(&mut self, key: Key) -> bool {
        self.decide_hint(key, HintStep::OneRow).is_some()
    }
    fn is_resident(&self, key: Key) -> bool {
        LayerLru::is_resident(self, key)
    }
}

/// Per-layer LFU: evicts the resident expert used least often so far (ties: least recently).
pub struct LayerLfu {
    slots_per_layer: usize,
    resident: Vec<Vec<u16>>,
    counts: HashMap<Key, (u64, u64)>,
    tick: u64,
}

impl LayerLfu {
    pub fn new(layers: usize, slots_per_layer: usize) -> Self {
        LayerLfu { slots_per_layer, resident: vec![Vec::new(); layers], counts: HashMap::new(), tick: 0 }
    }
}

impl CachePolicy for LayerLfu {
    fn name(&self) -> String {
        "LFU".into()
    }
    fn is_resident(&self, (layer, e): Key) -> bool {
        self.resident.get(layer as usize).is_some_and(|r| r.contains(&e))
    }
    fn access(&mut self, (layer, e): Key) -> bool {
        self.tick += 1;
        let c = self.counts.entry((layer, e)).or_insert((0, 0));
        c.0 += 1;
        c.1 = self.tick;
        let l = layer as usize;
        if self.resident[l].contains(&e) {
            return true;
        }
        if self.slots_per_layer == 0 {
            return false;
        }
        if self.resident[l].len() >= self.slots_per_layer {
            let counts = &self.counts;
            let victim =
                self.resident[l].iter().enumerate().min_by_key(|(_, x)| counts.get(&(layer, **x)).copied().unwrap_or((0, 0))).map(|(i, _)| i).unwrap_or(0);
            self.resident[l].swap_remove(victim);
        }
        self.resident[l].push(e);
        false
    }
}

/// Demand hits of Belady's optimal policy (evict the resident key whose next use is furthest)
/// with `capacity` keys shared by all layers, over `accesses` in order.
pub fn belady_hits(accesses: &[Key], capacity: usize) -> usize {
    belady(accesses, capacity).iter().filter(|h| **h).count()
}

/// Belady's optimal policy: for each access, whether it hit.
pub fn belady(accesses: &[Key], capacity: usize) -> Vec<bool> {
    let mut hit = vec![false; accesses.len()];
    if capacity == 0 {
        return hit;
    }
    // next[i]: index of the next access to the same key after i (usize::MAX if none).
    let mut next = vec![usize::MAX; accesses.len()];
    let mut last: HashMap<Key, usize> = HashMap::new();
    for (i, k) in accesses.iter().enumerate().rev() {
        if let Some(j) = last.insert(*k, i) {
            next[i] = j;
        }
    }
    let mut by_next: BTreeSet<(usize, Key)> = BTreeSet::new();
    let mut resident: HashMap<Key, usize> = HashMap::new();
    for (i, k) in accesses.iter().enumerate() {
        if let Some(n) = resident.remove(k) {
            hit[i] = true;
            by_next.remove(&(n, *k));
        } else if resident.len() >= capacity {
            if let Some(&(n, victim)) = by_next.iter().next_back() {
                by_next.remove(&(n, victim));
                resident.remove(&victim);
            }
        }
        resident.insert(*k, next[i]);
        by_next.insert((next[i], *k));
    }
    hit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay(p: &mut dyn CachePolicy, keys: &[Key]) -> usize {
        keys.iter().filter(|k| p.access(**k)).count()
    }

    #[test]
    fn lru_evicts_the_least_recently_used_per_layer() {
        let mut p = LayerLru::new(2, 2);
        let seq = [(0, 1), (0, 2), (0, 1), (0, 3), (0, 2), (1, 5), (0, 1)];
        // 1 m, 2 m, 1 h, 3 m (evicts 2), 2 m (evicts 1), layer 1 separate, 1 m.
        let hits: Vec<bool> = seq.iter().map(|k| p.access(*k)).collect();
        assert_eq!(hits, [false, false, true, false, false, false, false]);
    }

    #[test]
    fn pins_stay_and_prefetch_turns_misses_into_hits() {
        let mut p = LayerLru::new(1, 2).with_pins(vec![vec![9]]);
        assert!(!p.access((0, 9)), "a pin is read on first use");
        assert!(p.access((0, 9)));
        assert!(!p.access((0, 1)));
        assert!(!p.access((0, 2))); // evicts 1, never 9
        assert!(p.access((0, 9)));
        let mut q = LayerLru::new(1, 2).with_prefetch(1);
        // A layer reads hints only once they have proved right (judged unread at first).
        for i in 0..PREFETCH_WARMUP as u16 {
            assert!(!q.hint((0, 10 + i)), "hint {i} read before the layer's hints were judged");
            q.access((0, 10 + i));
        }
        assert!(q.hint((0, 4)));
        assert!(q.access((0, 4)));
        assert!(!q.hint((0, 4)), "already resident: no read");
        let mut small = LayerLru::new(1, 2).with_prefetch(4);
        assert!(!small.hint((0, 4)), "fewer slots than a token's selections: no prefetch");
    }

    #[test]
    fn prefetch_that_goes_unused_is_held_back_and_resumes_when_useful() {
        let mut p = LayerLru::new(1, 8).with_prefetch(1);
        // Hints that come true: read once judged right.
        let mut reads = 0;
        for i in 0..100u16 {
            reads += p.hint((0, 1000 + i)) as usize;
            p.access((0, 1000 + i));
        }
        assert!(reads > 100 - 2 * PREFETCH_WARMUP as usize, "useful hints read: {reads} of 100");
        // Hints that are never used: read only until the record turns, then judged unread.
        let mut reads = 0;
        for i in 0..400u16 {
            reads += p.hint((0, 100 + i % 50)) as usize;
            p.access((0, i % 3));
        }
        assert!(reads <= 64, "{reads} prefetch reads for useless hints");
        let mut late = 0;
        for i in 0..400u16 {
            late += p.hint((0, 300 + i % 50)) as usize;
            p.access((0, i % 3));
        }
        assert_eq!(late, 0, "useless hints read after the layer's record turned");
        // Hints that are then used: judged right while held back, so prefetch comes back.
        let mut late_reads = 0;
        for i in 0..400u16 {
            let k = (0, 200 + i % 40);
            let read = p.hint(k);
            if i >= 300 {
                late_reads += read as usize;
            }
            p.access(k);
        }
        assert!(late_reads > 90, "useful prefetch was not resumed ({late_reads} of the last 100 hints)");
    }

    #[test]
    fn a_held_back_hint_counts_as_used_only_while_a_prefetch_would_have_stayed() {
        // Four slots: a prefetched expert would have been evicted within four misses. Each round
        // hints one expert, then misses `gap` other experts, then uses the hinted one.
        let reads_with_gap = |gap: u16| {
            let mut p = LayerLru::new(1, 4).with_prefetch(1);
            for i in 0..PREFETCH_WARMUP as u16 {
                p.hint((0, 1000 + i)); // judged, never used: the layer is held back
            }
            let (mut reads, mut other) = (0, 2000);
            for round in 0..200u16 {
                let k = (0, round % 100);
                reads += p.hint(k) as usize;
                for _ in 0..gap {
                    p.access((0, other));
                    other += 1;
                }
                p.access(k);
            }
            reads
        };
        assert_eq!(reads_with_gap(6), 0, "hints used only after six misses are wrong for four slots");
        assert!(reads_with_gap(2) > 150, "hints used within two misses resume prefetching");
    }

    #[test]
    fn one_rows_hints_and_many_rows_hints_are_judged_apart() {
        // A prompt's hints all come true, a decode step's never: decode stops reading its
        // hints, the prompt's keep being read.
        let mut p = LayerLru::new(1, 8).with_prefetch(1);
        let (mut prompt_reads, mut decode_reads) = (0, 0);
        for round in 0..100u16 {
            let k = (0, round % 60);
            prompt_reads += p.decide_hint(k, HintStep::ManyRows).is_some() as usize;
            p.access(k);
            decode_reads += p.decide_hint((0, 100 + round % 60), HintStep::OneRow).is_some() as usize;
            p.access((0, 200 + round % 60));
        }
        assert_eq!(decode_reads, 0, "one-row hints that never come true are never read");
        assert!(prompt_reads >= 100 - 2 * PREFETCH_WARMUP as usize, "many-row hints that come true are read ({prompt_reads} of 100)");
        // The learned pins read at start are not predictions: read, and never judged.
        let mut q = LayerLru::new(1, 8).with_prefetch(1);
        for e in 0..PREFETCH_WARMUP as u16 * 2 {
            q.decide_hint((0, 300 + e), HintStep::OneRow);
        }
        assert!(q.decide_hint((0, 7), HintStep::Pins).is_some());
        assert!(q.decide_hint((0, 8), HintStep::OneRow).is_none(), "the layer's one-row hints stay held back");
    }

    #[test]
    fn decisions_name_the_evicted_expert_and_zero_slot_layers_stream() {
        let mut p = LayerLru::new(2, 2);
        assert_eq!(p.decide((0, 1)), Decision { hit: false, kept: true, evicted: None });
        p.decide((0, 2));
        p.decide((0, 1));
        assert_eq!(p.decide((0, 3)), Decision { hit: false, kept: true, evicted: Some((0, 2)) });
        assert!(p.is_resident((0, 1)) && p.is_resident((0, 3)) && !p.is_resident((0, 2)));
        p.forget((0, 3));
        assert!(!p.decide((0, 3)).hit);
        let mut none = LayerLru::new(1, 0);
        assert_eq!(none.decide((0, 5)), Decision { hit: false, kept: false, evicted: None });
        assert!(!none.decide((0, 5)).hit, "nothing is ever kept with no slots");
    }

    #[test]
    fn lfu_keeps_the_frequent() {
        let mut p = LayerLfu::new(1, 2);
        let seq = [(0, 1), (0, 1), (0, 2), (0, 3), (0, 1), (0, 2)];
        // 1 m, 1 h, 2 m, 3 m (evicts 2: count 1, older than 3? 3 not resident yet; evicts 2), 1 h, 2 m.
        assert_eq!(replay(&mut p, &seq), 2);
    }

    #[test]
    fn belady_is_optimal_on_a_textbook_sequence_and_bounds_the_others() {
        // Classic page reference string with 3 frames: OPT has 9 faults in 20 references.
        let refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1];
        let keys: Vec<Key> = refs.iter().map(|r| (0u16, *r as u16)).collect();
        assert_eq!(keys.len() - belady_hits(&keys, 3), 9);
        let mut lru = LayerLru::new(1, 3);
        assert_eq!(keys.len() - replay(&mut lru, &keys), 12); // LRU: 12 faults
                                                              // On any sequence, no policy beats Belady at the same capacity.
        let mut s = 7u64;
        let keys: Vec<Key> = (0..3000)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
                ((s >> 60) as u16 % 3, ((s >> 40) % 16) as u16)
            })
            .collect();
        let opt = belady_hits(&keys, 12);
        assert!(replay(&mut LayerLru::new(3, 4), &keys) <= opt);
        assert!(replay(&mut LayerLfu::new(3, 4), &keys) <= opt);
    }
}
