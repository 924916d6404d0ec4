//! The hash chain over the store's records and the signed checkpoints that
//! commit to it, as pure functions: no I/O but reading a key file.
//!
//! Each kind of record (facts, decision records) has its own chain per
//! store epoch, because each has its own writer and its own `seq`:
//! `chain(seq) = SHA-256(domain ‖ chain(seq − 1) ‖ seq ‖ body)`, where the
//! body is the record's stored JSON, byte for byte, and the chain before
//! the first record is [`genesis`] (bound to the kind, the cell and the
//! epoch). A checkpoint is a C2SP signed note (`tlog-checkpoint` shape):
//! the origin `loom-egress/<cell>/<epoch>`, the facts' size (the newest
//! seq) and chain head, then extension lines for the decision records'
//! size and head, the time, and `closed` when the writer stopped cleanly;
//! signed with Ed25519 (`signed-note` key and signature encoding).

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use ring::signature::{Ed25519KeyPair, KeyPair, UnparsedPublicKey, ED25519};
use sha2::{Digest, Sha256};
use std::path::Path;

/// A chain value.
pub type Head = [u8; 32];

/// Which chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Facts,
    Decisions,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Facts => "facts",
            Kind::Decisions => "decisions",
        }
    }

    fn domain(self) -> &'static [u8] {
        match self {
            Kind::Facts => b"loom-egress chain v1 facts\0",
            Kind::Decisions => b"loom-egress chain v1 decisions\0",
        }
    }
}

/// The chain before a kind's first record of a store epoch.
pub fn genesis(kind: Kind, cell: &str, epoch: &str) -> Head {
    let mut h = Sha256::new();
    h.update(b"loom-egress chain v1 genesis\0");
    h.update(kind.name().as_bytes());
    h.update([0]);
    h.update(cell.as_bytes());
    h.update([0]);
    h.update(epoch.as_bytes());
    h.finalize().into()
}

/// The chain at record `seq` of `kind`, whose stored body is `body`, after
/// the chain `prev`.
pub fn link(kind: Kind, prev: &Head, seq: u64, body: &[u8]) -> Head {
    let mut h = Sha256::new();
    h.update(kind.domain());
    h.update(prev);
    h.update(seq.to_be_bytes());
    h.update(body);
    h.finalize().into()
}

/// A chain value as a checkpoint writes it (standard base64).
pub fn encode(h: &Head) -> String {
    B64.encode(h)
}

/// A chain value from a checkpoint's base64.
pub fn decode(s: &str) -> Option<Head> {
    B64.decode(s).ok()?.try_into().ok()
}

/// The origin line of a store's checkpoints.
pub fn origin(cell: &str, epoch: &str) -> String {
    format!("loom-egress/{cell}/{epoch}")
}

/// What a checkpoint says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub cell: String,
    pub epoch: String,
    /// The newest fact's seq.
    pub size: u64,
    /// The facts' chain at `size`.
    pub head: Head,
    /// The newest decision record's seq and the chain there.
    pub decisions: (u64, Head),
    /// When it was signed (RFC 3339).
    pub time: String,
    /// Signed as the writer stopped: nothing follows in this epoch until the
    /// store is opened again.
    pub closed: bool,
}

impl Checkpoint {
    /// The note's text: what is signed.
    pub fn text(&self) -> String {
        let mut t = format!(
            "{}\n{}\n{}\ndecisions {} {}\ntime {}\n",
            origin(&self.cell, &self.epoch),
            self.size,
            encode(&self.head),
            self.decisions.0,
            encode(&self.decisions.1),
            self.time
        );
        if self.closed {
            t.push_str("closed\n");
        }
        t
    }

    /// Reads a note's text (without its signatures).
    pub fn parse(text: &str) -> Result<Checkpoint, String> {
        let mut lines = text
            .strip_suffix('\n')
            .ok_or("a note's text ends with a newline")?
            .split('\n');
        let origin = lines.next().unwrap_or_default();
        let rest = origin
            .strip_prefix("loom-egress/")
            .ok_or_else(|| format!("origin {origin:?} is not a Loom Egress store's"))?;
        let (cell, epoch) = rest
            .rsplit_once('/')
            .ok_or_else(|| format!("origin {origin:?} has no epoch"))?;
        let size = lines
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or("the second line is not a size")?;
        let head = lines
            .next()
            .and_then(decode)
            .ok_or("the third line is not a chain head")?;
        let mut c = Checkpoint {
            cell: cell.to_owned(),
            epoch: epoch.to_owned(),
            size,
            head,
            decisions: (0, [0; 32]),
            time: String::new(),
            closed: false,
        };
        let mut decisions = None;
        for line in lines {
            match line.split(' ').collect::<Vec<_>>()[..] {
                ["decisions", n, h] => {
                    decisions = Some((
                        n.parse().map_err(|_| "bad decisions size")?,
                        decode(h).ok_or("bad decisions head")?,
                    ))
                }
                ["time", t] => c.time = t.to_owned(),
                ["closed"] => c.closed = true,
                // Extension lines this version does not know are signed
                // like the rest and otherwise ignored.
                _ => {}
            }
        }
        c.decisions = decisions.ok_or("no decisions line")?;
        Ok(c)
    }

