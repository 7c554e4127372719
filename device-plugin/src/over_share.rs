//! A pod over its share of a GPU, by the driver's own figures: told once per episode, and
//! with `--over-share evict` evicted once it stayed over for a grace period.
//!
//! ```text
//!   every usage period (crate::usage): Report ─▶ Tracker::observe ─▶ actions
//!     (pod, GPU) goes over its share ─────────▶ Warning Event GpuMemoryOverShare (once)
//!     still over after --over-share-grace-seconds, evict ─▶ Eviction (policy/v1)
//!     back within its share, or gone ─────────▶ the episode ends (the next one is told again)
//! ```
//!
//! Why the node watches at all: the interposer is a counter inside the container, and a
//! program can get past it (a static binary, one that drops `LD_PRELOAD`, a tampered budget
//! file). NVML's per-process figures cannot be lied to from inside a container, so the plugin
//! compares them with what kubelet gave the pod and acts on the pod, not on its neighbours:
//! the runaway is evicted before the GPU is full for everyone (`evict`), or at least named
//! (`report`, the default, for clusters where a restart costs more than a noisy neighbour).
//!
//! The grace period lets a short spike pass (a framework's warm-up, a copy being freed) and
//! keeps a pod that hovers at its share from being evicted on one reading. The decisions are
//! pure ([`Tracker`]); [`Actor`] does the API calls.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::time::Instant;

use crate::attribution::Report;
use crate::metrics::Metrics;
use crate::pods::PodCache;

/// What the plugin does about a pod over its share (`--over-share`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OverShareMode {
    /// A Warning Event and the metrics; the pod keeps running.
    #[default]
    Report,
    /// As `report`, then an eviction once it stayed over for the grace period.
    Evict,
}

/// `--over-share` and `--over-share-grace-seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// What to do.
    pub mode: OverShareMode,
    /// How long a pod may stay over before it is evicted (`evict`).
    pub grace: Duration,
}

/// One decision of [`Tracker::observe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// A pod went over its share of a GPU: tell its owner (once per episode).
    Report(Finding),
    /// A pod stayed over for the grace period: evict it.
    Evict(Finding),
}

/// A pod over its share of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// `namespace/name`.
    pub pod: String,
    /// The GPU's index on the node.
    pub gpu: u32,
    /// Bytes kubelet gave the pod there.
    pub share: u64,
    /// Bytes its processes use there.
    pub used: u64,
    /// How long it has been over.
    pub over_for: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Episode {
    since: Instant,
    /// An eviction was asked for in this episode (and not refused).
    evicted: bool,
}

/// The episodes in progress; see the module doc.
#[derive(Debug)]
pub struct Tracker {
    policy: Policy,
    episodes: BTreeMap<(String, u32), Episode>,
}

impl Tracker {
    /// No episode yet.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            episodes: BTreeMap::new(),
        }
    }

    /// The actions one measurement `report`, taken at `now`, calls for. Episodes of pods
    /// back within their share, or gone, end.
    pub fn observe(&mut self, report: &Report, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        let mut over_now = BTreeMap::new();
        for (pod, gpus) in &report.pods {
            for (&gpu, held) in gpus {
                if held.over_share() == 0 {
                    continue;
                }
                let key = (pod.clone(), gpu);
                let episode = match self.episodes.get(&key) {
                    Some(episode) => *episode,
                    None => Episode {
                        since: now,
                        evicted: false,
                    },
                };
                let finding = Finding {
                    pod: pod.clone(),
                    gpu,
                    share: held.allocated,
                    used: held.used,
                    over_for: now.saturating_duration_since(episode.since),
                };
                let mut episode = episode;
                if !self.episodes.contains_key(&key) {
                    actions.push(Action::Report(finding.clone()));
                }
                if self.policy.mode == OverShareMode::Evict
                    && !episode.evicted
                    && finding.over_for >= self.policy.grace
                {
                    episode.evicted = true;
                    actions.push(Action::Evict(finding));
                }
                over_now.insert(key, episode);
            }
        }
        self.episodes = over_now;
        actions
    }

    /// An eviction asked for pod `pod` on GPU `gpu` was refused (a disruption budget, the
    /// API server unreachable): asked again at the next measurement that still finds it over.
    pub fn eviction_failed(&mut self, pod: &str, gpu: u32) {
        if let Some(episode) = self.episodes.get_mut(&(pod.to_owned(), gpu)) {
            episode.evicted = false;
        }
    }
}

