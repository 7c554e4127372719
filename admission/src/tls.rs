//! TLS for the webhook, generated and rotated by gpushare itself.
//!
//! The API server only calls webhooks over HTTPS and only trusts the `caBundle` written in
//! the MutatingWebhookConfiguration. Rather than asking operators to install cert-manager,
//! the extender makes its own small CA and a serving certificate for
//! `<service>.<namespace>.svc`, serves it, and patches the CA into the webhook configuration.
//!
//! Rotation never leaves the API server without trust in the served certificate:
//!
//! ```text
//!  prepare_rotation()  new CA + cert generated, not served yet
//!  patch caBundle      bundle = new CA + CAs already there (the old one stays trusted)
//!  commit_rotation()   the resolver hands out the new cert to the next handshake
//! ```
//!
//! Several extender replicas each have their own CA; [`merge_ca_bundle`] keeps the newest few
//! in the bundle, so every replica stays trusted. Certificates are swapped through a
//! [`rustls::server::ResolvesServerCert`] read on every handshake: no restart, no dropped
//! connections.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::api::{Api, Patch, PatchParams};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use time::OffsetDateTime;
use tokio::net::TcpListener;

use gpushare_runtime::http::{Server, TlsAcceptor};

use crate::{Error, Result};

/// How many CAs a merged caBundle keeps (ours first, then the newest others).
pub const MAX_BUNDLED_CAS: usize = 4;

/// What the generated certificates are for and how long they live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertConfig {
    /// The webhook's Service name, e.g. `gpushare-extender`.
    pub service: String,
    /// The Service's namespace.
    pub namespace: String,
    /// Lifetime of the CA and serving certificate.
    pub validity: Duration,
    /// More names for the serving certificate (e.g. `localhost` in tests).
    pub extra_names: Vec<String>,
}

impl CertConfig {
    /// Certificates for `<service>.<namespace>.svc`, valid one year.
    pub fn new(service: impl Into<String>, namespace: impl Into<String>) -> Self {
        Self {
            service: service.into(),
            namespace: namespace.into(),
            validity: Duration::from_secs(365 * 24 * 3600),
            extra_names: Vec::new(),
        }
    }

    /// The names the serving certificate is valid for: every way the API server may dial
    /// the Service, then the extras.
    pub fn dns_names(&self) -> Vec<String> {
        let (service, namespace) = (&self.service, &self.namespace);
        let mut names = vec![
            format!("{service}.{namespace}.svc"),
            format!("{service}.{namespace}.svc.cluster.local"),
            format!("{service}.{namespace}"),
            service.clone(),
        ];
        names.extend(self.extra_names.iter().cloned());
        names
    }
}

/// A CA and the serving certificate it signed, as PEM and DER.
#[derive(Clone)]
pub struct SelfSignedCa {
    ca_pem: String,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    key_pem: String,
    key_der: Vec<u8>,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
}

impl fmt::Debug for SelfSignedCa {
    // Never print the private key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SelfSignedCa")
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl SelfSignedCa {
    /// A fresh CA and serving certificate, valid from now.
    pub fn generate(config: &CertConfig) -> Result<Self> {
        Self::generate_at(config, OffsetDateTime::now_utc())
    }

    /// A fresh CA and serving certificate valid from `now` (a minute earlier, for clock skew).
    pub fn generate_at(config: &CertConfig, now: OffsetDateTime) -> Result<Self> {
        let not_before = now - time::Duration::minutes(1);
        let validity = time::Duration::try_from(config.validity)
            .map_err(|_| Error::Validity(config.validity))?;
        let not_after = now + validity;

        let ca_key = KeyPair::generate().map_err(Error::Certificate)?;
        let mut ca_params = CertificateParams::default();
        ca_params.distinguished_name = rcgen::DistinguishedName::new();
        ca_params.distinguished_name.push(
            DnType::CommonName,
            format!("gpushare webhook CA {}", now.unix_timestamp()),
        );
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca_params.not_before = not_before;
        ca_params.not_after = not_after;
        let ca_cert = ca_params.self_signed(&ca_key).map_err(Error::Certificate)?;
        let issuer = Issuer::new(ca_params, ca_key);

        let names = config.dns_names();
        let key = KeyPair::generate().map_err(Error::Certificate)?;
        let mut params = CertificateParams::new(names.clone()).map_err(Error::Certificate)?;
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, names[0].clone());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = not_before;
        params.not_after = not_after;
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(Error::Certificate)?;

        Ok(Self {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
            not_before,
            not_after,
        })
    }

