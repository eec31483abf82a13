//! Where expert bytes come from: a container's experts file (one `pread` per expert, optionally
//! O_DIRECT, optionally on two drives), or an unconverted checkpoint (three tensors per expert).
//!
//! Owns: file handles, aligned buffers, checksum verification, mirror choice and fallback.
//! Must never: return an expert whose checksum did not match, or hide which file failed.

use std::alloc::{self, Layout};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use shimmer_common::expert_blob::{self, StoredExpert, StoredMatrix};
use shimmer_common::spec::ExpertActivation;
use shimmer_common::{Checkpoint, LoadError, ModelSpec};
use shimmer_kernels::matrix::WeightData;
use shimmer_kernels::Matrix;

use crate::container::Container;
use shimmer_experts::expert::ExpertBias;
use shimmer_experts::Expert;

/// A zeroed, 4096-byte-aligned buffer (what O_DIRECT reads need).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    /// Bytes allocated.
    len: usize,
    /// Bytes the slice views show (at most `len`).
    shown: usize,
}

// SAFETY: the buffer is uniquely owned heap memory.
unsafe impl Send for AlignedBuf {}
// SAFETY: a shared reference only reads it (writes need `&mut`).
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), expert_blob::BLOB_ALIGN).expect("valid layout");
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len, shown: len }
    }
}

impl AlignedBuf {
    /// The same allocation seen as its first `len` bytes (a reused buffer read a shorter blob);
    /// its full length is kept for when it is freed.
    pub fn truncated(mut self, len: usize) -> Self {
        self.shown = len.min(self.len);
        self
    }

    /// Bytes allocated, which may exceed what `truncated` shows.
    pub fn capacity(&self) -> usize {
        self.len
    }

    /// All of the allocation shown again, for its next read.
    pub fn reset(mut self) -> Self {
        self.shown = self.len;
        self
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len ≥ shown initialised (zeroed at allocation) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.shown) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.shown) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len.max(1), expert_blob::BLOB_ALIGN).expect("valid layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// One copy of the experts file.
pub struct Drive {
    pub path: PathBuf,
    file: File,
    /// Relative read bandwidth, measured at open; weights the expert → drive assignment.
    pub weight: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{0}")]
    Failed(String),
}

/// One blob's read from a drive, planned for a ring: the file descriptor stays open for the
/// source's life, which outlives every read the store submits.
#[derive(Debug, Clone, Copy)]
pub struct BlobRead {
    pub fd: std::os::fd::RawFd,
    pub offset: u64,
    pub len: usize,
}

/// Counters the source keeps (read by the store's telemetry).
#[derive(Default)]
pub struct SourceCounters {
    pub mirror_fallbacks: AtomicU64,
}

/// Read buffers kept for the next reads: a fresh one costs a zeroing and a page fault a page
/// before the read can even start (~6 % of a streaming decode's CPU on two cores). Bounded in
/// bytes, so that a burst of reads does not pin its peak for the process's life.
#[derive(Default)]
pub struct SpareBuffers(Mutex<Vec<AlignedBuf>>);

/// What the spare buffers may hold at most.
const SPARE_BUFFER_BYTES: usize = 64 << 20;

impl SpareBuffers {
    fn take(&self, len: usize) -> AlignedBuf {
        let mut spare = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match spare.iter().rposition(|b| b.capacity() >= len) {
            Some(i) => spare.swap_remove(i).reset().truncated(len),
            None => AlignedBuf::new(len),
        }
    }

    fn keep(&self, buf: AlignedBuf) {
        let mut spare = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if spare.iter().map(AlignedBuf::capacity).sum::<usize>() + buf.capacity() <= SPARE_BUFFER_BYTES {
            spare.push(buf);
        }
    }
}

/// A read buffer that an expert's matrices view in place (`shimmer_kernels::words`): it goes
/// back to the spare buffers when the last of them is dropped (the expert evicted).
struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<SpareBuffers>,
}

