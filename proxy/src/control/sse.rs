//! `GET /v1/facts/stream?after=<seq>`: Server-Sent Events that first replay
//! facts after the cursor, then follow new ones live. The live feed is
//! subscribed before the replay, so nothing falls between the two; a slow
//! reader that lags the live feed goes back to the store by cursor.

use crate::control::error::ApiError;
use crate::control::facts::FactCursor;
use crate::facts::{Fact, FactQuery};
use crate::state::Shared;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast::{self, error::RecvError};

struct Tail {
    /// This stream's place among `max_event_streams`, held while it lives.
    _place: tokio::sync::OwnedSemaphorePermit,
    sh: Arc<Shared>,
    rx: broadcast::Receiver<Fact>,
    last: u64,
    pending: VecDeque<Fact>,
    catching_up: bool,
}

fn event(f: &Fact) -> Event {
    let data = serde_json::to_string(f).unwrap_or_else(|_| "{}".into());
    let name = if f.kind == egress_api::PENDING_FACT_TYPE {
        "pending"
    } else {
        "fact"
    };
    Event::default().id(f.seq.to_string()).event(name).data(data)
}

/// `GET /v1/facts/stream`.
#[utoipa::path(get, path = "/v1/facts/stream", tag = "facts", security(("control_token" = [])),
    params(egress_api::Cursor),
    responses(
        (status = 200, description = "Server-Sent Events: `event: fact` (`event: pending` for a fetch held for a grant), `id: <seq>`, `data: <fact JSON>`; replay from the cursor, then live", body = String, content_type = "text/event-stream"),
        (status = 400, description = "bad_request", body = egress_api::ErrorBody),
        (status = 503, description = "too_many_streams", body = egress_api::ErrorBody),
    ))]
pub async fn stream(
    State(sh): State<Arc<Shared>>,
    FactCursor(c): FactCursor,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let place = sh.event_streams.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "too_many_streams",
            format!(
                "{} event streams are open already (proxy.max_event_streams)",
                sh.cfg.max_event_streams
            ),
        )
    })?;
    let rx = sh.facts.subscribe();
    let tail = Tail {
        _place: place,
        sh,
        rx,
        last: c.after,
        pending: VecDeque::new(),
        catching_up: true,
    };
    let s = futures_util::stream::unfold(tail, |mut t| async move {
        loop {
            if let Some(f) = t.pending.pop_front() {
                t.last = f.seq;
                let ev = event(&f);
                return Some((Ok(ev), t));
            }
            if t.catching_up {
                let page =
                    t.sh.facts
                        .query(FactQuery {
                            after: t.last,
                            limit: 500,
                            run_id: None,
                        })
                        .await;
                match page {
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
                r = t.rx.recv() => match r {
                    Ok(f) if f.seq > t.last => t.pending.push_back(f),
                    Ok(_) => {}
                    Err(RecvError::Lagged(_)) => t.catching_up = true,
                    Err(RecvError::Closed) => return None,
                },
                _ = t.sh.control_stop.cancelled() => return None,
            }
        }
    });
    Ok(Sse::new(s).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
