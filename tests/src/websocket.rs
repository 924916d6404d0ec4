//! WebSocket test support: the `websockets` (PyPI) origin of
//! `tests/python/ws.py` run as a child, with the events it prints, and a CA
//! with a leaf for a `wss://` origin.

use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The client and origin script, `tests/python/ws.py`.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ws.py")
}

/// Fails (says why) unless python3 can import `websockets`.
pub fn require_websockets() {
    let ok = Command::new("python3")
        .args(["-c", "import websockets.asyncio.client"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "python3 with websockets is required for this test (pip install websockets)"
    );
}

/// The `websockets` origin: its port and every event it printed.
pub struct WsOrigin {
    child: Child,
    pub port: u16,
    events: Arc<Mutex<Vec<Value>>>,
}

impl WsOrigin {
    /// Starts the origin on 127.0.0.2, `wss` with `tls` = (cert, key) files.
    pub fn start(tls: Option<(&Path, &Path)>) -> WsOrigin {
        let mut cmd = Command::new("python3");
        cmd.arg(script()).arg("serve");
        if let Some((cert, key)) = tls {
            cmd.arg("--cert").arg(cert).arg("--key").arg(key);
        }
        let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
        let port = first["port"].as_u64().unwrap() as u16;
        let events = Arc::new(Mutex::new(vec![]));
        let e = events.clone();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&l) {
                    e.lock().unwrap().push(v);
                }
            }
        });
        WsOrigin { child, port, events }
    }

    pub fn events(&self) -> Vec<Value> {
        self.events.lock().unwrap().clone()
    }

    /// The events of one kind (`open`, `text`, `binary`, `closed`).
    pub fn of(&self, kind: &str) -> Vec<Value> {
        self.events().into_iter().filter(|e| e["event"] == kind).collect()
    }

    /// Waits (up to 5 s) until the origin has printed `n` events of `kind`.
    pub async fn wait(&self, kind: &str, n: usize) -> Vec<Value> {
        for _ in 0..250 {
            let got = self.of(kind);
            if got.len() >= n {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the origin never printed {n} {kind} events: {:?}", self.events());
    }
}

impl Drop for WsOrigin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A CA and a leaf for `name` in `dir`: (CA PEM, cert file, key file).
pub fn leaf(dir: &Path, name: &str) -> (String, PathBuf, PathBuf) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "ws origin CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let (c, k) = (dir.join("ws-leaf.pem"), dir.join("ws-leaf.key"));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (ca_cert.pem(), c, k)
}
