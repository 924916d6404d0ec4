//! The real `egress-proxy`, started from its binary, beside an executor in
//! the test's process, both reading one config: a `[proxy]` on ports of the
//! OS's choice whose only DNS server is a fake one and which allows
//! `127.0.0.2` (the origins' address), an `[executor]`, and the test's tools.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use egress_executor::Executor;

use crate::executor::TempDir;
use crate::harness::TOKEN;
use crate::process::{spawn_reporting, KillOnDrop};

/// The proxy binary: `EGRESS_PROXY_BIN`, else beside the running test's or
/// example's target directory (`cargo build -p egress-proxy` puts it there);
/// `None` when it is not built.
pub fn proxy_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("EGRESS_PROXY_BIN") {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("egress-proxy");
    p.exists().then_some(p)
}

/// Starts the proxy at `bin` on the config file `config` (with the test
/// control token, and `env`): it, and its control address read from its JSON log.
pub fn start_proxy(bin: &Path, config: &Path, env: &[(&str, &str)]) -> (KillOnDrop, SocketAddr) {
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--log-format", "json", "--config"])
        .arg(config)
        .env("EGRESS_CONTROL_TOKEN", TOKEN)
        .envs(env.iter().copied());
    let (child, control) = spawn_reporting(&mut cmd, "control");
    (KillOnDrop(child), control)
}

/// The config both read: the proxy's control API on `control`, its only DNS
/// server `dns`, `127.0.0.2` allowed, more `[proxy]` keys (`proxy_extra`),
/// then `tools`.
pub fn config(control: &str, dns: SocketAddr, proxy_extra: &str, tools: &str) -> String {
    format!(
        r#"
[proxy]
listen = "127.0.0.1:0"
control = "{control}"
facts = "var/egress-facts.db"
allow_ranges = ["127.0.0.2/32"]
{proxy_extra}

[proxy.dns]
servers = ["{dns}"]

[executor]
listen = "127.0.0.1:0"
scratch_dir = "scratch"
{tools}"#
    )
}

/// The proxy and an executor on [`config`] (in `dir`: `proxy.toml`, then
/// `egress.toml` naming the proxy's control address).
pub struct Stack {
    pub proxy: KillOnDrop,
    pub exec: Arc<Executor>,
    pub control: SocketAddr,
}

/// Starts a [`Stack`]: the proxy from `bin`, then the executor.
pub fn start_stack(bin: &Path, dir: &TempDir, dns: SocketAddr, tools: &str) -> Stack {
    start_stack_with(bin, dir, dns, "", tools, &[])
}

/// [`start_stack`] with more `[proxy]` keys (`proxy_extra`, say a shorter
/// `header_read_timeout_ms`), the proxy with `proxy_env` added to its
/// environment (a benchmark's `RUST_LOG`, say).
pub fn start_stack_with(
    bin: &Path,
    dir: &TempDir,
    dns: SocketAddr,
    proxy_extra: &str,
    tools: &str,
    proxy_env: &[(&str, &str)],
) -> Stack {
    let (proxy, control) = start_proxy(
        bin,
        &dir.write("proxy.toml", &config("127.0.0.1:0", dns, proxy_extra, tools)),
        proxy_env,
    );
    let cfg = dir.write("egress.toml", &config(&control.to_string(), dns, proxy_extra, tools));
    Stack {
        proxy,
        exec: crate::executor::executor(&cfg),
        control,
    }
}
