//! The object store: every object of every resource, one global resourceVersion, and a bounded
//! history of changes that watches replay from.
//!
//! Like etcd behind the real server, the resourceVersion is a single counter bumped by every
//! write, and an object's `metadata.resourceVersion` is the counter value of its last write.
//! History older than `oldest` is gone (bounded, or forgotten on purpose by
//! [`Inner::compact`]); a watch asking to start before it gets 410 Expired.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::{Value, json};
use tokio::sync::watch;

use super::locked;
use super::resources::Kind;

/// How many changes a watch can replay before history is compacted on its own.
const HISTORY_LIMIT: usize = 10_000;
/// The first resourceVersion handed out; anything but 0, which means "any" to clients.
const FIRST_RESOURCE_VERSION: u64 = 100;

/// `(namespace, name)`; the namespace is empty for cluster-scoped objects.
pub(crate) type Key = (String, String);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeType {
    Added,
    Modified,
    Deleted,
}

/// One write, as watches see it.
#[derive(Debug)]
pub(crate) struct Change {
    pub rv: u64,
    pub kind: Kind,
    pub change: ChangeType,
    /// The object after the write (for deletions: its last state, at the deletion's version).
    pub object: Value,
    /// The object before the write, to tell "stopped matching a selector" from "changed".
    pub old: Option<Value>,
    /// For pods: `spec.nodeName` after and before the write ("" when unbound), so that a
    /// node-scoped watch skips other nodes' pods without reading them.
    pub pod_nodes: Vec<String>,
    /// `object` as JSON, made by the first watch that sends it and shared by the others.
    json: OnceLock<String>,
}

impl Change {
    fn new(rv: u64, kind: Kind, change: ChangeType, object: Value, old: Option<Value>) -> Self {
        let pods = std::iter::once(&object).chain(old.as_ref());
        let pods = pods.filter(|_| kind == Kind::Pod);
        let mut pod_nodes: Vec<String> = pods.map(|pod| pod_node(pod).to_owned()).collect();
        // After and before: at most two, so the same node twice is side by side.
        pod_nodes.dedup();
        Change {
            rv,
            kind,
            change,
            object,
            old,
            pod_nodes,
            json: OnceLock::new(),
        }
    }

    /// The object after the write, as JSON.
    pub fn json(&self) -> &str {
        self.json.get_or_init(|| self.object.to_string())
    }
}

/// The history a watch asked for is no longer held.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expired {
    pub requested: u64,
    pub oldest: u64,
}

pub(crate) struct Store {
    inner: Mutex<Inner>,
    rv_tx: watch::Sender<u64>,
    /// Per node name: moves when a pod on that node (before or after the write) changes.
    /// Node-scoped pod watches (every kubelet's and device plugin's) wait on these, so that
    /// a write wakes the watches it concerns rather than all of them.
    pods_on: Mutex<HashMap<String, watch::Sender<u64>>>,
}

pub(crate) struct Inner {
    rv: u64,
    objects: BTreeMap<Kind, BTreeMap<Key, Value>>,
    history: VecDeque<Arc<Change>>,
    /// Watches may start from any version `>= oldest`.
    oldest: u64,
}

impl Store {
    pub fn new() -> Self {
        let (rv_tx, _) = watch::channel(FIRST_RESOURCE_VERSION);
        Self {
            inner: Mutex::new(Inner {
                rv: FIRST_RESOURCE_VERSION,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                oldest: FIRST_RESOURCE_VERSION,
            }),
            rv_tx,
            pods_on: Mutex::new(HashMap::new()),
        }
    }

    /// Runs `f` under the lock, then wakes the watches concerned if it wrote anything.
    pub fn write<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let (result, rv, nodes) = {
            let mut inner = locked(&self.inner);
            let before = inner.rv;
            let result = f(&mut inner);
            let nodes = inner.pod_nodes_since(before);
            (result, inner.rv, nodes)
        };
        if !nodes.is_empty() {
            let topics = locked(&self.pods_on);
            for node in nodes {
                if let Some(tx) = topics.get(&node) {
                    tx.send_replace(rv);
                }
            }
        }
        self.rv_tx
            .send_if_modified(|current| std::mem::replace(current, rv) != rv);
        result
    }

    pub fn read<R>(&self, f: impl FnOnce(&Inner) -> R) -> R {
        f(&locked(&self.inner))
    }

    /// A receiver that changes whenever the resourceVersion moves.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.rv_tx.subscribe()
    }

    /// A receiver that changes whenever a pod whose `spec.nodeName` is `node` before or after
    /// the write changes ("" for unbound pods).
    pub fn subscribe_pods_on(&self, node: &str) -> watch::Receiver<u64> {
        let mut topics = locked(&self.pods_on);
        topics.retain(|_, tx| tx.receiver_count() > 0);
        topics
            .entry(node.to_owned())
            .or_insert_with(|| watch::Sender::new(FIRST_RESOURCE_VERSION))
            .subscribe()
    }
}

