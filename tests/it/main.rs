
#[cfg(feature = "conformance")] mod conformance;
#[cfg(feature = "async")]
mod async_store;
#[cfg(feature = "cli")]
mod cli;
mod stress;
mod fuzz_regressions;
