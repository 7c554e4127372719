//! The real `gpushare-extender` as a child process: started on a port, plain or HTTPS as the
//! chart runs it, restarted on the same address, and called as kube-scheduler calls it.
//!
//! Separate because the extender is the one component with its own certificate
//! ([`ExtenderTls`]) and its own client calls (inspect, bind, health).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};

use super::http::{exchange_on, get_request, http_exchange, http_get, post_json_request};
use super::{Binaries, Process, free_port};
use crate::scheduler::ExtenderTlsConfig;
use crate::scheduler::wire::{ExtenderBindingArgs, decode_binding_result};

/// The real `gpushare-extender`, serving on a port of 127.0.0.1.
#[derive(Debug)]
pub struct Extender {
    pub process: Process,
    /// `http://127.0.0.1:PORT`, or `https://` when it serves TLS.
    pub base_url: String,
    launch: Launch,
    /// Its certificate, when it serves TLS as the chart runs it.
    tls: Option<ExtenderTls>,
    /// `--monitor-listen`: plain HTTP health and metrics, when set.
    monitor: Option<SocketAddr>,
}

/// The Service name the chart's scheduler configuration dials, and the extender's
/// certificate names (`<service>.<namespace>.svc`).
pub const EXTENDER_SERVICE_HOST: &str = "gpushare-extender.kube-system.svc";

/// The extender's certificates as the chart's Secrets hold them: `<release>-extender-tls`
/// (a CA that kube-scheduler's `tlsConfig` trusts, and a certificate for the Service's names
/// signed by it) and `<release>-extender-client-tls` (a client CA, and the client
/// certificates of the scheduler and of the replicas, which the extender asks for).
#[derive(Clone)]
pub struct ExtenderTls {
    /// PEM of the CA (the Secret's `ca.crt`, the scheduler's `tlsConfig.caFile`).
    pub ca_pem: String,
    /// `tls.crt` and `tls.key`, as mounted into the extender.
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// The client CA (`--client-ca`).
    pub client_ca_file: PathBuf,
    /// The replicas' client certificate and key (`--leader-forward-cert`/`-key`).
    pub replica_identity: (PathBuf, PathBuf),
    /// The scheduler's client certificate and key, PEM (`tlsConfig.certFile`/`keyFile`).
    scheduler_identity: (String, String),
    /// Trusting the CA and presenting the scheduler's certificate.
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ExtenderTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtenderTls")
            .field("cert_file", &self.cert_file)
            .finish_non_exhaustive()
    }
}

impl ExtenderTls {
    /// A fresh CA and serving certificate for [`EXTENDER_SERVICE_HOST`], and a fresh client
    /// CA with the scheduler's and the replicas' certificates, written into `dir`.
    pub fn generate(dir: &Path) -> anyhow::Result<Self> {
        let ca = gpushare_admission::SelfSignedCa::generate(&gpushare_admission::CertConfig::new(
            "gpushare-extender",
            "kube-system",
        ))?;
        ca.write_pem_files(dir)?;
        let clients = ClientCa::generate("gpushare-extender-client-ca")?;
        let client_ca_file = dir.join("client-ca.crt");
        std::fs::write(&client_ca_file, &clients.pem)?;
        let (cert, key) = clients.issue("gpushare-extender")?;
        let replica_identity = (
            dir.join("extender-client.crt"),
            dir.join("extender-client.key"),
        );
        std::fs::write(&replica_identity.0, cert)?;
        std::fs::write(&replica_identity.1, key)?;
        let scheduler_identity = clients.issue("gpushare-scheduler")?;
        let client = client_config(ca.ca_pem(), Some(&scheduler_identity))?;
        Ok(Self {
            ca_pem: ca.ca_pem().to_owned(),
            cert_file: dir.join("tls.crt"),
            key_file: dir.join("tls.key"),
            client_ca_file,
            replica_identity,
            scheduler_identity,
            client,
        })
    }

