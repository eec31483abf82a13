//! The one place a model directory is opened: a Hugging Face checkpoint or a shimmer container,
//! its spec, and its fingerprint (computed here, once). From it come the dense model, the routed
//! experts in this process's memory, or the routed experts in the tiered store under a RAM
//! budget — every verb, the worker and the tests build an engine or a worker from these.
//!
//! Must never: compute a fingerprint anywhere else; size an `auto` RAM budget two ways (what the
//! process already holds — its dense weights, if it loaded them — is subtracted here, once).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shimmer_common::quant::QuantScheme;
use shimmer_common::spec::LayerMlp;
use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_experts::InProcessExperts;
use shimmer_model::{load_dense, Decoder};
use shimmer_store::container::{Container, DENSE_FILE};
use shimmer_store::usage::{Usage, USAGE_FILE};
use shimmer_store::{ExpertStore, Source, StoreOptions};

use crate::engine::{EngineError, ExpertOptions, RamBudget, UsageFile};

/// Bytes kept free for everything else when the RAM budget is `auto`.
pub(crate) const AUTO_RESERVE_BYTES: u64 = 1 << 30;

enum Kind {
    Container(Box<Container>),
    Checkpoint(Arc<Checkpoint>),
}

/// An opened model directory.
pub struct ModelDir {
    pub dir: PathBuf,
    pub spec: ModelSpec,
    /// The model's identity: a container's, or a checkpoint's (config and safetensors headers).
    pub fingerprint: String,
    kind: Kind,
    /// When opening began (the engine reports its load time from here).
    pub opened_at: std::time::Instant,
}

