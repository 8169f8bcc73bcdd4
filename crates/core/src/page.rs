//! Pages of a listing, the request for one, and an iterator that walks
//! them all. Every listing of every backend takes a [`PageRequest`] and
//! answers a [`Page`] (rules L1–L6).

use std::collections::VecDeque;

use crate::cursor::Cursor;
use crate::error::{Result, StateError};
use crate::limits::{PAGE_ITEMS_DEFAULT, PAGE_ITEMS_MAX};

/// Which page of a listing to read: how many items (1..=1000, rule K3) and
/// where the previous page ended.
///
/// ```
/// use agentstate::PageRequest;
/// let first = PageRequest::new(50);
/// assert_eq!((first.limit, first.cursor.is_none()), (50, true));
/// assert_eq!(PageRequest::default().limit, 100);
/// ```
///
/// It may gain fields (an order, say), so it is built with
/// [`PageRequest::new`] and its methods.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct PageRequest {
    /// Items per page, 1..=1000.
    pub limit: usize,
    /// Where the previous page ended; `None` for the first page.
    pub cursor: Option<Cursor>,
}

impl Default for PageRequest {
    fn default() -> Self {
        PageRequest::new(PAGE_ITEMS_DEFAULT)
    }
}

impl PageRequest {
    /// The first page, `limit` items long.
    pub fn new(limit: usize) -> Self {
        PageRequest {
            limit,
            cursor: None,
        }
    }
    /// The page after `cursor` (a page's [`Page::cursor`]); `None` asks for
    /// the first page.
    pub fn after(self, cursor: Option<&Cursor>) -> Self {
        self.with_cursor(cursor.cloned())
    }
    /// The page after `cursor`, taking it by value.
    pub fn with_cursor(mut self, cursor: Option<Cursor>) -> Self {
        self.cursor = cursor;
        self
    }
}

/// One page of a listing. The page that ends a walk has no cursor (rule L3).
///
/// In JSON: `{"items": [...], "cursor": "..." | null}`. Reading one back
/// checks it as [`Page::new`] does (an empty page with a cursor, or more
/// than 1000 items, is an error).
///
/// ```
/// use agentstate::{Page, RunKey};
/// let page: Page<RunKey> =
///     serde_json::from_str(r#"{"items":[{"tenant":"acme","run_id":"r1"}],"cursor":null}"#).unwrap();
/// assert_eq!(page.items(), [RunKey::new("acme", "r1")]);
/// assert!(serde_json::from_str::<Page<RunKey>>(r#"{"items":[],"cursor":"c"}"#).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Page<T> {
    items: Vec<T>,
    cursor: Option<Cursor>,
}

impl<T> Page<T> {
    /// A page; an empty page that carries a cursor is refused, since a
    /// walker handed one would ask for the next page forever.
    pub fn new(items: Vec<T>, cursor: Option<Cursor>) -> Result<Self> {
        if items.is_empty() && cursor.is_some() {
            return Err(StateError::invalid("an empty page cannot carry a cursor"));
        }
        if items.len() > PAGE_ITEMS_MAX {
            return Err(StateError::invalid(format!(
                "a page holds at most {PAGE_ITEMS_MAX} items, got {}",
                items.len()
            )));
        }
        Ok(Page { items, cursor })
    }
    /// The items, in listing order.
    pub fn items(&self) -> &[T] {
        &self.items
    }
    /// The cursor for the next page; `None` ends the walk.
    pub fn cursor(&self) -> Option<&Cursor> {
        self.cursor.as_ref()
    }
    /// Items and cursor, by value.
    pub fn into_parts(self) -> (Vec<T>, Option<Cursor>) {
        (self.items, self.cursor)
    }
}

/// A page as it is read, before [`Page::new`] checks it.
#[derive(serde::Deserialize)]
#[serde(rename = "Page")]
struct PageIn<T> {
    items: Vec<T>,
    cursor: Option<Cursor>,
}

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Page<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let p = PageIn::<T>::deserialize(d)?;
        Page::new(p.items, p.cursor).map_err(serde::de::Error::custom)
    }
}

type Fetch<'a, T> = Box<dyn FnMut(&PageRequest) -> Result<Page<T>> + Send + 'a>;

/// Every item of a listing, page after page: an iterator of
/// `Result<T>` that asks for the next page when the last one is used up
/// and stops after the page without a cursor. After an error it yields
/// nothing more. The walk has the listing's L2 guarantee: every record that
/// matches for the whole walk is yielded exactly once.
///
/// Made by the traits' `iter_*` methods:
///
/// ```
/// use agentstate::{MemoryStore, RunKey, RunRecord, StateQuery, StateStore};
/// let store = MemoryStore::new();
/// for i in 0..5 {
///     store.put_run(RunRecord::new(RunKey::new("acme", format!("run-{i}")), "planner"))?;
/// }
/// let ids: Vec<String> = store
///     .iter_runs(&StateQuery::new("acme"))
///     .page_size(2)
///     .map(|r| r.map(|r| r.key.run_id))
///     .collect::<agentstate::Result<_>>()?;
/// assert_eq!(ids, ["run-0", "run-1", "run-2", "run-3", "run-4"]);
/// # Ok::<(), agentstate::StateError>(())
/// ```
pub struct Pages<'a, T> {
    fetch: Fetch<'a, T>,
    next: Option<PageRequest>,
    buf: VecDeque<T>,
}

impl<T> std::fmt::Debug for Pages<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pages")
            .field("next", &self.next)
            .field("buffered", &self.buf.len())
            .finish_non_exhaustive()
    }
}

impl<'a, T> Pages<'a, T> {
    /// A walk that reads each page with `fetch`, 100 items a page.
    pub fn new(fetch: impl FnMut(&PageRequest) -> Result<Page<T>> + Send + 'a) -> Self {
        Pages {
            fetch: Box::new(fetch),
            next: Some(PageRequest::default()),
            buf: VecDeque::new(),
        }
    }
    /// Items per page read (1..=1000). Call it before the first item.
    pub fn page_size(mut self, limit: usize) -> Self {
        if let Some(req) = &mut self.next {
            req.limit = limit;
        }
        self
    }
    /// Starts after `cursor` instead of at the first page.
    pub fn after(mut self, cursor: Option<&Cursor>) -> Self {
        if let Some(req) = self.next.take() {
            self.next = Some(req.after(cursor));
        }
        self
    }
}

impl<T> Iterator for Pages<'_, T> {
    type Item = Result<T>;
    fn next(&mut self) -> Option<Result<T>> {
        loop {
            if let Some(item) = self.buf.pop_front() {
                return Some(Ok(item));
            }
            let req = self.next.take()?;
            match (self.fetch)(&req) {
                Ok(page) => {
                    let (items, cursor) = page.into_parts();
                    self.next = cursor.map(|c| PageRequest {
                        limit: req.limit,
                        cursor: Some(c),
                    });
                    self.buf = items.into();
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}
