//! The device manager's Registration server on `<dir>/kubelet.sock`: a plugin registers a
//! resource and an endpoint, and kubelet dials it back ([`super::plugin`]).
//!
//! Separate from the rest because it is the one gRPC server plugins call.

use std::collections::HashMap;
use std::sync::Arc;

use gpushare_proto::v1beta1::registration_server::{Registration, RegistrationServer};
use gpushare_proto::v1beta1::{Empty, RegisterRequest};
use gpushare_proto::{KUBELET_SOCKET, VERSION};
use tonic::transport::Server;
use tonic::{Request, Response, Status};

use super::plugin::run_plugin;
use super::{Plugin, ServedSocket, Shared};

struct RegistrationService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported device plugin API version {:?}; kubelet speaks {VERSION}",
                request.version
            )));
        }
        if request.resource_name.is_empty() || request.endpoint.is_empty() {
            return Err(Status::invalid_argument(
                "resource_name and endpoint are required",
            ));
        }
        let resource = request.resource_name.clone();
        let path = self.shared.dir.join(&request.endpoint);
        let mut state = self.shared.lock();
        state.next_generation += 1;
        let generation = state.next_generation;
        *state.registrations.entry(resource.clone()).or_default() += 1;
        // Like kubelet, connect to the plugin after answering the registration.
        let task = tokio::spawn(run_plugin(
            self.shared.clone(),
            resource.clone(),
            path.clone(),
            generation,
        ));
        let old = state.plugins.insert(
            resource.clone(),
            Plugin {
                generation,
                endpoint: path,
                options: request.options,
                channel: None,
                devices: Vec::new(),
                numa: HashMap::new(),
                listed: false,
                task,
            },
        );
        if let Some(old) = old {
            state.replaced.retain(|task| !task.is_finished());
            state.replaced.push(old.task);
        }
        drop(state);
        tracing::info!(%resource, endpoint = %request.endpoint, "device plugin registered");
        self.shared.changed();
        Ok(Response::new(Empty {}))
    }
}

pub(super) async fn serve_registration(shared: Arc<Shared>) -> anyhow::Result<ServedSocket> {
    let path = shared.dir.join(KUBELET_SOCKET);
    let service = RegistrationServer::new(RegistrationService { shared });
    ServedSocket::serve(&path, Server::builder().add_service(service))
}
