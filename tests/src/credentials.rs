//! Credential fixtures shared by the proxy's and the executor's tests: the
//! `[tools.<id>.credentials.api]` table they all configure (a bearer token
//! under `API_TOKEN`), a secret file of a given mode, and the world the
//! proxy's plain-HTTP credential tests share.

use crate::origin::{canary, http_origin, Canary, HttpOrigin};
use crate::FakeDns;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// `[tools.<tool>.credentials.api]`: `Authorization: Bearer ${secret}` on
/// `host` (a `"host:port"`), the secret from `source` (TOML, e.g.
/// `{ file = "api.token" }`), the placeholder in `API_TOKEN`.
pub fn api_credential(tool: &str, host: &str, source: &str) -> String {
    format!(
        "[tools.{tool}.credentials.api]\nhosts = [\"{host}\"]\nvalue = \"Bearer ${{secret}}\"\nsecret = {source}\nplaceholder_env = \"API_TOKEN\"\n"
    )
}

/// `{ file = "<path>" }` for [`api_credential`].
pub fn file_source(path: &Path) -> String {
    format!("{{ file = \"{}\" }}", path.display())
}

/// Writes `value` and a newline to `path` with `mode`.
pub fn write_secret(path: &Path, value: &str, mode: u32) {
    std::fs::write(path, format!("{value}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// What the plain-HTTP credential tests see: `api.example` and
/// `other.example` resolving to 127.0.0.2, an echoing origin (the
/// credential's host), a canary (the other host), and `secret` in a 0600
/// file `api.token` of a temporary directory.
pub struct World {
    pub dns: FakeDns,
    pub origin: HttpOrigin,
    pub canary: Canary,
    pub dir: tempfile::TempDir,
    pub secret_file: PathBuf,
}

pub async fn world(secret: &str) -> World {
    let dns = FakeDns::start().await;
    dns.set("api.example", &["127.0.0.2"]);
    dns.set("other.example", &["127.0.0.2"]);
    let origin = http_origin("127.0.0.2:0").await;
    let canary = canary("127.0.0.2:0").await;
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("api.token");
    write_secret(&secret_file, secret, 0o600);
    World {
        dns,
        origin,
        canary,
        dir,
        secret_file,
    }
}
