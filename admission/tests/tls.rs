//! The webhook over real HTTPS: a client trusting only the generated CA gets an answer, and
//! a rotation changes the certificate the next handshake sees without restarting the server.

// Test helpers outside #[test] functions: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use anyhow::Context as _;
use gpushare_admission::{
    AdmissionReview, AdmissionState, CertConfig, CertRotator, SelfSignedCa, merge_ca_bundle,
    router, serve_tls_on,
};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

fn config() -> CertConfig {
    CertConfig::new("gpushare-extender", "kube-system")
}

/// A TLS client that trusts exactly the CAs in `bundle_pem`.
fn connector(bundle_pem: &str) -> anyhow::Result<TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(bundle_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// Posts an AdmissionReview over HTTPS to the service name the API server would dial;
/// returns the answer and the certificate the server presented.
async fn call(
    addr: std::net::SocketAddr,
    bundle_pem: &str,
) -> anyhow::Result<(AdmissionReview, CertificateDer<'static>)> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("gpushare-extender.kube-system.svc")?;
    let tls = connector(bundle_pem)?.connect(name, tcp).await?;
    let presented = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .context("no server certificate")?
        .clone()
        .into_owned();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(connection);
    let body = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "abc",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "default",
            "operation": "CREATE",
            "object": {"metadata": {"name": "p"}, "spec": {"containers": [
                {"name": "c", "resources": {"limits": {"example.com/gpu-mem": "2"}}}
            ]}},
        }
    });
    let request = http::Request::post("/mutate-pods")
        .header("host", "gpushare-extender.kube-system.svc")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&body)?)))?;
    let response = sender.send_request(request).await?;
    anyhow::ensure!(response.status() == 200, "status {}", response.status());
    let bytes = response.into_body().collect().await?.to_bytes();
    Ok((serde_json::from_slice(&bytes)?, presented))
}

async fn start(
    rotator: CertRotator,
) -> anyhow::Result<(
    std::net::SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = stopped.await;
    };
    let server = tokio::spawn(async move {
        serve_tls_on(
            listener,
            router(AdmissionState::default()),
            rotator,
            shutdown,
        )
        .await
        .unwrap();
    });
    Ok((addr, stop, server))
}

#[tokio::test]
async fn https_client_trusting_only_the_generated_ca_gets_a_review() -> anyhow::Result<()> {
    let rotator = CertRotator::new(config())?;
    let (addr, stop, server) = start(rotator.clone()).await?;

    let (review, presented) = call(addr, &rotator.ca_bundle_pem()).await?;
    let response = review.response.context("no response")?;
    assert_eq!(response.uid, "abc");
    assert!(response.allowed);
    assert!(response.patch.is_some());
    assert_eq!(&presented, rotator.current().cert_der());

    // A client trusting some other CA refuses the server.
    let stranger = SelfSignedCa::generate(&config())?;
    assert!(call(addr, stranger.ca_pem()).await.is_err());

    stop.send(()).ok();
    server.await?;
    Ok(())
}

#[tokio::test]
async fn rotation_swaps_the_served_certificate_without_restart() -> anyhow::Result<()> {
    let rotator = CertRotator::new(config())?;
    let (addr, stop, server) = start(rotator.clone()).await?;
    let old = rotator.current();
    let (_, presented) = call(addr, old.ca_pem()).await?;
    assert_eq!(&presented, old.cert_der());

    // Prepared but not committed: the old cert is still served, the bundle trusts both.
    rotator.prepare_rotation()?;
    let bundle = rotator.ca_bundle_pem();
    assert_eq!(CertificateDer::pem_slice_iter(bundle.as_bytes()).count(), 2);
    let (_, presented) = call(addr, &bundle).await?;
    assert_eq!(&presented, old.cert_der());

    assert!(rotator.commit_rotation()?);
    let new = rotator.current();
    assert_ne!(new.cert_der(), old.cert_der());
    // The transition bundle still works, and so does the new CA alone.
    let (_, presented) = call(addr, &bundle).await?;
    assert_eq!(&presented, new.cert_der());
    let (review, presented) = call(addr, new.ca_pem()).await?;
    assert_eq!(&presented, new.cert_der());
    assert!(review.response.context("no response")?.allowed);
    // The old CA no longer verifies the server.
    assert!(call(addr, old.ca_pem()).await.is_err());

    stop.send(()).ok();
    server.await?;
    Ok(())
}

