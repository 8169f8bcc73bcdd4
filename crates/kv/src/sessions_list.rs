//! Listing a tenant's sessions, for operators and tools (the CLI's
//! `sessions list`).

use crate::key::table;
use agentstate_core::codec::cursor::Listing;
use agentstate_core::codec::key::{KeyBuf, KeyReader, prefix_end};
use agentstate_core::error::Result;
use agentstate_core::page::{Page, PageRequest};
use agentstate_core::record::{SessionKey, SessionRecord};

use super::sessions::decode_session;
use super::{KvStore, check_id};

impl KvStore {
    /// One page of a tenant's sessions, in session-id order (see
    /// `StoreAdmin::list_sessions`); a page costs O(limit).
    pub(crate) fn list_sessions(
        &self,
        tenant: &str,
        page: &PageRequest,
    ) -> Result<Page<SessionRecord>> {
        check_id("tenant", tenant)?;
        let prefix = KeyBuf::table(table::SESSION).str(tenant).done();
        self.scan_page(
            Listing::Sessions,
            &prefix,
            &prefix,
            &prefix_end(&prefix),
            page,
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