// SAFETY: the buffer is heap memory owned here, never written after the read that filled it
// (nothing hands out a mutable reference), and freed or pooled only when the owner is dropped.
unsafe impl shimmer_kernels::words::ByteOwner for PooledBuf {
    fn bytes(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.keep(buf);
        }
    }
}

/// An expert whose matrices view `buf` — a blob `expert_blob::check` passed, with its
/// `sections` — in place; the biases, a few KB, are copied. A section that cannot be viewed (see
/// `Words::shared`: a big-endian machine) makes it a copy instead, to the same values.
fn view_blob(buf: AlignedBuf, pool: &Arc<SpareBuffers>, container: &Container, sections: &[(usize, usize); 9], what: &str) -> Result<Expert, String> {
    use shimmer_common::quant::QuantScheme;
    use shimmer_kernels::words::{ByteOwner, Plain, Words};
    let owner: Arc<dyn ByteOwner> = Arc::new(PooledBuf { buf: Some(buf), pool: pool.clone() });
    fn view<T: Plain>(owner: &Arc<dyn ByteOwner>, (at, len): (usize, usize)) -> Option<Words<T>> {
        Words::shared(owner, at, len / std::mem::size_of::<T>()).ok()
    }
    let viewed = || -> Option<[Matrix; 3]> {
        let mut matrices = Vec::with_capacity(3);
        for (m, (rows, cols)) in expert_blob::matrix_shapes(container.shape).into_iter().enumerate() {
            let (d, s) = (sections[2 * m], sections[2 * m + 1]);
            let data = match container.scheme {
                QuantScheme::Bf16 => WeightData::Bf16(view(&owner, d)?),
                QuantScheme::Int8PerRow => WeightData::Int8 { q: view(&owner, d)?, scales: view(&owner, s)? },
                QuantScheme::Int4 { group } => WeightData::Int4 { packed: view(&owner, d)?, scales: view(&owner, s)?, group },
                QuantScheme::Mxfp4 => WeightData::Mxfp4 { packed: view(&owner, d)?, scales: view(&owner, s)? },
            };
            matrices.push(Matrix::new(rows, cols, data));
        }
        matrices.try_into().ok()
    };
    let bytes = owner.bytes();
    let Some([g, u, d]) = viewed() else {
        let copy = expert_blob::decode(bytes, container.scheme, container.shape, None, what).map_err(|e| e.to_string())?;
        return Ok(expert_from(copy, container.activation));
    };
    let bias = expert_blob::biases(bytes, container.shape, sections).map(|[gate, up, down]| ExpertBias { gate, up, down });
    Ok(Expert::new(g, u, d).with_form(bias, container.activation))
}

/// A blob read into `buf`, checked, as an expert viewing `buf` in place. `buf` goes back to the
/// spare buffers when the blob fails its checks, or with the expert's last matrix.
fn expert_from_read(
    buf: AlignedBuf,
    pool: &Arc<SpareBuffers>,
    container: &Container,
    checksum: (expert_blob::BlobId, u64),
    what: &str,
) -> Result<Expert, String> {
    match expert_blob::check(&buf, container.scheme, container.shape, Some(checksum), what) {
        Ok(sections) => view_blob(buf, pool, container, &sections, what),
        Err(e) => {
            pool.keep(buf);
            Err(e.to_string())
        }
    }
}

// One per store, held for the process's life: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    Container {
        container: Container,
        drives: Vec<Drive>,
        direct: bool,
        warned: Mutex<std::collections::HashSet<(usize, usize)>>,
        counters: SourceCounters,
        spare: Arc<SpareBuffers>,
    },
    Checkpoint {
        ckpt: Arc<Checkpoint>,
        spec: Box<ModelSpec>,
        first_moe: usize,
    },
}

