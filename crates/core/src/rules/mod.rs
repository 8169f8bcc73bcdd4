//! The rules every backend shares, written once: input checks and limits
//! (K1–K5), the decisions of a versioned put and a patch (R2, R4, R6, S1),
//! the spend caps (B1–B6: `budget.rs`), and the checks an imported entry
//! meets. A backend (the key-value store, or a server backend) reads what
//! is stored, asks these functions what to write, and writes it atomically
//! with the read.
//!
//! Scrubbing (`crate::scrub`), the record codec (`crate::codec::value`) and
//! the cursor codec (`crate::codec::cursor`) are shared the same way.

pub mod budget;
pub mod check;
pub mod decide;

pub use budget::*;
pub use check::*;
pub use decide::*;
