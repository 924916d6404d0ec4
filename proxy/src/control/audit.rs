//! `GET /v1/audit/checkpoint`: the newest signed checkpoint of the fact
//! log's hash chains (a C2SP signed note), so that a witness can hold it
//! off the box and `facts verify --checkpoints` can check the store
//! against it later.

use crate::control::caller::Caller;
use crate::control::error::{ApiError, ApiResult};
use crate::state::Shared;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use egress_api::ErrorBody;
use egress_config::principals::Action;
use std::sync::Arc;

#[utoipa::path(get, path = "/v1/audit/checkpoint", tag = "facts", security(("control_token" = [])),
    responses(
        (status = 200, description = "The newest signed checkpoint: a C2SP signed note (origin `loom-egress/<cell>/<epoch>`, the newest fact's seq, the facts' chain head, then `decisions <seq> <head>`, `time <RFC 3339>`, `closed` when the writer stopped, a blank line and an Ed25519 signature line)", body = String, content_type = "text/plain; charset=utf-8"),
        (status = 403, description = "the caller has no facts scope", body = ErrorBody),
        (status = 404, description = "no_checkpoint: no `[audit] signing_key_file`, or nothing signed yet", body = ErrorBody),
    ))]
pub(super) async fn checkpoint(State(sh): State<Arc<Shared>>, caller: Caller) -> ApiResult<Response> {
    caller.may(Action::ReadFacts)?;
    let Some(note) = sh.facts.checkpoint() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "no_checkpoint",
            "no checkpoint is signed: set [audit] signing_key_file (see docs/audit.md)",
        ));
    };
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], note.to_string()).into_response())
}