impl ModelDir {
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let opened_at = std::time::Instant::now();
        if !dir.is_dir() {
            return Err(LoadError::malformed(dir, "not a directory (expected a Hugging Face checkpoint directory or a shimmer container)").into());
        }
        if dir.join(shimmer_store::convert::JOURNAL_FILE).exists() && !Container::is_container(dir) {
            return Err(LoadError::malformed(dir, "holds an unfinished conversion (run the same `shimmer convert` again to finish it)").into());
        }
        Container::check_manifest_present(dir)?;
        let spec = ModelSpec::from_dir(dir)?;
        let (kind, fingerprint) = if Container::is_container(dir) {
            let container = Container::open(dir, &spec)?;
            let fingerprint = container.fingerprint();
            (Kind::Container(Box::new(container)), fingerprint)
        } else {
            let ckpt = Checkpoint::open(dir)?;
            let config_path = dir.join("config.json");
            let fingerprint = ckpt.fingerprint(&std::fs::read(&config_path).map_err(|e| LoadError::io(&config_path, e))?);
            (Kind::Checkpoint(Arc::new(ckpt)), fingerprint)
        };
        Ok(ModelDir { dir: dir.to_path_buf(), spec, fingerprint, kind, opened_at })
    }

    pub fn is_container(&self) -> bool {
        matches!(self.kind, Kind::Container(_))
    }

    fn moe_experts(&self) -> u64 {
        self.spec.layers.iter().filter(|k| **k == LayerMlp::Moe).count() as u64 * self.spec.moe.num_experts as u64
    }

    /// Bytes of all routed experts and of the dense weights as stored, without loading either.
    pub fn sizes(&self) -> Result<(u64, u64), EngineError> {
        let on_disk = |name: &std::ffi::OsStr| -> bool { name.to_string_lossy().ends_with(".safetensors") };
        match &self.kind {
            Kind::Container(container) => {
                let path = self.dir.join(DENSE_FILE);
                let dense = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?.len();
                Ok((self.moe_experts() * container.expert_bytes(), dense))
            }
            Kind::Checkpoint(ckpt) => {
                let total: u64 = std::fs::read_dir(&self.dir)
                    .map_err(|e| LoadError::io(&self.dir, e))?
                    .flatten()
                    .filter(|e| on_disk(&e.file_name()))
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum();
                let experts = self.moe_experts() * Source::checkpoint(ckpt.clone(), &self.spec).expert_bytes();
                Ok((experts, total.saturating_sub(experts)))
            }
        }
    }

    /// The container's expert file and its blobs' `(offset, length)`; `None` for a checkpoint.
    pub fn expert_blobs(&self) -> Option<(PathBuf, Vec<(u64, u64)>)> {
        match &self.kind {
            Kind::Container(c) => Some((c.experts_path(), c.manifest.blobs.iter().map(|b| (b.offset, b.length)).collect())),
            Kind::Checkpoint(_) => None,
        }
    }

    /// The dense model, and the bytes of its weights on disk (what loading it takes).
    pub fn dense(&self) -> Result<(Decoder, u64), EngineError> {
        match &self.kind {
            Kind::Container(container) => {
                container.verify_dense()?;
                let ckpt = Checkpoint::open_files(&self.dir, &[DENSE_FILE])?;
                let path = self.dir.join(DENSE_FILE);
                let bytes = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?.len();
                Ok((load_dense(&ckpt, &self.spec)?, bytes))
            }
            Kind::Checkpoint(ckpt) => {
                let total: u64 = std::fs::read_dir(&self.dir)
                    .map_err(|e| LoadError::io(&self.dir, e))?
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum();
                let experts = self.moe_experts() * Source::checkpoint(ckpt.clone(), &self.spec).expert_bytes();
                Ok((load_dense(ckpt, &self.spec)?, total.saturating_sub(experts)))
            }
        }
    }

    /// Every routed expert in this process's memory, quantised to `scheme` (`Bf16` keeps the
    /// stored precision; other schemes are for measuring a format's quality only). A container's
    /// experts are read through the store instead.
    pub fn in_process_experts(&self, scheme: QuantScheme, activations: Option<shimmer_kernels::Activations>) -> Result<InProcessExperts, EngineError> {
        match &self.kind {
            Kind::Checkpoint(ckpt) => Ok(InProcessExperts::load_as_with(ckpt, &self.spec, scheme, activations)?),
            Kind::Container(_) => Err(EngineError::Input(format!("{}: a container's experts are read through the expert store", self.dir.display()))),
        }
    }

    /// The routed experts in the tiered store under `opts`. `resident_bytes` is what this process
    /// already holds besides the experts (its dense weights, or 0 for a worker), subtracted from
    /// the memory an `auto` budget may take.
    pub fn expert_store(&self, opts: &ExpertOptions, resident_bytes: u64) -> Result<ExpertStore, EngineError> {
        let source = match &self.kind {
            Kind::Container(container) => Source::container(container.as_ref().clone(), opts.mirror.as_deref(), opts.direct_io)?,
            Kind::Checkpoint(ckpt) => {
                if opts.direct_io || opts.mirror.is_some() {
                    return Err(EngineError::Input(format!(
                        "{}: O_DIRECT reads and mirrors need a converted container's one-blob-per-expert file; convert the checkpoint first (shimmer convert)",
                        self.dir.display()
                    )));
                }
                Source::checkpoint(ckpt.clone(), &self.spec)
            }
        };
        let all_bytes = self.moe_experts() * source.expert_bytes();
        let budget_bytes = match opts.ram.unwrap_or(RamBudget::Auto) {
            RamBudget::Gb(gb) => (gb * 1e9) as u64,
            RamBudget::Auto => mem_available().unwrap_or(0).saturating_sub(resident_bytes).saturating_sub(AUTO_RESERVE_BYTES).min(all_bytes),
        };
        let usage = match &opts.usage {
            UsageFile::Off => None,
            other => {
                let path = match other {
                    UsageFile::File(p) => p.clone(),
                    _ => self.dir.join(USAGE_FILE),
                };
                let shape: Vec<usize> = self.spec.layers.iter().map(|k| if *k == LayerMlp::Moe { self.spec.moe.num_experts } else { 0 }).collect();
                Some(Usage::open(&path, &self.fingerprint, &shape)?)
            }
        };
        let store = ExpertStore::open(
            source,
            &self.spec,
            StoreOptions {
                budget_bytes,
                prefetch: opts.prefetch,
                io_depth: opts.io_depth,
                io_engine: opts.io_engine,
                usage,
                assigned: opts.assigned.clone(),
                accelerator: opts.vram.clone().map(|t| t as std::sync::Arc<dyn shimmer_experts::Accelerator>),
            },
        )
        .map_err(|e| EngineError::Input(e.to_string()))?;
        tracing::info!(budget_bytes, all_bytes, resident_bytes, "expert store open");
        Ok(store)
    }
}

/// A `Key:   N kB` field of a /proc file, in bytes.
pub(crate) fn proc_kb_field(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.strip_prefix(key).is_some_and(|rest| rest.starts_with(':')))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn mem_available() -> Option<u64> {
    proc_kb_field("/proc/meminfo", "MemAvailable")
}
