//! Whether a node plugin stops because its release is being uninstalled.
//!
//! Why: the plugins leave files on every node (the interposer, each container's accounting
//! directory and limits file, under `isolation.hostDir`), and `helm uninstall` removes only
//! API objects. A plugin that removed its files on every stop would take them from an upgrade
//! or a restart, whose next plugin pod uses them; so a plugin removes them only when it stops
//! because its DaemonSet is gone: deleted (a background delete, helm's default, removes the
//! DaemonSet before its pods), or being deleted (a foreground delete).
//!
//! The plugin cannot ask as it stops: by then `helm uninstall` has deleted its
//! ServiceAccount and Role too, and the API server refuses its token. So it watches its own
//! DaemonSet for its whole life ([`UninstallWatch`]): a watch opened earlier keeps streaming,
//! and the deletion arrives before kubelet's SIGTERM (the garbage collector deletes the pods
//! only after the DaemonSet). A DaemonSet of the same name with another UID is a new
//! install's, whose pod on this node is about to use the directory: the files stay. When the
//! watch saw nothing (no access, an API server down) the files stay: files left behind are
//! harmless, files taken from a running install are not.

use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Api;
use kube::runtime::{WatchStreamExt as _, watcher};

/// The plugin's own DaemonSet (flattened into each plugin's `Config`; the chart sets both).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct OwnDaemonSet {
    /// The DaemonSet running this plugin. The plugin watches it and, stopping after it was
    /// deleted (`helm uninstall`), removes its files under the isolation host directory;
    /// empty: it never does.
    #[arg(long, env = "GPUSHARE_DAEMON_SET", default_value = "")]
    pub daemon_set: String,
    /// The DaemonSet's namespace (the release namespace).
    #[arg(long, env = "GPUSHARE_POD_NAMESPACE", default_value = "")]
    pub pod_namespace: String,
}

/// What the watch has seen of the DaemonSet so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Seen {
    /// The UID first seen: the DaemonSet this plugin belongs to.
    uid: Option<String>,
    /// That DaemonSet is deleted or being deleted, and no other has taken its name.
    uninstalled: bool,
    /// During a (re)list: whether the DaemonSet was among the objects listed.
    listed: bool,
}

impl Seen {
    /// The state after one watch event about DaemonSets of our name.
    fn after(mut self, event: &watcher::Event<DaemonSet>) -> Self {
        match event {
            watcher::Event::Init => self.listed = false,
            watcher::Event::InitApply(set) | watcher::Event::Apply(set) => {
                self.listed = true;
                let uid = set.metadata.uid.clone().unwrap_or_default();
                let ours = self.uid.get_or_insert_with(|| uid.clone());
                self.uninstalled = *ours == uid && set.metadata.deletion_timestamp.is_some();
            }
            watcher::Event::Delete(set) => {
                if self.uid.is_some() && self.uid == set.metadata.uid {
                    self.uninstalled = true;
                }
            }
            // A list without it, after we knew it: deleted while the watch was down.
            watcher::Event::InitDone => {
                if !self.listed && self.uid.is_some() {
                    self.uninstalled = true;
                }
            }
        }
        self
    }
}

/// A watch on the plugin's own DaemonSet, from start to stop; stops with it (dropped).
#[derive(Debug)]
pub struct UninstallWatch {
    seen: Arc<Mutex<Seen>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl UninstallWatch {
    /// Starts watching `own` (nothing when it is not named).
    pub fn start(client: kube::Client, own: &OwnDaemonSet) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        if own.daemon_set.is_empty() || own.pod_namespace.is_empty() {
            return Self { seen, task: None };
        }
        let sets = Api::<DaemonSet>::namespaced(client, &own.pod_namespace);
        let config =
            watcher::Config::default().fields(&format!("metadata.name={}", own.daemon_set));
        let state = Arc::clone(&seen);
        let name = own.daemon_set.clone();
        let task = tokio::spawn(async move {
            let mut events = std::pin::pin!(watcher(sets, config).default_backoff());
            let mut warned = false;
            while let Some(event) = events.next().await {
                match event {
                    Ok(event) => {
                        let mut seen = state.lock().unwrap_or_else(|p| p.into_inner());
                        *seen = seen.clone().after(&event);
                    }
                    Err(error) if !warned => {
                        warned = true;
                        tracing::warn!(daemon_set = %name, %error, "cannot watch this plugin's DaemonSet: its isolation files stay on the node after an uninstall");
                    }
                    Err(_) => {}
                }
            }
        });
        Self {
            seen,
            task: Some(task),
        }
    }