/// A pod's `spec.nodeName`, "" when unbound.
fn pod_node(pod: &Value) -> &str {
    pod["spec"]["nodeName"].as_str().unwrap_or("")
}

impl Inner {
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    pub fn get(&self, kind: Kind, key: &Key) -> Option<&Value> {
        self.objects.get(&kind).and_then(|objects| objects.get(key))
    }

    /// Objects of `kind`, in key order, in `namespace` (all namespaces when `None`).
    pub fn list<'a>(
        &'a self,
        kind: Kind,
        namespace: Option<&'a str>,
    ) -> impl Iterator<Item = (&'a Key, &'a Value)> + 'a {
        self.objects
            .get(&kind)
            .into_iter()
            .flat_map(|objects| objects.iter())
            .filter(move |(key, _)| namespace.is_none_or(|ns| key.0 == ns))
    }

    fn bump(&mut self, object: &mut Value) -> u64 {
        self.rv += 1;
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), json!(self.rv.to_string()));
        }
        self.rv
    }

    fn record(&mut self, change: Change) {
        self.history.push_back(Arc::new(change));
        while self.history.len() > HISTORY_LIMIT {
            if let Some(dropped) = self.history.pop_front() {
                self.oldest = dropped.rv;
            }
        }
    }

    /// Stores a new object (ADDED). The caller has checked that the key is free.
    pub fn create(&mut self, kind: Kind, key: Key, object: Value) -> Value {
        self.update(kind, key, object)
    }

    /// Replaces an existing object (MODIFIED), or creates it when missing (ADDED).
    pub fn update(&mut self, kind: Kind, key: Key, mut object: Value) -> Value {
        let rv = self.bump(&mut object);
        let old = self
            .objects
            .entry(kind)
            .or_default()
            .insert(key, object.clone());
        let change = if old.is_some() {
            ChangeType::Modified
        } else {
            ChangeType::Added
        };
        self.record(Change::new(rv, kind, change, object.clone(), old));
        object
    }

    /// Removes an object; returns its last state, stamped with the deletion's version.
    pub fn delete(&mut self, kind: Kind, key: &Key) -> Option<Value> {
        let mut object = self.objects.get_mut(&kind)?.remove(key)?;
        let old = object.clone();
        let rv = self.bump(&mut object);
        self.record(Change::new(
            rv,
            kind,
            ChangeType::Deleted,
            object.clone(),
            Some(old),
        ));
        Some(object)
    }

    /// The node names (before and after) of the pods changed after `rv`.
    fn pod_nodes_since(&self, rv: u64) -> BTreeSet<String> {
        let changes = self.history.iter().rev().take_while(|c| c.rv > rv);
        changes.flat_map(|c| c.pod_nodes.iter().cloned()).collect()
    }

    /// Changes after `rv`, oldest first, or `Expired` when history no longer reaches back.
    pub fn changes_since(&self, rv: u64) -> Result<Vec<Arc<Change>>, Expired> {
        if let Some(expired) = self.is_expired(rv) {
            return Err(expired);
        }
        // History is sorted by rv; skip what the watch has already seen.
        let start = self.history.partition_point(|change| change.rv <= rv);
        Ok(self.history.range(start..).cloned().collect())
    }

    /// Whether a watch or continued list may still start from `rv`.
    pub fn is_expired(&self, rv: u64) -> Option<Expired> {
        (rv < self.oldest).then_some(Expired {
            requested: rv,
            oldest: self.oldest,
        })
    }

    /// Forgets all history: only the current version remains watchable.
    pub fn compact(&mut self) {
        self.history.clear();
        self.oldest = self.rv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Key {
        ("ns".into(), name.into())
    }

    #[test]
    fn versions_bump_and_history_replays() {
        let store = Store::new();
        let start = store.read(Inner::resource_version);
        let created =
            store.write(|s| s.create(Kind::Pod, key("a"), json!({"metadata": {"name": "a"}})));
        assert_eq!(
            created["metadata"]["resourceVersion"],
            (start + 1).to_string()
        );
        let changed = json!({"metadata": {"name": "a"}, "x": 1});
        store.write(|s| s.update(Kind::Pod, key("a"), changed));
        let deleted = store.write(|s| s.delete(Kind::Pod, &key("a"))).unwrap();
        assert_eq!(
            deleted["metadata"]["resourceVersion"],
            (start + 3).to_string()
        );
        let changes = store.read(|s| s.changes_since(start + 1)).unwrap();
        let types: Vec<_> = changes.iter().map(|c| c.change).collect();
        assert_eq!(types, vec![ChangeType::Modified, ChangeType::Deleted]);
        store.write(Inner::compact);
        assert!(store.read(|s| s.changes_since(start + 1)).is_err());
        let none = store.read(|s| s.changes_since(start + 3)).unwrap();
        assert!(none.is_empty());
    }
}