    /// The signed note: the text, a blank line, one signature line.
    pub fn sign(&self, key: &Signer) -> String {
        let text = self.text();
        let sig = key.pair.sign(text.as_bytes());
        let mut blob = key.hash.to_vec();
        blob.extend_from_slice(sig.as_ref());
        format!("{text}\n\u{2014} {} {}\n", key.name, B64.encode(blob))
    }
}

/// Why a note does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoteError {
    #[error("not a signed note: {0}")]
    Malformed(String),
    #[error("no signature by key {0}")]
    Unsigned(String),
    #[error("the signature by key {0} does not verify")]
    BadSignature(String),
}

/// A signature line: the key's name, then its key hash and signature.
type SignatureLine<'a> = (&'a str, Vec<u8>);

/// Splits a signed note into its text and its signature lines.
fn split(note: &str) -> Result<(&str, Vec<SignatureLine<'_>>), NoteError> {
    let bad = |m: &str| NoteError::Malformed(m.to_owned());
    let at = note
        .rfind("\n\n")
        .ok_or_else(|| bad("no blank line before the signatures"))?;
    let (text, sigs) = (&note[..=at], &note[at + 2..]);
    let mut out = Vec::new();
    for line in sigs.lines() {
        let rest = line
            .strip_prefix("\u{2014} ")
            .ok_or_else(|| bad("a signature line starts with an em dash"))?;
        let (name, blob) = rest
            .split_once(' ')
            .ok_or_else(|| bad("a signature line is name and signature"))?;
        let blob = B64.decode(blob).map_err(|_| bad("a signature is base64"))?;
        if blob.len() < 4 {
            return Err(bad("a signature is shorter than its key hash"));
        }
        out.push((name, blob));
    }
    if out.is_empty() {
        return Err(bad("no signature lines"));
    }
    Ok((text, out))
}

/// Verifies a signed note by `key`, and reads it.
pub fn verify_note(note: &str, key: &Verifier) -> Result<Checkpoint, NoteError> {
    let (text, sigs) = split(note)?;
    let c = Checkpoint::parse(text).map_err(NoteError::Malformed)?;
    let mine: Vec<_> = sigs
        .iter()
        .filter(|(n, b)| *n == key.name && b[..4] == key.hash)
        .collect();
    if mine.is_empty() {
        return Err(NoteError::Unsigned(key.name.clone()));
    }
    let pk = UnparsedPublicKey::new(&ED25519, &key.public);
    if mine.iter().any(|(_, b)| pk.verify(text.as_bytes(), &b[4..]).is_ok()) {
        Ok(c)
    } else {
        Err(NoteError::BadSignature(key.name.clone()))
    }
}

/// Reads a note's checkpoint without checking its signature.
pub fn read_note(note: &str) -> Result<Checkpoint, NoteError> {
    let (text, _) = split(note)?;
    Checkpoint::parse(text).map_err(NoteError::Malformed)
}

/// The signed-note key hash: the first 4 bytes of
/// SHA-256(name ‖ "\n" ‖ 0x01 ‖ public key).
fn key_hash(name: &str, public: &[u8]) -> [u8; 4] {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update(b"\n\x01");
    h.update(public);
    let d = h.finalize();
    [d[0], d[1], d[2], d[3]]
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 128 && !name.chars().any(|c| c == '+' || c.is_whitespace() || c.is_control())
}

/// A signing key: `PRIVATE+KEY+<name>+<hash>+<base64(0x01 ‖ seed)>`, the
/// signed-note encoding of an Ed25519 key.
pub struct Signer {
    name: String,
    hash: [u8; 4],
    pair: Ed25519KeyPair,
}

