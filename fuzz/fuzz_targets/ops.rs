#![no_main]

use std::path::PathBuf;
use std::sync::LazyLock;

// The check lives in fuzz/check/ so tests/it/fuzz_regressions.rs can
// replay committed findings through the very same code.
#[path = "../check/mod.rs"]
#[allow(dead_code)]
mod check;

/// Stores live on tmpfs when there is one: the check is about logic, and
/// syncs to a real disk would make each input cost tens of milliseconds.
fn scratch() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// One empty store per fuzzing process, copied for every input.
static TEMPLATE: LazyLock<(tempfile::TempDir, PathBuf)> = LazyLock::new(|| {
    let dir = tempfile::tempdir_in(scratch()).expect("temp dir");
    let path = dir.path().join("template");
    check::ops::make_template(&path);
    (dir, path)
});

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let template = &TEMPLATE.1;
    let dir = tempfile::tempdir_in(scratch()).expect("temp dir");
    check::ops::run_at(data, &dir.path().join("store"), Some(template));
});
