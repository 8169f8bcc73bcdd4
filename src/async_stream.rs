//! The async walks: [`PageStream`], a [`Stream`] of every item of a
//! listing, page after page, as [`Pages`](crate::Pages) is for the
//! synchronous traits.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;

use agentstate_core::cursor::Cursor;
use agentstate_core::error::Result;
use agentstate_core::page::{Page, PageRequest};

type PageFut<T> = Pin<Box<dyn Future<Output = Result<Page<T>>> + Send>>;
type Fetch<T> = Box<dyn FnMut(PageRequest) -> PageFut<T> + Send>;

/// Every item of a listing, page after page: a [`Stream`] of `Result<T>`
/// that reads the next page when the last one is used up and ends after
/// the page without a cursor. After an error it yields nothing more. The
/// walk has the listing's L2 guarantee: every record that matches for the
/// whole walk is yielded exactly once.
///
/// Made by [`AsyncStore`](crate::AsyncStore)'s `iter_*` methods. Use it
/// with any `StreamExt` (futures', tokio-stream's), or with its own
/// [`next`](Self::next):
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> agentstate::Result<()> {
/// use agentstate::{AsyncStore, RunKey, RunRecord, StateQuery};
/// let store = AsyncStore::memory();
/// for i in 0..5 {
///     store.put_run(RunRecord::new(RunKey::new("acme", format!("run-{i}")), "planner")).await?;
/// }
/// let mut walk = store.iter_runs(&StateQuery::new("acme")).page_size(2);
/// let mut ids = Vec::new();
/// while let Some(run) = walk.next().await {
///     ids.push(run?.key.run_id);
/// }
/// assert_eq!(ids, ["run-0", "run-1", "run-2", "run-3", "run-4"]);
/// # Ok(())
/// # }
/// ```
pub struct PageStream<T> {
    fetch: Fetch<T>,
    next: Option<PageRequest>,
    buf: VecDeque<T>,
    pending: Option<PageFut<T>>,
}

// Nothing of `T` is ever pinned: the items sit in a `VecDeque`.
impl<T> Unpin for PageStream<T> {}

impl<T> std::fmt::Debug for PageStream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageStream")
            .field("next", &self.next)
            .field("buffered", &self.buf.len())
            .field("reading", &self.pending.is_some())
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> PageStream<T> {
    /// A walk that reads each page with `fetch`, 100 items a page.
    pub(crate) fn new<F, Fut>(mut fetch: F) -> Self
    where
        F: FnMut(PageRequest) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Page<T>>> + Send + 'static,
    {
        PageStream {
            fetch: Box::new(move |req| Box::pin(fetch(req))),
            next: Some(PageRequest::default()),
            buf: VecDeque::new(),
            pending: None,
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

    /// The next item; `None` at the end of the walk (or after an error).
    pub async fn next(&mut self) -> Option<Result<T>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Every remaining item, or the first error.
    pub async fn collect_all(mut self) -> Result<Vec<T>> {
        let mut all = Vec::new();
        while let Some(item) = self.next().await {
            all.push(item?);
        }
        Ok(all)
    }
}

impl<T> Stream for PageStream<T> {
    type Item = Result<T>;

    #[allow(clippy::expect_used, reason = "a read is pending; the request read")]
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<T>>> {
        let this = self.get_mut();
        loop {
            if let Some(item) = this.buf.pop_front() {
                return Poll::Ready(Some(Ok(item)));
            }
            if this.pending.is_none() {
                let Some(req) = this.next.clone() else {
                    return Poll::Ready(None);
                };
                this.pending = Some((this.fetch)(req));
            }
            let fut = this.pending.as_mut().expect("a read is pending");
            let page = match fut.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(page) => page,
            };
            this.pending = None;
            let req = this.next.take().expect("the request read");
            match page {
                Ok(page) => {
                    let (items, cursor) = page.into_parts();
                    this.next = cursor.map(|c| PageRequest::new(req.limit).with_cursor(Some(c)));
                    this.buf = items.into();
                }
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }
}

type ChangeFut = Pin<Box<dyn Future<Output = Result<agentstate_core::feed::ChangePage>> + Send>>;
type Wait = Box<dyn FnMut(agentstate_core::feed::Position) -> ChangeFut + Send>;

/// A feed followed without end: a [`Stream`] of `Result<Change>` that
/// waits for the next commit of its scope whenever it has handed out
/// every change (rules F1–F5). It never ends by itself; after an error
/// (`FeedPruned`, a lost server) it yields nothing more. Keep
/// [`position`](Self::position) to resume from where it got to.
///
/// Made by [`AsyncStore::watch`](crate::AsyncStore::watch).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> agentstate::Result<()> {
/// use agentstate::{AsyncStore, Changed, FeedScope, RunKey, RunRecord};
/// let store = AsyncStore::memory();
/// let scope = FeedScope::tenant("acme");
/// let mut feed = store.watch(&scope, store.feed_head(&scope).await?);
/// store.put_run(RunRecord::new(RunKey::new("acme", "r1"), "planner")).await?;
/// let change = feed.next().await.expect("a watch never ends")?;
/// assert!(matches!(change.item, Changed::Run { .. }));
/// assert_eq!(feed.position(), change.position);
/// # Ok(())
/// # }
/// ```
pub struct ChangeStream {
    wait: Wait,
    /// Where the next read starts: the last page's `next`.
    at: agentstate_core::feed::Position,
    /// The position of the last change handed out.
    handed: agentstate_core::feed::Position,
    buf: VecDeque<agentstate_core::feed::Change>,
    pending: Option<ChangeFut>,
    failed: bool,
}

impl Unpin for ChangeStream {}

impl std::fmt::Debug for ChangeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeStream")
            .field("position", &self.position())
            .field("buffered", &self.buf.len())
            .finish_non_exhaustive()
    }
}

impl ChangeStream {
    pub(crate) fn new<F, Fut>(after: agentstate_core::feed::Position, mut wait: F) -> Self
    where
        F: FnMut(agentstate_core::feed::Position) -> Fut + Send + 'static,
        Fut: Future<Output = Result<agentstate_core::feed::ChangePage>> + Send + 'static,
    {
        ChangeStream {
            wait: Box::new(move |at| Box::pin(wait(at))),
            at: after,
            handed: after,
            buf: VecDeque::new(),
            pending: None,
            failed: false,
        }
    }

    /// Where a later watch resumes so that it misses nothing this one has
    /// not handed out: the last change's position, or, once every change
    /// read was handed out, the position the feed was read up to.
    pub fn position(&self) -> agentstate_core::feed::Position {
        if self.buf.is_empty() {
            self.at
        } else {
            self.handed
        }
    }

    /// The next change (waiting for one as long as it takes).
    pub async fn next(&mut self) -> Option<Result<agentstate_core::feed::Change>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }
}

impl Stream for ChangeStream {
    type Item = Result<agentstate_core::feed::Change>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(c) = this.buf.pop_front() {
                this.handed = c.position;
                return Poll::Ready(Some(Ok(c)));
            }
            if this.failed {
                return Poll::Ready(None);
            }
            let at = this.at;
            let fut = this.pending.get_or_insert_with(|| (this.wait)(at));
            match fut.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => {
                    this.pending = None;
                    match r {
                        Ok(page) => {
                            this.at = page.next;
                            this.buf.extend(page.changes);
                        }
                        Err(e) => {
                            this.failed = true;
                            return Poll::Ready(Some(Err(e)));
                        }
                    }
                }
            }
        }
    }
}
