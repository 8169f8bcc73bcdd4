
#[cfg(feature = "conformance")] mod conformance;
#[cfg(feature = "async")]
mod async_store;
#[cfg(feature = "cli")]
mod cli;
mod stress;
mod durability;
mod fuzz_regressions;
