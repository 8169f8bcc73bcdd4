use agentstate::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
fn main() {
    let url = std::env::args().nth(1).unwrap();
    let workers: usize = std::env::args().nth(2).unwrap().parse().unwrap();
    let secs: f64 = std::env::args().nth(3).unwrap().parse().unwrap();
    let s = Arc::new(PostgresStore::connect_with(&url, PgOptions::new().pool_size(16)).unwrap());
    s.setup().unwrap();
    let tag = std::process::id();
    for w in 0..workers {
        s.put_run(RunRecord::new(
            RunKey::new("p8", format!("{tag}-{w}")),
            "agent",
        ))
        .unwrap();
    }
    let t = Instant::now();
    let hs: Vec<_> = (0..workers)
        .map(|w| {
            let s = s.clone();
            std::thread::spawn(move || {
                let k = RunKey::new("p8", format!("{tag}-{w}"));
                let mut n = 0u64;
                while t.elapsed() < Duration::from_secs_f64(secs) {
                    s.patch_run(
                        &k,
                        StateDelta {
                            cost_micros: 1,
                            ..Default::default()
                        },
                    )
                    .unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    let n: u64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
    println!(
        "{workers} workers: {:.0} patches/s",
        n as f64 / t.elapsed().as_secs_f64()
    );
}