    /// The CA certificate (PEM): what the API server must trust.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The serving certificate (PEM).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The serving certificate (DER), as a TLS client sees it.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The serving key (PKCS#8 PEM).
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Start of validity.
    pub fn not_before(&self) -> OffsetDateTime {
        self.not_before
    }

    /// End of validity.
    pub fn not_after(&self) -> OffsetDateTime {
        self.not_after
    }

    /// When to replace this certificate: at 80% of its life, but with at least
    /// `min(30 days, half its life)` left, so a one-year certificate is renewed with 73
    /// days to spare and a short test certificate halfway.
    pub fn renew_at(&self) -> OffsetDateTime {
        let life = self.not_after - self.not_before;
        let fifth: time::Duration = life / 5;
        let margin = fifth.max(time::Duration::days(30).min(life / 2));
        self.not_after - margin
    }

    /// True once `now` is past [`Self::renew_at`].
    pub fn needs_renewal(&self, now: OffsetDateTime) -> bool {
        now >= self.renew_at()
    }

    /// Writes `ca.crt`, `tls.crt` and `tls.key` (mode 0600 on Unix) into `dir`, for tools
    /// that want files (e.g. a sidecar or `kubectl --certificate-authority`).
    pub fn write_pem_files(&self, dir: &Path) -> Result<()> {
        let write = |name: &str, contents: &str, private: bool| -> Result<()> {
            let path = dir.join(name);
            let io = |source| Error::Write {
                path: path.clone(),
                source,
            };
            std::fs::write(&path, contents).map_err(io)?;
            #[cfg(unix)]
            if private {
                use std::os::unix::fs::PermissionsExt as _;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                    .map_err(io)?;
            }
            #[cfg(not(unix))]
            let _ = private;
            Ok(())
        };
        std::fs::create_dir_all(dir).map_err(|source| Error::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        write("ca.crt", &self.ca_pem, false)?;
        write("tls.crt", &self.cert_pem, false)?;
        write("tls.key", &self.key_pem, true)?;
        Ok(())
    }

    fn certified_key(&self) -> Result<Arc<CertifiedKey>> {
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()));
        let signing_key =
            rustls::crypto::ring::sign::any_supported_type(&key).map_err(Error::Key)?;
        Ok(Arc::new(CertifiedKey::new(
            vec![self.cert_der.clone()],
            signing_key,
        )))
    }
}

/// Hands out whatever certificate is current at each handshake.
#[derive(Debug)]
struct SwappableResolver {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for SwappableResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        // A poisoned lock still holds a valid certificate.
        let guard = self.current.read().unwrap_or_else(|p| p.into_inner());
        Some(Arc::clone(&guard))
    }
}

#[derive(Debug)]
struct Generations {
    current: SelfSignedCa,
    next: Option<SelfSignedCa>,
}

/// Owns the webhook's certificates: serves the current one and replaces it before expiry.
/// Cheap to clone; clones share state.
#[derive(Debug, Clone)]
pub struct CertRotator {
    config: Arc<CertConfig>,
    generations: Arc<RwLock<Generations>>,
    resolver: Arc<SwappableResolver>,
}

impl CertRotator {
    /// Generates a first CA and certificate for `config`.
    pub fn new(config: CertConfig) -> Result<Self> {
        let first = SelfSignedCa::generate(&config)?;
        Self::with_certificate(config, first)
    }

