//! The owner lease: under `[executor] name`, this executor owns the runs it
//! creates on the proxy. At `serve` it ends what a previous instance left
//! (and removes its scratch directories), then renews the lease, so a crash
//! ends its runs within `lease_ms`; a graceful stop releases them.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::invoke::Executor;

impl Executor {
    /// Makes this executor the owner of the runs it creates (`serve`): ends
    /// whatever a previous instance under the same `[executor] name` left on
    /// the proxy, removes scratch directories no live process owns, takes the
    /// owner lease and keeps renewing it, so a crash of this executor ends
    /// its runs on the proxy within `lease_ms`. Waits (logging) until the
    /// proxy answers or `stop` fires.
    pub async fn take_ownership(self: &Arc<Self>, stop: CancellationToken) {
        let name = self.config.executor.name.clone();
        let lease = Duration::from_millis(self.config.executor.lease_ms);
        self.remove_stale_scratch();
        let control = &self.shared.control;
        let mut warned = false;
        loop {
            let r = async {
                let ended = control.release_owner(&name).await?;
                control.renew_lease(&name, lease).await?;
                Ok::<u64, crate::proxy::control::ControlError>(ended)
            }
            .await;
            match r {
                Ok(ended) => {
                    if ended > 0 {
                        tracing::warn!(owner = %name, runs = ended, "ended the runs a previous instance left on the proxy");
                    }
                    break;
                }
                Err(crate::proxy::control::ControlError::Rejected { status: 404 | 405, .. }) => {
                    tracing::warn!("the proxy has no owner leases (an older version): this executor's runs are not leased, and a crash leaves them until max_run_ms");
                    return;
                }
                Err(e) if !warned => {
                    tracing::warn!(error = %e, "cannot take the owner lease yet; retrying every second");
                    warned = true;
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.cancelled() => return,
            }
        }
        control.set_owner(&name);
        let exec = self.clone();
        tokio::spawn(async move {
            let every = lease / 3;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.cancelled() => return,
                }
                if let Err(e) = exec.shared.control.renew_lease(&name, lease).await {
                    tracing::warn!(error = %e, "renewing the owner lease failed; the proxy ends this executor's runs if it stays expired");
                }
            }
        });
    }

    /// At a graceful stop: ends every run still held under the owner name.
    pub async fn release_ownership(&self) {
        let name = &self.config.executor.name;
        match self.shared.control.release_owner(name).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(owner = %name, runs = n, "ended the executor's remaining runs"),
            Err(e) => tracing::warn!(error = %e, "could not release the owner lease at stop"),
        }
    }

    /// Removes scratch directories (`<tool>-<pid>-<n>`) whose executor
    /// process is gone: what a crashed instance left behind.
    fn remove_stale_scratch(&self) {
        let dir = &self.config.executor.scratch_dir;
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        let me = std::process::id();
        let mut removed = 0;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let mut parts = name.rsplitn(3, '-');
            let (Some(_n), Some(pid), Some(_tool)) = (parts.next(), parts.next(), parts.next()) else {
                continue;
            };
            let Ok(pid) = pid.parse::<u32>() else { continue };
            if pid != me
                && !std::path::Path::new(&format!("/proc/{pid}")).exists()
                && std::fs::remove_dir_all(e.path()).is_ok()
            {
                removed += 1;
            }
        }
        if removed > 0 {
            tracing::info!(removed, dir = %dir.display(), "removed scratch directories left by a previous instance");
        }
    }
}
