//! The hand-off socket's checks, made before anything is sent to it: a
//! socket only its owner may use, on a path only its owner or root can
//! change, so a listener never goes to a socket another user could have put
//! there. Both the start-up gate (`binding`) and every hand-off (`handoff`)
//! apply them.

use std::io;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

/// Why a hand-off socket cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("no socket at {0} (is the proxy running, and does it see the same path?)")]
    Missing(PathBuf),
    #[error("{0} is not a socket")]
    NotASocket(PathBuf),
    #[error("{path} is open to other users (mode {mode:03o}); the proxy creates it 0600")]
    Permissive { path: PathBuf, mode: u32 },
    #[error(
        "{dir} (owner uid {uid}, mode {mode:03o}) would let another user replace the socket: every directory \
         on its path must be owned by root or by the socket's owner (uid {owner}) and writable by no one else"
    )]
    UnsafeDir {
        dir: PathBuf,
        uid: u32,
        mode: u32,
        owner: u32,
    },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

impl SocketError {
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            SocketError::Missing(_) => io::ErrorKind::NotFound,
            SocketError::Io { source, .. } => source.kind(),
            _ => io::ErrorKind::PermissionDenied,
        }
    }
}

/// Checks `path` before anything is sent to it: an existing socket, of
/// mode 0600 or stricter, and no directory on its (resolved) path that
/// anyone but root or the socket's owner could change. A root-owned
/// sticky directory (`/tmp`) is fine above the socket's own directory,
/// which no one else may write at all (else another user could have
/// created the socket before the proxy).
pub fn vet(path: &Path) -> Result<(), SocketError> {
    let io = |source: io::Error| SocketError::Io {
        path: path.to_path_buf(),
        source,
    };
    let real = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(SocketError::Missing(path.to_path_buf())),
        Err(e) => return Err(io(e)),
    };
    let meta = std::fs::symlink_metadata(&real).map_err(io)?;
    if !meta.file_type().is_socket() {
        return Err(SocketError::NotASocket(path.to_path_buf()));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SocketError::Permissive {
            path: path.to_path_buf(),
            mode,
        });
    }
    let owner = meta.uid();
    for (i, dir) in real.ancestors().skip(1).enumerate() {
        let m = std::fs::symlink_metadata(dir).map_err(io)?;
        let (uid, mode) = (m.uid(), m.mode() & 0o7777);
        let trusted = uid == 0 || uid == owner;
        let shared_sticky = uid == 0 && mode & 0o1000 != 0 && i > 0;
        if !trusted || (mode & 0o022 != 0 && !shared_sticky) {
            return Err(SocketError::UnsafeDir {
                dir: dir.to_path_buf(),
                uid,
                mode,
                owner,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A private socket in a private directory passes; a socket others may
    /// use, a directory others may write, a missing socket or another kind
    /// of file does not.
    #[test]
    fn only_a_private_socket_on_a_path_no_one_else_can_change_passes() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("var");
        std::fs::create_dir(&sub).unwrap();
        chmod(&sub, 0o755);
        let sock = sub.join("egress-handoff.sock");
        assert!(matches!(vet(&sock), Err(SocketError::Missing(_))));
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        chmod(&sock, 0o600);
        vet(&sock).unwrap();
        // Through a symlink to it: the real path is what is checked.
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&sock, &link).unwrap();
        vet(&link).unwrap();

        chmod(&sock, 0o666);
        let e = vet(&sock).unwrap_err();
        assert!(matches!(e, SocketError::Permissive { mode: 0o666, .. }), "{e}");
        assert!(e.to_string().contains("0600"), "{e}");
        chmod(&sock, 0o600);

        for mode in [0o775, 0o757, 0o1777] {
            chmod(&sub, mode);
            let e = vet(&sock).unwrap_err();
            assert!(matches!(e, SocketError::UnsafeDir { .. }), "{mode:o}: {e}");
            assert!(e.to_string().contains(&sub.display().to_string()), "{e}");
        }
        chmod(&sub, 0o755);
        // A root-owned sticky directory above the socket's own is fine
        // (the temporary directory lives in /tmp).
        if rustix::process::geteuid().as_raw() == 0 {
            chmod(dir.path(), 0o1777);
            vet(&sock).unwrap();
            chmod(dir.path(), 0o700);
        }

        let file = sub.join("plain");
        std::fs::write(&file, "").unwrap();
        chmod(&file, 0o600);
        assert!(matches!(vet(&file), Err(SocketError::NotASocket(_))));
    }

    /// A directory owned by someone other than root and the socket's owner.
    #[test]
    fn a_directory_of_another_user_is_refused() {
        if rustix::process::geteuid().as_raw() != 0 {
            eprintln!("SKIPPED: needs root to chown");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("var");
        std::fs::create_dir(&sub).unwrap();
        let sock = sub.join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        chmod(&sock, 0o600);
        std::os::unix::fs::chown(&sub, Some(4242), None).unwrap();
        let e = vet(&sock).unwrap_err();
        assert!(
            matches!(
                e,
                SocketError::UnsafeDir {
                    uid: 4242,
                    owner: 0,
                    ..
                }
            ),
            "{e}"
        );
        // Owned by the socket's owner: fine.
        std::os::unix::fs::chown(&sock, Some(4242), None).unwrap();
        vet(&sock).unwrap();
    }
}