fn open_drive(path: &Path, direct: bool) -> Result<File, LoadError> {
    let file = crate::uncached::open(path, direct).map_err(|e| {
        if direct && e.raw_os_error() == Some(libc::EINVAL) {
            LoadError::malformed(path, "this filesystem does not support O_DIRECT reads (e.g. tmpfs): read without O_DIRECT, or move the model")
        } else {
            LoadError::io(path, e)
        }
    })?;
    if direct {
        // Some filesystems accept O_DIRECT at open and refuse it at the first read.
        let mut probe = AlignedBuf::new(expert_blob::BLOB_ALIGN);
        file.read_at(&mut probe, 0).map_err(|e| LoadError::malformed(path, format!("an aligned O_DIRECT read failed ({e}): read without O_DIRECT")))?;
    }
    Ok(file)
}

impl Source {
    /// A container's experts file, and its mirror copy when given (checked to be the same
    /// container); each drive's bandwidth is measured with a few blob reads.
    pub fn container(container: Container, mirror: Option<&Path>, direct: bool) -> Result<Self, LoadError> {
        let mut drives = vec![Drive { path: container.experts_path(), file: open_drive(&container.experts_path(), direct)?, weight: 1.0 }];
        if let Some(m) = mirror {
            if crate::container::read_manifest(m)? != container.manifest {
                return Err(LoadError::malformed(m, "the mirror holds a different container than the model directory (manifests differ)"));
            }
            let path = m.join(crate::container::EXPERTS_FILE);
            let len = std::fs::metadata(&path).map_err(|e| LoadError::io(&path, e))?.len();
            if len != container.manifest.experts_file_bytes {
                return Err(LoadError::malformed(&path, format!("mirror copy is {len} bytes, the manifest says {}", container.manifest.experts_file_bytes)));
            }
            drives.push(Drive { file: open_drive(&path, direct)?, path, weight: 1.0 });
        }
        if drives.len() > 1 {
            let probes: Vec<_> = container.manifest.blobs.iter().take(8).map(|b| (b.offset, b.length as usize)).collect();
            for d in drives.iter_mut() {
                let t = Instant::now();
                let mut bytes = 0usize;
                for (off, len) in &probes {
                    let mut buf = AlignedBuf::new(*len);
                    if d.file.read_exact_at(&mut buf, *off).is_ok() {
                        bytes += len;
                    }
                }
                let gbps = bytes as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9;
                // Two significant digits: the assignment should not flicker with timing noise.
                d.weight = round_sig(gbps.max(1e-6), 2);
            }
        }
        Ok(Source::Container {
            container,
            drives,
            direct,
            warned: Mutex::new(Default::default()),
            counters: SourceCounters::default(),
            spare: Arc::new(SpareBuffers::default()),
        })
    }

    pub fn checkpoint(ckpt: Arc<Checkpoint>, spec: &ModelSpec) -> Self {
        let first_moe = spec.layers.iter().position(|k| *k == shimmer_common::spec::LayerMlp::Moe).unwrap_or(0);
        Source::Checkpoint { ckpt, spec: Box::new(spec.clone()), first_moe }
    }

    pub fn drives(&self) -> Vec<(PathBuf, f64)> {
        match self {
            Source::Container { drives, .. } => drives.iter().map(|d| (d.path.clone(), d.weight)).collect(),
            Source::Checkpoint { ckpt, .. } => vec![(ckpt.dir().to_path_buf(), 1.0)],
        }
    }

    pub fn mirror_fallbacks(&self) -> u64 {
        match self {
            Source::Container { counters, .. } => counters.mirror_fallbacks.load(Ordering::Relaxed),
            Source::Checkpoint { .. } => 0,
        }
    }

    /// Bytes one expert occupies in memory once read.
    pub fn expert_bytes(&self) -> u64 {
        match self {
            Source::Container { container, .. } => container.expert_bytes(),
            Source::Checkpoint { ckpt, spec, first_moe } => {
                // The first MoE layer's expert 0 tells the stored form (fp8 block scales, MXFP4
                // scales and biases included).
                match shimmer_experts::weights::load_expert(ckpt, spec, *first_moe, 0) {
                    Ok(e) => e.bytes() as u64,
                    Err(_) => (3 * spec.hidden_size * spec.moe.expert_intermediate_size * 2) as u64,
                }
            }
        }
    }

