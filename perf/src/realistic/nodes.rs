//! The cluster as the replay books it, whatever strategy places the tasks: CPU and memory
//! requested per node, free GiB per GPU, and GPU memory as kube-scheduler counts it. One book
//! for every strategy, so that their figures are counted alike; the allocator's own cluster
//! (gpushare's strategies) is checked against it in the replay's tests.

use gpushare_allocator::fragmentation::Host;

use super::generator::{SimNode, Task};
use super::scores::default_score;
use super::strategy::{Cause, RequestForm, Strategy};

/// The cluster as the replay tracks it, whatever places the tasks.
pub(super) struct Nodes<'a> {
    pub(super) specs: &'a [SimNode],
    pub(super) names: Vec<String>,
    /// Requested CPU and memory per node.
    pub(super) used: Vec<Host>,
    /// Free GiB per GPU per node.
    pub(super) free: Vec<Vec<u64>>,
    /// GPU memory the node's pods request, as kube-scheduler counts the extended resource
    /// (a pod's total, whatever its GPUs hold).
    pub(super) requested_gib: Vec<u64>,
}

impl<'a> Nodes<'a> {
    pub(super) fn new(specs: &'a [SimNode]) -> Self {
        Self {
            specs,
            names: (0..specs.len()).map(|n| format!("node-{n:05}")).collect(),
            used: vec![Host::default(); specs.len()],
            free: specs
                .iter()
                .map(|n| vec![n.gpu_gib; n.gpus as usize])
                .collect(),
            requested_gib: vec![0; specs.len()],
        }
    }

    pub(super) fn host_free(&self, n: usize) -> Host {
        self.specs[n].host.saturating_sub(self.used[n])
    }

    /// kube-scheduler's default CPU and memory scores of node `n` for a pod asking `pod`.
    pub(super) fn default_score(&self, n: usize, pod: Host) -> i64 {
        default_score(self.specs[n].host, self.used[n], pod)
    }

    /// Whether node `n` has a GPU nothing is booked on: the extender's idle-GPU taint
    /// (`extender.idleGpuTaint`) is on the node while it does.
    pub(super) fn has_idle_gpu(&self, n: usize) -> bool {
        let size = self.specs[n].gpu_gib;
        self.free[n].contains(&size)
    }

    pub(super) fn model_ok(&self, n: usize, task: &Task) -> bool {
        task.model.is_none_or(|m| m.contains(self.specs[n].model))
    }

    /// GPUs of node `n` with `task.gpu_gib` free (`whole`: empty GPUs of at least that
    /// size): enough of them?
    pub(super) fn gpus_ok(&self, n: usize, task: &Task, whole: bool) -> bool {
        let size = self.specs[n].gpu_gib;
        let takes = |free: u64| {
            if whole {
                free == size && size >= task.gpu_gib
            } else {
                free >= task.gpu_gib
            }
        };
        task.gpus == 0 || self.free[n].iter().filter(|f| takes(**f)).count() >= task.gpus as usize
    }

    /// Whether node `n` takes `task` now: its model, enough GPUs with the task's GiB free,
    /// and its CPU and memory.
    pub(super) fn takes(&self, n: usize, task: &Task) -> bool {
        self.model_ok(n, task) && self.gpus_ok(n, task, false) && self.host_free(n).fits(task.host)
    }

    /// Books `task` on node `n`'s `gpus`: its GiB on each, or the whole GPUs when `whole`.
    /// Returns the GiB booked beyond the task's request.
    pub(super) fn place(&mut self, n: usize, task: &Task, gpus: &[usize], whole: bool) -> u64 {
        self.used[n] = self.used[n].saturating_add(task.host);
        self.requested_gib[n] += task.demand_gib();
        let mut surplus = 0;
        for &g in gpus {
            let booked = if whole { self.free[n][g] } else { task.gpu_gib };
            surplus += booked - task.gpu_gib;
            self.free[n][g] -= booked;
        }
        surplus
    }

    /// Why no node took `task` under `strategy` and `form`.
    pub(super) fn cause(&self, task: &Task, strategy: Strategy, form: RequestForm) -> Cause {
        if task.gpus > 1 && !strategy.places_multi_gpu() {
            return Cause::MultiGpu;
        }
        let whole = strategy.books_whole(task, form);
        let (mut any_gpu, mut cpu, mut memory) = (false, false, false);
        for n in 0..self.specs.len() {
            if !self.model_ok(n, task) || !self.gpus_ok(n, task, whole) {
                continue;
            }
            any_gpu = true;
            let free = self.host_free(n);
            let (c, m) = (
                free.milli_cpu >= task.host.milli_cpu,
                free.memory_mib >= task.host.memory_mib,
            );
            if c && m {
                return Cause::Other;
            }
            cpu |= c;
            memory |= m;
        }
        match (any_gpu, cpu, memory) {
            (false, _, _) => Cause::Gpu,
            (true, true, false) => Cause::Memory,
            (true, false, true) => Cause::Cpu,
            _ => Cause::Both,
        }
    }
}
