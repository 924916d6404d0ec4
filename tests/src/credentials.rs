//! Credential fixtures shared by the proxy's and the executor's tests: the
//! `[tools.<id>.credentials.api]` table they all configure (a bearer token
//! under `API_TOKEN`) and a secret file of a given mode.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

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