    /// Starts from an existing certificate (tests use one generated at a chosen time).
    pub fn with_certificate(config: CertConfig, current: SelfSignedCa) -> Result<Self> {
        let resolver = Arc::new(SwappableResolver {
            current: RwLock::new(current.certified_key()?),
        });
        Ok(Self {
            config: Arc::new(config),
            generations: Arc::new(RwLock::new(Generations {
                current,
                next: None,
            })),
            resolver,
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Generations> {
        self.generations.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Generations> {
        self.generations.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The certificate being served now.
    pub fn current(&self) -> SelfSignedCa {
        self.read().current.clone()
    }

    /// The CAs the API server must trust now: the served one, plus the prepared next one
    /// during a rotation. PEM, concatenated.
    pub fn ca_bundle_pem(&self) -> String {
        let generations = self.read();
        let mut bundle = generations.current.ca_pem.clone();
        if let Some(next) = &generations.next {
            bundle.push_str(&next.ca_pem);
        }
        bundle
    }

    /// True when the served certificate is due for renewal at `now`.
    pub fn needs_rotation(&self, now: OffsetDateTime) -> bool {
        self.read().current.needs_renewal(now)
    }

    /// Generates the next CA and certificate without serving them; afterwards
    /// [`Self::ca_bundle_pem`] trusts both. Patch the bundle, then [`Self::commit_rotation`].
    pub fn prepare_rotation(&self) -> Result<()> {
        let next = SelfSignedCa::generate(&self.config)?;
        // Check the key now, so commit cannot fail.
        next.certified_key()?;
        self.write().next = Some(next);
        Ok(())
    }

    /// Serves the prepared certificate from the next handshake on. False when nothing was
    /// prepared.
    pub fn commit_rotation(&self) -> Result<bool> {
        let mut generations = self.write();
        let Some(next) = generations.next.take() else {
            return Ok(false);
        };
        let key = next.certified_key()?;
        *self
            .resolver
            .current
            .write()
            .unwrap_or_else(|p| p.into_inner()) = key;
        tracing::info!(not_after = %next.not_after, "webhook serving certificate rotated");
        generations.current = next;
        Ok(true)
    }

    /// Prepare and commit at once (when no caBundle needs patching, e.g. in tests).
    pub fn rotate(&self) -> Result<()> {
        self.prepare_rotation()?;
        self.commit_rotation().map(|_| ())
    }

    /// A rustls server configuration whose certificate follows this rotator.
    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        // The ring provider supports the default protocol versions.
        let builder = match rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
        {
            Ok(builder) => builder,
            Err(_) => {
                rustls::ServerConfig::builder_with_protocol_versions(rustls::DEFAULT_VERSIONS)
            }
        };
        let mut config = builder
            .with_no_client_auth()
            .with_cert_resolver(self.resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }

    /// Keeps the certificate fresh until `shutdown`: every `check_every`, rotate when due,
    /// patching the caBundle through `patcher` (when in cluster) before serving the new
    /// certificate. Publishes the current bundle once at start. A failed patch is retried at
    /// the next check; the certificate is committed anyway when less than a day is left,
    /// since an expired certificate fails every call.
    pub async fn run(
        self,
        patcher: Option<CaBundlePatcher>,
        check_every: Duration,
        shutdown: impl Future<Output = ()>,
    ) {
        tokio::pin!(shutdown);
        let mut published = false;
        loop {
            let now = OffsetDateTime::now_utc();
            if self.needs_rotation(now) && self.read().next.is_none() {
                if let Err(error) = self.prepare_rotation() {
                    tracing::error!(%error, "cannot generate the next webhook certificate");
                }
                published = false;
            }
            if !published {
                published = match &patcher {
                    Some(patcher) => match patcher.patch(&self.ca_bundle_pem()).await {
                        Ok(()) => true,
                        Err(error) => {
                            tracing::warn!(%error, "cannot publish the webhook caBundle; the webhook fails open until it is");
                            false
                        }
                    },
                    None => true,
                };
            }
            let expiring = self.current().not_after - now < time::Duration::days(1);
            if published || expiring {
                match self.commit_rotation() {
                    Ok(true) if !published => {
                        // Committed without a published bundle: publish it next round.
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::error!(%error, "cannot serve the next webhook certificate")
                    }
                }
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(check_every) => {}
            }
        }
    }
}

/// Keeps `caBundle` of a MutatingWebhookConfiguration in step with our CA
/// (`admissionregistration.k8s.io/v1`, needs `get` and `patch` on it).
#[derive(Clone)]
pub struct CaBundlePatcher {
    api: Api<MutatingWebhookConfiguration>,
    name: String,
}

impl fmt::Debug for CaBundlePatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaBundlePatcher")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl CaBundlePatcher {
    /// Patches the MutatingWebhookConfiguration called `name`.
    pub fn new(client: kube::Client, name: impl Into<String>) -> Self {
        Self {
            api: Api::all(client),
            name: name.into(),
        }
    }

    /// Writes `ours` (PEM) merged with the CAs already there into every webhook of the
    /// configuration. The patch carries the resourceVersion it was computed from, so two
    /// replicas patching at once cannot lose each other's CA: the loser gets a conflict and
    /// retries at its next check.
    pub async fn patch(&self, ours: &str) -> Result<()> {
        let err = |source| Error::PatchCaBundle {
            name: self.name.clone(),
            source,
        };
        let config = self.api.get(&self.name).await.map_err(err)?;
        let patch =
            ca_bundle_patch(&config, ours).ok_or_else(|| Error::NoWebhooks(self.name.clone()))?;
        self.api
            .patch(
                &self.name,
                &PatchParams::default(),
                &Patch::Strategic(patch),
            )
            .await
            .map_err(err)?;
        tracing::info!(webhook_config = %self.name, "webhook caBundle published");
        Ok(())
    }
}

/// A strategic merge patch setting every webhook's caBundle (webhooks merge by `name`) to
/// `ours` merged with what it holds, guarded by the configuration's resourceVersion. `None`
/// when the configuration has no webhooks.
pub fn ca_bundle_patch(
    config: &MutatingWebhookConfiguration,
    ours: &str,
) -> Option<serde_json::Value> {
    let webhooks = config.webhooks.as_deref().unwrap_or_default();
    if webhooks.is_empty() {
        return None;
    }
    let entries: Vec<_> = webhooks
        .iter()
        .map(|webhook| {
            let old_pem = webhook
                .client_config
                .ca_bundle
                .as_ref()
                .map(|bytes| String::from_utf8_lossy(&bytes.0).into_owned())
                .unwrap_or_default();
            let merged = merge_ca_bundle(ours, &old_pem, MAX_BUNDLED_CAS);
            serde_json::json!({
                "name": webhook.name,
                "clientConfig": {"caBundle": BASE64.encode(merged)},
            })
        })
        .collect();
    Some(serde_json::json!({
        "metadata": {"resourceVersion": config.metadata.resource_version},
        "webhooks": entries,
    }))
}

/// `ours` first, then the certificates of `existing` not already in `ours`, at most `keep`
/// certificates in all. Unreadable PEM in `existing` is dropped.
pub fn merge_ca_bundle(ours: &str, existing: &str, keep: usize) -> String {
    let parse = |pem: &str| -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .filter_map(|cert| cert.ok())
            .collect()
    };
    let mut certs = parse(ours);
    for cert in parse(existing) {
        if !certs.contains(&cert) {
            certs.push(cert);
        }
    }
    certs.truncate(keep.max(1));
    certs.iter().map(|cert| to_pem(cert)).collect()
}

fn to_pem(cert: &CertificateDer<'_>) -> String {
    let body = BASE64.encode(cert.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

/// Binds `addr` and serves `router` over HTTPS with the rotator's certificate until
/// `shutdown`; see [`serve_tls_on`].
pub async fn serve_tls(
    addr: SocketAddr,
    router: Router,
    rotator: CertRotator,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })?;
    serve_tls_on(listener, router, rotator, shutdown).await
}

/// Serves `router` over HTTPS (HTTP/1.1 and HTTP/2 by ALPN) on an already bound listener,
/// on the accept loop every gpushare server runs (`gpushare_runtime::http`: handshake
/// timeout, graceful drain). Each handshake picks up the rotator's current certificate. On
/// `shutdown` the listener closes and in-flight requests are let finish (the API server
/// times out at 10 s anyway).
pub async fn serve_tls_on(
    listener: TcpListener,
    router: Router,
    rotator: CertRotator,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let local = listener.local_addr().ok();
    tracing::info!(addr = ?local, "admission webhook serving HTTPS");
    Server::new(listener, router)
        .tls(Some(TlsAcceptor::from(rotator.server_config())))
        .serve(shutdown)
        .await;
    Ok(())
}
