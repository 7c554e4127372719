//! The drive: pending pods through filter → prioritize → bind, `concurrency` at a time, each
//! scheduling cycle as kube-scheduler runs it with our extender configured, and what each
//! worker saw ([`Tally`]).
//!
//! Kept apart from the phase's set-up and report because this is the model of
//! kube-scheduler's behaviour (which nodes a filter call carries, when it asks for scores,
//! how it requeues a refused pod): change it here when kube-scheduler changes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Context;
use gpushare_e2e::scheduler::wire::{self, ExtenderArgs, ExtenderBindingArgs};
use hyper::body::Bytes;
use k8s_openapi::api::core::v1::Pod;

use crate::extender::NAMESPACE;
use crate::extender_http::Http;
use crate::report::Latencies;

/// Scheduling attempts per pod: kube-scheduler requeues a pod whose bind was refused (forever,
/// with backoff); we give up after this many so a broken extender cannot spin the drive.
const MAX_ATTEMPTS: u32 = 20;

/// The drive: pending pods handed out one at a time to `concurrency` workers; a pod whose
/// bind was refused, or whose filter failed, goes to the back of the queue, as kube-scheduler
/// requeues it.
pub struct Drive {
    pub http: Http,
    pods: Vec<Pod>,
    names: Vec<String>,
    filter_nodes: usize,
    /// Pod index and attempts so far.
    queue: Mutex<VecDeque<(usize, u32)>>,
    /// Scheduling cycles started, for rotating the filter window.
    pub cycles: AtomicUsize,
    /// Whether the extender scores the passing nodes (else: most GPU memory requested wins).
    pub prioritize: bool,
    /// GiB of the resource requested on each node by the pods bound so far.
    requested: Mutex<HashMap<String, u64>>,
}

/// What one worker saw.
#[derive(Default)]
pub struct Tally {
    pub filter: Latencies,
    pub prioritize: Latencies,
    pub bind: Latencies,
    pub bound: u64,
    /// Cycles in which no node passed filter.
    pub unfit: u64,
    /// Filter calls answered with an error (the pod requeued, as a refused bind's).
    pub filter_errors: Vec<String>,
    /// Pods given up on (out of attempts, or a call failed).
    pub unscheduled: u64,
    pub refusals: Vec<String>,
    pub errors: Vec<String>,
}

impl Tally {
    fn merge(&mut self, other: Tally) {
        self.filter.extend(other.filter);
        self.prioritize.extend(other.prioritize);
        self.bind.extend(other.bind);
        self.bound += other.bound;
        self.unfit += other.unfit;
        self.filter_errors.extend(other.filter_errors);
        self.unscheduled += other.unscheduled;
        self.refusals.extend(other.refusals);
        self.errors.extend(other.errors);
    }
}

impl Drive {
    pub fn new(http: Http, pods: Vec<Pod>, names: Vec<String>, filter_nodes: usize) -> Self {
        let queue = (0..pods.len()).map(|i| (i, 0)).collect();
        Self {
            http,
            pods,
            names,
            filter_nodes,
            queue: Mutex::new(queue),
            cycles: AtomicUsize::new(0),
            prioritize: true,
            requested: Mutex::new(HashMap::new()),
        }
    }

