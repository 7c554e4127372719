//! The scheduling side of a [`TestCluster`]: the extender process with the flags the chart
//! gives it, and the scheduler driver configured as the chart configures kube-scheduler
//! (HTTPS to the extender's Service, or the dedicated scheduler's rendered configuration).
//!
//! Separate because these are the two pieces the faults restart, and their flags and
//! configuration follow the chart's templates, to be read beside them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, ensure};

use super::{
    ALLOCATION_KEYS, DEDICATED_SCHEDULER, Extender, RELEASE, RELEASE_NAMESPACE,
    SCHEDULER_BACKOFF_MAX, TestCluster, dedicated_scheduler_configuration,
};
use crate::scheduler::{ExtenderConfig, SchedulerConfig, SchedulerDriver};

impl TestCluster {
    pub(super) async fn start_extender(&mut self) -> anyhow::Result<()> {
        self.spawn_extender()?.wait_ready().await
    }

    /// Starts the extender process on the cluster's extender port, without waiting for it.
    pub(super) fn spawn_extender(&mut self) -> anyhow::Result<&mut Extender> {
        let mut args = self.spec.extender_args.clone();
        let native_scoring = self
            .spec
            .scheduler_values
            .iter()
            .any(|value| value == "scheduler.nativeGpuScoring=true");
        if self.spec.dedicated
            && !native_scoring
            && !args.iter().any(|arg| arg.starts_with("--filter-keep-best"))
        {
            // The chart's dedicated install: filter keeps the node the profile would rank
            // best (`extender.filterKeepBest: 1`, its weight `scheduler.extender.weight`);
            // with `scheduler.nativeGpuScoring` the chart renders 0.
            args.extend([
                "--filter-keep-best=1".to_owned(),
                "--prioritize-weight=1".to_owned(),
            ]);
        }
        if let Some(port) = self.webhook_port {
            // As the chart's extender Deployment sets them in dedicated mode.
            args.extend([
                "--webhook-enabled=true".to_owned(),
                format!("--webhook-listen=127.0.0.1:{port}"),
                format!("--webhook-service={RELEASE}-extender"),
                format!("--namespace={RELEASE_NAMESPACE}"),
                format!("--webhook-configuration={RELEASE}-webhook"),
                format!("--scheduler-name={DEDICATED_SCHEDULER}"),
            ]);
        }
        let ports = (self.extender_port, self.monitor_port);
        let extender =
            self.spawn_extender_replica("extender", &self.extender_kubeconfig, ports, &args)?;
        Ok(self.extender.insert(extender))
    }

    pub(super) async fn start_scheduler(&mut self) -> anyhow::Result<()> {
        // As the chart configures it: HTTPS, trusting the extender's CA, verifying the
        // Service's name (here dialled by address, so the name is given as `serverName`).
        let prefix = format!(
            "https://127.0.0.1:{}/gpushare-scheduler",
            self.extender_port
        );
        let mut config = SchedulerConfig {
            extenders: vec![ExtenderConfig {
                http_timeout: self.spec.http_timeout,
                enable_https: true,
                tls: Some(self.extender_tls.scheduler_config()),
                ..ExtenderConfig::gpushare(&prefix)
            }],
            // kube-scheduler runs every bind in a goroutine of its own, unbounded.
            parallel_binds: UNBOUNDED_BINDS,
            binding_cycle_delay: self.spec.binding_cycle_delay,
            backoff_initial: Duration::from_millis(50),
            backoff_max: SCHEDULER_BACKOFF_MAX,
            unschedulable_retry: self.spec.unschedulable_retry,
            ..SchedulerConfig::default()
        };
        if self.spec.dedicated {
            // The dedicated scheduler runs the configuration the chart renders for this
            // extender's policy; only the address and certificates are the harness's.
            let spec = &self.spec;
            let rendered =
                dedicated_scheduler_configuration(&spec.extender_args, &spec.scheduler_values)
                    .await?;
            config = SchedulerConfig::from_kube_scheduler_configuration(&rendered, config)?;
            ensure!(
                config.scheduler_name == DEDICATED_SCHEDULER,
                "{}",
                config.scheduler_name
            );
            for extender in &mut config.extenders {
                extender.url_prefix.clone_from(&prefix);
                extender.http_timeout = self.spec.http_timeout;
                extender.tls = Some(self.extender_tls.scheduler_config());
            }
        }
        self.scheduler = Some(SchedulerDriver::start(self.client.clone(), config).await?);
        Ok(())
    }

    /// The port kube-scheduler calls the extender on (the Service's port).
    pub fn extender_port(&self) -> u16 {
        self.extender_port
    }

    /// The CA of the extender's certificate, as a file (the Secret's `ca.crt`).
    pub fn extender_ca_file(&self) -> PathBuf {
        self.extender_tls.cert_file.with_file_name("ca.crt")
    }

    /// Starts an extender process the way the chart runs each replica: this cluster's
    /// certificate and signing keys, HTTPS on `port` and health on `monitor_port`, acting
    /// with `kubeconfig`, logging to `<name>.log`, with `extra` flags. Does not wait for it.
    /// (The replicas of `tests/ha.rs`, and [`TestCluster::extender`] with the spec's flags.)
    pub fn spawn_extender_replica(
        &self,
        name: &str,
        kubeconfig: &Path,
        (port, monitor_port): (u16, u16),
        extra: &[String],
    ) -> anyhow::Result<Extender> {
        let mut args = extra.to_vec();
        if !args.iter().any(|arg| arg.starts_with("--bind-grace-ms")) {
            // Production holds binds 2 s after start-up; the scenarios' API server answers in
            // milliseconds, so a shorter hold keeps them quick without skipping it.
            args.extend(["--bind-grace-ms".to_owned(), "300".to_owned()]);
        }
        args.extend([
            "--allocation-keys-file".to_owned(),
            self.dir.path().join(ALLOCATION_KEYS).display().to_string(),
        ]);
        Extender::spawn_secured_on(
            &self.binaries,
            kubeconfig,
            &self.dir.path().join(format!("{name}.log")),
            &args,
            port,
            (&self.extender_tls, monitor_port),
        )
    }

    /// The running extender.
    pub fn extender(&self) -> anyhow::Result<&Extender> {
        self.extender
            .as_ref()
            .context("the extender is not running")
    }
}

/// Binds in flight at once: as many as there are pods (kube-scheduler bounds them by nothing).
const UNBOUNDED_BINDS: usize = 100_000;