#[test]
fn certificates_are_renewed_at_80_percent_of_their_life() -> anyhow::Result<()> {
    let now = time::OffsetDateTime::now_utc();
    let ca = SelfSignedCa::generate_at(&config(), now)?;
    assert!(!ca.needs_renewal(now));
    assert!(!ca.needs_renewal(now + time::Duration::days(290)));
    assert!(ca.needs_renewal(now + time::Duration::days(293)));

    let mut short = config();
    short.validity = std::time::Duration::from_secs(10 * 24 * 3600);
    let ca = SelfSignedCa::generate_at(&short, now)?;
    assert!(!ca.needs_renewal(now + time::Duration::days(4)));
    assert!(ca.needs_renewal(now + time::Duration::days(6)));
    Ok(())
}

#[test]
fn pem_files_are_written_with_a_private_key() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ca = SelfSignedCa::generate(&config())?;
    ca.write_pem_files(dir.path())?;
    let ca_pem = std::fs::read_to_string(dir.path().join("ca.crt"))?;
    assert_eq!(ca_pem, ca.ca_pem());
    assert!(std::fs::read_to_string(dir.path().join("tls.key"))?.contains("PRIVATE KEY"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join("tls.key"))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    assert!(!format!("{ca:?}").contains("PRIVATE"));
    Ok(())
}

#[test]
fn merged_bundles_put_ours_first_dedupe_and_cap() -> anyhow::Result<()> {
    let cas: Vec<_> = (0..6)
        .map(|_| SelfSignedCa::generate(&config()))
        .collect::<Result<_, _>>()?;
    let count = |pem: &str| CertificateDer::pem_slice_iter(pem.as_bytes()).count();
    let existing: String = cas[1..].iter().map(|ca| ca.ca_pem()).collect();
    let merged = merge_ca_bundle(cas[0].ca_pem(), &existing, 4);
    assert_eq!(count(&merged), 4);
    assert!(merged.starts_with(cas[0].ca_pem()));
    // Merging again with ourselves already present changes nothing.
    assert_eq!(merge_ca_bundle(cas[0].ca_pem(), &merged, 4), merged);
    // Garbage in the old bundle is dropped, not fatal.
    assert_eq!(count(&merge_ca_bundle(cas[0].ca_pem(), "garbage", 4)), 1);
    Ok(())
}

#[test]
fn ca_bundle_patch_covers_every_webhook_and_guards_the_version() -> anyhow::Result<()> {
    use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
    let config: MutatingWebhookConfiguration = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "gpushare", "resourceVersion": "42"},
        "webhooks": [
            {"name": "pods.gpushare.example.com", "clientConfig": {}, "sideEffects": "None", "admissionReviewVersions": ["v1"]},
        ]
    }))?;
    let ca = SelfSignedCa::generate(&self::config())?;
    let patch = gpushare_admission::tls::ca_bundle_patch(&config, ca.ca_pem()).context("patch")?;
    assert_eq!(patch["metadata"]["resourceVersion"], "42");
    assert_eq!(patch["webhooks"][0]["name"], "pods.gpushare.example.com");
    use base64::Engine as _;
    let bundle = base64::engine::general_purpose::STANDARD.decode(
        patch["webhooks"][0]["clientConfig"]["caBundle"]
            .as_str()
            .context("str")?,
    )?;
    assert_eq!(String::from_utf8(bundle)?, ca.ca_pem());
    Ok(())
}

#[tokio::test]
async fn run_rotates_a_certificate_that_is_due() -> anyhow::Result<()> {
    let now = time::OffsetDateTime::now_utc();
    let old = SelfSignedCa::generate_at(&config(), now - time::Duration::days(300))?;
    let rotator = CertRotator::with_certificate(config(), old.clone())?;
    assert!(rotator.needs_rotation(now));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(rotator.clone().run(
        None,
        std::time::Duration::from_secs(3600),
        async move {
            let _ = stopped.await;
        },
    ));
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while rotator.current().cert_der() == old.cert_der() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "not rotated in time"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(!rotator.needs_rotation(now));
    assert!(rotator.current().not_after() > old.not_after());
    stop.send(()).ok();
    task.await?;
    Ok(())
}
