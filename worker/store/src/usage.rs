//! The routing-heat file the store learns its pinned set from: how often each (layer, expert) was
//! selected, kept beside the model (`shimmer-usage.json`), keyed to the model's fingerprint.
//!
//! Saving merges: the file on disk is re-read and this run's new counts are added to it, so runs
//! that overlap or follow each other all contribute; the write is atomic (temp + rename).
//!
//! Must never: accept a file of another model, format version or shape — a usage file only ever
//! changes speed, but a foreign one would silently pin the wrong experts.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shimmer_common::LoadError;

pub const USAGE_FILE: &str = "shimmer-usage.json";
pub const USAGE_VERSION: u32 = 1;
const MAX_USAGE_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UsageFile {
    pub format: String,
    pub version: u32,
    pub fingerprint: String,
    /// Selections counted (rows × top_k, summed over layers).
    pub selections: u64,
    /// `[layer][expert]` selection counts; empty rows for dense layers.
    pub counts: Vec<Vec<u64>>,
}

/// Heat for one model, as learned so far and as added by this run.
pub struct Usage {
    pub path: PathBuf,
    fingerprint: String,
    /// What the file held when read (or last saved).
    pub base: Vec<Vec<u64>>,
    /// Counted since then.
    pub delta: Vec<Vec<u64>>,
}

impl Usage {
    /// Reads `path` if it exists (refusing one of another model or shape), else starts empty.
    /// `experts_per_layer[l]` is 0 for dense layers.
    pub fn open(path: &Path, fingerprint: &str, experts_per_layer: &[usize]) -> Result<Self, LoadError> {
        let empty: Vec<Vec<u64>> = experts_per_layer.iter().map(|n| vec![0; *n]).collect();
        let base = match read(path, fingerprint, experts_per_layer)? {
            Some(file) => file.counts,
            None => empty.clone(),
        };
        Ok(Usage { path: path.to_path_buf(), fingerprint: fingerprint.to_string(), base, delta: empty })
    }

    pub fn record(&mut self, layer: usize, expert: usize) {
        if let Some(c) = self.delta.get_mut(layer).and_then(|l| l.get_mut(expert)) {
            *c += 1;
        }
    }

    /// Per layer, up to `per_layer` experts by learned heat (hottest first; never unused ones).
    pub fn hottest(&self, per_layer: usize) -> Vec<Vec<u16>> {
        self.base
            .iter()
            .map(|counts| {
                let mut order: Vec<usize> = (0..counts.len()).filter(|e| counts[*e] > 0).collect();
                order.sort_by_key(|e| (std::cmp::Reverse(counts[*e]), *e));
                order.into_iter().take(per_layer).map(|e| e as u16).collect()
            })
            .collect()
    }

    /// Adds this run's new counts to the file on disk (re-read now, so concurrent runs merge).
    pub fn save(&mut self) -> Result<(), LoadError> {
        if self.delta.iter().flatten().all(|c| *c == 0) {
            return Ok(());
        }
        let shape: Vec<usize> = self.base.iter().map(Vec::len).collect();
        let mut counts = match read(&self.path, &self.fingerprint, &shape)? {
            Some(file) => file.counts,
            None => shape.iter().map(|n| vec![0; *n]).collect(),
        };
        for (row, add) in counts.iter_mut().zip(&self.delta) {
            for (c, a) in row.iter_mut().zip(add) {
                *c = c.saturating_add(*a);
            }
        }
        let file = UsageFile {
            format: "shimmer-usage".into(),
            version: USAGE_VERSION,
            fingerprint: self.fingerprint.clone(),
            selections: counts.iter().flatten().sum(),
            counts: counts.clone(),
        };
        let json = serde_json::to_vec(&file).map_err(|e| LoadError::malformed(&self.path, e.to_string()))?;
        let tmp = self.path.with_extension(format!("json.{}.partial", std::process::id()));
        std::fs::write(&tmp, json).map_err(|e| LoadError::io(&tmp, e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| LoadError::io(&self.path, e))?;
        self.base = counts;
        self.delta.iter_mut().flatten().for_each(|c| *c = 0);
        Ok(())
    }
}

fn read(path: &Path, fingerprint: &str, shape: &[usize]) -> Result<Option<UsageFile>, LoadError> {
    if !path.exists() {
        return Ok(None);
    }
    let value = shimmer_common::spec::read_json_file(path, MAX_USAGE_BYTES)?;
    let bad = |p: String| LoadError::malformed(path, p);
    if value.get("format").and_then(|v| v.as_str()) != Some("shimmer-usage") {
        return Err(bad("not a shimmer usage file".into()));
    }
    match value.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == USAGE_VERSION as u64 => {}
        other => return Err(bad(format!("usage file version {other:?}; this build reads {USAGE_VERSION} (delete the file to start learning again)"))),
    }
    let file: UsageFile = serde_json::from_value(value).map_err(|e| bad(format!("invalid usage file: {e}")))?;
    if file.fingerprint != fingerprint {
        return Err(bad(format!(
            "usage file of another model (fingerprint {}, this model is {fingerprint}); delete it or keep this model's heat in another file",
            file.fingerprint
        )));
    }
    if file.counts.iter().map(Vec::len).ne(shape.iter().copied()) {
        return Err(bad("usage counts do not match the model's layers and experts".into()));
    }
    Ok(Some(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heat_persists_merges_across_runs_and_refuses_another_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(USAGE_FILE);
        let shape = [0, 4, 4];
        let mut a = Usage::open(&path, "aaaa", &shape).unwrap();
        let mut b = Usage::open(&path, "aaaa", &shape).unwrap();
        for _ in 0..3 {
            a.record(1, 2);
        }
        a.record(2, 0);
        b.record(1, 3);
        a.save().unwrap();
        b.save().unwrap(); // merges with a's counts, does not overwrite them
        let c = Usage::open(&path, "aaaa", &shape).unwrap();
        assert_eq!(c.base, vec![vec![], vec![0, 0, 3, 1], vec![1, 0, 0, 0]]);
        assert_eq!(c.hottest(1), vec![vec![], vec![2], vec![0]]);
        assert_eq!(c.hottest(9), vec![vec![], vec![2, 3], vec![0]]);
        let e = Usage::open(&path, "bbbb", &shape).err().unwrap().to_string();
        assert!(e.contains("another model") && e.contains(USAGE_FILE), "{e}");
        let e = Usage::open(&path, "aaaa", &[0, 4, 5]).err().unwrap().to_string();
        assert!(e.contains("do not match"), "{e}");
        std::fs::write(&path, b"{\"format\":\"shimmer-usage\",\"version\":9}").unwrap();
        assert!(Usage::open(&path, "aaaa", &shape).err().unwrap().to_string().contains("version"));
    }
}