    /// Whether the DaemonSet was deleted (and not installed again) by now.
    pub fn uninstalled(&self) -> bool {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .uninstalled
    }

    /// As the plugin stops: removes what it installed under `host_dir`
    /// ([`crate::isolation::remove_installation`]) when its DaemonSet is gone; logs either way.
    pub fn leave_node_if_uninstalled(&self, host_dir: &Path) {
        if !self.uninstalled() {
            tracing::info!(dir = %host_dir.display(), "keeping the isolation files on this node (the plugin's DaemonSet stays)");
            return;
        }
        match crate::isolation::remove_installation(host_dir) {
            Ok(removed) => tracing::info!(
                dir = %host_dir.display(),
                removed,
                "uninstalled: removed the interposer, accounting and limits files from this node"
            ),
            Err(error) => tracing::warn!(
                dir = %host_dir.display(),
                %error,
                "uninstalled, but the isolation files could not all be removed"
            ),
        }
    }
}

impl Drop for UninstallWatch {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use watcher::Event;

    fn set(uid: &str, deleting: bool) -> DaemonSet {
        let mut set = DaemonSet::default();
        set.metadata.uid = Some(uid.to_owned());
        if deleting {
            set.metadata.deletion_timestamp = Some(Time(Default::default()));
        }
        set
    }

    fn after(events: &[Event<DaemonSet>]) -> bool {
        events
            .iter()
            .fold(Seen::default(), |seen, event| seen.after(event))
            .uninstalled
    }

    #[test]
    fn a_deleted_or_deleting_daemon_set_is_an_uninstall() {
        let listed = [
            Event::Init,
            Event::InitApply(set("u1", false)),
            Event::InitDone,
        ];
        assert!(!after(&listed));
        assert!(after(
            &[
                listed.clone().as_slice(),
                &[Event::Delete(set("u1", false))]
            ]
            .concat()
        ));
        assert!(after(
            &[listed.clone().as_slice(), &[Event::Apply(set("u1", true))]].concat()
        ));
        // Deleted while the watch was down: the next list lacks it.
        assert!(after(
            &[listed.as_slice(), &[Event::Init, Event::InitDone]].concat()
        ));
    }

    #[test]
    fn an_upgrade_a_reinstall_or_a_blind_watch_keeps_the_files() {
        let listed = [
            Event::Init,
            Event::InitApply(set("u1", false)),
            Event::InitDone,
        ];
        // An upgrade changes the DaemonSet, not its UID.
        assert!(!after(
            &[listed.as_slice(), &[Event::Apply(set("u1", false))]].concat()
        ));
        // Uninstalled and installed again before this plugin stopped: the new one's pod
        // uses the files.
        let reinstalled = [
            Event::Delete(set("u1", false)),
            Event::Apply(set("u2", false)),
        ];
        assert!(!after(&[listed.as_slice(), &reinstalled].concat()));
        // Another DaemonSet's deletion is not ours.
        assert!(!after(
            &[listed.as_slice(), &[Event::Delete(set("u9", false))]].concat()
        ));
        // Never saw it (no access, or the API server was down since the start).
        assert!(!after(&[Event::Init, Event::InitDone]));
        assert!(!after(&[]));
    }
}
