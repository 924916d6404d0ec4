//! The OAuth2 authorization server of the minted-token tests and bench
//! (`tests/credentials/oauth2_server.py`, authlib on Flask): its token
//! endpoint over TLS with a certificate for `auth.example` from a test CA,
//! and its API (`/api/check`, `/api/echo`) and controls in plain HTTP, both
//! on 127.0.0.2. Killed when dropped.

use crate::pki::Ca;
use crate::raw::{send, RawResponse};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Child;

pub struct OAuthServer {
    child: Child,
    /// The token endpoint (TLS).
    pub tls: SocketAddr,
    /// The API and the controls (plain HTTP).
    pub plain: SocketAddr,
    /// The CA that issued the token endpoint's certificate.
    pub ca_file: PathBuf,
}

/// Skips (with a message) where authlib or Flask is missing; `.ci/run`
/// installs both (tests/credentials/requirements.txt).
pub fn available() -> bool {
    crate::process::python_has("authlib, flask", "pip install -r tests/credentials/requirements.txt")
}

impl OAuthServer {
    /// Starts the server with tokens of `lifetime_s` seconds; its CA and
    /// leaf go to `dir`.
    pub fn start(dir: &Path, lifetime_s: u64) -> OAuthServer {
        let ca = Ca::new("loom test token CA");
        let ca_file = ca.write(dir, "token-ca.pem");
        let leaf = ca.leaf(dir, "auth", "auth.example", &["auth.example"]);
        let lifetime = lifetime_s.to_string();
        let (child, v) = crate::process::python_server(
            "tests/credentials/oauth2_server.py",
            &[
                "127.0.0.2".as_ref(),
                leaf.cert.as_os_str(),
                leaf.key.as_os_str(),
                lifetime.as_ref(),
            ],
        );
        let port = |k: &str| u16::try_from(v[k].as_u64().expect("a port")).expect("a port");
        OAuthServer {
            child,
            tls: SocketAddr::from(([127, 0, 0, 2], port("tls"))),
            plain: SocketAddr::from(([127, 0, 0, 2], port("plain"))),
            ca_file,
        }
    }

    async fn call(&self, method: &str, path: &str) -> RawResponse {
        let req = format!("{method} {path} HTTP/1.1\r\nHost: api\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        send(self.plain, req.as_bytes()).await
    }

    /// `/stats`: `requests`, `by_grant`, `refresh_tokens_presented`.
    pub async fn stats(&self) -> serde_json::Value {
        let r = self.call("GET", "/stats").await;
        serde_json::from_str(&r.text()).expect("stats are JSON")
    }

    /// Token requests so far.
    pub async fn token_requests(&self) -> u64 {
        self.stats().await["requests"].as_u64().unwrap_or(0)
    }

    /// The token endpoint answers 503 (`true`) or serves again.
    pub async fn set_down(&self, down: bool) {
        let r = self.call("POST", if down { "/down" } else { "/up" }).await;
        assert_eq!(r.status, 200);
    }
}

impl Drop for OAuthServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
