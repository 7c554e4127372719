//! Fluent builders for the nodes and pods every test needs, so a test reads as its scenario:
//! `node("n1").gpushare().gpus(&[16, 16])`, `pod("a").gpu_mem(4).on_node("n1")`.
//!
//! Nodes carry what gpushare's device plugin would publish (the inventory annotation, the
//! GPU-count label, `example.com/gpu-mem` capacity); pods carry what users write.

use std::collections::BTreeMap;

use anyhow::Context;

use gpushare_contract::{
    DEFAULT_NODE_LABEL_KEY, DEFAULT_NODE_LABEL_VALUE, DEFAULT_RESOURCE, GpuInfo, Keys, inventory,
};
use k8s_openapi::api::core::v1::{
    Container, Node, NodeCondition, NodeStatus, Pod, PodSpec, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;

/// Image for every container a fixture builds; never pulled, but the API server requires one.
pub const IMAGE: &str = "registry.k8s.io/pause:3.10";

/// A node named `name`: Ready, 8 CPUs, 32Gi memory, 110 pods, no GPUs.
pub fn node(name: &str) -> NodeBuilder {
    NodeBuilder {
        name: name.to_owned(),
        labels: BTreeMap::from([("kubernetes.io/hostname".to_owned(), name.to_owned())]),
        gpus: Vec::new(),
        capacity_only: None,
        cpu: "8".to_owned(),
        memory: "32Gi".to_owned(),
    }
}

#[derive(Debug, Clone)]
pub struct NodeBuilder {
    name: String,
    labels: BTreeMap<String, String>,
    gpus: Vec<GpuInfo>,
    capacity_only: Option<(u64, u32)>,
    cpu: String,
    memory: String,
}

impl NodeBuilder {
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.to_owned(), v.to_owned());
        self
    }

    /// Opts the node in: label `gpushare=true`.
    pub fn gpushare(self) -> Self {
        self.label(DEFAULT_NODE_LABEL_KEY, DEFAULT_NODE_LABEL_VALUE)
    }

    /// GPUs of these sizes (GiB), healthy, published as the device plugin would: inventory
    /// annotation, capacity/allocatable `example.com/gpu-mem` = sum, GPU-count label.
    pub fn gpus(mut self, gib: &[u64]) -> Self {
        self.gpus = gib
            .iter()
            .zip(0u32..)
            .map(|(&mem_gib, index)| GpuInfo {
                index,
                uuid: format!("GPU-{}-{index}", self.name),
                model: "Simulated GPU".to_owned(),
                mem_gib,
                healthy: true,
                numa_node: None,
            })
            .collect();
        self.capacity_only = None;
        self
    }

    /// Marks GPU `index` unhealthy in the inventory (no effect if there is no such GPU).
    pub fn unhealthy(mut self, index: u32) -> Self {
        for gpu in self.gpus.iter_mut().filter(|gpu| gpu.index == index) {
            gpu.healthy = false;
        }
        self
    }

    /// Capacity and GPU-count label only, no inventory annotation (a device plugin that
    /// has not published yet, or an older one).
    pub fn capacity_only(mut self, total_gib: u64, count: u32) -> Self {
        self.capacity_only = Some((total_gib, count));
        self.gpus.clear();
        self
    }

    pub fn cpu(mut self, cores: &str) -> Self {
        self.cpu = cores.to_owned();
        self
    }

    pub fn memory(mut self, q: &str) -> Self {
        self.memory = q.to_owned();
        self
    }

    pub fn build(self) -> Node {
        let keys = Keys::default();
        let mut labels = self.labels;
        let mut annotations = BTreeMap::new();
        let gpu = if !self.gpus.is_empty() {
            annotations.insert(keys.node_gpus.clone(), inventory::encode(&self.gpus));
            Some((
                self.gpus.iter().map(|g| g.mem_gib).sum::<u64>(),
                self.gpus.len(),
            ))
        } else {
            self.capacity_only
                .map(|(total, count)| (total, count as usize))
        };
        let mut resources = BTreeMap::from([
            ("cpu".to_owned(), Quantity(self.cpu)),
            ("memory".to_owned(), Quantity(self.memory)),
            ("pods".to_owned(), Quantity("110".to_owned())),
        ]);
        if let Some((total, count)) = gpu {
            labels.insert(keys.node_gpu_count.clone(), count.to_string());
            resources.insert(DEFAULT_RESOURCE.to_owned(), Quantity(total.to_string()));
        }
        Node {
            metadata: ObjectMeta {
                name: Some(self.name),
                labels: Some(labels),
                annotations: (!annotations.is_empty()).then_some(annotations),
                ..Default::default()
            },
            spec: None,
            status: Some(NodeStatus {
                capacity: Some(resources.clone()),
                allocatable: Some(resources),
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".to_owned(),
                    status: "True".to_owned(),
                    reason: Some("KubeletReady".to_owned()),
                    message: Some("kubelet is posting ready status".to_owned()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    /// Creates the node through `client` and returns it as stored. The error wraps the
    /// `kube::Error` (downcast it to see the API status).
    pub async fn create(self, client: &kube::Client) -> anyhow::Result<Node> {
        let name = self.name.clone();
        Api::<Node>::all(client.clone())
            .create(&PostParams::default(), &self.build())
            .await
            .with_context(|| format!("creating node {name}"))
    }
}

/// A pod named `name` in namespace `default`, with no containers until one is added
/// (`gpu_mem` or `container`); `build` adds a plain `main` container if none was.
pub fn pod(name: &str) -> PodBuilder {
    PodBuilder {
        name: name.to_owned(),
        namespace: "default".to_owned(),
        containers: Vec::new(),
        init_containers: Vec::new(),
        cpu: None,
        memory: None,
        scheduler_name: None,
        annotations: BTreeMap::new(),
        node_name: None,
        priority: None,
        nominated_node: None,
        compute: 0,
    }
}

#[derive(Debug, Clone)]
pub struct PodBuilder {
    name: String,
    namespace: String,
    containers: Vec<(String, u64)>,
    init_containers: Vec<(String, u64)>,
    cpu: Option<String>,
    memory: Option<String>,
    scheduler_name: Option<String>,
    annotations: BTreeMap<String, String>,
    node_name: Option<String>,
    priority: Option<i32>,
    nominated_node: Option<String>,
    /// Percent of GPU compute the `main` container asks for (0: none).
    compute: u32,
}

/// A container asking `gib` of GPU memory and, as requests, `cpu` and `memory`.
fn container(name: &str, gib: u64, (cpu, memory): (Option<&str>, Option<&str>)) -> Container {
    let mut limits = BTreeMap::new();
    if gib > 0 {
        limits.insert(DEFAULT_RESOURCE.to_owned(), Quantity(gib.to_string()));
    }
    let requests: BTreeMap<String, Quantity> = [("cpu", cpu), ("memory", memory)]
        .into_iter()
        .filter_map(|(resource, q)| Some((resource.to_owned(), Quantity(q?.to_owned()))))
        .collect();
    let requests = (!requests.is_empty()).then_some(requests);
    let resources = (!limits.is_empty() || requests.is_some()).then(|| ResourceRequirements {
        limits: (!limits.is_empty()).then_some(limits),
        requests,
        ..Default::default()
    });
    Container {
        name: name.to_owned(),
        image: Some(IMAGE.to_owned()),
        resources,
        ..Default::default()
    }
}

impl PodBuilder {
    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = ns.to_owned();
        self
    }

    /// The app container `main`, asking for `gib` GiB of GPU memory (as a limit).
    pub fn gpu_mem(mut self, gib: u64) -> Self {
        match self.containers.iter_mut().find(|(name, _)| name == "main") {
            Some(main) => main.1 = gib,
            None => self.containers.insert(0, ("main".to_owned(), gib)),
        }
        self
    }

    /// The `main` container also asks for `percent` of GPU compute (as a limit, beside its
    /// memory).
    pub fn gpu_compute(mut self, percent: u32) -> Self {
        self.compute = percent;
        self
    }

    /// An extra app container; `gib` 0 asks for no GPU memory.
    pub fn container(mut self, name: &str, gib: u64) -> Self {
        self.containers.push((name.to_owned(), gib));
        self
    }

    pub fn init_container(mut self, name: &str, gib: u64) -> Self {
        self.init_containers.push((name.to_owned(), gib));
        self
    }

    /// CPU request of every app container.
    pub fn cpu(mut self, q: &str) -> Self {
        self.cpu = Some(q.to_owned());
        self
    }

    /// Memory request of every app container.
    pub fn memory(mut self, q: &str) -> Self {
        self.memory = Some(q.to_owned());
        self
    }

    pub fn scheduler_name(mut self, s: &str) -> Self {
        self.scheduler_name = Some(s.to_owned());
        self
    }

    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.to_owned(), v.to_owned());
        self
    }

    /// Already bound: `spec.nodeName`.
    pub fn on_node(mut self, node: &str) -> Self {
        self.node_name = Some(node.to_owned());
        self
    }

    /// `spec.priority`, as the API server's priority admission sets it from the class.
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = Some(priority);
        self
    }

    /// `status.nominatedNodeName`: kube-scheduler evicted pods on `node` for this one.
    pub fn nominated(mut self, node: &str) -> Self {
        self.nominated_node = Some(node.to_owned());
        self
    }

    pub fn build(self) -> Pod {
        let mut containers = self.containers;
        if containers.is_empty() {
            containers.push(("main".to_owned(), 0));
        }
        let requests = (self.cpu.as_deref(), self.memory.as_deref());
        let init: Vec<Container> = self
            .init_containers
            .iter()
            .map(|(name, gib)| container(name, *gib, (None, None)))
            .collect();
        Pod {
            metadata: ObjectMeta {
                name: Some(self.name),
                namespace: Some(self.namespace),
                annotations: (!self.annotations.is_empty()).then_some(self.annotations),
                ..Default::default()
            },
            spec: Some(PodSpec {
                containers: containers
                    .iter()
                    .map(|(name, gib)| {
                        let mut built = container(name, *gib, requests);
                        if name == "main" && self.compute > 0 {
                            let compute =
                                gpushare_contract::request::compute_resource_of(DEFAULT_RESOURCE);
                            let limits = built.resources.get_or_insert_with(Default::default);
                            limits
                                .limits
                                .get_or_insert_with(Default::default)
                                .insert(compute, Quantity(self.compute.to_string()));
                        }
                        built
                    })
                    .collect(),
                init_containers: (!init.is_empty()).then_some(init),
                scheduler_name: self.scheduler_name,
                node_name: self.node_name,
                priority: self.priority,
                ..Default::default()
            }),
            status: self.nominated_node.map(|node| PodStatus {
                nominated_node_name: Some(node),
                ..Default::default()
            }),
        }
    }

    /// Creates the pod through `client` and returns it as stored. The error wraps the
    /// `kube::Error` (downcast it to see the API status).
    pub async fn create(self, client: &kube::Client) -> anyhow::Result<Pod> {
        let (name, namespace) = (self.name.clone(), self.namespace.clone());
        Api::<Pod>::namespaced(client.clone(), &namespace)
            .create(&PostParams::default(), &self.build())
            .await
            .with_context(|| format!("creating pod {namespace}/{name}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_publishes_inventory_capacity_and_count() {
        let keys = Keys::default();
        let n = node("n1").gpushare().gpus(&[16, 24]).unhealthy(1).build();
        let annotations = n.metadata.annotations.unwrap();
        let gpus = inventory::decode(&annotations[&keys.node_gpus]).unwrap();
        assert_eq!(gpus[0].uuid, "GPU-n1-0");
        assert!(gpus[0].healthy && !gpus[1].healthy);
        let labels = n.metadata.labels.unwrap();
        assert_eq!(labels["gpushare"], "true");
        assert_eq!(labels[&keys.node_gpu_count], "2");
        let status = n.status.unwrap();
        assert_eq!(status.capacity.unwrap()[DEFAULT_RESOURCE].0, "40");

        let bare = node("n2").capacity_only(32, 2).build();
        assert!(bare.metadata.annotations.is_none());
        assert_eq!(
            bare.status.unwrap().allocatable.unwrap()[DEFAULT_RESOURCE].0,
            "32"
        );
    }

    #[test]
    fn pod_containers() {
        let p = pod("a")
            .container("side", 0)
            .gpu_mem(4)
            .init_container("init", 2)
            .build();
        let spec = p.spec.unwrap();
        let names: Vec<_> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["main", "side"]);
        let main_limits = spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap();
        assert_eq!(main_limits[DEFAULT_RESOURCE].0, "4");
        assert!(spec.containers[1].resources.is_none());
        assert_eq!(spec.init_containers.unwrap()[0].name, "init");
        assert_eq!(pod("b").build().spec.unwrap().containers[0].name, "main");
    }
}