impl Signer {
    /// Reads the key file, refusing one that others may read or write.
    pub fn from_file(path: &Path) -> Result<Signer, String> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display();
        let meta = std::fs::metadata(path).map_err(|e| format!("signing key {shown}: {e}"))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "signing key {shown} has mode {mode:04o}: others may read it; make it 0600 (chmod 600 {shown})"
            ));
        }
        if meta.len() > 4096 {
            return Err(format!("signing key {shown} is not a key ({} bytes)", meta.len()));
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("signing key {shown}: {e}"))?;
        Signer::parse(text.trim()).map_err(|e| format!("signing key {shown}: {e}"))
    }

    pub fn parse(text: &str) -> Result<Signer, String> {
        let parts: Vec<&str> = text.splitn(5, '+').collect();
        let ["PRIVATE", "KEY", name, hash, key] = parts[..] else {
            return Err("not a signed-note private key (PRIVATE+KEY+name+hash+key)".into());
        };
        let raw = B64.decode(key).map_err(|_| "the key is not base64")?;
        let seed = match raw.split_first() {
            Some((1, seed)) if seed.len() == 32 => seed,
            _ => return Err("not an Ed25519 key (algorithm 1, 32 bytes)".into()),
        };
        let pair = Ed25519KeyPair::from_seed_unchecked(seed).map_err(|_| "the key is not a valid Ed25519 seed")?;
        let h = key_hash(name, pair.public_key().as_ref());
        if !valid_name(name) || hex(&h) != hash {
            return Err("the key's name or hash does not match the key".into());
        }
        Ok(Signer {
            name: name.to_owned(),
            hash: h,
            pair,
        })
    }

    /// A new key named `name`: its private text and its verifier key.
    pub fn generate(name: &str) -> Result<(String, String), String> {
        if !valid_name(name) {
            return Err(format!(
                "{name:?} is not a key name (no '+', spaces or control characters; 1 to 128 bytes)"
            ));
        }
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| e.to_string())?;
        let pair = Ed25519KeyPair::from_seed_unchecked(&seed).map_err(|_| "cannot make a key")?;
        let h = hex(&key_hash(name, pair.public_key().as_ref()));
        let mut private = vec![1u8];
        private.extend_from_slice(&seed);
        let text = format!("PRIVATE+KEY+{name}+{h}+{}", B64.encode(private));
        let signer = Signer::parse(&text)?;
        Ok((text, signer.verifier()))
    }

    /// The key's name, as signature lines show it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes a new key named `name` at `path` (created 0600, never over an
    /// existing file, synced) and its verifier key at `path.pub`; returns the
    /// verifier key.
    pub fn create_file(path: &Path, name: &str) -> Result<String, String> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let (private, public) = Signer::generate(name)?;
        let shown = path.display();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| format!("{shown}: {e} (an existing key is never overwritten)"))?;
        f.write_all(format!("{private}\n").as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| format!("{shown}: {e}"))?;
        let mut pub_path = path.as_os_str().to_owned();
        pub_path.push(".pub");
        let pub_path = std::path::PathBuf::from(pub_path);
        std::fs::write(&pub_path, format!("{public}\n")).map_err(|e| format!("{}: {e}", pub_path.display()))?;
        Ok(public)
    }

    /// The verifier key: `<name>+<hash>+<base64(0x01 ‖ public key)>`.
    pub fn verifier(&self) -> String {
        let mut public = vec![1u8];
        public.extend_from_slice(self.pair.public_key().as_ref());
        format!("{}+{}+{}", self.name, hex(&self.hash), B64.encode(public))
    }
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A verifier key: `<name>+<hash>+<base64(0x01 ‖ public key)>`.
#[derive(Debug, Clone)]
pub struct Verifier {
    name: String,
    hash: [u8; 4],
    public: Vec<u8>,
}

impl Verifier {
    /// The key's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn parse(text: &str) -> Result<Verifier, String> {
        let parts: Vec<&str> = text.trim().splitn(3, '+').collect();
        let [name, hash, key] = parts[..] else {
            return Err("not a signed-note verifier key (name+hash+key)".into());
        };
        let raw = B64.decode(key).map_err(|_| "the key is not base64")?;
        let public = match raw.split_first() {
            Some((1, pk)) if pk.len() == 32 => pk.to_vec(),
            _ => return Err("not an Ed25519 verifier key (algorithm 1, 32 bytes)".into()),
        };
        let h = key_hash(name, &public);
        if !valid_name(name) || hex(&h) != hash {
            return Err("the key's name or hash does not match the key".into());
        }
        Ok(Verifier {
            name: name.to_owned(),
            hash: h,
            public,
        })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint() -> Checkpoint {
        Checkpoint {
            cell: "cell-a".into(),
            epoch: "0b6a7c1e-5d2f-4c61-9a55-1f3e0d7a9b21".into(),
            size: 42,
            head: link(Kind::Facts, &genesis(Kind::Facts, "cell-a", "e"), 1, b"{}"),
            decisions: (7, genesis(Kind::Decisions, "cell-a", "e")),
            time: "2026-12-06T20:00:00.000Z".into(),
            closed: true,
        }
    }

