//! The async walks: [`PageStream`], a [`Stream`] of every item of a
//! listing, page after page, as [`Pages`](crate::Pages) is for the
//! synchronous traits.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;

use crate::cursor::Cursor;
use crate::error::Result;
use crate::page::{Page, PageRequest};

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
                    this.next = cursor.map(|c| PageRequest {
                        limit: req.limit,
                        cursor: Some(c),
                    });
                    this.buf = items.into();
                }
                Err(e) => return Poll::Ready(Some(Err(e))),
            }
        }
    }
}
