//! Executable identity: what a child runs, hashed with SHA-256 before it
//! starts — its program, read from the descriptor the child then executes
//! (`execveat`), and the script files its command names (read by path, as
//! the interpreter reads them) — and checked against the tool's
//! `expect_sha256` pins. Every child start hashes again; a file whose
//! `(dev, ino, size, mtime, ctime)` did not change since it was last hashed
//! keeps its digest.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use sha2::{Digest as _, Sha256};

/// Most executables a run carries (`egress_api::rules::MAX_EXECUTABLES`).
pub const MAX_EXECUTABLES: usize = egress_api::rules::MAX_EXECUTABLES;

/// A cached digest is trusted only if the file's last change is at least
/// this much older than the hash (git's "racily clean" rule): a write in
/// the same timestamp tick as the read could leave every stat field as it
/// was.
const RACY: Duration = Duration::from_secs(2);

/// Why a child's files could not be hashed.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot hash `{}`: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("cannot hash `{}`: not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error(transparent)]
    Resolve(io::Error),
}

/// A pin of `expect_sha256` that what a child would run does not meet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    #[error("`{}` is pinned to sha256 {expected} in expect_sha256 but hashes to {actual}", path.display())]
    Digest {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error(
        "`{}` is pinned in expect_sha256 but the command does not run it (it runs: {})",
        path.display(),
        hashed.join(", ")
    )]
    NotRun { path: PathBuf, hashed: Vec<String> },
}

/// One hashed file: its path as the command names it (absolute) and its
/// lowercase hex SHA-256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hashed {
    pub path: PathBuf,
    pub sha256: String,
}

/// What a child runs: its program, and what its command names besides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub program: Hashed,
    /// The interpreter a `#!` program names, then every argument that is
    /// an existing regular file, in order.
    pub others: Vec<Hashed>,
}

impl Identity {
    /// Every hashed file, the program first.
    pub fn files(&self) -> impl Iterator<Item = &Hashed> {
        std::iter::once(&self.program).chain(&self.others)
    }

    /// What a run carries (`CreateRun::executables`): path → digest, at
    /// most [`MAX_EXECUTABLES`], the program first, then in command order.
    pub fn executables(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for h in self.files() {
            if out.len() == MAX_EXECUTABLES {
                break;
            }
            let path = h.path.to_string_lossy().into_owned();
            if path.len() <= 4096 {
                out.insert(path, h.sha256.clone());
            }
        }
        out
    }
}

/// The program of a child, open for `execveat`: the descriptor its digest
/// was read from, and how to run it.
#[derive(Debug)]
pub struct Program {
    pub path: PathBuf,
    pub fd: OwnedFd,
    /// A `#!` script: the kernel cannot run it from a close-on-exec
    /// descriptor (its interpreter would be handed `/dev/fd/N`, closed by
    /// then), so it is executed by path, and read by path, as an
    /// interpreter's script is.
    pub script: bool,
    /// Its stat when hashed; compared again once the child runs it.
    pub stamp: Stamp,
    /// It had changed within [`RACY`] of the hash: an unchanged stamp
    /// proves nothing, it is read again once the child runs it.
    pub racy: bool,
}

/// A child's program, opened, and what it runs, hashed.
#[derive(Debug)]
pub struct Opened {
    pub program: Program,
    pub identity: Identity,
}

/// `(dev, ino, size, mtime, ctime)`: a file that keeps all five kept its
/// content (ctime cannot be set back by a user).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    pub fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }

    /// Whether the file changed less than `racy` before `now`: a change in
    /// the same tick could have left this stamp as it is.
    fn racy(&self, now: SystemTime, racy: Duration) -> bool {
        let changed = Duration::new(self.ctime.0.max(0) as u64, self.ctime.1.clamp(0, 999_999_999) as u32);
        let now = now.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        now.saturating_sub(changed) < racy
    }
}

