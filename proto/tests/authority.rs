//! A tonic server on a unix socket, called as kubelet's plugin watcher calls it: with the
//! socket path as `:authority`. Plain, `h2` resets the call (what kubelet logs as
//! `RST_STREAM with error code: PROTOCOL_ERROR`); through [`authority::unix_incoming`] it is
//! served.

use std::path::Path;

use gpushare_proto::authority::{self, connect_with_authority};
use gpushare_proto::pluginregistration::registration_client::RegistrationClient;
use gpushare_proto::pluginregistration::registration_server::{Registration, RegistrationServer};
use gpushare_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic::{Code, Request, Response, Status};

struct Plugin;

#[tonic::async_trait]
impl Registration for Plugin {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: gpushare_proto::dra::PLUGIN_TYPE.to_owned(),
            name: "gpushare.example.com".to_owned(),
            endpoint: "/var/lib/kubelet/plugins/gpushare.example.com/dra.sock".to_owned(),
            supported_versions: vec![gpushare_proto::dra::V1_SERVICE.to_owned()],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        match request.into_inner().plugin_registered {
            true => Ok(Response::new(RegistrationStatusResponse {})),
            false => Err(Status::failed_precondition("not registered")),
        }
    }
}

/// Dials `socket` as kubelet does and registers: `GetInfo`, then `NotifyRegistrationStatus`
/// on the same connection (its second header block refers to the first's).
async fn register_as_kubelet(socket: &Path) -> Result<PluginInfo, Status> {
    let channel = connect_with_authority(socket, socket.as_os_str().as_encoded_bytes())
        .await
        .map_err(|err| Status::unavailable(err.to_string()))?;
    let mut client = RegistrationClient::new(channel);
    let info = client.get_info(InfoRequest {}).await?.into_inner();
    let status = RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    };
    client.notify_registration_status(status).await?;
    Ok(info)
}

#[tokio::test]
async fn kubelet_authority_is_reset_by_a_plain_tonic_server() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gpushare.example.com-reg.sock");
    let incoming = UnixListenerStream::new(UnixListener::bind(&socket).unwrap());
    let server = tokio::spawn(
        Server::builder()
            .add_service(RegistrationServer::new(Plugin))
            .serve_with_incoming(incoming),
    );

    let err = register_as_kubelet(&socket).await.unwrap_err();
    // `Reset(StreamId(1), PROTOCOL_ERROR, Remote)` in the source: h2 reset the stream.
    assert_eq!(err.code(), Code::Internal, "{err:?}");
    assert!(format!("{err:?}").contains("PROTOCOL_ERROR"), "{err:?}");
    server.abort();
}

#[tokio::test]
async fn kubelet_authority_is_served_through_the_rewrite() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gpushare.example.com-reg.sock");
    let incoming = authority::unix_incoming(UnixListener::bind(&socket).unwrap());
    let server = tokio::spawn(
        Server::builder()
            .add_service(RegistrationServer::new(Plugin))
            .serve_with_incoming(incoming),
    );

    let info = register_as_kubelet(&socket).await.unwrap();
    assert_eq!(info.name, "gpushare.example.com");
    assert_eq!(info.supported_versions, [gpushare_proto::dra::V1_SERVICE]);
    // A client with a valid authority (tonic's own) is served as before.
    let channel = gpushare_proto::connect_unix(&socket).await.unwrap();
    let info = RegistrationClient::new(channel)
        .get_info(InfoRequest {})
        .await;
    assert_eq!(info.unwrap().into_inner().name, "gpushare.example.com");
    server.abort();
}
