//! Fleet-wide idempotency: a keyed invocation claims its key in
//! `egress_invocations` before it runs, so a retry at any cell of the fleet
//! gets what a retry at the owner gets: the stored answer, a conflict for a
//! different request, or, while the owner runs it, where the owner answers.
//! When PostgreSQL cannot be asked, the caller answers that idempotency is
//! unavailable and runs nothing.

use crate::pg::{ident, timed, Connector, PgError, Session};
use std::sync::Arc;
use std::time::Duration;

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This invocation holds the key: run it, then [`Claims::finish`].
    Won,
    /// The key's invocation ended at `cell`: its HTTP status and its answer
    /// exactly as the owner sent it.
    Done { cell: String, status: u16, answer: String },
    /// The key's invocation is running at `cell`, whose executor answers at
    /// `control_url` (where a retry waits for the answer).
    Running { cell: String, control_url: Option<String> },
    /// The key was used at `cell` with a different request.
    Conflict { cell: String },
}

/// The claims of one cell's executor. One connection, opened on first use
/// and again after any failure.
pub struct Claims {
    connector: Connector,
    schema: String,
    table: String,
    cell: String,
    control_url: Option<String>,
    window: Duration,
    client: tokio::sync::Mutex<Option<Arc<Session>>>,
}

impl std::fmt::Debug for Claims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claims")
            .field("cell", &self.cell)
            .field("table", &self.table)
            .finish()
    }
}

impl Claims {
    /// Claims made by `cell`, whose executor answers at `control_url`; a
    /// finished invocation's answer is given again for `window`.
    pub fn new(
        connector: Connector,
        schema: &str,
        cell: &str,
        control_url: Option<String>,
        window: Duration,
    ) -> Claims {
        Claims {
            connector,
            schema: schema.to_owned(),
            table: format!("{}.egress_invocations", ident(schema)),
            cell: cell.to_owned(),
            control_url,
            window,
            client: tokio::sync::Mutex::new(None),
        }
    }

    /// The open connection, or a new one.
    async fn client(&self) -> Result<Arc<Session>, PgError> {
        let mut slot = self.client.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        *slot = None;
        let c = Arc::new(self.connector.connect(&self.schema).await?);
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Forgets the connection after a failure (the next call reconnects).
    async fn reset(&self) {
        *self.client.lock().await = None;
    }

    /// Claims `key` for invocation `invocation_id` of the request whose
    /// digest is `digest`, for at most `hold` (after which, unfinished, it
    /// is taken as abandoned: its invocation has been killed by its own
    /// deadline by then). A finished key older than the window, or an
    /// abandoned one, is claimed again.
    pub async fn claim(&self, key: &str, digest: &str, invocation_id: &str, hold: Duration) -> Result<Claim, PgError> {
        let r = self.claim_on(key, digest, invocation_id, hold).await;
        if r.is_err() {
            self.reset().await;
        }
        r
    }

    async fn claim_on(&self, key: &str, digest: &str, invocation_id: &str, hold: Duration) -> Result<Claim, PgError> {
        let c = self.client().await?;
        let t = &self.table;
        let take = format!(
            "INSERT INTO {t} AS x (key, digest, cell, invocation_id, control_url, state, expires_at)
             VALUES ($1, $2, $3, $4::text::uuid, $5, 'running', now() + make_interval(secs => $6))
             ON CONFLICT (key) DO UPDATE SET
                 digest = EXCLUDED.digest, cell = EXCLUDED.cell, invocation_id = EXCLUDED.invocation_id,
                 control_url = EXCLUDED.control_url, state = 'running', claimed_at = now(),
                 expires_at = EXCLUDED.expires_at, finished_at = NULL, status = NULL, answer = NULL
             WHERE (x.state = 'done' AND x.finished_at < now() - make_interval(secs => $7))
                OR (x.state = 'running' AND x.expires_at < now())
             RETURNING 1"
        );
        let look = format!("SELECT digest, cell, control_url, state, status, answer FROM {t} WHERE key = $1");
        let (hold, window) = (hold.as_secs_f64(), self.window.as_secs_f64());
        // A row found missing between the two statements was released in
        // between: try again.
        for _ in 0..3 {
            let won = timed(
                "claim",
                c.query_opt(
                    &take,
                    &[
                        &key,
                        &digest,
                        &self.cell,
                        &invocation_id,
                        &self.control_url,
                        &hold,
                        &window,
                    ],
                ),
            )
            .await?;
            if won.is_some() {
                return Ok(Claim::Won);
            }
            let Some(row) = timed("claim", c.query_opt(&look, &[&key])).await? else {
                continue;
            };
            let cell: String = row.get(1);
            if row.get::<_, String>(0) != digest {
                return Ok(Claim::Conflict { cell });
            }
            return Ok(match row.get::<_, String>(3).as_str() {
                "done" => Claim::Done {
                    cell,
                    status: row.get::<_, Option<i16>>(4).map_or(200, |s| s as u16),
                    answer: row.get::<_, Option<String>>(5).unwrap_or_default(),
                },
                _ => Claim::Running {
                    cell,
                    control_url: row.get(2),
                },
            });
        }
        Err(PgError::Failed {
            kind: "claim",
            message: format!("the claim on key {key:?} kept changing"),
        })
    }

    /// Stores the answer of a won claim; `false` if the claim was no longer
    /// this invocation's (taken over as abandoned). Also forgets finished
    /// keys older than the window, a bounded batch at a time.
    pub async fn finish(&self, key: &str, invocation_id: &str, status: u16, answer: &str) -> Result<bool, PgError> {
        let r = async {
            let c = self.client().await?;
            let t = &self.table;
            let n = timed(
                "finish",
                c.execute(
                    &format!(
                        "UPDATE {t} SET state = 'done', finished_at = now(), status = $3, answer = $4
                         WHERE key = $1 AND invocation_id = $2::text::uuid"
                    ),
                    &[&key, &invocation_id, &(status as i16), &answer],
                ),
            )
            .await?;
            timed(
                "finish",
                c.execute(
                    &format!(
                        "DELETE FROM {t} WHERE key IN (SELECT key FROM {t} WHERE state = 'done'
                         AND finished_at < now() - make_interval(secs => $1) LIMIT 100)"
                    ),
                    &[&self.window.as_secs_f64()],
                ),
            )
            .await?;
            Ok(n == 1)
        }
        .await;
        if r.is_err() {
            self.reset().await;
        }
        r
    }

    /// Gives up a won claim whose invocation was abandoned before it ran to
    /// its end (the caller went away): a retry may run it again, as on one
    /// executor.
    pub async fn release(&self, key: &str, invocation_id: &str) -> Result<(), PgError> {
        let r = async {
            let c = self.client().await?;
            timed(
                "release",
                c.execute(
                    &format!(
                        "DELETE FROM {} WHERE key = $1 AND invocation_id = $2::text::uuid AND state = 'running'",
                        self.table
                    ),
                    &[&key, &invocation_id],
                ),
            )
            .await
        }
        .await;
        match r {
            Ok(_) => Ok(()),
            Err(e) => {
                self.reset().await;
                Err(e)
            }
        }
    }
}