    /// A client configuration trusting the CA and presenting the scheduler's certificate
    /// (no ALPN set; callers add theirs).
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        self.client.clone()
    }

    /// What the scheduler's extender stanza says about TLS (as the chart renders it).
    pub fn scheduler_config(&self) -> ExtenderTlsConfig {
        ExtenderTlsConfig {
            ca_pem: self.ca_pem.clone(),
            server_name: EXTENDER_SERVICE_HOST.to_owned(),
            cert_pem: self.scheduler_identity.0.clone(),
            key_pem: self.scheduler_identity.1.clone(),
        }
    }
}

/// A client configuration trusting `ca_pem`, presenting `identity` if given (the API
/// server's webhook client uses it too).
pub(crate) fn client_config(
    ca_pem: &str,
    identity: Option<&(String, String)>,
) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let identity = identity.map(|(cert, key)| (cert.as_str(), key.as_str()));
    let config = crate::scheduler::tls_client(ca_pem, identity).map_err(anyhow::Error::msg)?;
    Ok(Arc::new(config))
}

/// A CA that issues client certificates, as the chart's `genCA` and `genSignedCert` make them.
pub struct ClientCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
}

impl ClientCa {
    /// A fresh CA named `name`.
    pub fn generate(name: &str) -> anyhow::Result<Self> {
        let (key, mut params) = key_and_params(name)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let pem = params.self_signed(&key)?.pem();
        Ok(Self {
            issuer: rcgen::Issuer::new(params, key),
            pem,
        })
    }

