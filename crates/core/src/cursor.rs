//! Opaque listing cursors (rule L6).

use serde::{Deserialize, Serialize};

/// Where a listing's page ended. Opaque: bound to the listing, its tenant
/// and filters, and to the store that issued it; a cursor that was altered,
/// or is handed to another listing, is refused with `Invalid`.
///
/// A cursor is plain text, so it can be kept between processes and handed
/// back later with [`Cursor::from_text`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Cursor(pub String);

impl Cursor {
    /// The cursor as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
    /// A cursor from text given out earlier by [`Cursor::as_str`]. It is
    /// checked when used, not here.
    pub fn from_text(text: impl Into<String>) -> Self {
        Cursor(text.into())
    }
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
