//! Who is calling the executor's API: the same principals as the proxy's
//! control API, from the same file (`[control] principals_file`) and the
//! same control token, decided by the same pure function
//! (`egress_config::principals::authorize`). The file is read again when
//! it changes (a revoked token is refused from the next request); one that
//! cannot be read keeps the last good set and is logged.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::Response;
use egress_config::principals::{authorize, Action, Principal, Principals, Record};

use super::api_error;
use crate::invoke::Executor;

/// The authenticated principal of a request.
#[derive(Clone)]
pub struct Caller(pub Arc<Principal>);

impl Caller {
    /// `None` when the caller may do `a`, else the `403` answer.
    pub fn refuses(&self, a: Action<'_>) -> Option<Response> {
        authorize(&self.0, &a)
            .err()
            .map(|r| api_error(StatusCode::FORBIDDEN, r.code, r.message))
    }

    /// Whether an invocation or session of `owner` is the caller's to see.
    pub fn sees(&self, owner: Option<&str>) -> bool {
        self.0.sees(Record::Run, owner)
    }

    /// The name recorded on what the caller starts (`None`: the control
    /// token's principal).
    pub fn recorded(&self) -> Option<String> {
        self.0.recorded().map(|p| p.to_string())
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| api_error(StatusCode::UNAUTHORIZED, "unauthorized", "no principal"))
    }
}

/// The principals as last read, with the file's mtime and the control
/// token they were read with.
type Cached = (Option<SystemTime>, String, Arc<Principals>);

/// The principals, kept current with the file and the control token.
pub struct Auth {
    pub exec: Arc<Executor>,
    file: Option<PathBuf>,
    cached: Mutex<Option<Cached>>,
}

impl Auth {
    pub fn new(exec: Arc<Executor>, file: Option<PathBuf>) -> Self {
        Auth {
            exec,
            file,
            cached: Mutex::new(None),
        }
    }

    /// The current set, or `None` when there is no control token yet.
    fn principals(&self) -> Option<Arc<Principals>> {
        let token = self.exec.control_token()?;
        let mtime = self
            .file
            .as_ref()
            .and_then(|f| std::fs::metadata(f).ok())
            .and_then(|m| m.modified().ok());
        let mut cached = self.cached.lock().ok()?;
        if let Some((m, t, p)) = cached.as_ref() {
            if *m == mtime && *t == token {
                return Some(p.clone());
            }
        }
        let loaded = match &self.file {
            None => Ok(Principals::single(&token)),
            Some(f) => Principals::load(f, &token),
        };
        match loaded {
            Ok(p) => {
                let p = Arc::new(p);
                *cached = Some((mtime, token, p.clone()));
                Some(p)
            }
            Err(e) => {
                tracing::error!(error = %e, "the principals file cannot be read; the last good principals stay");
                // Nothing good yet: only the control token gets in.
                let p = cached
                    .as_ref()
                    .map(|c| c.2.clone())
                    .unwrap_or_else(|| Arc::new(Principals::single(&token)));
                Some(p)
            }
        }
    }
}

/// The `/v1` layer: a request without a known principal is `401` (`503
/// no_token` while the executor has no control token to check against).
pub async fn authenticate(
    State(auth): State<Arc<Auth>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(principals) = auth.principals() else {
        return api_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_token",
            "the executor has no control token to check against",
        );
    };
    let names = req
        .extensions()
        .get::<egress_api::tls::PeerNames>()
        .map_or(&[][..], |p| &p.0[..]);
    match principals.find(names, egress_api::bearer(req.headers())) {
        Some(p) => {
            req.extensions_mut().insert(Caller(p.clone()));
            next.run(req).await
        }
        None => {
            let mut r = api_error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Authorization: Bearer <token> of a principal required",
            );
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            r
        }
    }
}
