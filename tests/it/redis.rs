//! The Redis backend against real servers: durability settings, a SIGKILL
//! of the server during an 8-thread workload, and two OS processes racing.
//! (The conformance suite runs on it in `conformance.rs`.)

use agentstate::{Options, RedisOptions, RedisStore, StateError, StoreAdmin};

use crate::redis_server::{Server, temp_dir};

/// `require_fsync` (the default) refuses a server with `appendfsync
/// everysec`, naming the setting; without it the store connects and says
/// what an `Ok` survives.
#[test]
fn require_fsync_refuses_everysec() {
    let server = Server::start(&temp_dir("everysec"), &["--appendfsync", "everysec"]);
    let e = RedisStore::connect(&server.url(0)).expect_err("everysec must be refused");
    assert!(e.is_retryable() || matches!(e, StateError::Persistence { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("appendfsync always"), "names the setting: {msg}");
    assert!(msg.contains("everysec"), "names what it found: {msg}");
    let s = RedisStore::connect_with(&server.url(0), RedisOptions::new().require_fsync(false))
        .expect("require_fsync(false) connects");
    let backend = s.stats().expect("stats").backend;
    assert!(backend.contains("everysec"), "stats shows the mode: {backend}");
    let fsynced = Server::start(&temp_dir("always"), &[]);
    let s = RedisStore::connect(&fsynced.url(0)).expect("appendfsync always connects");
    assert!(s.stats().expect("stats").backend.contains("appendfsync always"));
    let _ = Options::new();
}
