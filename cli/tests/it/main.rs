//! The `agentstate` binary's tests: one test binary (see the main crate's
//! `tests/it`), with the main crate's throwaway-server fixtures.

#[allow(dead_code)]
#[path = "../../../tests/it/certs.rs"]
mod certs;
mod cli;
mod pg_cli;
// The main crate's fixtures, shared whole: this binary uses part of them
// (pg_server.rs allows its own unused parts).
#[path = "../../../tests/it/pg_server.rs"]
mod pg_server;
#[allow(dead_code)]
#[path = "../../../tests/it/redis_server.rs"]
mod redis_server;
