//! A small authoritative DNS responder on loopback UDP (RFC 1035 §4): A and
//! AAAA answers from a table, rotating answer sets (for rebinding tests),
//! per-name delays (for deadline tests), NXDOMAIN otherwise, and a log of
//! every query it received.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::UdpSocket;

#[derive(Clone, Default)]
struct Entry {
    sets: Vec<Vec<IpAddr>>,
    next: usize,
    ttl: u32,
    delay: Duration,
}

#[derive(Default)]
struct State {
    names: HashMap<String, Entry>,
    log: Vec<(String, u16)>,
}

/// The fake DNS server. Dropping it stops nothing; it lives for the test.
#[derive(Clone)]
pub struct FakeDns {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl FakeDns {
    pub async fn start() -> FakeDns {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let sock = Arc::new(sock);
        tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            loop {
                let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                    return;
                };
                let q = buf[..n].to_vec();
                let st = st.clone();
                let sock = sock.clone();
                tokio::spawn(async move {
                    if let Some((resp, delay)) = answer(&st, &q) {
                        if !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        let _ = sock.send_to(&resp, peer).await;
                    }
                });
            }
        });
        FakeDns { addr, state }
    }

    /// Static answer (A and AAAA records from `ips`), TTL 60.
    pub fn set(&self, name: &str, ips: &[&str]) {
        self.rotate(name, &[ips], 60);
    }

    /// Answers cycle through `sets`, one per query of either type.
    pub fn rotate(&self, name: &str, sets: &[&[&str]], ttl: u32) {
        let sets = sets
            .iter()
            .map(|s| s.iter().map(|i| i.parse().unwrap()).collect())
            .collect();
        let mut st = self.state.lock().unwrap();
        let delay = st.names.get(name).map(|e| e.delay).unwrap_or_default();
        st.names.insert(
            name.to_ascii_lowercase(),
            Entry {
                sets,
                next: 0,
                ttl,
                delay,
            },
        );
    }

    /// Delays every answer for `name`.
    pub fn delay(&self, name: &str, d: Duration) {
        let mut st = self.state.lock().unwrap();
        st.names.entry(name.to_ascii_lowercase()).or_default().delay = d;
    }

    /// Every name queried so far (lower case, no trailing dot).
    pub fn queries(&self) -> Vec<String> {
        self.state.lock().unwrap().log.iter().map(|(n, _)| n.clone()).collect()
    }
}

fn answer(st: &Mutex<State>, q: &[u8]) -> Option<(Vec<u8>, Duration)> {
    if q.len() < 12 {
        return None;
    }
    let mut i = 12;
    let mut labels = vec![];
    loop {
        let len = *q.get(i)? as usize;
        i += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(q.get(i..i + len)?).to_ascii_lowercase());
        i += len;
    }
    let qtype = u16::from_be_bytes([*q.get(i)?, *q.get(i + 1)?]);
    let question_end = i + 4;
    let name = labels.join(".");
    let (ips, ttl, delay, found) = {
        let mut st = st.lock().unwrap();
        st.log.push((name.clone(), qtype));
        match st.names.get_mut(&name) {
            Some(e) if !e.sets.is_empty() => {
                let set = e.sets[e.next % e.sets.len()].clone();
                // A and AAAA queries of one lookup arrive together; advance on A only.
                if qtype == 1 || !set.iter().any(|i| i.is_ipv4()) {
                    e.next += 1;
                }
                (set, e.ttl, e.delay, true)
            }
            Some(e) => (vec![], 0, e.delay, false),
            None => (vec![], 0, Duration::ZERO, false),
        }
    };
    let records: Vec<&IpAddr> = ips
        .iter()
        .filter(|ip| (qtype == 1 && ip.is_ipv4()) || (qtype == 28 && ip.is_ipv6()))
        .collect();
    let mut r = Vec::with_capacity(512);
    r.extend_from_slice(&q[0..2]);
    let rd = q[2] & 0x01;
    r.push(0x84 | rd); // QR, AA, RD copied
    r.push(if found { 0x80 } else { 0x83 }); // RA; NXDOMAIN when unknown
    r.extend_from_slice(&[0, 1]);
    r.extend_from_slice(&(records.len() as u16).to_be_bytes());
    // Negative answers carry an SOA (RFC 2308) so resolvers may cache them, as real servers do.
    let negative = records.is_empty();
    r.extend_from_slice(&[0, u8::from(negative), 0, 0]);
    r.extend_from_slice(&q[12..question_end]);
    for ip in records {
        r.extend_from_slice(&[0xc0, 0x0c]);
        let (t, data): (u16, Vec<u8>) = match ip {
            IpAddr::V4(v) => (1, v.octets().to_vec()),
            IpAddr::V6(v) => (28, v.octets().to_vec()),
        };
        r.extend_from_slice(&t.to_be_bytes());
        r.extend_from_slice(&[0, 1]);
        r.extend_from_slice(&ttl.to_be_bytes());
        r.extend_from_slice(&(data.len() as u16).to_be_bytes());
        r.extend_from_slice(&data);
    }
    if negative {
        r.extend_from_slice(&[0xc0, 0x0c, 0, 6, 0, 1]);
        r.extend_from_slice(&60u32.to_be_bytes());
        r.extend_from_slice(&22u16.to_be_bytes());
        r.extend_from_slice(&[0, 0]); // mname, rname: root
        for v in [1u32, 3600, 600, 86400, if found { ttl.max(1) } else { 60 }] {
            r.extend_from_slice(&v.to_be_bytes());
        }
    }
    Some((r, delay))
}
