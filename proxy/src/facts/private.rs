//! The fact store's files are the proxy's alone: they hold every denial, the
//! run table's secret digests, placeholders, labels and owners. The
//! database and its `-wal` and `-shm` files are created 0600 whatever the
//! umask (SQLite gives the journal files the database's mode), their
//! directory 0700, and looser modes found at start are repaired with a log
//! line. The directory is 0711 instead when the appliance CA's public files
//! live below it (confined children of other uids must reach them; they
//! still cannot list it), and a directory that is not the proxy's own
//! (another owner, or sticky like `/tmp`) is never changed, only warned of.

use std::fs::{OpenOptions, Permissions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The files SQLite keeps for the database at `path`.
fn store_files(path: &Path) -> [PathBuf; 3] {
    let with = |suffix: &str| {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        PathBuf::from(p)
    };
    [path.to_owned(), with("-wal"), with("-shm")]
}

/// Makes the database file exist with mode 0600 (so its journal files get
/// it too), and takes group and other rights off each of its files that has
/// them.
pub fn files(path: &Path) -> std::io::Result<()> {
    // Created here, not by SQLite, so the umask cannot widen it. Only when
    // missing: closing a descriptor of a database this process has open
    // would drop SQLite's POSIX locks on it; modes are changed by path.
    match OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    for f in store_files(path) {
        let mode = match std::fs::metadata(&f) {
            Ok(m) => m.permissions().mode() & 0o7777,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if mode & 0o077 != 0 {
            std::fs::set_permissions(&f, Permissions::from_mode(mode & 0o700))?;
            tracing::warn!(file = %f.display(), was = format!("{mode:04o}"), now = format!("{:04o}", mode & 0o700), "fact store file was readable by other users; repaired");
        }
    }
    Ok(())
}

/// Creates the store's directory `dir` with `mode` (0700, or 0711 when
/// children must traverse it), or sets an existing one of the proxy's to
/// it (a looser one is logged as repaired).
pub fn dir(dir: &Path, mode: u32) -> std::io::Result<()> {
    if dir.as_os_str().is_empty() {
        return Ok(());
    }
    if !dir.exists() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, Permissions::from_mode(mode))?;
        return Ok(());
    }
    let meta = std::fs::metadata(dir)?;
    let now = meta.permissions().mode() & 0o7777;
    if now & 0o777 == mode {
        return Ok(());
    }
    let own = meta.uid() == rustix::process::geteuid().as_raw();
    let sticky = now & 0o1000 != 0;
    let looser = now & !mode & 0o777 != 0;
    if !own || sticky {
        if looser {
            tracing::warn!(
                dir = %dir.display(),
                mode = format!("{now:04o}"),
                "the fact store's directory is shared (another owner, or sticky): its files are 0600, but other users can list it; give the store a directory of its own"
            );
        }
        return Ok(());
    }
    std::fs::set_permissions(dir, Permissions::from_mode(now & !0o777 | mode))?;
    if looser {
        tracing::warn!(dir = %dir.display(), was = format!("{now:04o}"), now = format!("{mode:04o}"), "fact store directory was open to other users; repaired");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn files_are_created_private_and_looser_ones_repaired() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("store").join("facts.db");
        dir(db.parent().unwrap(), 0o700).unwrap();
        assert_eq!(mode(db.parent().unwrap()), 0o700);
        files(&db).unwrap();
        assert_eq!(mode(&db), 0o600);
        let [_, wal, shm] = store_files(&db);
        for f in [&db, &wal, &shm] {
            std::fs::write(f, b"").unwrap();
            std::fs::set_permissions(f, Permissions::from_mode(0o644)).unwrap();
        }
        std::fs::set_permissions(db.parent().unwrap(), Permissions::from_mode(0o755)).unwrap();
        files(&db).unwrap();
        dir(db.parent().unwrap(), 0o711).unwrap();
        for f in [&db, &wal, &shm] {
            assert_eq!(mode(f), 0o600, "{}", f.display());
        }
        assert_eq!(mode(db.parent().unwrap()), 0o711);
    }

    #[test]
    fn a_sticky_shared_directory_is_left_alone() {
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), Permissions::from_mode(0o1777)).unwrap();
        dir(d.path(), 0o700).unwrap();
        assert_eq!(mode(d.path()), 0o1777);
    }
}
