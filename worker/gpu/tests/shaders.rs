//! The committed SPIR-V is what `shaders/build.sh` makes of the GLSL beside it (the test command
//! installs Debian's `glslc`), so a shader edited without rebuilding — or a binary edited by
//! hand — fails here.

use std::path::Path;
use std::process::Command;

#[test]
fn shaders_match_their_source() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let out = tempfile::tempdir().expect("a temporary directory");
    let status = Command::new("bash").arg(dir.join("build.sh")).arg(out.path()).status().expect("bash runs");
    assert!(status.success(), "shaders/build.sh failed (is `glslc` installed? apt-get install glslc)");
    let mut built: Vec<_> = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    built.sort();
    let mut committed: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).filter(|n| n.to_string_lossy().ends_with(".spv")).collect();
    committed.sort();
    assert_eq!(built, committed, "the committed .spv files are not the ones build.sh makes");
    for name in built {
        let (a, b) = (std::fs::read(out.path().join(&name)).unwrap(), std::fs::read(dir.join(&name)).unwrap());
        assert!(a == b, "shaders/{} differs from its source's build: run bash worker/gpu/shaders/build.sh", name.to_string_lossy());
    }
}
