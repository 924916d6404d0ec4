//! The cost of scrubbing responses from credential hosts: the same
//! plain-HTTP requests to the same origin through one egress-proxy, as tool
//! `plain` (no credential: responses pass as they are) and as tool
//! `scrubbed` (a credential on the origin, `allow_plaintext = true` since
//! the origin is on loopback: the secret is written into every request and
//! every response is scanned for its forms and streamed on), in the same
//! run. Two loads: keep-alive 1 KiB GETs, and sequential downloads of the
//! bulk size in absolute form (not through a tunnel: a tunnel's bytes are
//! never scrubbed). The bulk body is printable text holding the secret's
//! first bytes often (a sparse file of zeros would let the scan skip it).

use crate::load::{self, Binder, Path, ProxyTarget, Timing, Window};
use crate::peers::{self, Egress, Launcher, Origin};
use std::io;
use std::sync::Arc;

/// The credential's secret (its first bytes recur in the bulk body).
const SECRET: &str = "sk-bench-3f9a7c21e6d4b058";

/// The egress-proxy of this figure: tools `plain` and `scrubbed`, both
/// allowed `origin.test:<port>`.
pub fn egress_proxy(
    l: &Launcher,
    program: &std::path::Path,
    dns: std::net::SocketAddr,
    port: u16,
    token: &str,
) -> io::Result<Egress> {
    use std::os::unix::fs::PermissionsExt;
    let name = "egress-proxy-scrub";
    let d = l.subdir(name)?;
    let secret = d.join("api.token");
    std::fs::write(&secret, format!("{SECRET}\n"))?;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600))?;
    let limits = "fetch_timeout_ms = 3600000\nmax_concurrent_fetches = 65536\nmax_queued_fetches = 65536\n";
    let tools = format!(
        "[tools.plain]
egress = [\"origin.test:{port}\"]
{limits}[tools.scrubbed]
egress = [\"origin.test:{port}\"]
{limits}[tools.scrubbed.credentials.api]
hosts = [\"origin.test:{port}\"]
value = \"Bearer ${{secret}}\"
secret = {{ file = \"{}\" }}
placeholder_env = \"API_TOKEN\"
allow_plaintext = true
",
        secret.display()
    );
    peers::egress_proxy_in(l, program, name, dns, "", &tools, token)
}

/// Rewrites nginx's bulk file (`www/bulk` under the launcher's `nginx`
/// directory) as `bytes` of printable text in which the secret's first
/// three bytes recur about every 300 bytes.
pub fn text_bulk(l: &Launcher, bytes: u64) -> io::Result<()> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut body = Vec::with_capacity(bytes as usize);
    while (body.len() as u64) < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(300) {
            body.extend_from_slice(&SECRET.as_bytes()[..3]);
        } else {
            body.push(b' ' + (x % 95) as u8);
        }
    }
    body.truncate(bytes as usize);
    std::fs::write(l.dir.join("nginx").join("www").join("bulk"), body)
}

/// The two paths, each with a run of its tool.
pub async fn paths(proxy: &Egress, port: u16) -> Vec<Path> {
    let mut out = vec![];
    for tool in ["plain", "scrubbed"] {
        let (id, secret) = egress_e2e::harness::create_run_at(proxy.control, tool).await;
        out.push(Path {
            name: tool.into(),
            addr: proxy.addr,
            proxy: Some(ProxyTarget {
                authority: format!("origin.test:{port}"),
                auth: Some(egress_e2e::harness::basic(&id, &secret)),
            }),
            pid: Some(proxy.daemon.pid()),
        });
    }
    out
}

/// Keep-alive GETs of the small response on `path`.
pub async fn keepalive(b: &Arc<Binder>, path: &Path, origin: &Origin, conns: usize, t: &Timing) -> Window {
    let req = path.get(&format!("origin.test:{}", origin.addr.port()), &origin.small);
    load::keepalive(b, path, req, conns, t).await
}

/// Sequential downloads of the bulk response on `path`, in absolute form on
/// a connection to the proxy: (median MiB/s, proxy CPU s/GiB).
pub async fn bulk(
    b: &Arc<Binder>,
    path: &Path,
    origin: &Origin,
    bytes: u64,
    reps: usize,
) -> io::Result<(f64, Option<f64>)> {
    let req = path.get(&format!("origin.test:{}", origin.addr.port()), &origin.bulk);
    let direct = Path {
        proxy: None,
        ..path.clone()
    };
    load::bulk(b, &direct, &req, bytes, reps).await
}