    fn requested(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        self.requested
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// `NodeResourcesFit` `MostAllocated` on the GPU-memory resource alone, where every node
    /// has the same capacity: the passing node with the most GiB requested; ties to the first.
    fn most_allocated<'a>(&self, passed: &'a [String]) -> &'a str {
        let requested = self.requested();
        first_highest(passed, |host| requested.get(host).copied().unwrap_or(0))
    }

    fn queue(&self) -> MutexGuard<'_, VecDeque<(usize, u32)>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The node names of scheduling cycle `cycle`.
    fn candidates(&self, cycle: usize) -> Vec<String> {
        let n = self.names.len();
        if self.filter_nodes == 0 || self.filter_nodes >= n {
            return self.names.clone();
        }
        let start = cycle.wrapping_mul(self.filter_nodes) % n;
        self.names
            .iter()
            .cycle()
            .skip(start)
            .take(self.filter_nodes)
            .cloned()
            .collect()
    }

    /// Runs `concurrency` workers until every pod is bound or given up on; what they saw.
    pub async fn run(self: &Arc<Self>, concurrency: usize) -> anyhow::Result<Tally> {
        let workers: Vec<_> = (0..concurrency)
            .map(|_| tokio::spawn(self.clone().worker()))
            .collect();
        let mut tally = Tally::default();
        for worker in workers {
            tally.merge(worker.await.context("a drive worker panicked")?);
        }
        Ok(tally)
    }

    async fn worker(self: Arc<Self>) -> Tally {
        let mut tally = Tally::default();
        loop {
            let next = self.queue().pop_front();
            let Some((index, attempts)) = next else { break };
            let Some(pod) = self.pods.get(index) else {
                break;
            };
            let cycle = self.cycles.fetch_add(1, Ordering::Relaxed);
            match self.schedule(cycle, pod, &mut tally).await {
                Ok(true) => {}
                Ok(false) if attempts + 1 < MAX_ATTEMPTS => {
                    self.queue().push_back((index, attempts + 1))
                }
                Ok(false) => tally.unscheduled += 1,
                Err(err) => {
                    tally.unscheduled += 1;
                    tally.errors.push(format!("{err:#}"));
                }
            }
        }
        tally
    }

    /// One scheduling cycle, as kube-scheduler runs it with our extender configured; whether
    /// the pod was bound.
    async fn schedule(&self, cycle: usize, pod: &Pod, tally: &mut Tally) -> anyhow::Result<bool> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let (took, answer) = self.ask("filter", pod, self.candidates(cycle)).await?;
        tally.filter.push(took);
        let filtered = wire::decode_filter_result(&answer)?;
        if !filtered.error.is_empty() {
            // kube-scheduler retries a pod whose filter failed after its backoff (the
            // extender answers an error while the only nodes left wait for an admission).
            tally.filter_errors.push(filtered.error);
            return Ok(false);
        }
        let passed = filtered.node_names.unwrap_or_default();
        let Some(first) = passed.first() else {
            tally.unfit += 1;
            return Ok(false);
        };
        // kube-scheduler asks for scores only when there is a choice to make.
        let node = if passed.len() > 1 && !self.prioritize {
            self.most_allocated(&passed).to_owned()
        } else if passed.len() > 1 {
            let (took, answer) = self.ask("prioritize", pod, passed.clone()).await?;
            tally.prioritize.push(took);
            let scores = wire::decode_host_priorities(&answer)?;
            best_node(&passed, &scores).to_owned()
        } else {
            first.clone()
        };
        let args = ExtenderBindingArgs {
            pod_name: name,
            pod_namespace: pod
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| NAMESPACE.to_owned()),
            pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
            node,
        };
        let node = args.node.clone();
        let (took, answer) = self.http.post("bind", serde_json::to_vec(&args)?).await?;
        tally.bind.push(took);
        let result = wire::decode_binding_result(&answer)?;
        if result.error.is_empty() {
            let gib = gpushare_contract::pod_request_with(
                pod,
                gpushare_contract::DEFAULT_RESOURCE,
                &gpushare_contract::Keys::default(),
            )
            .ok()
            .flatten()
            .map_or(0, |request| request.pod_gib);
            *self.requested().entry(node).or_default() += gib;
            tally.bound += 1;
            Ok(true)
        } else {
            tally.refusals.push(result.error);
            Ok(false)
        }
    }

    /// `verb` (filter or prioritize) for `pod` on `node_names`.
    async fn ask(
        &self,
        verb: &str,
        pod: &Pod,
        node_names: Vec<String>,
    ) -> anyhow::Result<(Duration, Bytes)> {
        let args = ExtenderArgs {
            pod: pod.clone(),
            nodes: None,
            node_names: Some(node_names),
        };
        self.http.post(verb, serde_json::to_vec(&args)?).await
    }
}

/// The highest-scored of `passed`; ties go to the node sent first. Unscored nodes score 0.
fn best_node<'a>(passed: &'a [String], scores: &[wire::HostPriority]) -> &'a str {
    let by_host: HashMap<&str, i64> = scores.iter().map(|h| (h.host.as_str(), h.score)).collect();
    first_highest(passed, |host| by_host.get(host).copied().unwrap_or(0))
}

/// The first of `passed` with the highest `key` ("" when none passed).
fn first_highest<K: Ord>(passed: &[String], key: impl Fn(&str) -> K) -> &str {
    passed
        .iter()
        .rev()
        .max_by_key(|host| key(host))
        .map_or("", String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpushare_testkit::workload::node_name;

    #[test]
    fn best_node_prefers_score_then_order() {
        let passed = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let host = |h: &str, score| wire::HostPriority {
            host: h.to_owned(),
            score,
        };
        assert_eq!(
            best_node(&passed, &[host("a", 3), host("b", 7), host("c", 7)]),
            "b"
        );
        assert_eq!(best_node(&passed, &[]), "a");
    }

    #[test]
    fn candidate_windows_rotate() {
        let names: Vec<String> = (0..5).map(node_name).collect();
        let http = || Http::new("http://127.0.0.1:1".to_owned(), None).unwrap();
        let drive = Drive::new(http(), Vec::new(), names.clone(), 2);
        assert_eq!(drive.candidates(2), [node_name(4), node_name(0)]);
        assert_eq!(
            Drive::new(http(), Vec::new(), names, 0).candidates(7).len(),
            5
        );
    }

    #[test]
    fn without_prioritize_the_most_requested_node_wins() {
        let names: Vec<String> = (0..3).map(node_name).collect();
        let drive = Drive::new(
            Http::new("http://127.0.0.1:1".to_owned(), None).unwrap(),
            Vec::new(),
            names.clone(),
            0,
        );
        assert_eq!(
            drive.most_allocated(&names),
            node_name(0),
            "ties: first sent"
        );
        drive.requested().insert(node_name(1), 3);
        drive.requested().insert(node_name(2), 5);
        assert_eq!(drive.most_allocated(&names), node_name(2));
        assert_eq!(drive.most_allocated(&names[..2]), node_name(1));
    }
}
