//! moto in server mode (PyPI, pinned in tests/credentials/requirements.txt)
//! on 127.0.0.2 as the AWS APIs of the credential tests, and boto3 to set
//! it up as an operator would. Killed when dropped.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Moto {
    child: Child,
    pub addr: SocketAddr,
}

/// Skips (with a message) where moto or boto3 is missing; `.ci/run`
/// installs both.
pub fn available() -> bool {
    crate::process::python_has(
        "moto.server, boto3",
        "pip install -r tests/credentials/requirements.txt",
    )
}

impl Moto {
    pub fn start() -> Moto {
        let port = crate::process::free_port();
        let child = Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.2", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 starts");
        let addr = SocketAddr::from(([127, 0, 0, 2], port));
        let start = Instant::now();
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "moto did not listen on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Moto { child, addr }
    }

    /// Runs `code` in Python with `sm` a boto3 Secrets Manager client of
    /// this server (region us-east-1); panics if it fails.
    pub fn boto(&self, code: &str) {
        let prelude = format!(
            "import boto3\nsm = boto3.client('secretsmanager', endpoint_url='http://{}', region_name='us-east-1', \
             aws_access_key_id='moto-admin', aws_secret_access_key='moto-admin')\n",
            self.addr
        );
        let out = Command::new("python3")
            .arg("-c")
            .arg(format!("{prelude}{code}"))
            .output()
            .expect("python3 runs");
        assert!(out.status.success(), "boto3: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The S3-style origin of the SigV4 re-signing tests and bench
/// (`tests/credentials/s3_origin.py`): HTTPS on 127.0.0.2 with a
/// certificate for `s3.example` from a test CA; it accepts a request only
/// when botocore's signer, with the real keys it is given, computes the
/// same signature. Killed when dropped.
pub struct S3Origin {
    child: Child,
    pub addr: SocketAddr,
    /// The CA that issued its certificate (the proxy's `upstream_ca_file`).
    pub ca_file: std::path::PathBuf,
    /// One JSON line per request it got.
    pub log: std::path::PathBuf,
    /// moto as STS in the origin's process (plain HTTP), when asked for.
    pub sts: Option<SocketAddr>,
}

impl S3Origin {
    /// Starts the origin with the real keys `ak`/`sk` (region us-east-1),
    /// and with `sts`, moto as STS whose temporary keys it accepts too; its
    /// files go to `dir`.
    pub fn start(dir: &std::path::Path, ak: &str, sk: &str, sts: bool) -> S3Origin {
        let ca = crate::pki::Ca::new("loom test s3 CA");
        let ca_file = ca.write(dir, "s3-ca.pem");
        let leaf = ca.leaf(dir, "s3", "s3.example", &["s3.example"]);
        let log = dir.join("s3-requests.jsonl");
        let mut args = vec![
            "127.0.0.2".as_ref(),
            leaf.cert.as_os_str(),
            leaf.key.as_os_str(),
            ak.as_ref(),
            sk.as_ref(),
            "us-east-1".as_ref(),
            log.as_os_str(),
        ];
        if sts {
            args.push("--sts".as_ref());
        }
        let (child, v) = crate::process::python_server("tests/credentials/s3_origin.py", &args);
        let port = |k: &str| v[k].as_u64().and_then(|p| u16::try_from(p).ok());
        S3Origin {
            child,
            addr: SocketAddr::from(([127, 0, 0, 2], port("port").expect("a port"))),
            ca_file,
            log,
            sts: port("sts_port").map(|p| SocketAddr::from(([127, 0, 0, 2], p))),
        }
    }

    /// Every request it got so far, oldest first.
    pub fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for S3Origin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
