#![no_main]

// The check lives in fuzz/check/ so tests/it/fuzz_regressions.rs can
// replay committed findings through the very same code.
#[path = "../check/mod.rs"]
#[allow(dead_code)]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::scrub::run(data));
