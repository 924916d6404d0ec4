//! `type = "file"`: OCSF events as JSON lines appended to a file of mode
//! 0600, synced (`fsync`) before the sink's cursor moves. Before a batch
//! would take the file past `max_file_mb`, it is rotated: `path` becomes
//! `path.1`, `path.1` becomes `path.2`, … and the oldest beyond
//! `max_files` (the current file included) is deleted; the directory is
//! synced after the renames. A crash between the sync and the cursor
//! repeats the batch: duplicates, with their `metadata.uid`, never a gap.

use super::records::Record;
use super::{Delivered, Failure};
use egress_config::audit::FileSink;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

pub(super) struct FileOut {
    cfg: FileSink,
    /// The open file and its size; taken while a blocking write runs.
    open: Option<(File, u64)>,
}

/// `path.N`.
pub fn rotated(path: &Path, n: usize) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(format!(".{n}"));
    PathBuf::from(p)
}

impl FileOut {
    pub(super) fn new(cfg: &FileSink) -> FileOut {
        FileOut {
            cfg: cfg.clone(),
            open: None,
        }
    }

    /// The lines of `batch`.
    pub(super) fn encode(batch: &[Record]) -> Vec<u8> {
        let mut out = Vec::with_capacity(batch.iter().map(|r| r.json.len() + 1).sum());
        for r in batch {
            out.extend_from_slice(r.json.as_bytes());
            out.push(b'\n');
        }
        out
    }

    pub(super) async fn send(&mut self, batch: &[Record]) -> Result<Delivered, Failure> {
        let lines = Self::encode(batch);
        let cfg = self.cfg.clone();
        let open = self.open.take();
        let (open, r) = tokio::task::spawn_blocking(move || {
            let mut open = open;
            let r = append(&cfg, &mut open, &lines);
            if r.is_err() {
                open = None;
            }
            (open, r)
        })
        .await
        .map_err(|e| Failure::new("write", e.to_string()))?;
        self.open = open;
        r.map(|()| Delivered { rejected: 0 })
            .map_err(|e| Failure::new("write", format!("{}: {e}", self.cfg.path.display())))
    }
}

/// Opens `path` for appending, creating it 0600 (an existing file's group
/// and other rights are taken off).
fn open_private(path: &Path) -> std::io::Result<(File, u64)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
    }
    let f = OpenOptions::new().append(true).create(true).mode(0o600).open(path)?;
    let meta = f.metadata()?;
    if meta.permissions().mode() & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    Ok((f, meta.len()))
}

/// Appends `lines` (rotating first when they would not fit) and syncs.
pub(super) fn append(cfg: &FileSink, open: &mut Option<(File, u64)>, lines: &[u8]) -> std::io::Result<()> {
    if open.is_none() {
        *open = Some(open_private(&cfg.path)?);
    }
    let size = open.as_ref().map_or(0, |o| o.1);
    if size > 0 && size + lines.len() as u64 > cfg.max_file_bytes {
        *open = None;
        rotate(&cfg.path, cfg.max_files)?;
        *open = Some(open_private(&cfg.path)?);
    }
    let Some((f, size)) = open.as_mut() else {
        return Err(std::io::Error::other("no file"));
    };
    f.write_all(lines)?;
    f.sync_data()?;
    *size += lines.len() as u64;
    Ok(())
}

/// Shifts `path` to `path.1` and each `path.N` to `path.N+1`, deleting
/// what falls beyond `max_files` files.
pub(super) fn rotate(path: &Path, max_files: usize) -> std::io::Result<()> {
    let gone = |r: std::io::Result<()>| match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    };
    if max_files <= 1 {
        gone(std::fs::remove_file(path))?;
    } else {
        gone(std::fs::remove_file(rotated(path, max_files - 1)))?;
        for n in (1..max_files - 1).rev() {
            gone(std::fs::rename(rotated(path, n), rotated(path, n + 1)))?;
        }
        gone(std::fs::rename(path, rotated(path, 1)))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_rotate_by_size_and_count_and_are_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit").join("events.jsonl");
        let cfg = FileSink {
            path: path.clone(),
            max_file_bytes: 100,
            max_files: 3,
        };
        let mut open = None;
        for i in 0..20 {
            let line = format!("{{\"n\":{i},\"pad\":\"{}\"}}\n", "x".repeat(20));
            append(&cfg, &mut open, line.as_bytes()).unwrap();
        }
        let mut kept = vec![];
        for p in [path.clone(), rotated(&path, 1), rotated(&path, 2)] {
            let meta = std::fs::metadata(&p).unwrap();
            assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{}", p.display());
            assert!(meta.len() <= 100, "{} holds {} bytes", p.display(), meta.len());
            kept.push(std::fs::read_to_string(&p).unwrap());
        }
        assert!(!rotated(&path, 3).exists(), "only max_files files are kept");
        // Newest last: path.2, path.1, path hold consecutive lines ending with 19.
        let lines: Vec<String> = kept.iter().rev().flat_map(|t| t.lines().map(str::to_owned)).collect();
        let ns: Vec<u64> = lines
            .iter()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["n"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(*ns.last().unwrap(), 19);
        assert!(ns.windows(2).all(|w| w[1] == w[0] + 1), "{ns:?}");
        let dir_mode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777;
        assert_eq!(dir_mode, 0o700);
    }

    #[test]
    fn a_looser_existing_file_is_made_private_and_one_file_is_truncated_by_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.jsonl");
        std::fs::write(&path, b"old\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let cfg = FileSink {
            path: path.clone(),
            max_file_bytes: 10,
            max_files: 1,
        };
        let mut open = None;
        append(&cfg, &mut open, b"new line 1\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new line 1\n");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!rotated(&path, 1).exists());
    }
}