/// What a file's digest was, and what else its head said.
#[derive(Debug, Clone)]
struct Known {
    stamp: Stamp,
    sha256: String,
    /// The interpreter of a `#!` file, as its first line names it.
    shebang: Option<Option<PathBuf>>,
}

/// The digests of files hashed so far, by path: a child start hashes again
/// only what changed.
#[derive(Debug)]
pub struct Hasher {
    known: Mutex<HashMap<PathBuf, Known>>,
    /// See [`RACY`].
    racy: Duration,
}

impl Default for Hasher {
    fn default() -> Self {
        Hasher::new()
    }
}

impl Hasher {
    pub fn new() -> Hasher {
        Hasher {
            known: Mutex::new(HashMap::new()),
            racy: RACY,
        }
    }

    /// Opens the program of `command` (found on `path`, as the child would
    /// find it) and hashes it from that descriptor, then every argument
    /// that names an existing regular file (relative to `cwd`), by path,
    /// and the interpreter of a `#!` program.
    pub fn open(&self, command: &[String], path: &str, cwd: &Path) -> Result<Opened, IdentityError> {
        let name = command
            .first()
            .ok_or_else(|| IdentityError::Resolve(io::Error::new(io::ErrorKind::InvalidInput, "empty command")))?;
        let resolved = normal(&super::resolve_program(name, path, cwd).map_err(IdentityError::Resolve)?);
        let (file, known) = self.hash_path(&resolved)?;
        let mut others = Vec::new();
        let script = known.shebang.is_some();
        if let Some(Some(interpreter)) = &known.shebang {
            if interpreter.is_absolute() && interpreter.is_file() {
                let (_, k) = self.hash_path(interpreter)?;
                others.push(Hashed {
                    path: interpreter.clone(),
                    sha256: k.sha256,
                });
            }
        }
        let program_path = resolved.clone();
        for arg in crate::confine::landlock::command_files(command, Some(&resolved), cwd)
            .into_iter()
            .skip(1)
        {
            let arg = normal(&arg);
            let (_, k) = self.hash_path(&arg)?;
            others.push(Hashed {
                path: arg,
                sha256: k.sha256,
            });
        }
        Ok(Opened {
            program: Program {
                path: program_path.clone(),
                fd: OwnedFd::from(file),
                script,
                stamp: known.stamp,
                racy: known.stamp.racy(SystemTime::now(), self.racy),
            },
            identity: Identity {
                program: Hashed {
                    path: program_path,
                    sha256: known.sha256,
                },
                others,
            },
        })
    }