    /// A client certificate for `name` and its key, PEM.
    pub fn issue(&self, name: &str) -> anyhow::Result<(String, String)> {
        let (key, mut params) = key_and_params(name)?;
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

/// A fresh key, and certificate parameters with the common name `name`.
fn key_and_params(name: &str) -> anyhow::Result<(rcgen::KeyPair, rcgen::CertificateParams)> {
    let mut params = rcgen::CertificateParams::new(Vec::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    Ok((rcgen::KeyPair::generate()?, params))
}

/// How an extender was started, to start it again the same way.
#[derive(Debug, Clone)]
struct Launch {
    program: PathBuf,
    args: Vec<String>,
    kubeconfig: PathBuf,
    log: PathBuf,
    addr: SocketAddr,
}

impl Launch {
    fn spawn(&self) -> anyhow::Result<Process> {
        Process::spawn(
            "gpushare-extender",
            &self.program,
            &self.args,
            &self.kubeconfig,
            &self.log,
        )
    }
}

impl Extender {
    /// Starts the extender, plain HTTP on a free port, and waits until `/readyz` answers 200.
    pub async fn start(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
    ) -> anyhow::Result<Self> {
        let mut extender = Self::spawn_with(bin, kubeconfig, log, extra, free_port()?, None)?;
        extender.wait_ready().await?;
        Ok(extender)
    }

    /// Starts the extender process the way the chart runs it, without waiting for it: HTTPS
    /// with `tls` on `port` of 127.0.0.1, and health and metrics over plain HTTP on
    /// `monitor_port`.
    pub fn spawn_secured_on(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
        port: u16,
        (tls, monitor_port): (&ExtenderTls, u16),
    ) -> anyhow::Result<Self> {
        Self::spawn_with(bin, kubeconfig, log, extra, port, Some((tls, monitor_port)))
    }

    fn spawn_with(
        bin: &Binaries,
        kubeconfig: &Path,
        log: &Path,
        extra: &[String],
        port: u16,
        secured: Option<(&ExtenderTls, u16)>,
    ) -> anyhow::Result<Self> {
        let mut args = vec![format!("--listen=127.0.0.1:{port}")];
        if let Some((tls, monitor_port)) = secured {
            args.extend([
                format!("--tls-cert={}", tls.cert_file.display()),
                format!("--tls-key={}", tls.key_file.display()),
                format!("--monitor-listen=127.0.0.1:{monitor_port}"),
                format!("--client-ca={}", tls.client_ca_file.display()),
                format!("--leader-forward-cert={}", tls.replica_identity.0.display()),
                format!("--leader-forward-key={}", tls.replica_identity.1.display()),
            ]);
        }
        args.extend_from_slice(extra);
        let monitor = secured.map(|(_, port)| SocketAddr::from(([127, 0, 0, 1], port)));
        let tls = secured.map(|(tls, _)| tls.clone());
        let scheme = if tls.is_some() { "https" } else { "http" };
        let launch = Launch {
            program: bin.extender.clone(),
            args,
            kubeconfig: kubeconfig.to_owned(),
            log: log.to_owned(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
        };
        Ok(Self {
            process: launch.spawn()?,
            base_url: format!("{scheme}://127.0.0.1:{port}"),
            launch,
            tls,
            monitor,
        })
    }

    /// Waits until `/readyz` answers 200 (up to 30 s).
    ///
    /// Right after the previous process on the port was killed, a new one may fail to bind
    /// for a moment; one that exits at start is started again for up to
    /// [`RESTART_BIND_RETRY`], as kubelet restarts a crashed container.
    pub async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let started = tokio::time::Instant::now();
        let deadline = started + Duration::from_secs(30);
        let log = self.launch.log.display().to_string();
        loop {
            // Ready, and ours: the answer counts only while our process runs.
            if matches!(self.get_health("/readyz").await, Ok((200, _))) && self.process.is_running()
            {
                return Ok(());
            }
            if !self.process.is_running() {
                if started.elapsed() >= RESTART_BIND_RETRY {
                    bail!("gpushare-extender exited at start; see {log}");
                }
                tracing::debug!(addr = %self.launch.addr, "gpushare-extender exited at start; starting it again");
                tokio::time::sleep(Duration::from_millis(100)).await;
                self.process = self.launch.spawn()?;
                continue;
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("timed out after 30s waiting for the extender to become ready; see {log}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The URL prefix kube-scheduler is configured with.
    pub fn url_prefix(&self) -> String {
        format!("{}/gpushare-scheduler", self.base_url)
    }

    /// `GET /gpushare-scheduler/inspect` as JSON.
    pub async fn inspect(&self) -> anyhow::Result<serde_json::Value> {
        let request = get_request(self.launch.addr, "/gpushare-scheduler/inspect");
        let (status, body) = self.exchange(&request).await?;
        if status != 200 {
            bail!("inspect answered {status}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// Asks the extender to bind a pod, as kube-scheduler would: `POST
    /// /gpushare-scheduler/bind`. `Ok(None)` when it bound the pod, `Ok(Some(error))` with
    /// the error it reported to the scheduler otherwise.
    pub async fn bind(&self, args: &ExtenderBindingArgs) -> anyhow::Result<Option<String>> {
        let body = serde_json::to_string(args)?;
        let request = post_json_request(self.launch.addr, "/gpushare-scheduler/bind", &body);
        let (status, answer) = self.exchange(&request).await?;
        if status != 200 {
            bail!("bind answered {status}: {answer}");
        }
        let result = decode_binding_result(answer.as_bytes())
            .with_context(|| format!("decoding the bind answer {answer:?}"))?;
        Ok((!result.error.is_empty()).then_some(result.error))
    }

    /// `GET path` of the health and metrics endpoints: on `--monitor-listen` when set.
    pub async fn get_health(&self, path: &str) -> anyhow::Result<(u16, String)> {
        match self.monitor {
            Some(addr) => http_get(addr, path).await,
            None => self.exchange(&get_request(self.launch.addr, path)).await,
        }
    }

    /// Where `/healthz`, `/readyz` and `/metrics` are served: the monitor port when the
    /// scheduler-facing port serves TLS, else that port.
    pub fn monitor_addr(&self) -> SocketAddr {
        self.monitor.unwrap_or(self.launch.addr)
    }

    /// One request to the scheduler-facing port, over TLS when it serves TLS.
    async fn exchange(&self, request: &str) -> anyhow::Result<(u16, String)> {
        match &self.tls {
            None => http_exchange(self.launch.addr, request).await,
            Some(tls) => {
                let tcp = tokio::net::TcpStream::connect(self.launch.addr).await?;
                let name = rustls::pki_types::ServerName::try_from(EXTENDER_SERVICE_HOST)?;
                let stream = tokio_rustls::TlsConnector::from(tls.client.clone())
                    .connect(name, tcp)
                    .await?;
                exchange_on(stream, request).await
            }
        }
    }
}

/// How long a start that fails at once (the port still held by a killed predecessor) is retried.
pub const RESTART_BIND_RETRY: Duration = Duration::from_secs(10);
