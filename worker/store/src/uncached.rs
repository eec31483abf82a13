//! Opening a file so that reads bypass the page cache — the one place that knows how each OS
//! spells it: Linux `O_DIRECT` (reads must then be aligned: `source::AlignedBuf`, blobs at
//! `BLOB_ALIGN`), macOS `F_NOCACHE` (no alignment rule). Elsewhere the file opens cached.
//!
//! Must never: silently fall back to cached reads where the OS has a way and refuses it — the
//! caller's error says what to do instead.

use std::fs::File;
use std::io;
use std::path::Path;

/// `path` opened for reading, bypassing the page cache when `direct`.
pub fn open(path: &Path, direct: bool) -> io::Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(target_os = "linux")]
    if direct {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = opts.open(path)?;
    #[cfg(target_os = "macos")]
    if direct {
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl on a descriptor this function owns, with an integer argument.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
            return Err(io::Error::last_os_error());
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    let _ = direct;
    Ok(file)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_direct_open_reads_what_a_cached_one_does() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        use std::os::unix::fs::FileExt;
        let mut cached = vec![0u8; 4096];
        super::open(&path, false).unwrap().read_exact_at(&mut cached, 4096).unwrap();
        assert_eq!(cached, data[4096..]);
        // tmpfs refuses O_DIRECT; where it is accepted the bytes are the same.
        if let Ok(f) = super::open(&path, true) {
            let mut buf = crate::source::AlignedBuf::new(4096);
            if f.read_exact_at(&mut buf, 4096).is_ok() {
                assert_eq!(&buf[..], &data[4096..]);
            }
        }
    }
}
