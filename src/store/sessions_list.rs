//! Listing a tenant's sessions, for operators and tools (the CLI's
//! `sessions list`).

use crate::codec::cursor::Listing;
use crate::codec::key::{KeyBuf, KeyReader, prefix_end, table};
use crate::cursor::Cursor;
use crate::error::Result;
use crate::record::{Page, SessionKey, SessionRecord};

use super::sessions::decode_session;
use super::{Store, check_id};

impl Store {
    /// One page of a tenant's sessions, in session-id order (byte order of
    /// the ids). Walk it with the cursor like any listing: the L rules hold
    /// (every session that exists for the whole walk is visited exactly once;
    /// the last page has no cursor; a cursor is bound to its tenant), and a
    /// page costs O(limit).
    ///
    /// ```
    /// use agentstate::{MemoryStore, SessionKey, SessionRecord, StateStore};
    /// let store = MemoryStore::new();
    /// for id in ["a", "b", "c"] {
    ///     store.put_session(SessionRecord::new(SessionKey::new("acme", id)))?;
    /// }
    /// let page = store.list_sessions("acme", 2, None)?;
    /// assert_eq!(page.items().len(), 2);
    /// let page = store.list_sessions("acme", 2, page.cursor())?;
    /// assert_eq!(page.items()[0].key.session_id, "c");
    /// assert!(page.cursor().is_none());
    /// # Ok::<(), agentstate::StateError>(())
    /// ```
    pub fn list_sessions(
        &self,
        tenant: &str,
        limit: usize,
        cursor: Option<&Cursor>,
    ) -> Result<Page<SessionRecord>> {
        check_id("tenant", tenant)?;
        let prefix = KeyBuf::table(table::SESSION).str(tenant).done();
        self.scan_page(
            Listing::Sessions,
            &prefix,
            &prefix,
            &prefix_end(&prefix),
            cursor,
            limit,
            |k, v| {
                let mut r = KeyReader::new(k, table::SESSION)?;
                let key = SessionKey::new(r.str()?, r.str()?);
                r.end()?;
                let s = decode_session(v, &key)?;
                Ok(Some(s))
            },
        )
    }
}
