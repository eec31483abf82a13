//! Embeds the bundled demo model (`models/demo/` at the repository root) into the `shimmer`
//! binary: writes `$OUT_DIR/demo_files.rs` with every file's name and bytes (`include_bytes!`)
//! and a content hash that names the unpacked cache directory.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/demo");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<(String, std::path::PathBuf)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_file() {
                println!("cargo:rerun-if-changed={}", path.display());
                files.push((entry.file_name().to_string_lossy().into_owned(), path));
            }
        }
    }
    files.sort();
    // xxh3 (shimmer's one checksum) over names and contents: a change to any byte gives a new
    // cache directory.
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut feed = |bytes: &[u8]| hasher.update(bytes);
    let mut src = String::from("pub const DEMO_FILES: &[(&str, &[u8])] = &[\n");
    for (name, path) in &files {
        let bytes = std::fs::read(path).expect("read demo model file");
        feed(name.as_bytes());
        feed(&(bytes.len() as u64).to_le_bytes());
        feed(&bytes);
        let canonical = path.canonicalize().expect("canonical path");
        writeln!(src, "    ({name:?}, include_bytes!({:?})),", canonical.display().to_string()).unwrap();
    }
    src.push_str("];\n");
    writeln!(src, "pub const DEMO_HASH: &str = \"{:016x}\";", hasher.digest()).unwrap();
    let out = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("demo_files.rs");
    std::fs::write(out, src).expect("write demo_files.rs");
}