    /// A read buffer of `len` bytes (a spare one when one is large enough).
    pub fn spare_buffer(&self, len: usize) -> AlignedBuf {
        match self {
            Source::Container { spare, .. } => spare.take(len),
            Source::Checkpoint { .. } => AlignedBuf::new(len),
        }
    }

    /// Whether experts come from a container's experts file (one blob a read), which is what a
    /// ring of reads can serve; a checkpoint's experts are gathered from several tensors.
    pub fn is_container(&self) -> bool {
        matches!(self, Source::Container { .. })
    }

    /// The longest blob a read may fetch (0 for a checkpoint).
    pub fn largest_blob(&self) -> u64 {
        match self {
            Source::Container { container, .. } => container.manifest.blobs.iter().map(|b| b.length).max().unwrap_or(0),
            Source::Checkpoint { .. } => 0,
        }
    }

    /// Where one expert's blob lies on the drive a plain `read` would try first: the read a ring
    /// submits. `None` for a checkpoint or an expert the container does not hold (`read` then
    /// names the problem).
    pub fn blob_read(&self, layer: usize, expert: usize) -> Option<BlobRead> {
        let Source::Container { container, drives, .. } = self else { return None };
        let loc = container.location(layer, expert)?;
        let drive = &drives[choose_drive(drives, layer, expert)];
        Some(BlobRead { fd: std::os::fd::AsRawFd::as_raw_fd(&drive.file), offset: loc.offset, len: usize::try_from(loc.length).ok()? })
    }

    /// Verifies a blob that a ring read as `blob_read` planned it, and makes it an expert that
    /// views `buf` in place (`buf` goes back to the spare buffers when the expert is dropped, or
    /// at once when the blob fails); an error names the drive, layer and expert (the caller then
    /// falls back to `read`, which tries every copy).
    pub fn decode_blob(&self, layer: usize, expert: usize, buf: AlignedBuf) -> Result<(Expert, u64), String> {
        let Source::Container { container, drives, spare, .. } = self else { return Err(format!("layer {layer} expert {expert}: not a container")) };
        let loc = container.location(layer, expert).ok_or_else(|| format!("layer {layer} expert {expert}: not in the container"))?;
        let drive = &drives[choose_drive(drives, layer, expert)];
        let what = format!("{} layer {layer} expert {expert}", drive.path.display());
        if buf.len() as u64 != loc.length {
            let why = format!("{what}: read {} bytes of {}", buf.len(), loc.length);
            spare.keep(buf);
            return Err(why);
        }
        Ok((expert_from_read(buf, spare, container, (loc.id, loc.checksum), &what)?, loc.length))
    }

    /// Reads one expert; returns it and the bytes read from storage.
    pub fn read(&self, layer: usize, expert: usize) -> Result<(Expert, u64), ReadError> {
        match self {
            Source::Container { container, drives, warned, counters, spare, .. } => {
                let loc = container.location(layer, expert).ok_or_else(|| ReadError::Failed(format!("layer {layer} expert {expert}: not in the container")))?;
                let first = choose_drive(drives, layer, expert);
                let order: Vec<usize> = std::iter::once(first).chain((0..drives.len()).filter(|d| *d != first)).collect();
                let mut failures = Vec::new();
                for (attempt, d) in order.iter().enumerate() {
                    let drive = &drives[*d];
                    let what = format!("{} layer {layer} expert {expert}", drive.path.display());
                    let mut buf = spare.take(loc.length as usize);
                    let result = match drive.file.read_exact_at(&mut buf, loc.offset) {
                        Ok(()) => expert_from_read(buf, spare, container, (loc.id, loc.checksum), &what),
                        Err(e) => {
                            spare.keep(buf);
                            Err(format!("{what}: read failed: {e}"))
                        }
                    };
                    match result {
                        Ok(found) => {
                            if attempt > 0 {
                                counters.mirror_fallbacks.fetch_add(1, Ordering::Relaxed);
                                if warned.lock().unwrap_or_else(|e| e.into_inner()).insert((layer, expert)) {
                                    tracing::warn!("{}; served from {} instead", failures.join("; "), drive.path.display());
                                }
                            }
                            return Ok((found, loc.length));
                        }
                        Err(e) => failures.push(e),
                    }
                }
                Err(ReadError::Failed(failures.join("; ")))
            }
            Source::Checkpoint { ckpt, spec, .. } => {
                let e = shimmer_experts::weights::load_expert(ckpt, spec, layer, expert).map_err(|e| ReadError::Failed(e.to_string()))?;
                let bytes = e.bytes() as u64;
                Ok((e, bytes))
            }
        }
    }
}

