//! Leader election over a `coordination.k8s.io/v1` Lease, and the fence that keeps a deposed
//! leader's Binding writes out of its successor's way.
//!
//! ```text
//!  every retry period:  GET Lease ──▶ step() ──▶ Create / Take / Renew (PUT with resourceVersion,
//!                                      │          a 409 means someone else won this round)
//!                                      └──▶ Follow: remember the holder and its URL
//!
//!  leader's lease, as it counts it:  renewed_at ───────────── renewed_at + lease duration
//!                                    (start of the last successful renew: the server's
//!                                     renewTime, and so every follower's clock, is later)
//!  a Binding write may start at t only if t + its timeout <= renewed_at + lease duration,
//!  so every write of ours has ended (client side) before any other replica can take over.
//! ```
//!
//! Why this shape: a follower takes over only after it has seen the Lease record unchanged for
//! a full lease duration, counted on its own clock from when it saw the record change, which
//! is after the leader started that renewal. The leader, for its part, gives every write a
//! client timeout that ends before its lease could look expired to anyone. So no write of the
//! old leader is still under way when the new one binds; what the old leader wrote has
//! committed, and the new leader waits a short catch-up ([`LeaseTiming::catch_up`]) for its
//! watch to show it. A deposed leader that is still running (partitioned from the API server)
//! refuses binds and stops re-posting Bindings the moment its budget is gone, whether or not
//! it has heard that it lost. The one thing this cannot prove is what an API server does with
//! a write after its client gave up on it (a stalled etcd applying it seconds later): the same
//! residual the restart grace has (docs/operating.md, "Known limits").
//!
//! A term counts the times this replica became leader: a Binding written in an earlier term
//! is never re-posted (another leader may have handed its memory out meanwhile).
//!
//! Why not a crate: none fits kube 5 and the fence. `kube-runtime` has no leader election;
//! `kube-leader-election` (kube 0.96, "without fencing") and `kube-coordinate` (kube ≤ 2, a
//! leader/follower state channel) and `kube-lease-manager` (kube 4) would each pull a second
//! kube and k8s-openapi into the workspace, and none says until when its lease is safe to act
//! on, which is what bounds our writes. What is needed is small: read, compare-and-swap,
//! release.
//!
//! Why a lease can end early: a follower that waits out a SIGKILLed leader's Lease leaves
//! binding stopped for the lease duration and more (3.4–4.3 s on the real cluster). But every
//! leader publishes the URL it serves on, answers `/identity` there with its
//! `holderIdentity`, and keeps that listening socket open until it has released the Lease: on
//! a graceful stop, and on any error of its own, the socket closes only after its last write
//! ended (`crate::serve` holds a copy of it to the end). So each round a follower asks the
//! holder's address who serves there ([`crate::leader::forward::Probe`]): a refused connection (nothing listens) or
//! another identity (a restarted container in the same pod) means no process of the holder
//! is left to write, and the follower takes the Lease over at once, with the same
//! compare-and-swap as an expired one. Anything else (the holder answering, a timeout, a
//! reset, TLS trouble, an older extender without `/identity`) proves nothing, and the Lease
//! is waited out as before. A replica probes only once its own bind grace is over: a container
//! kubelet restarted in the dead leader's pod would otherwise win the race and then refuse
//! binds for that grace, while the other follower could have bound at once.
//!
//! Identity: `<pod name>_<random>`, fresh for every process, so a restarted container never
//! mistakes its predecessor's lease for its own (it knows nothing of that one's writes).
//! Graceful shutdown stops binding, waits for its own writes to end, then releases the Lease
//! (holder cleared), so the successor takes over at once instead of after a lease duration.
//!
//! The parts: `fence.rs` holds [`Leadership`], what the bind path asks (may it write now,
//! for how long, who leads instead) and the reachability `/readyz` reports; `election.rs`
//! runs the Lease rounds that feed it. The bind path never touches the Lease, and the
//! election never decides a bind.

use std::time::Duration;

mod election;
mod fence;
pub mod forward;
#[cfg(test)]
mod tests;

pub use election::{ElectionConfig, Error, Observed, Result, Step, run, step};
pub use fence::{Gate, Leadership, MIN_WRITE_BUDGET, WriteGuard};

/// The Lease's timing, as `--leader-*` flags set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a Lease record stays valid after its last renewal (`leaseDurationSeconds`,
    /// rounded up to whole seconds in the record).
    pub duration: Duration,
    /// The leader gives up leading when it could not renew for this long.
    pub renew_deadline: Duration,
    /// How often every replica reads the Lease, and the leader renews it.
    pub retry_period: Duration,
    /// After acquiring, binds wait this long for the watch to show what the previous leader
    /// wrote (its writes have all ended by then: see the module documentation).
    pub catch_up: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        Self {
            duration: Duration::from_millis(3000),
            renew_deadline: Duration::from_millis(2000),
            retry_period: Duration::from_millis(500),
            catch_up: Duration::from_millis(500),
        }
    }
}

/// A `holderIdentity` for this process: the pod name and a random suffix.
pub fn identity(pod_name: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let name = if pod_name.is_empty() {
        "gpushare-extender"
    } else {
        pod_name
    };
    format!("{name}_{:08x}", hasher.finish() as u32)
}

/// The pod name part of a `holderIdentity` made by [`identity`].
pub fn pod_of(identity: &str) -> &str {
    identity.rsplit_once('_').map_or(identity, |(pod, _)| pod)
}