    #[test]
    fn the_chain_binds_kind_cell_epoch_seq_body_and_order() {
        let g = genesis(Kind::Facts, "c", "e");
        assert_ne!(g, genesis(Kind::Decisions, "c", "e"));
        assert_ne!(g, genesis(Kind::Facts, "c", "f"));
        assert_ne!(g, genesis(Kind::Facts, "ce", ""), "fields are separated");
        let a = link(Kind::Facts, &g, 1, b"a");
        assert_ne!(a, link(Kind::Decisions, &g, 1, b"a"));
        assert_ne!(a, link(Kind::Facts, &g, 2, b"a"));
        assert_ne!(a, link(Kind::Facts, &g, 1, b"b"));
        let ab = link(Kind::Facts, &a, 2, b"b");
        let b_first = link(Kind::Facts, &link(Kind::Facts, &g, 1, b"b"), 2, b"a");
        assert_ne!(ab, b_first, "swapping two records changes the head");
        assert_eq!(decode(&encode(&ab)), Some(ab));
    }

    #[test]
    fn a_signed_checkpoint_verifies_and_reads_back() {
        let (private, public) = Signer::generate("cell-a-audit").unwrap();
        let key = Signer::parse(&private).unwrap();
        let v = Verifier::parse(&public).unwrap();
        let c = checkpoint();
        let note = c.sign(&key);
        assert!(note.starts_with("loom-egress/cell-a/0b6a7c1e-5d2f-4c61-9a55-1f3e0d7a9b21\n42\n"));
        assert!(note.contains("\n\n\u{2014} cell-a-audit "));
        assert_eq!(verify_note(&note, &v), Ok(c.clone()));
        assert_eq!(read_note(&note), Ok(c));
    }

    #[test]
    fn any_change_to_a_note_or_the_wrong_key_fails_verification() {
        let (private, _) = Signer::generate("k").unwrap();
        let key = Signer::parse(&private).unwrap();
        let v = Verifier::parse(&key.verifier()).unwrap();
        let note = checkpoint().sign(&key);
        let edited = note.replacen("\n42\n", "\n41\n", 1);
        assert_eq!(verify_note(&edited, &v), Err(NoteError::BadSignature("k".into())));
        // A bit flipped in the signature.
        let (text, sig) = note.rsplit_once(' ').unwrap();
        let mut blob = B64.decode(sig.trim()).unwrap();
        blob[10] ^= 1;
        let flipped = format!("{text} {}\n", B64.encode(blob));
        assert_eq!(verify_note(&flipped, &v), Err(NoteError::BadSignature("k".into())));
        // Another key of the same name.
        let (other, _) = Signer::generate("k").unwrap();
        let other = Verifier::parse(&Signer::parse(&other).unwrap().verifier()).unwrap();
        assert_eq!(verify_note(&note, &other), Err(NoteError::Unsigned("k".into())));
        for bad in [
            "",
            "loom-egress/c/e\n1\n",
            "x\n\n\u{2014} k AAAA\n",
            "loom-egress/c/e\n1\nAA\n\n\u{2014} k AAAAAAAA\n",
        ] {
            assert!(matches!(verify_note(bad, &v), Err(NoteError::Malformed(_))), "{bad:?}");
        }
    }

    #[test]
    fn keys_round_trip_and_bad_keys_are_refused_with_a_reason() {
        let (private, public) = Signer::generate("n").unwrap();
        assert!(private.starts_with("PRIVATE+KEY+n+"));
        assert_eq!(Signer::parse(&private).unwrap().verifier(), public);
        assert!(Signer::generate("a+b").is_err());
        assert!(Signer::generate("a b").is_err());
        let renamed = private.replacen("+n+", "+m+", 1);
        assert!(Signer::parse(&renamed).unwrap_err().contains("does not match"));
        assert!(Verifier::parse("n+00000000+AQ==").is_err());
        assert!(Signer::parse("garbage").is_err());
    }

    #[test]
    fn a_key_file_others_may_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        let (private, _) = Signer::generate("n").unwrap();
        std::fs::write(&path, format!("{private}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Signer::from_file(&path).unwrap_err();
        assert!(e.contains("mode 0644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Signer::from_file(&path).is_ok());
    }
}
