mod api;
#[cfg(all(feature = "async", feature = "conformance"))]
mod async_conformance;
#[cfg(feature = "async")]
mod async_store;
mod budgets;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod certs;
#[cfg(feature = "conformance")]
mod conformance;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod cut_relay;
mod durability;
mod errors;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod exactly_once;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod failover;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod fault_proxy;
mod feed;
mod fuzz_regressions;
mod hardening;
mod instance_trays;
mod json_shapes;
mod observe;
#[cfg(feature = "postgres")]
mod pg_pinned;
#[cfg(feature = "postgres")]
mod pg_server;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
mod redis_server;
mod stress;