    /// Opens `path` (never blocking on a FIFO) and hashes it from that
    /// descriptor, or takes its known digest if its stamp did not change.
    fn hash_path(&self, path: &Path) -> Result<(File, Known), IdentityError> {
        let read = |source| IdentityError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(read)?;
        let meta = file.metadata().map_err(read)?;
        if !meta.is_file() {
            return Err(IdentityError::NotAFile {
                path: path.to_path_buf(),
            });
        }
        let stamp = Stamp::of(&meta);
        if let Some(k) = self.lock().get(path).filter(|k| k.stamp == stamp) {
            return Ok((file, k.clone()));
        }
        let (sha256, head) = digest(&file).map_err(read)?;
        let known = Known {
            stamp,
            sha256,
            shebang: shebang(&head),
        };
        if !stamp.racy(SystemTime::now(), self.racy) {
            self.lock().insert(path.to_path_buf(), known.clone());
        }
        Ok((file, known))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, Known>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The SHA-256 of what `fd` holds now, as lowercase hex.
pub fn digest_fd(fd: &OwnedFd) -> io::Result<String> {
    Ok(digest(&File::from(fd.try_clone()?))?.0)
}

/// The SHA-256 of everything `file` holds (read from offset 0, whatever
/// its position), as lowercase hex, and its first line (at most 256 bytes).
fn digest(file: &File) -> io::Result<(String, Vec<u8>)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut head = Vec::new();
    let mut at = 0u64;
    loop {
        let n = match file.read_at(&mut buf, at) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if head.len() < 256 {
            let take = (256 - head.len()).min(n);
            head.extend_from_slice(&buf[..take]);
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok((hex(&h.finalize()), head))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// `None`: not a `#!` file; `Some(interpreter)`: one, and the interpreter
/// its first line names (none if the line names nothing).
pub fn shebang(head: &[u8]) -> Option<Option<PathBuf>> {
    use std::os::unix::ffi::OsStrExt;
    let rest = head.strip_prefix(b"#!")?;
    let line = rest.split(|b| *b == b'\n').next().unwrap_or_default();
    let interpreter = line
        .split(|b| *b == b' ' || *b == b'\t' || *b == b'\r')
        .find(|w| !w.is_empty())
        .map(|w| PathBuf::from(std::ffi::OsStr::from_bytes(w)));
    Some(interpreter)
}

/// `path` made absolute (against the current directory) with its `.`
/// components dropped (`..` is kept: lexically it cannot be resolved
/// through a symlink).
pub fn normal(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    abs.components().filter(|c| *c != Component::CurDir).collect()
}

/// Whether `identity` meets every pin of `expect_sha256` (`pins`, paths as
/// written, relative ones under `cwd`): the first pin it does not meet.
pub fn verify(pins: &BTreeMap<PathBuf, String>, cwd: &Path, identity: &Identity) -> Result<(), Mismatch> {
    for (path, expected) in pins {
        let path = normal(&cwd.join(path));
        match identity.files().find(|h| h.path == path) {
            Some(h) if h.sha256 == *expected => {}
            Some(h) => {
                return Err(Mismatch::Digest {
                    path,
                    expected: expected.clone(),
                    actual: h.sha256.clone(),
                })
            }
            None => {
                return Err(Mismatch::NotRun {
                    path,
                    hashed: identity.files().map(|h| h.path.display().to_string()).collect(),
                })
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashed(path: &str, sha256: &str) -> Hashed {
        Hashed {
            path: PathBuf::from(path),
            sha256: sha256.repeat(64 / sha256.len()),
        }
    }

    fn identity() -> Identity {
        Identity {
            program: hashed("/usr/bin/python3", "a"),
            others: vec![hashed("/srv/runner.py", "b"), hashed("/srv/t/tool.py", "c")],
        }
    }

    /// Each pin, absolute or relative to cwd, is met only by a hashed
    /// file of that path with that digest.
    #[test]
    fn pins_are_met_by_the_hashed_files_only() {
        let cwd = Path::new("/srv");
        let (a, b, c, d) = ("a".repeat(64), "b".repeat(64), "c".repeat(64), "d".repeat(64));
        /// Pins, and the error a mismatch says (a part of it).
        type Case<'a> = (Vec<(&'a str, &'a str)>, Result<(), &'a str>);
        let cases: Vec<Case> = vec![
            (vec![], Ok(())),
            (vec![("/usr/bin/python3", &a)], Ok(())),
            (vec![("t/tool.py", &c), ("./runner.py", &b)], Ok(())),
            (vec![("/srv/./t/tool.py", &c)], Ok(())),
            (vec![("t/tool.py", &d)], Err("/srv/t/tool.py` is pinned to sha256 dddd")),
            (vec![("/usr/bin/python3", &b)], Err("hashes to aaaa")),
            (vec![("/usr/bin/python3", &a), ("other.py", &a)], Err("`/srv/other.py` is pinned in expect_sha256 but the command does not run it (it runs: /usr/bin/python3, /srv/runner.py, /srv/t/tool.py)")),
            (vec![("/usr/bin/python3.11", &a)], Err("does not run it")),
        ];
        for (pins, want) in cases {
            let pins: BTreeMap<PathBuf, String> = pins.iter().map(|(p, d)| (PathBuf::from(p), d.to_string())).collect();
            let got = verify(&pins, cwd, &identity()).map_err(|e| e.to_string());
            match (&got, want) {
                (Ok(()), Ok(())) => {}
                (Err(e), Err(w)) if e.contains(w) => {}
                _ => panic!("{pins:?}: {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn shebang_names_the_interpreter() {
        for (head, want) in [
            (&b"\x7fELF\x02"[..], None),
            (b"#!/bin/sh\necho", Some(Some("/bin/sh"))),
            (b"#! /usr/bin/env python3 -u\n", Some(Some("/usr/bin/env"))),
            (b"#!\t/bin/bash\r\n", Some(Some("/bin/bash"))),
            (b"#!\n", Some(None)),
            (b"#!/bin/sh", Some(Some("/bin/sh"))),
            (b"print(1)", None),
        ] {
            assert_eq!(shebang(head), want.map(|w| w.map(PathBuf::from)), "{head:?}");
        }
    }

    #[test]
    fn executables_are_at_most_sixteen_program_first() {
        let mut id = identity();
        for i in 0..20 {
            id.others.push(hashed(&format!("/srv/f{i:02}"), "e"));
        }
        let e = id.executables();
        assert_eq!(e.len(), MAX_EXECUTABLES);
        assert!(e.contains_key("/usr/bin/python3"));
        assert!(e.contains_key("/srv/f12") && !e.contains_key("/srv/f13"));
        assert!(egress_api::rules::valid_executables(&e));
    }

    /// A file hashes as `sha256sum` would; once known, a change to it is
    /// seen at the next hash (its stamp changed), also by a hasher that
    /// trusts every stamp at once. A file replaced by another (rename) is
    /// another inode: hashed again too.
    #[test]
    fn a_changed_file_is_hashed_again() {
        let dir = std::env::temp_dir().join(format!("loom-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("tool.py");
        std::fs::write(&f, "abc").unwrap();
        let h = Hasher {
            racy: Duration::ZERO,
            ..Hasher::new()
        };
        let cmd = ["sh".to_string(), "./tool.py".to_string()];
        let digest_of = |h: &Hasher| h.open(&cmd, "/bin:/usr/bin", &dir).unwrap().identity.others[0].clone();
        // sha256("abc")
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(
            digest_of(&h),
            Hashed {
                path: f.clone(),
                sha256: abc.into()
            }
        );
        assert_eq!(digest_of(&h).sha256, abc);
        std::fs::write(&f, "abcd").unwrap();
        // sha256("abcd")
        let abcd = "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589";
        assert_eq!(digest_of(&h).sha256, abcd);
        let tmp = dir.join("new");
        std::fs::write(&tmp, "abc").unwrap();
        std::fs::rename(&tmp, &f).unwrap();
        assert_eq!(digest_of(&h).sha256, abc);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A digest of a file changed within [`RACY`] is not kept: the next
    /// start reads the file again, so a write in the same timestamp tick
    /// (same size, same times) is seen.
    #[test]
    fn a_racy_stamp_is_not_trusted() {
        let dir = std::env::temp_dir().join(format!("loom-identity-racy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tool.py"), "abc").unwrap();
        let h = Hasher::new();
        h.open(&["sh".into(), "tool.py".into()], "/bin:/usr/bin", &dir).unwrap();
        assert!(
            !h.lock().contains_key(&dir.join("tool.py")),
            "a file written just now is not kept"
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let now = SystemTime::now();
        let secs = now.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64;
        let stamp = |ctime| Stamp {
            dev: 1,
            ino: 1,
            size: 1,
            mtime: (0, 0),
            ctime: (ctime, 0),
        };
        assert!(stamp(secs).racy(now, RACY));
        assert!(stamp(secs + 10).racy(now, RACY));
        assert!(!stamp(secs - 10).racy(now, RACY));
        assert!(!stamp(secs).racy(now + RACY, RACY));
    }
}
