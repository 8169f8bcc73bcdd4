//! Replays the fuzz targets' checks as ordinary tests: every input
//! committed under `tests/fuzz_regressions/<target>/` (minimized findings,
//! each fixed), plus a few seeded inputs so the differential `ops` check
//! runs on every `cargo test`, not only under the fuzzer.

use std::path::Path;

#[path = "../../fuzz/check/mod.rs"]
#[allow(dead_code)]
mod check;

/// Runs `check` on every file of `tests/fuzz_regressions/<target>/`.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz_regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return 0;
    };
    let mut paths: Vec<_> = entries.map(|e| e.expect("read_dir entry").path()).collect();
    paths.sort();
    for p in &paths {
        let data = std::fs::read(p).expect("read regression input");
        eprintln!("replaying {}", p.display());
        check(&data);
    }
    paths.len()
}

/// Deterministic pseudo-random inputs (xorshift64*), for the seeded runs.
fn seeded(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.max(1);
    (0..len)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

#[test]
fn fuzz_regressions_ops() {
    replay("ops", check::ops::run);
}

#[test]
fn fuzz_regressions_codec() {
    replay("codec", check::codec::run);
}

#[test]
fn fuzz_regressions_scrub() {
    replay("scrub", check::scrub::run);
}

#[test]
fn fuzz_ops_seeded_inputs_agree_with_the_model() {
    for seed in 1..=24u64 {
        check::ops::run(&seeded(seed, 400));
    }
}

#[test]
fn fuzz_ops_seeded_spend_cap_sequences_agree_with_the_model() {
    for seed in 1..=48u64 {
        check::ops::run_caps_biased(&seeded(seed * 7919, 400));
    }
}

#[test]
fn fuzz_codec_seeded_inputs() {
    for seed in 1..=500u64 {
        check::codec::run(&seeded(seed, 1 + (seed as usize * 7) % 300));
    }
}

#[test]
fn fuzz_scrub_seeded_inputs() {
    for seed in 1..=300u64 {
        check::scrub::run(&seeded(seed, 1 + (seed as usize * 13) % 400));
    }
}
