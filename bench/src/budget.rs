//! The cost of a byte budget on bulk (part of the `bulk` figure): one
//! egress-proxy, a run of a tool without `max_bytes_per_run` and a run of
//! a tool with one (never reached), downloading the bulk response in turn
//! (interleaved, so both see the same machine): through a CONNECT tunnel
//! (splice, which asks the budget before every read) and in plain HTTP
//! (hyper's body frames, each cut to a grant). For each: the median MiB/s,
//! the proxy's CPU seconds per GiB and, with `--callgrind`, its user-space
//! instructions per MiB.

use crate::load::{self, Binder, Path};
use crate::procfs::cpu_seconds;
use std::io;
use std::sync::Arc;

/// One way and one run's figures.
#[derive(Debug, Default)]
pub struct Figures {
    pub mib_per_s: f64,
    pub cpu_s_per_gib: Option<f64>,
    pub instructions_per_mib: Option<f64>,
}

/// One download's rate, CPU seconds and instructions.
async fn once(b: &Arc<Binder>, path: &Path, req: &[u8], bytes: u64) -> io::Result<(f64, Option<f64>, Option<u64>)> {
    let pid = path.pid;
    let counting = crate::callgrind::start(pid);
    let cpu0 = pid.and_then(cpu_seconds);
    let (mibps, _) = load::bulk(b, path, req, bytes, 1).await?;
    let cpu = match (cpu0, pid.and_then(cpu_seconds)) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let ins = if counting {
        pid.and_then(crate::callgrind::instructions)
    } else {
        None
    };
    Ok((mibps, cpu, ins))
}

/// Downloads of `bytes`, `reps` times on each of `paths` (in turn), with
/// `request(path)` on `open(path)`; the figures of each path.
async fn interleaved(
    b: &Arc<Binder>,
    paths: &[&Path],
    request: impl Fn(&Path) -> (Path, Vec<u8>),
    bytes: u64,
    reps: usize,
) -> io::Result<Vec<Figures>> {
    let mut rates = vec![vec![]; paths.len()];
    let mut cpu = vec![Some(0.0); paths.len()];
    let mut ins = vec![Some(0u64); paths.len()];
    for _ in 0..reps {
        for (i, path) in paths.iter().enumerate() {
            let (via, req) = request(path);
            let (r, c, n) = once(b, &via, &req, bytes).await?;
            rates[i].push(r);
            cpu[i] = cpu[i].zip(c).map(|(a, b)| a + b);
            ins[i] = ins[i].zip(n).map(|(a, b)| a + b);
        }
    }
    let gib = (bytes as f64 * reps as f64) / (1u64 << 30) as f64;
    let mib = (bytes as f64 * reps as f64) / (1u64 << 20) as f64;
    Ok(rates
        .into_iter()
        .zip(cpu.into_iter().zip(ins))
        .map(|(mut r, (c, n))| {
            r.sort_by(f64::total_cmp);
            Figures {
                mib_per_s: r[r.len() / 2],
                cpu_s_per_gib: c.map(|c| c / gib),
                instructions_per_mib: n.filter(|n| *n > 0).map(|n| n as f64 / mib),
            }
        })
        .collect())
}

/// The tunnel and plain-HTTP figures of `plain` (a run without a budget)
/// and `budgeted` (a run with one), in that order: `[tunnel, http]` each.
pub async fn cost(
    b: &Arc<Binder>,
    plain: &Path,
    budgeted: &Path,
    authority: &str,
    bulk: &str,
    bytes: u64,
    reps: usize,
) -> io::Result<[Vec<Figures>; 2]> {
    let paths = [plain, budgeted];
    let tunnel_req = format!("GET {bulk} HTTP/1.1\r\nHost: origin.test\r\n\r\n").into_bytes();
    let tunnel = interleaved(b, &paths, |p| (p.clone(), tunnel_req.clone()), bytes, reps).await?;
    // Plain HTTP: the absolute-form request on a connection to the proxy.
    let http = interleaved(
        b,
        &paths,
        |p| {
            let req = p.get(authority, bulk);
            (
                Path {
                    proxy: None,
                    ..p.clone()
                },
                req,
            )
        },
        bytes,
        reps,
    )
    .await?;
    Ok([tunnel, http])
}
