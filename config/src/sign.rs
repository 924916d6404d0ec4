//! `sign = { aws_sigv4 = { … } }` on a credential: the proxy re-signs the
//! tool's AWS Signature Version 4 requests to the credential's hosts with
//! the real keys. The tool holds placeholder keys (the run's placeholder
//! as both its access key id and its secret access key) and signs with
//! them as any AWS SDK does; the proxy checks the key id, strips the tool's
//! signature and signs again.
//!
//! The credential's `secret` is the secret access key (its own source:
//! `secret_access_key`, any source a `secret` may be). The access key id
//! and the session token are read with it from the environment or a file,
//! and are looked for like the secret: scrubbed from the hosts' answers and
//! `credential_misuse` anywhere else.

use crate::credentials::Secret;
use crate::reader::Section;
use crate::sources::SecretSource;

/// The default variable the child finds the placeholder secret key in.
pub const DEFAULT_SECRET_ENV: &str = "AWS_SECRET_ACCESS_KEY";
/// The default largest request body the proxy reads to hash it, when the
/// tool's request does not name its payload hash (`x-amz-content-sha256`).
pub const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;
/// The largest `max_body_bytes` (and chunk of a signed streaming upload).
pub const MAX_BODY_BYTES: u64 = 16 << 20;

/// `aws_sigv4 = { … }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsSigV4 {
    /// The signing name of the service, e.g. `s3`, `secretsmanager`.
    pub service: String,
    /// The region signed for, e.g. `us-east-1`.
    pub region: String,
    /// Where the access key id comes from (the environment or a file);
    /// `None` with `assume_role`, whose refresher sets `key_id` and `token`.
    pub access_key_id: Option<SecretSource>,
    /// Where the session token comes from, for temporary keys.
    pub session_token: Option<SecretSource>,
    /// The variable the child gets the placeholder in as its secret key.
    pub secret_env: String,
    /// The largest body read whole to hash it (a request without
    /// `x-amz-content-sha256`), and the largest chunk of a signed
    /// streaming upload.
    pub max_body_bytes: u64,
    /// Loaded with the secret (empty until then).
    pub key_id: Secret,
    /// Loaded with the secret; empty without `session_token`.
    pub token: Secret,
}

/// Reads `sign = { aws_sigv4 = { … } }` (the table is `s`).
pub(crate) fn sign(s: &mut Section) -> Option<(AwsSigV4, SecretSource)> {
    let at = s.path().to_owned();
    let Some(mut a) = s.optional_table("aws_sigv4") else {
        s.problems.push(
            at,
            "must be { aws_sigv4 = { service, region, access_key_id, secret_access_key } }",
        );
        return None;
    };
    let name = |a: &mut Section, key: &'static str, example: &str| -> Option<String> {
        let v: Option<String> = a.required(key, example);
        match v {
            Some(v)
                if !v.is_empty()
                    && v.len() <= 64
                    && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') =>
            {
                Some(v)
            }
            Some(v) => {
                let at = a.at(key);
                a.problems
                    .push(at, format!("{v:?} is not 1-64 letters, digits, '-' or '_'"));
                None
            }
            None => None,
        }
    };
    let service = name(&mut a, "service", "the service's signing name, e.g. \"s3\"");
    let region = name(&mut a, "region", "the region, e.g. \"us-east-1\"");
    let nested = |a: &mut Section, key: &'static str, live: bool| -> Option<SecretSource> {
        let mut t = a.optional_table(key)?;
        let source = crate::sources::secret(&mut t);
        t.finish();
        match source {
            Some(SecretSource::Live(_)) if !live => {
                let at = a.at(key);
                a.problems.push(
                    at,
                    "is read with the secret key: { env = \"NAME\" } or { file = \"path\" } (only secret_access_key may be a live source)",
                );
                None
            }
            s => s,
        }
    };
    let assumed = a.has("assume_role");
    for key in ["access_key_id", "secret_access_key"] {
        if !assumed && !a.has(key) {
            let at = a.at(key);
            a.problems.push(
                at,
                "is required (a source, e.g. { env = \"NAME\" } or { file = \"path\" }), or assume_role = { … } instead",
            );
        }
    }
    if assumed {
        for key in ["access_key_id", "secret_access_key", "session_token"] {
            if a.has(key) {
                let at = a.at(key);
                a.problems
                    .push(at, "is not for keys from assume_role: STS gives all three");
                let _ = a.take(key);
            }
        }
    }
    let (access_key_id, secret, session_token) = if assumed {
        let mut t = a.table("assume_role");
        let r = crate::sources::assume_role(&mut t);
        t.finish();
        (None, r, None)
    } else {
        (
            nested(&mut a, "access_key_id", false),
            nested(&mut a, "secret_access_key", true),
            nested(&mut a, "session_token", false),
        )
    };
    let secret_env: String = a.or("secret_env", DEFAULT_SECRET_ENV.to_owned());
    let max_body_bytes: u64 = a.or("max_body_bytes", DEFAULT_MAX_BODY_BYTES);
    if !(1024..=MAX_BODY_BYTES).contains(&max_body_bytes) {
        let at = a.at("max_body_bytes");
        a.problems
            .push(at, format!("must be between 1024 and {MAX_BODY_BYTES} bytes"));
    }
    a.finish();
    Some((
        AwsSigV4 {
            service: service?,
            region: region?,
            access_key_id: if assumed { None } else { Some(access_key_id?) },
            session_token,
            secret_env,
            max_body_bytes,
            key_id: Secret::default(),
            token: Secret::default(),
        },
        secret?,
    ))
}

impl AwsSigV4 {
    /// Reads the access key id and the session token (static sources).
    pub(crate) fn load(&mut self) -> Result<(), String> {
        let read = |s: &SecretSource, what: &str| match crate::sources::read_simple(s) {
            Some(r) => r.map_err(|e| format!("{what}: {e}")),
            None => Err(format!("{what}: not a static source")),
        };
        // Keys from assume_role are its refresher's.
        let Some(id) = &self.access_key_id else {
            return Ok(());
        };
        self.key_id = read(id, "access_key_id")?;
        if let Some(t) = &self.session_token {
            self.token = read(t, "session_token")?;
        }
        Ok(())
    }

    /// Every file path it names (to resolve against the config's directory).
    pub(crate) fn paths_mut(&mut self, f: &mut dyn FnMut(&mut std::path::PathBuf)) {
        if let Some(id) = &mut self.access_key_id {
            id.paths_mut(f);
        }
        if let Some(t) = &mut self.session_token {
            t.paths_mut(f);
        }
    }
}
