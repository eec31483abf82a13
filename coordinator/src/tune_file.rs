//! `shimmer-tune.json`: what `shimmer tune` measured as best for a model on this machine —
//! compute threads, I/O depth, the RAM for experts — written beside the model and read by every
//! verb that runs it, under the flags (a flag given wins).
//!
//! Must never: accept a value outside the bounds the flags have, or a file of another version,
//! without an error naming the file; read more than `MAX_BYTES` of it.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The file's name beside the model.
pub const FILE_NAME: &str = "shimmer-tune.json";
/// The version this shimmer writes and reads.
pub const VERSION: u32 = 1;
/// Largest file read (it holds a few numbers and the measurements behind them).
const MAX_BYTES: u64 = 1 << 20;
/// Most compute threads a file or flag may ask for.
pub const MAX_THREADS: usize = 1024;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuneFile {
    pub version: u32,
    /// The CPU it was measured on (informative).
    pub cpu: String,
    pub threads: Option<usize>,
    pub io_depth: Option<usize>,
    /// RAM for the expert cache in GB (`--ram-gb`).
    pub ram_gb: Option<f64>,
    /// What the choices rest on.
    pub measured: Measured,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    /// `(threads, decode tok/s)`.
    pub decode_tok_s_by_threads: Vec<(usize, f64)>,
    /// `(depth, GB/s)` reading the model's expert blobs (a container only).
    pub disk_gb_s_by_depth: Vec<(usize, f64)>,
    pub experts_bytes: u64,
    pub dense_bytes: u64,
    pub available_memory_bytes: Option<u64>,
}

impl TuneFile {
    pub fn path_beside(dir: &Path) -> PathBuf {
        dir.join(FILE_NAME)
    }

    /// The tune file beside the model in `dir`, if there is one; an unreadable or invalid one is
    /// an error naming it.
    pub fn read_beside(dir: &Path) -> Result<Option<TuneFile>, String> {
        let path = Self::path_beside(dir);
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let mut text = String::new();
        file.take(MAX_BYTES + 1).read_to_string(&mut text).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if text.len() as u64 > MAX_BYTES {
            return Err(format!("{} is over {MAX_BYTES} bytes; remove it or run `shimmer tune` again", path.display()));
        }
        Self::parse(&text).map(Some).map_err(|e| format!("{}: {e}; remove it or run `shimmer tune` again", path.display()))
    }

    pub fn parse(text: &str) -> Result<TuneFile, String> {
        let t: TuneFile = serde_json::from_str(text).map_err(|e| format!("not a tune file: {e}"))?;
        if t.version != VERSION {
            return Err(format!("version {} (this shimmer reads version {VERSION})", t.version));
        }
        t.check()?;
        Ok(t)
    }

    /// Every choice within the bounds its flag has.
    pub fn check(&self) -> Result<(), String> {
        if let Some(n) = self.threads {
            if n == 0 || n > MAX_THREADS {
                return Err(format!("threads {n} is not between 1 and {MAX_THREADS}"));
            }
        }
        if let Some(d) = self.io_depth {
            if d == 0 || d > 256 {
                return Err(format!("io_depth {d} is not between 1 and 256"));
            }
        }
        if let Some(g) = self.ram_gb {
            if !(g.is_finite() && g > 0.0 && g <= 1e6) {
                return Err(format!("ram_gb {g} is not a size in (0, 1e6] GB"));
            }
        }
        Ok(())
    }

    /// Written next to the model, through a temporary file, so a reader never sees half of it.
    pub fn write_to(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(self).map_err(std::io::Error::other)? + "\n")?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> TuneFile {
        TuneFile {
            version: VERSION,
            cpu: "test".into(),
            threads: Some(2),
            io_depth: Some(16),
            ram_gb: Some(1.5),
            measured: Measured {
                decode_tok_s_by_threads: vec![(1, 10.0), (2, 18.0)],
                disk_gb_s_by_depth: vec![(1, 0.5), (16, 1.5)],
                experts_bytes: 1000,
                dense_bytes: 10,
                available_memory_bytes: Some(1 << 30),
            },
        }
    }

    #[test]
    fn a_tune_file_round_trips_and_bad_values_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(TuneFile::read_beside(dir.path()).unwrap(), None);
        sample().write_to(&TuneFile::path_beside(dir.path())).unwrap();
        assert_eq!(TuneFile::read_beside(dir.path()).unwrap(), Some(sample()));
        let text = serde_json::to_string(&sample()).unwrap();
        for (from, to, needle) in [
            ("\"threads\":2", "\"threads\":0", "threads 0"),
            ("\"threads\":2", "\"threads\":5000", "threads 5000"),
            ("\"io_depth\":16", "\"io_depth\":999", "io_depth 999"),
            ("\"ram_gb\":1.5", "\"ram_gb\":-1.0", "ram_gb -1"),
            ("\"version\":1", "\"version\":7", "version 7"),
            ("\"cpu\"", "\"extra\":1,\"cpu\"", "unknown field"),
        ] {
            let bad = text.replace(from, to);
            assert_ne!(bad, text, "{from}");
            let err = TuneFile::parse(&bad).unwrap_err();
            assert!(err.contains(needle), "{to}: {err}");
            std::fs::write(TuneFile::path_beside(dir.path()), &bad).unwrap();
            let err = TuneFile::read_beside(dir.path()).unwrap_err();
            assert!(err.contains(FILE_NAME) && err.contains(needle), "{err}");
        }
        std::fs::write(TuneFile::path_beside(dir.path()), vec![b' '; (MAX_BYTES + 1) as usize]).unwrap();
        assert!(TuneFile::read_beside(dir.path()).unwrap_err().contains("over"));
    }
}
