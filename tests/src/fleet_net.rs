//! A fleet's network for tests, made of network namespaces as separate
//! hosts would be: a `kernel` host and the cells on a service bridge
//! (192.0.2.0/24), the cells and a `db` host on a data bridge
//! (198.51.100.0/24; documentation ranges, never routed). Kernels reach
//! cells, cells reach PostgreSQL, and a partition cuts one cell's port on the
//! data bridge (the link goes down: its packets vanish, nothing is refused).
//! The test body runs in `kernel` ([`FleetNet::enter`] re-executes the test
//! there); every other process starts in its host with [`within`]. Names
//! carry the test's pid and are removed on drop. Needs root and `ip`.

use std::process::Command;

const MARKER: &str = "EGRESS_E2E_FLEET_NET";

/// `program` run inside network namespace `netns` (`nsenter`, which execs
/// it: the same pid), or as it is with `None`.
pub fn within(netns: Option<&str>, program: &std::path::Path) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net=/run/netns/{ns}")).arg("--").arg(program);
            c
        }
        None => Command::new(program),
    }
}

pub struct FleetNet {
    prefix: String,
    cells: Vec<String>,
    /// The process that made the namespaces removes them.
    owner: bool,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl FleetNet {
    /// Inside the re-executed test: the layout, to run the body in.
    /// Outside: builds the layout with `cells`, runs `test_name` again
    /// inside `kernel`, asserts it passed, and returns `None` (also, loudly,
    /// when this machine cannot build it).
    pub fn enter(test_name: &str, cells: &[&str]) -> Option<FleetNet> {
        let args = [test_name, "--exact", "--nocapture", "--test-threads=1"];
        Self::enter_with(cells, &args, |stdout| {
            assert!(stdout.contains("1 passed"), "{test_name} ran no test:\n{stdout}")
        })
    }

    /// [`FleetNet::enter`] for a whole program (a benchmark): it runs again
    /// with the same arguments inside `kernel`.
    pub fn enter_program(cells: &[&str]) -> Option<FleetNet> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Self::enter_with(cells, &args, |stdout| print!("{stdout}"))
    }

    fn enter_with(cells: &[&str], args: &[&str], check: impl FnOnce(&str)) -> Option<FleetNet> {
        let cells: Vec<String> = cells.iter().map(|c| c.to_string()).collect();
        if let Ok(prefix) = std::env::var(MARKER) {
            return Some(FleetNet {
                prefix,
                cells,
                owner: false,
            });
        }
        if !crate::executor::is_root() {
            eprintln!("SKIPPED: the fleet's network needs root (network namespaces)");
            return None;
        }
        let net = FleetNet {
            prefix: format!("le{}", std::process::id()),
            cells,
            owner: true,
        };
        net.build();
        let exe = std::env::current_exe().expect("current executable");
        let out = within(Some(&net.ns("kernel")), &exe)
            .args(args)
            .env(MARKER, &net.prefix)
            .output()
            .expect("nsenter (util-linux)");
        let stdout = String::from_utf8_lossy(&out.stdout);
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        assert!(
            out.status.success(),
            "{} in the fleet's network failed:\n{stdout}",
            args.join(" ")
        );
        check(&stdout);
        None
    }

    /// The namespace of `host` (`kernel`, `db` or a cell).
    pub fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.prefix)
    }

    fn index(&self, cell: &str) -> usize {
        self.cells.iter().position(|c| c == cell).expect("a cell of this fleet") + 2
    }

    /// `cell`'s address on the service bridge (where kernels reach it).
    pub fn service_ip(&self, cell: &str) -> String {
        format!("192.0.2.{}", self.index(cell))
    }

    /// PostgreSQL's host on the data bridge.
    pub fn db_ip(&self) -> &'static str {
        "198.51.100.1"
    }

    fn build(&self) {
        for host in ["kernel", "db"]
            .into_iter()
            .chain(self.cells.iter().map(String::as_str))
        {
            let ns = self.ns(host);
            ip(&["netns", "add", &ns]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
        }
        for (hub, addr) in [("kernel", "192.0.2.1/24"), ("db", "198.51.100.1/24")] {
            let hub = self.ns(hub);
            ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"]);
            ip(&["-n", &hub, "addr", "add", addr, "dev", "br0"]);
            ip(&["-n", &hub, "link", "set", "br0", "up"]);
        }
        for cell in &self.cells {
            let (ns, i) = (self.ns(cell), self.index(cell));
            for (hub, dev, net) in [("kernel", "svc", "192.0.2"), ("db", "data", "198.51.100")] {
                let (hub, port) = (self.ns(hub), format!("p{i}"));
                ip(&[
                    "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", dev, "netns", &ns,
                ]);
                ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"]);
                ip(&["-n", &ns, "addr", "add", &format!("{net}.{i}/24"), "dev", dev]);
                ip(&["-n", &ns, "link", "set", dev, "up"]);
            }
        }
    }

    /// Cuts `cell`'s port on the data bridge: it loses PostgreSQL and
    /// nothing else.
    pub fn cut(&self, cell: &str) {
        self.data_port(cell, "down");
    }

    /// Brings `cell`'s port on the data bridge back.
    pub fn heal(&self, cell: &str) {
        self.data_port(cell, "up");
    }

    fn data_port(&self, cell: &str, state: &str) {
        let port = format!("p{}", self.index(cell));
        ip(&["-n", &self.ns("db"), "link", "set", &port, state]);
    }
}

impl Drop for FleetNet {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        for host in ["kernel", "db"]
            .into_iter()
            .chain(self.cells.iter().map(String::as_str))
        {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(host)]).status();
        }
    }
}