/// Carries out [`Action`]s against the API server.
pub struct Actor {
    /// The API.
    pub client: kube::Client,
    /// This node, for the Events' reporter.
    pub node: String,
    /// The node's pods (UIDs for the Events).
    pub pods: std::sync::Arc<PodCache>,
    /// Counters.
    pub metrics: Metrics,
}

impl Actor {
    /// Publishes or evicts as `actions` say; refused evictions go back to `tracker`.
    pub async fn act(&self, actions: Vec<Action>, report: &Report, tracker: &mut Tracker) {
        if actions.is_empty() {
            return;
        }
        let recorder = Recorder::new(
            self.client.clone(),
            Reporter {
                controller: "gpushare-device-plugin".into(),
                instance: Some(self.node.clone()),
            },
        );
        for action in actions {
            let (finding, evict) = match action {
                Action::Report(finding) => (finding, false),
                Action::Evict(finding) => (finding, true),
            };
            let Some(gpu) = report.gpus.iter().find(|g| g.index == finding.gpu) else {
                continue;
            };
            let uid = self
                .pods
                .pods_on_gpu(&gpu.uuid)
                .into_iter()
                .find_map(|(key, uid)| (key == finding.pod).then_some(uid));
            // An eviction names the pod by UID too, so that a pod created again under the same
            // name is not taken for the one measured: without one (the cache has not caught up,
            // or the pod is on its way out), it waits for the next measurement.
            if evict && uid.is_none() {
                tracing::warn!(pod = %finding.pod, gpu = finding.gpu, "a pod over its GPU memory share is not among the GPU's pods yet; evicting it at the next measurement");
                tracker.eviction_failed(&finding.pod, finding.gpu);
                continue;
            }
            let (namespace, name) = finding
                .pod
                .split_once('/')
                .unwrap_or(("default", finding.pod.as_str()));
            let mib = |bytes: u64| bytes >> 20;
            let figures = format!(
                "uses {} MiB of GPU {} ({}) against a share of {} MiB, by the driver's count",
                mib(finding.used),
                finding.gpu,
                gpu.uuid,
                mib(finding.share)
            );
            let (reason, note) = if evict {
                (
                    "GpuMemoryOverShareEvicted",
                    format!(
                        "{figures}, for {}s: evicted, so that its GPU's other pods keep their memory",
                        finding.over_for.as_secs()
                    ),
                )
            } else {
                (
                    "GpuMemoryOverShare",
                    format!(
                        "{figures}: something in the pod allocates past the isolation interposer (a static binary, a program without LD_PRELOAD, a changed budget file) or it runs without one"
                    ),
                )
            };
            tracing::warn!(pod = %finding.pod, gpu = finding.gpu, used_mib = mib(finding.used), share_mib = mib(finding.share), evict, "GPU memory over share");
            let reference = ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                namespace: Some(namespace.to_owned()),
                name: Some(name.to_owned()),
                uid: uid.clone(),
                ..ObjectReference::default()
            };
            let event = Event {
                type_: EventType::Warning,
                reason: reason.to_owned(),
                note: Some(note),
                action: if evict { "Evict" } else { "MeasureGpuMemory" }.to_owned(),
                secondary: None,
            };
            if let Err(error) = recorder.publish(&event, &reference).await {
                tracing::warn!(pod = %finding.pod, %error, "cannot publish the over-share event");
            }
            if !evict {
                self.metrics.over_share_episodes.inc();
                continue;
            }
            let Some(uid) = uid else {
                continue;
            };
            let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
            match api.evict(name, &crate::pods::eviction_of(&uid)).await {
                Ok(_) => self.metrics.over_share_evictions.inc(),
                Err(kube::Error::Api(status)) if status.code == 404 => 0,
                // A conflict is a pod created again under the name (the UID precondition) or
                // the Eviction API's own retries running out: the next measurement decides.
                Err(error) => {
                    tracing::warn!(pod = %finding.pod, %error, "cannot evict a pod over its GPU memory share; trying again at the next measurement");
                    tracker.eviction_failed(&finding.pod, finding.gpu);
                    0
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribution::{GpuMemory, Held};

    const GIB: u64 = 1 << 30;

    fn report(pods: &[(&str, u64, u64)]) -> Report {
        Report {
            gpus: vec![GpuMemory {
                index: 0,
                uuid: "GPU-0".into(),
                allocated: 0,
                used: 0,
                unattributed: 0,
            }],
            pods: pods
                .iter()
                .map(|&(key, allocated, used)| {
                    let held = Held {
                        allocated,
                        used,
                        counted: None,
                    };
                    (key.to_owned(), BTreeMap::from([(0, held)]))
                })
                .collect(),
            ..Report::default()
        }
    }

    fn policy(mode: OverShareMode, grace_s: u64) -> Policy {
        Policy {
            mode,
            grace: Duration::from_secs(grace_s),
        }
    }

    fn kinds(actions: &[Action]) -> Vec<(&'static str, &str)> {
        actions
            .iter()
            .map(|a| match a {
                Action::Report(f) => ("report", f.pod.as_str()),
                Action::Evict(f) => ("evict", f.pod.as_str()),
            })
            .collect()
    }

    #[test]
    fn an_episode_is_told_once_and_again_after_it_ended() {
        let mut tracker = Tracker::new(policy(OverShareMode::Report, 0));
        let t0 = Instant::now();
        let over = report(&[("default/a", 4 * GIB, 6 * GIB), ("default/b", 4 * GIB, GIB)]);
        let first = tracker.observe(&over, t0);
        assert_eq!(kinds(&first), [("report", "default/a")]);
        let Action::Report(finding) = &first[0] else {
            panic!("{first:?}")
        };
        assert_eq!((finding.share, finding.used), (4 * GIB, 6 * GIB));
        for s in 1..5 {
            assert!(
                tracker
                    .observe(&over, t0 + Duration::from_secs(s))
                    .is_empty()
            );
        }
        // Back within its share, then over again: a new episode.
        let within = report(&[("default/a", 4 * GIB, 4 * GIB)]);
        assert!(
            tracker
                .observe(&within, t0 + Duration::from_secs(6))
                .is_empty()
        );
        let again = tracker.observe(&over, t0 + Duration::from_secs(7));
        assert_eq!(kinds(&again), [("report", "default/a")]);
    }

    #[test]
    fn evict_waits_for_the_grace_period_and_asks_once() {
        let mut tracker = Tracker::new(policy(OverShareMode::Evict, 30));
        let t0 = Instant::now();
        let over = report(&[
            ("default/a", 4 * GIB, 5 * GIB),
            ("default/b", 4 * GIB, 4 * GIB),
        ]);
        assert_eq!(
            kinds(&tracker.observe(&over, t0)),
            [("report", "default/a")]
        );
        assert!(
            tracker
                .observe(&over, t0 + Duration::from_secs(29))
                .is_empty()
        );
        let at_grace = tracker.observe(&over, t0 + Duration::from_secs(30));
        assert_eq!(kinds(&at_grace), [("evict", "default/a")]);
        assert!(
            tracker
                .observe(&over, t0 + Duration::from_secs(31))
                .is_empty()
        );
        // A refused eviction is asked again.
        tracker.eviction_failed("default/a", 0);
        assert_eq!(
            kinds(&tracker.observe(&over, t0 + Duration::from_secs(32))),
            [("evict", "default/a")]
        );
    }

    #[test]
    fn a_spike_shorter_than_the_grace_period_is_not_evicted() {
        let mut tracker = Tracker::new(policy(OverShareMode::Evict, 30));
        let t0 = Instant::now();
        let over = report(&[("default/a", 4 * GIB, 5 * GIB)]);
        let within = report(&[("default/a", 4 * GIB, 3 * GIB)]);
        tracker.observe(&over, t0);
        tracker.observe(&within, t0 + Duration::from_secs(20));
        // Over again: its clock starts again.
        tracker.observe(&over, t0 + Duration::from_secs(25));
        assert!(
            tracker
                .observe(&over, t0 + Duration::from_secs(50))
                .is_empty()
        );
        assert_eq!(
            kinds(&tracker.observe(&over, t0 + Duration::from_secs(55))),
            [("evict", "default/a")]
        );
    }

    #[test]
    fn report_mode_never_evicts() {
        let mut tracker = Tracker::new(policy(OverShareMode::Report, 0));
        let t0 = Instant::now();
        let over = report(&[("default/a", 4 * GIB, 16 * GIB)]);
        tracker.observe(&over, t0);
        assert!(
            tracker
                .observe(&over, t0 + Duration::from_secs(3600))
                .is_empty()
        );
    }
}
