//! The control API's one error type and the extractors that produce it:
//! every handler answers `{"error":{"code","message"}}` (the `ErrorBody` of
//! `egress-api`), and a body or query string that does not parse is a
//! `bad_request` of the same shape, never axum's plain-text rejection.

use crate::runs::RunError;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use egress_api::{ErrorBody, ErrorDetail, Problem};
use serde::de::DeserializeOwned;

/// A control API error: status, stable code, message, and for a rejected
/// config every problem.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    problems: Option<Vec<Problem>>,
    diff: Option<Box<egress_api::PolicyDiff>>,
}

pub(crate) type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            problems: None,
            diff: None,
        }
    }

    pub fn with_problems(mut self, problems: Vec<Problem>) -> ApiError {
        self.problems = Some(problems);
        self
    }

    /// The message (what the answer says).
    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn with_diff(mut self, diff: egress_api::PolicyDiff) -> ApiError {
        self.diff = Some(Box::new(diff));
        self
    }
}

/// `400 bad_request` with `message`.
pub fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
}

/// `422 invalid_config` with every problem of `e` (a reload's, a replay's
/// or a diff's config).
pub(crate) fn invalid_config(e: &egress_config::ConfigError) -> ApiError {
    let problems = e
        .problems
        .iter()
        .map(|p| Problem {
            path: p.path.clone(),
            message: p.message.clone(),
        })
        .collect();
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_config", format!("{e}")).with_problems(problems)
}

/// The cell every error answer names, set once at start when the proxy
/// has a `[cell]` (a process serves one cell).
static CELL: std::sync::OnceLock<(String, Option<String>)> = std::sync::OnceLock::new();

/// Makes every error answer name `cell` and its control URL.
pub fn set_cell(cell: &egress_config::CellConfig) {
    let _ = CELL.set((cell.id.clone(), cell.advertise_control.clone()));
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let here = CELL.get();
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message,
                problems: self.problems,
                cell: here.map(|c| c.0.clone()),
                control_url: here.and_then(|c| c.1.clone()),
                diff: self.diff.map(|d| *d),
            },
        };
        (self.status, Json(body)).into_response()
    }
}

impl From<RunError> for ApiError {
    fn from(e: RunError) -> ApiError {
        let (status, code) = match &e {
            RunError::Exists(_) => (StatusCode::CONFLICT, "run_exists"),
            RunError::TooMany(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_runs"),
            RunError::NotFound(_) => (StatusCode::NOT_FOUND, "run_not_found"),
            RunError::Ended(_) => (StatusCode::CONFLICT, "run_ended"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> ApiError {
        ApiError::new(e.status(), "bad_request", e.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> ApiError {
        bad_request(e.body_text())
    }
}

/// A JSON body, rejected as an [`ApiError`] (`400`, `413`, `415`, `422`).
pub struct AppJson<T>(pub T);

impl<T, S> FromRequest<S> for AppJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let Json(v) = Json::<T>::from_request(req, state).await?;
        Ok(AppJson(v))
    }
}

/// A query string, rejected as `400 bad_request` naming what is wrong.
pub struct AppQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for AppQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Query(v) = Query::<T>::from_request_parts(parts, state).await?;
        Ok(AppQuery(v))
    }
}
