mod api;
#[cfg(feature = "async")]
mod async_store;
mod budgets;
#[cfg(feature = "cli")]
mod cli;
#[cfg(feature = "conformance")]
mod conformance;
mod durability;
mod fuzz_regressions;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redis_server;
mod stress;