fn expert_from(stored: StoredExpert, activation: ExpertActivation) -> Expert {
    let m = |s: StoredMatrix| match s {
        StoredMatrix::Bf16 { rows, cols, words } => Matrix::new(rows, cols, WeightData::Bf16(words.into())),
        StoredMatrix::Quant(q) => Matrix::from_quant(q),
    };
    let [g, u, d] = stored.matrices;
    let bias = stored.bias.map(|[gate, up, down]| ExpertBias { gate, up, down });
    Expert::new(m(g), m(u), m(d)).with_form(bias, activation)
}

fn round_sig(x: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits - 1 - x.log10().floor() as i32);
    (x * scale).round() / scale
}

/// Weighted rendezvous hashing: each expert goes to the drive maximising `weight / -ln(u)`, `u`
/// a hash of (layer, expert, drive) in (0, 1). Deterministic for given weights; a drive's share
/// is proportional to its weight; removing a drive moves only its own experts.
pub fn choose_drive(drives: &[Drive], layer: usize, expert: usize) -> usize {
    choose_weighted(&drives.iter().map(|d| d.weight).collect::<Vec<_>>(), layer, expert)
}

pub fn choose_weighted(weights: &[f64], layer: usize, expert: usize) -> usize {
    let mut best = (0, f64::NEG_INFINITY);
    for (d, w) in weights.iter().enumerate() {
        let key = ((layer as u64) << 40) ^ ((expert as u64) << 8) ^ d as u64;
        let h = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
        let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let score = w / -u.ln();
        if score > best.1 {
            best = (d, score);
        }
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_assignment_is_deterministic_and_proportional() {
        let weights = [1.0, 3.0];
        let mut on = [0usize; 2];
        for l in 0..20 {
            for e in 0..200 {
                let d = choose_weighted(&weights, l, e);
                assert_eq!(d, choose_weighted(&weights, l, e));
                on[d] += 1;
            }
        }
        let share = on[1] as f64 / 4000.0;
        assert!((share - 0.75).abs() < 0.03, "drive 1 got {share}");
        assert_eq!(round_sig(1.2345, 2), 1.2);
        assert_eq!(round_sig(0.0456, 2), 0.046);
    }

    #[test]
    fn aligned_buffers_are_aligned() {
        for len in [1, 4096, 12288] {
            let b = AlignedBuf::new(len);
            assert_eq!(b.as_ptr() as usize % 4096, 0);
            assert_eq!(b.len(), len);
        }
    }

    /// The demo model converted to `scheme`, and its store source.
    fn demo_source(scheme: shimmer_common::quant::QuantScheme, dir: &Path) -> (Source, ModelSpec, usize) {
        let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo");
        let opts = crate::convert::ConvertOptions { expert_quant: scheme, dense_quant: crate::convert::DenseQuant::Bf16, head_quant: None };
        crate::convert::convert(&demo, dir, opts, &mut |_| {}).expect("convert the demo model");
        let spec = ModelSpec::from_dir(dir).expect("the container's spec");
        let layer = spec.layers.iter().position(|k| *k == shimmer_common::spec::LayerMlp::Moe).expect("a MoE layer");
        let container = Container::open(dir, &spec).expect("open the container");
        (Source::container(container, None, false).expect("a source"), spec, layer)
    }

    fn spare_bytes(source: &Source) -> usize {
        let Source::Container { spare, .. } = source else { return 0 };
        spare.0.lock().unwrap().iter().map(AlignedBuf::capacity).sum()
    }

    #[test]
    fn a_read_expert_views_its_read_buffer_which_returns_to_the_spares_when_it_is_dropped() {
        use shimmer_common::quant::QuantScheme;
        for scheme in [QuantScheme::Int4 { group: 32 }, QuantScheme::Int8PerRow, QuantScheme::Mxfp4, QuantScheme::Bf16] {
            let dir = tempfile::tempdir().unwrap();
            let (source, _spec, layer) = demo_source(scheme, dir.path());
            let Source::Container { container, .. } = &source else { unreachable!() };
            let loc = container.location(layer, 3).unwrap();
            let mut blob = vec![0u8; loc.length as usize];
            std::fs::File::open(container.experts_path()).unwrap().read_exact_at(&mut blob, loc.offset).unwrap();
            let copied = expert_from(expert_blob::decode(&blob, container.scheme, container.shape, None, "test").unwrap(), container.activation);

            let (viewed, bytes) = source.read(layer, 3).unwrap();
            assert_eq!(bytes, loc.length);
            let views = |e: &Expert| {
                [&e.gate, &e.up, &e.down].iter().all(|m| match &m.data {
                    WeightData::Bf16(w) => w.is_shared(),
                    WeightData::Int8 { q, scales } => q.is_shared() && scales.is_shared(),
                    WeightData::Int4 { packed, scales, .. } => packed.is_shared() && scales.is_shared(),
                    WeightData::Mxfp4 { packed, scales } => packed.is_shared() && scales.is_shared(),
                    _ => false,
                })
            };
            assert!(views(&viewed), "{scheme:?}: the matrices view the read buffer");
            assert!(!views(&copied));
            for (v, c) in [(&viewed.gate, &copied.gate), (&viewed.up, &copied.up), (&viewed.down, &copied.down)] {
                assert_eq!(v, c, "{scheme:?}: the same stored values as a copy");
            }
            let x: Vec<f32> = (0..viewed.gate.cols).map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0).collect();
            let forward = |e: &Expert| {
                let mut out = vec![0f32; e.down.rows];
                e.forward(&x, &mut Default::default(), &mut out);
                out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            assert_eq!(forward(&viewed), forward(&copied), "{scheme:?}: the same outputs");

            assert_eq!(spare_bytes(&source), 0, "the buffer is the expert's while it lives");
            drop(viewed);
            assert!(spare_bytes(&source) >= loc.length as usize, "{scheme:?}: the buffer is a spare again once the expert is gone");
        }
    }

    #[test]
    fn a_blob_that_fails_its_checksum_is_refused_and_its_buffer_kept_for_the_next_read() {
        let dir = tempfile::tempdir().unwrap();
        let (source, _spec, layer) = demo_source(shimmer_common::quant::QuantScheme::Int4 { group: 32 }, dir.path());
        let read = source.blob_read(layer, 5).unwrap();
        let mut buf = source.spare_buffer(read.len);
        let Source::Container { container, .. } = &source else { unreachable!() };
        std::fs::File::open(container.experts_path()).unwrap().read_exact_at(&mut buf, read.offset).unwrap();
        buf[100] ^= 1;
        let e = source.decode_blob(layer, 5, buf).err().expect("a flipped bit is caught");
        assert!(e.contains("checksum mismatch") && e.contains(&format!("layer {layer} expert 5")), "{e}");
        assert!(spare_bytes(&source) >= read.len);
    }
}
