//! The control-plane bearer token. Taken from `EGRESS_CONTROL_TOKEN`; when
//! unset, read from (or generated into) `egress-control.token` beside the
//! facts store, created with mode 0600. The control API never runs without one.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

pub const TOKEN_ENV: &str = "EGRESS_CONTROL_TOKEN";
pub const TOKEN_FILE: &str = "egress-control.token";

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is readable by other users (mode {mode:o}); chmod 600 it")]
    Permissive { path: PathBuf, mode: u32 },
    #[error("{0} is set but empty or shorter than 16 characters")]
    Weak(&'static str),
    #[error("no randomness available: {0}")]
    Random(String),
}

/// Where the token came from.
pub enum TokenSource {
    Env,
    File(PathBuf),
    Generated(PathBuf),
}

/// The token file path for a facts store path.
pub fn token_path(home: &Path) -> PathBuf {
    home.join(TOKEN_FILE)
}

/// Resolves the control token.
pub fn resolve(env: Option<String>, home: &Path) -> Result<(String, TokenSource), TokenError> {
    if let Some(t) = env {
        let t = t.trim().to_owned();
        if t.len() < 16 {
            return Err(TokenError::Weak(TOKEN_ENV));
        }
        return Ok((t, TokenSource::Env));
    }
    let path = token_path(home);
    let io = |source| TokenError::Io {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(t) if t.trim().len() >= 16 => {
            let mode = std::fs::metadata(&path).map_err(io)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(TokenError::Permissive { path, mode });
            }
            return Ok((t.trim().to_owned(), TokenSource::File(path)));
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    if let Some(dir) = path.parent().filter(|d| !d.exists()) {
        // The store's directory: private until the store opens it.
        crate::facts::private::dir(dir, 0o700).map_err(io)?;
    }
    let token = crate::runs::random_hex(32).map_err(|e| TokenError::Random(e.to_string()))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    f.write_all(token.as_bytes()).map_err(io)?;
    f.write_all(b"\n").map_err(io)?;
    f.sync_all().map_err(io)?;
    Ok((token, TokenSource::Generated(path)))
}

/// `egress-proxy principal add`: a new principal `name` with `scopes`
/// and one fresh token, whose SHA-256 is appended to the principals file
/// at `path` (created 0600; an existing one must already be private). The
/// result is checked as a whole before it is written, so a bad scope or a
/// taken name leaves the file as it was. Returns the token, shown once.
pub fn add_principal(path: &Path, name: &str, scopes: &[String]) -> Result<String, String> {
    use egress_config::principals::{entry, token_hash, Principals};
    let existing = match std::fs::metadata(path) {
        Ok(m) => {
            let mode = m.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(format!(
                    "{} is mode {mode:04o}: a principals file must be 0600 or stricter",
                    path.display()
                ));
            }
            std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    if let Ok(p) = Principals::parse(&existing) {
        if p.by_name(name).is_some() {
            return Err(format!("{}: principal {name:?} exists already", path.display()));
        }
    }
    let token = crate::runs::random_hex(32).map_err(|e| format!("no randomness available: {e}"))?;
    let added = entry(name, &token_hash(&token), scopes);
    let whole = format!("{existing}{added}");
    Principals::parse(&whole).map_err(|problems| {
        problems
            .iter()
            .map(|p| format!("{}: {}", p.path, p.message))
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(added.as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_token_is_private_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("var");
        let (t1, s1) = resolve(None, &home).unwrap();
        assert!(matches!(s1, TokenSource::Generated(_)));
        let mode = std::fs::metadata(token_path(&home)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (t2, s2) = resolve(None, &home).unwrap();
        assert!(matches!(s2, TokenSource::File(_)));
        assert_eq!(t1, t2);
    }

    #[test]
    fn a_token_file_others_can_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path();
        std::fs::write(token_path(home), "0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(token_path(home), std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(resolve(None, home), Err(TokenError::Permissive { .. })));
    }

    #[test]
    fn principal_add_appends_a_hash_and_shows_the_token_once() {
        use egress_config::principals::Principals;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("principals.toml");
        let a = add_principal(&path, "kernel-a", &["runs:search-*".into(), "facts:own".into()]).unwrap();
        let b = add_principal(&path, "auditor", &["facts:all".into()]).unwrap();
        assert_ne!(a, b);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&a) && !text.contains(&b), "a token is never written");
        let p = Principals::parse(&text).unwrap();
        assert_eq!(&*p.by_token(&a).unwrap().name, "kernel-a");
        assert_eq!(&*p.by_token(&b).unwrap().name, "auditor");
        let taken = add_principal(&path, "kernel-a", &[]).unwrap_err();
        assert!(taken.contains("exists already"), "{taken}");
        let bad = add_principal(&path, "c", &["root".into()]).unwrap_err();
        assert!(bad.contains("unknown scope"), "{bad}");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            text,
            "a refused add writes nothing"
        );
    }

    #[test]
    fn a_weak_environment_token_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            resolve(Some("short".into()), dir.path()),
            Err(TokenError::Weak(_))
        ));
        let (t, s) = resolve(Some("  long-enough-token-value  ".into()), dir.path()).unwrap();
        assert_eq!(t, "long-enough-token-value");
        assert!(matches!(s, TokenSource::Env));
    }
}
