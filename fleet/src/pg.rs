//! The PostgreSQL connection both services open: its configuration (the DSN
//! read only from the environment variable `[export] dsn_env` names), TLS,
//! the bound on every operation, and the fleet schema.

use egress_config::ExportConfig;
use std::sync::Arc;
use std::time::Duration;

/// Longest wait for any one PostgreSQL operation: a partition must not hang
/// a service (it reconnects, or answers that the store is unavailable).
pub const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// Why PostgreSQL could not be used (`kind` is a metric label).
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("the DSN variable {0} is not set (the DSN is read from the environment only)")]
    NoDsn(String),
    #[error("the DSN in {var} cannot be parsed: {message}")]
    BadDsn { var: String, message: String },
    #[error("{kind}: {message}")]
    Failed { kind: &'static str, message: String },
}

impl PgError {
    /// The failure's metric label (`connect` for a DSN problem).
    pub fn kind(&self) -> &'static str {
        match self {
            PgError::Failed { kind, .. } => kind,
            _ => "connect",
        }
    }
}

/// Maps a driver error to a [`PgError`] of `kind`.
pub fn failed(kind: &'static str) -> impl Fn(tokio_postgres::Error) -> PgError {
    move |e| PgError::Failed {
        kind,
        message: e.to_string(),
    }
}

/// Runs one operation within [`OP_TIMEOUT`].
pub async fn timed<T>(
    kind: &'static str,
    f: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, PgError> {
    match tokio::time::timeout(OP_TIMEOUT, f).await {
        Ok(r) => r.map_err(failed(kind)),
        Err(_) => Err(PgError::Failed {
            kind,
            message: format!("no answer within {OP_TIMEOUT:?}"),
        }),
    }
}

/// A way to open connections: the parsed DSN and the TLS connector.
#[derive(Clone)]
pub struct Connector {
    pg: tokio_postgres::Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
}

impl Connector {
    /// Reads the DSN from the environment variable `cfg.dsn_env`;
    /// `application` names the connections in `pg_stat_activity`.
    pub fn from_env(cfg: &ExportConfig, application: &str) -> Result<Connector, PgError> {
        let dsn = std::env::var(&cfg.dsn_env)
            .ok()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| PgError::NoDsn(cfg.dsn_env.clone()))?;
        let mut pg: tokio_postgres::Config = dsn.parse().map_err(|e: tokio_postgres::Error| PgError::BadDsn {
            var: cfg.dsn_env.clone(),
            message: e.to_string(),
        })?;
        pg.application_name(application);
        pg.connect_timeout(OP_TIMEOUT);
        pg.keepalives_idle(Duration::from_secs(10));
        Ok(Connector {
            pg,
            tls: tls_connector(),
        })
    }

    /// Opens one connection, its driver task spawned, and brings the
    /// schema up to date.
    pub async fn connect(&self, schema: &str) -> Result<Session, PgError> {
        let session = self.open().await?;
        timed("migrate", session.batch_execute(&migration(schema))).await?;
        Ok(session)
    }

    /// Opens one connection, its driver task spawned, and changes nothing
    /// (a reader's: `facts verify --postgres`).
    pub async fn open(&self) -> Result<Session, PgError> {
        let (client, conn) = timed("connect", self.pg.connect(self.tls.clone())).await?;
        let driver = tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "PostgreSQL connection closed");
            }
        });
        Ok(Session { client, driver })
    }
}

/// An open connection. Dropping it closes the socket at once, also across
/// a partition that would hang a polite goodbye: the server then ends the
/// session, and with it any advisory lock it held.
pub struct Session {
    client: tokio_postgres::Client,
    driver: tokio::task::JoinHandle<()>,
}

impl std::ops::Deref for Session {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        &self.client
    }
}

