//! The bundled demo model: its files are compiled into the binary (see `build.rs`) and unpacked
//! once to `$XDG_CACHE_HOME/shimmer/models/demo-<hash>/` (or `~/.cache/…`), so the engine reads
//! it from disk through exactly the code path a user's own model takes.
//!
//! Unpacking is atomic: files go to a private temporary directory, are synced, and the directory
//! is renamed into place. A reader never sees a half-written model; concurrent first runs race
//! harmlessly (the loser removes its copy). A cached copy whose file sizes no longer match is
//! unpacked again.

use std::io::Write;
use std::path::{Path, PathBuf};

include!(concat!(env!("OUT_DIR"), "/demo_files.rs"));

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("this build of shimmer has no bundled demo model (models/demo/ was empty when it was built); pass --model DIR")]
    NotBundled,
    #[error("cannot find a cache directory: set XDG_CACHE_HOME or HOME, or pass --model DIR")]
    NoCacheDir,
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DemoError + '_ {
    move |source| DemoError::Io { path: path.to_path_buf(), source }
}

/// `$XDG_CACHE_HOME/shimmer/models`, else `$HOME/.cache/shimmer/models`.
pub fn models_cache_dir() -> Result<PathBuf, DemoError> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(x) => PathBuf::from(x),
        None => PathBuf::from(std::env::var_os("HOME").filter(|v| !v.is_empty()).ok_or(DemoError::NoCacheDir)?).join(".cache"),
    };
    Ok(base.join("shimmer").join("models"))
}

/// The unpacked demo model's directory, unpacking it first if needed.
pub fn demo_model_dir() -> Result<PathBuf, DemoError> {
    if DEMO_FILES.is_empty() {
        return Err(DemoError::NotBundled);
    }
    let root = models_cache_dir()?;
    let target = root.join(format!("demo-{DEMO_HASH}"));
    if is_intact(&target) {
        return Ok(target);
    }
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let tmp = root.join(format!(".demo-{DEMO_HASH}.tmp-{}-{}", std::process::id(), nanos()));
    let result = write_all(&tmp).and_then(|()| publish(&tmp, &target));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result.map(|()| target)
}

fn nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

fn is_intact(dir: &Path) -> bool {
    DEMO_FILES.iter().all(|(name, bytes)| std::fs::metadata(dir.join(name)).is_ok_and(|m| m.is_file() && m.len() == bytes.len() as u64))
}

fn write_all(tmp: &Path) -> Result<(), DemoError> {
    std::fs::create_dir_all(tmp).map_err(io(tmp))?;
    for (name, bytes) in DEMO_FILES {
        let path = tmp.join(name);
        let mut f = std::fs::File::create(&path).map_err(io(&path))?;
        f.write_all(bytes).map_err(io(&path))?;
        f.sync_all().map_err(io(&path))?;
    }
    std::fs::File::open(tmp).and_then(|d| d.sync_all()).map_err(io(tmp))
}

fn publish(tmp: &Path, target: &Path) -> Result<(), DemoError> {
    match std::fs::rename(tmp, target) {
        Ok(()) => {}
        // Someone else published first: theirs is as good as ours.
        Err(_) if is_intact(target) => {
            let _ = std::fs::remove_dir_all(tmp);
        }
        // A damaged copy is in the way: replace it.
        Err(_) if target.exists() => {
            let aside = target.with_extension(format!("stale-{}-{}", std::process::id(), nanos()));
            std::fs::rename(target, &aside).map_err(io(target))?;
            let _ = std::fs::remove_dir_all(&aside);
            if let Err(e) = std::fs::rename(tmp, target) {
                if !is_intact(target) {
                    return Err(io(target)(e));
                }
                let _ = std::fs::remove_dir_all(tmp);
            }
        }
        Err(e) => return Err(io(target)(e)),
    }
    if let Some(parent) = target.parent() {
        let _ = std::fs::File::open(parent).and_then(|d| d.sync_all());
    }
    Ok(())
}
