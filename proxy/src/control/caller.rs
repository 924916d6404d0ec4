//! Who is calling: every `/v1` request is authenticated to a principal
//! (its bearer token, looked up by SHA-256 among the control token's and
//! the principals file's), which handlers take as [`Caller`] and ask
//! `egress_config::principals::authorize` before they act. A refusal is
//! `403` with the scope's reason; a missing or unknown token is `401`.

use crate::control::error::ApiError;
use crate::state::Shared;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use egress_config::principals::{authorize, Action, Principal, Record};
use std::sync::Arc;

/// The authenticated principal of a request.
#[derive(Clone)]
pub struct Caller(pub Arc<Principal>);

impl Caller {
    /// `Ok` when the caller may do `a`, else `403` with the reason.
    pub fn may(&self, a: Action<'_>) -> Result<(), ApiError> {
        authorize(&self.0, &a).map_err(|r| ApiError::new(StatusCode::FORBIDDEN, r.code, r.message))
    }

    /// Whether a record attributed to `owner` is shown to the caller.
    pub fn sees(&self, kind: Record, owner: Option<&str>) -> bool {
        self.0.sees(kind, owner)
    }

    /// The name recorded on what the caller creates (`None`: the control
    /// token's principal).
    pub fn recorded(&self) -> Option<Arc<str>> {
        self.0.recorded().cloned()
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "no principal"))
    }
}

/// The principal a request authenticates as, if any: the one a verified
/// client certificate names (by subject CN or SAN), else its bearer token's.
pub fn principal<B>(sh: &Shared, req: &axum::http::Request<B>) -> Option<Arc<Principal>> {
    let names = req
        .extensions()
        .get::<egress_api::tls::PeerNames>()
        .map_or(&[][..], |p| &p.0[..]);
    sh.principals
        .load()
        .find(names, egress_api::bearer(req.headers()))
        .cloned()
}

/// The `/v1` layer: a request without a known principal is `401`.
pub(super) async fn authenticate(State(sh): State<Arc<Shared>>, mut req: Request, next: Next) -> Response {
    match principal(&sh, &req) {
        Some(p) => {
            req.extensions_mut().insert(Caller(p));
            next.run(req).await
        }
        None if egress_api::bearer(req.headers()).is_some() => {
            sh.refused_credential();
            ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "wrong control token").into_response()
        }
        None => {
            let mut r = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Authorization: Bearer <token> of a principal required",
            )
            .into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
    }
}
