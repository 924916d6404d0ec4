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
