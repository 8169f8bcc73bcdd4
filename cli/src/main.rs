//! `agentstate`: the operator's tool for an agentstate file store, and the
//! demo. See `agentstate --help`.

#![forbid(unsafe_code)]
// Operating errors are reported, never unwrapped.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
