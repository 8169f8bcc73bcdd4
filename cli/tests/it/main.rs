//! The `agentstate` binary's tests: one test binary (see the main crate's
//! `tests/it`), with the main crate's throwaway-server fixtures.

mod cli;
mod pg_cli;
#[path = "../../../tests/it/pg_server.rs"]
mod pg_server;
#[path = "../../../tests/it/redis_server.rs"]
mod redis_server;
