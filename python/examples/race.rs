//! The Rust side of the two-language test (tests/test_two_languages.py):
//! a process that writes one run of a PostgreSQL database at the version
//! it is told, racing a Python process that writes the same run at the
//! same version. Exactly one of the two wins each round.
//!
//! Usage: `race <dsn> <tenant> <run_id>`, then one line `put <version>` a
//! round on stdin; it answers `won <version>`, `lost <expected> <actual>`
//! or `error <message>` on stdout.

use std::io::{BufRead, Write};

use agentstate::{PostgresStore, RunKey, StateError, StateStore};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, dsn, tenant, run_id] = args.as_slice() else {
        eprintln!("usage: race <dsn> <tenant> <run_id>");
        std::process::exit(2);
    };
    let store = PostgresStore::connect(dsn).expect("a valid DSN");
    store.setup().expect("setup");
    let key = RunKey::new(tenant.as_str(), run_id.as_str());
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").expect("stdout");
    out.flush().expect("stdout");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        let Some(version) = line
            .strip_prefix("put ")
            .and_then(|v| v.parse::<u64>().ok())
        else {
            writeln!(out, "error bad line {line:?}").expect("stdout");
            continue;
        };
        let answer = match store.get_run(&key) {
            Ok(Some(mut run)) => {
                run.version = version;
                run.agent_name = format!("rust-{version}");
                match store.put_run(run) {
                    Ok(stored) => format!("won {}", stored.version),
                    Err(StateError::Conflict {
                        expected, actual, ..
                    }) => {
                        format!("lost {expected} {actual}")
                    }
                    Err(e) => format!("error {e}"),
                }
            }
            Ok(None) => "error the run does not exist".to_string(),
            Err(e) => format!("error {e}"),
        };
        writeln!(out, "{answer}").expect("stdout");
        out.flush().expect("stdout");
    }
}
