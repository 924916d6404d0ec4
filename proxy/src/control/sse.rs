//! Server-Sent Events that first replay records after a cursor, then follow
//! new ones live: `GET /v1/facts/stream?after=<seq>` (facts) and
//! `GET /v1/decisions/stream` (the decision log) share [`tail`]. The live
//! feed is subscribed before the replay, so nothing falls between the two;
//! a slow reader that lags the live feed goes back to the store by cursor.
//! With `format=ocsf` each `data:` is the record's OCSF event (`format`).

use crate::control::caller::Caller;
use crate::control::error::ApiError;
use crate::control::facts::Paging;
use crate::facts::{Fact, FactQuery};
use crate::state::Shared;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use egress_config::principals::{Action, Record};
use futures_util::future::BoxFuture;
use futures_util::Stream;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::OwnedSemaphorePermit;

/// Records after a cursor, oldest first (a page), or why not.
pub(super) type Page<T> = Box<dyn Fn(u64) -> BoxFuture<'static, Result<Vec<T>, String>> + Send + Sync>;

/// What one stream follows: a live feed, the store read by cursor, which
/// records it wants, and how a record is numbered and sent.
pub(super) struct Feed<T> {
    pub rx: broadcast::Receiver<T>,
    pub page: Page<T>,
    /// Whether a record is one the reader asked for and may see.
    pub keep: Box<dyn Fn(&T) -> bool + Send + Sync>,
    pub seq: fn(&T) -> u64,
    pub event: fn(&T) -> Event,
}

struct Tail<T> {
    /// This stream's place among `max_event_streams`, held while it lives.
    _place: OwnedSemaphorePermit,
    sh: Arc<Shared>,
    feed: Feed<T>,
    last: u64,
    pending: VecDeque<T>,
    catching_up: bool,
}

/// A place among `max_event_streams`, or `503 too_many_streams`.
pub(super) fn place(sh: &Shared) -> Result<OwnedSemaphorePermit, ApiError> {
    sh.event_streams.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "too_many_streams",
            format!(
                "{} event streams are open already (proxy.max_event_streams)",
                sh.cfg.max_event_streams
            ),
        )
    })
}

/// The stream of `feed` after `after`: replay, then live, until the
/// control listener stops.
pub(super) fn tail<T: Clone + Send + Sync + 'static>(
    sh: Arc<Shared>,
    place: OwnedSemaphorePermit,
    after: u64,
    feed: Feed<T>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let tail = Tail {
        _place: place,
        sh,
        feed,
        last: after,
        pending: VecDeque::new(),
        catching_up: true,
    };
    let s = futures_util::stream::unfold(tail, |mut t| async move {
        loop {
            if let Some(f) = t.pending.pop_front() {
                t.last = (t.feed.seq)(&f);
                // Replayed pages hold records the reader may not see too:
                // passed over, the cursor still moves past them.
                if !(t.feed.keep)(&f) {
                    continue;
                }
                let ev = (t.feed.event)(&f);
                return Some((Ok(ev), t));
            }
            if t.catching_up {
                match (t.feed.page)(t.last).await {
                    Ok(p) if !p.is_empty() => {
                        t.pending.extend(p);
                        continue;
                    }
                    Ok(_) => t.catching_up = false,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                }
            }
            tokio::select! {
                r = t.feed.rx.recv() => match r {
                    Ok(f) if (t.feed.seq)(&f) > t.last && (t.feed.keep)(&f) => t.pending.push_back(f),
                    Ok(_) => {}
                    Err(RecvError::Lagged(_)) => t.catching_up = true,
                    Err(RecvError::Closed) => return None,
                },
                _ = t.sh.control_stop.cancelled() => return None,
            }
        }
    });
    Sse::new(s).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// `GET /v1/facts/stream`.
#[utoipa::path(get, path = "/v1/facts/stream", tag = "facts", security(("control_token" = [])),
    params(egress_api::Cursor),
    responses(
        (status = 200, description = "Server-Sent Events: `event: fact` (`event: pending` for a fetch held for a grant), `id: <seq>`, `data: <fact JSON>` (with `format=ocsf`, its OCSF 1.8.0 event); replay from the cursor, then live", body = egress_api::SseEvent, content_type = "text/event-stream"),
        (status = 400, description = "bad_request", body = egress_api::ErrorBody),
        (status = 403, description = "scope: the caller has no facts scope (facts:own sees the facts of its runs and its own control actions)", body = egress_api::ErrorBody),
        (status = 503, description = "too_many_streams", body = egress_api::ErrorBody),
    ))]
pub async fn stream(
    State(sh): State<Arc<Shared>>,
    caller: Caller,
    Paging(c): Paging<egress_api::Cursor>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    caller.may(Action::ReadFacts)?;
    let place = place(&sh)?;
    let facts = sh.facts.clone();
    let feed = Feed {
        rx: sh.facts.subscribe(),
        page: Box::new(move |after| {
            let facts = facts.clone();
            Box::pin(async move {
                facts
                    .query(FactQuery {
                        after,
                        limit: 500,
                        run_id: None,
                    })
                    .await
                    .map_err(|e| e.to_string())
            })
        }),
        keep: Box::new(move |f: &Fact| caller.sees(Record::Fact, f.principal.as_deref())),
        seq: |f| f.seq,
        event: crate::control::format::fact_sse_in(c.format),
    };
    Ok(tail(sh, place, c.after, feed))
}