impl std::ops::DerefMut for Session {
    fn deref_mut(&mut self) -> &mut tokio_postgres::Client {
        &mut self.client
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// TLS for DSNs that ask for it (`sslmode=prefer`, the default, or
/// `require`): rustls with the system roots plus `PGSSLROOTCERT` if set,
/// verifying the server's name (as libpq's `verify-full`).
fn tls_connector() -> tokio_postgres_rustls::MakeRustlsConnect {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for c in native.certs {
        let _ = roots.add(c);
    }
    if let Some(file) = std::env::var_os("PGSSLROOTCERT") {
        use rustls_pki_types::pem::PemObject;
        match rustls_pki_types::CertificateDer::pem_file_iter(&file) {
            Ok(certs) => {
                for c in certs.flatten() {
                    let _ = roots.add(c);
                }
            }
            Err(e) => tracing::error!(file = ?file, error = %e, "PGSSLROOTCERT cannot be read"),
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = match rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions() {
        Ok(b) => b.with_root_certificates(roots).with_no_client_auth(),
        Err(e) => {
            tracing::error!(error = %e, "no TLS versions for PostgreSQL connections");
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        }
    };
    tokio_postgres_rustls::MakeRustlsConnect::new(config)
}

/// `"name"`: a schema name checked by the config (a-z, 0-9, `_`).
pub fn ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// The fleet schema, made once under a transaction-level lock so cells
/// starting together do not race: the exported facts (each also as the
/// cell stored it, byte for byte, with its hash chain value, so that
/// `facts verify --postgres` can check them) with the indexes a fleet
/// query needs (by time, tool, reason, run), the signed checkpoints
/// of each cell's fact log (kept here beyond the cell's retention: a
/// witness off the box), and the idempotency claims of keyed invocations.
pub fn migration(schema: &str) -> String {
    let s = ident(schema);
    format!(
        "SET client_min_messages = warning;
         SELECT pg_advisory_xact_lock(hashtextextended('loom-egress-migrate', 0));
         CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.egress_facts (
             cell   text        NOT NULL,
             epoch  uuid        NOT NULL,
             seq    bigint      NOT NULL,
             id     uuid        NOT NULL UNIQUE,
             at     timestamptz NOT NULL,
             run_id text,
             tool   text,
             reason text        NOT NULL,
             mode   text        NOT NULL,
             policy text        NOT NULL,
             body   jsonb       NOT NULL,
             PRIMARY KEY (cell, epoch, seq)
         );
         ALTER TABLE {s}.egress_facts ADD COLUMN IF NOT EXISTS stored text;
         ALTER TABLE {s}.egress_facts ADD COLUMN IF NOT EXISTS chain bytea;
         CREATE INDEX IF NOT EXISTS egress_facts_at ON {s}.egress_facts (at);
         CREATE INDEX IF NOT EXISTS egress_facts_tool_at ON {s}.egress_facts (tool, at);
         CREATE INDEX IF NOT EXISTS egress_facts_reason_at ON {s}.egress_facts (reason, at);
         CREATE INDEX IF NOT EXISTS egress_facts_run ON {s}.egress_facts (run_id, at);
         CREATE TABLE IF NOT EXISTS {s}.egress_checkpoints (
             cell      text        NOT NULL,
             epoch     uuid        NOT NULL,
             size      bigint      NOT NULL,
             decisions bigint      NOT NULL,
             at        timestamptz NOT NULL,
             closed    boolean     NOT NULL,
             note      text        NOT NULL,
             PRIMARY KEY (cell, epoch, size, decisions, at)
         );
         CREATE TABLE IF NOT EXISTS {s}.egress_invocations (
             key           text        PRIMARY KEY,
             digest        text        NOT NULL,
             cell          text        NOT NULL,
             invocation_id uuid        NOT NULL,
             control_url   text,
             state         text        NOT NULL CHECK (state IN ('running', 'done')),
             claimed_at    timestamptz NOT NULL DEFAULT now(),
             expires_at    timestamptz NOT NULL,
             finished_at   timestamptz,
             status        smallint,
             answer        text
         );
         CREATE INDEX IF NOT EXISTS egress_invocations_finished ON {s}.egress_invocations (finished_at);"
    )
}
