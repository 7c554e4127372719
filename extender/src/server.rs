//! The extender's ports on the one accept loop of `gpushare_runtime::http` (connections owned
//! by the server, TLS handshake timeout, graceful drain), with one thing of its own:
//!
//! A replica cut off from the API server lets go of kube-scheduler's connections. Over
//! HTTPS, kube-scheduler speaks HTTP/2 and sends every call down one long-lived connection;
//! a Service routes a connection, not a call, so that connection would pin the scheduler to a
//! replica that can no longer bind (its lease is stale, it cannot reach the leader to forward)
//! for as long as the partition lasts, readiness probes or not: taking a pod out of the
//! endpoints does not end connections already made. So while [`Leadership::reaches_api`] is
//! false, every connection is asked to close gracefully (HTTP/2 GOAWAY: calls under way
//! finish, new ones go to a new connection), and the scheduler dials again, reaching a replica
//! that can serve.

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use axum::Router;
use gpushare_runtime::http::Server;

use crate::leader::Leadership;

pub use gpushare_runtime::http::{
    TlsAcceptor, TlsError, tls_acceptor, tls_acceptor_asking_clients,
};

use crate::http::callers::Callers;

/// Serves `app` on `listener` (over TLS when `tls` is given) until `stop` is cancelled,
/// then drains. Handshakes refused for a client certificate of another CA count against
/// `callers`. With `leadership`, connections are let go while the replica is cut off from
/// the API server (see the module docs).
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    stop: CancellationToken,
    leadership: Option<Leadership>,
    callers: Option<Callers>,
) {
    let mut server = Server::new(listener, app).tls(tls);
    if let Some(callers) = callers {
        server = server.on_refused_handshake(move || callers.count_untrusted_handshake());
    }
    if let Some(leadership) = leadership {
        server = server.let_go_while(
            move || !leadership.reaches_api(),
            "cut off from the API server, so this replica cannot bind",
        );
    }
    server.serve(stop.cancelled_owned()).await;
}
