//! The per-node decision: which GPU, or which GPUs, of one node a request gets, or why it
//! fits nowhere there. Filter, score and reserve all rest on this one decision (the policy
//! changes which GPU, never whether one fits), so a node that passes the filter is one a
//! bind can take. It honours the model filter, NUMA locality for multi-GPU pods and the twin
//! rule (see the crate documentation), in O(GPUs) for a one-GPU slice; the GiB each GPU has
//! free it reads from the bookings kept in `node`.

use super::{GpuSet, GpuUsage, Node};
use crate::fragmentation::Workload;
use crate::{GpuList, Policy, Request, Unfit};

/// The positions (in [`Node::gpus`]) a decision picked: the first GPU, then the others of a
/// multi-GPU pod, best first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Choice {
    pub(crate) first: usize,
    pub(crate) more: Vec<usize>,
}

impl Node {
    /// The GPUs the pod would get, or why it fits nowhere: [`Node::decide`] for a slice of
    /// one GPU, [`Node::decide_multi`] for the rest.
    pub(crate) fn choose(
        &self,
        request: &Request,
        policy: Policy,
        workload: &Workload,
    ) -> Result<Choice, Unfit> {
        if request.is_multi() {
            return self.decide_multi(request, policy);
        }
        self.decide(request, policy, workload).map(|first| Choice {
            first,
            more: Vec::new(),
        })
    }

    /// The first GPUs, in index order, that each take the request's slice (one for a one-GPU
    /// request, N distinct ones for `gpus: N`; exclusive: empty ones), whatever a policy would
    /// prefer: kube-scheduler's DRA allocator takes devices so. Where none (or too few) take
    /// it, the refusal is the one [`Node::choose`] gives, so a first-fit booking and a
    /// policy's agree on whether the request fits.
    pub(crate) fn first_fit(
        &self,
        request: &Request,
        workload: &Workload,
    ) -> Result<Choice, Unfit> {
        self.check_node()?;
        let wanted = request.gpus.max(1) as usize;
        let mut taken = (0..self.gpus.len()).filter(|&pos| self.takes_slice(pos, request));
        let first = taken.next();
        let more: Vec<usize> = taken.take(wanted - 1).collect();
        match first {
            Some(first) if more.len() + 1 == wanted => Ok(Choice { first, more }),
            _ => Err(self
                .choose(request, Policy::Binpack, workload)
                .err()
                .unwrap_or(Unfit::NoGpus)),
        }
    }

    /// Why no GPU of the node is of a model `request` allows.
    fn no_model(&self, request: &Request) -> Unfit {
        let mut models: Vec<&str> = self.gpus.iter().map(|u| u.gpu.model.as_str()).collect();
        models.sort_unstable();
        models.dedup();
        Unfit::NoModel {
            wanted: request.models.to_string(),
            has: models.join(", "),
        }
    }

    /// Why the node cannot be considered at all, if so.
    pub(super) fn check_node(&self) -> Result<(), Unfit> {
        if !self.present {
            return Err(Unfit::UnknownNode);
        }
        if !self.eligible {
            return Err(Unfit::NotEligible);
        }
        if self.gpus.is_empty() {
            return Err(Unfit::NoGpus);
        }
        Ok(())
    }

    /// The GPU (position in `gpus`) a one-GPU, shared request would get, or why it fits
    /// nowhere. O(GPUs + container sizes × pending entries of that size); never allocates on
    /// success.
    pub(super) fn decide(
        &self,
        request: &Request,
        policy: Policy,
        workload: &Workload,
    ) -> Result<usize, Unfit> {
        self.check_node()?;
        let filtered = !request.models.is_any();
        // Never, as things stand (unresolvable), before "retry later".
        if filtered
            && !self
                .gpus
                .iter()
                .any(|u| request.models.allows(&u.gpu.model))
        {
            return Err(self.no_model(request));
        }
        if let Some((set, size)) = self.pin(request)? {
            return self.decide_pinned(request, set, size);
        }
        let scan = self.scan_slice(request, policy);
        if !scan.any_model {
            return Err(self.no_model(request));
        }
        if let Some((pos, _)) = scan.best {
            if policy == Policy::Fragmentation {
                return Ok(self.fragmentation_gpu(request, workload).unwrap_or(pos));
            }
            return Ok(pos);
        }
        Err(scan.refusal(request, self.gpus.len()))
    }

    /// [`Node::decide`] for a one-GPU request the twin rule pins to `set` (by a pending
    /// container of `size` GiB): that GPU if it takes the pod, else why not.
    fn decide_pinned(&self, request: &Request, set: &[u32], size: u64) -> Result<usize, Unfit> {
        let need = request.pod_gib;
        let gpu = set.first().copied().unwrap_or_default();
        if set.len() != 1 {
            return Err(Unfit::TwinShape {
                size,
                gpus: GpuList(set.to_vec()),
                wanted: 1,
            });
        }
        let Some(pos) = self.position(gpu) else {
            return Err(Unfit::TwinBlocked {
                size,
                gpus: GpuList(vec![gpu]),
                need,
                free: 0,
                healthy: false,
                compute: None,
            });
        };
        let usage = &self.gpus[pos];
        if !request.models.allows(&usage.gpu.model) {
            return Err(Unfit::TwinModel {
                size,
                gpu,
                model: usage.gpu.model.clone(),
            });
        }
        if usage.healthy && usage.has_room(need, request.compute) {
            return Ok(pos);
        }
        Err(Unfit::TwinBlocked {
            size,
            gpus: GpuList(vec![gpu]),
            need,
            free: usage.free_gib(),
            healthy: usage.healthy,
            compute: compute_short(usage, need, request.compute),
        })
    }

    /// One pass over the GPUs for an unpinned one-GPU request: the GPU the policy prefers
    /// among the healthy ones of an allowed model with room (binpack and fragmentation the
    /// least free, spread the most; the lowest position on ties), and what a refusal names.
    fn scan_slice(&self, request: &Request, policy: Policy) -> SliceScan {
        let need = request.pod_gib;
        let filtered = !request.models.is_any();
        let mut scan = SliceScan {
            best: None,
            largest_free: None,
            largest_total: 0,
            any_model: false,
            most_compute: None,
        };
        for (pos, usage) in self.gpus.iter().enumerate() {
            if filtered && !request.models.allows(&usage.gpu.model) {
                continue;
            }
            scan.any_model = true;
            if !usage.healthy {
                continue;
            }
            let free = usage.free_gib();
            scan.largest_total = scan.largest_total.max(usage.total_gib);
            if scan.largest_free.is_none_or(|(_, most)| free > most) {
                scan.largest_free = Some((usage.index, free));
            }
            if free < need {
                continue;
            }
            if usage.free_compute() < request.compute {
                if scan
                    .most_compute
                    .is_none_or(|(_, most)| usage.free_compute() > most)
                {
                    scan.most_compute = Some((usage.index, usage.free_compute()));
                }
                continue;
            }
            let better = match (scan.best, policy) {
                (None, _) => true,
                (Some((_, chosen)), Policy::Binpack | Policy::Fragmentation) => free < chosen,
                (Some((_, chosen)), Policy::Spread) => free > chosen,
            };
            if better {
                scan.best = Some((pos, free));
            }
        }
        scan
    }

    /// Whether the GPU at `pos` can take a slice of `per_gpu` GiB of a multi-GPU or exclusive
    /// request: healthy, and enough free (exclusive: empty and at least that large).
    fn takes_slice(&self, pos: usize, request: &Request) -> bool {
        let (per_gpu, exclusive) = (request.gib_per_gpu(), request.exclusive);
        let usage = &self.gpus[pos];
        usage.healthy
            && request.models.allows(&usage.gpu.model)
            && if exclusive {
                usage.used_gib == 0 && usage.used_compute == 0 && usage.total_gib >= per_gpu
            } else {
                usage.has_room(per_gpu, request.compute)
            }
    }

    /// The GPUs (positions) a request for N slices, or for whole GPUs, would get, or why it
    /// fits nowhere.
    ///
    /// - N distinct healthy GPUs that each take the slice ([`Node::takes_slice`]).
    /// - The policy applies per slice: binpack takes the GPUs with the least free memory that
    ///   still fit, spread the most; fragmentation packs like binpack here (its measure is
    ///   about one-GPU shapes).
    /// - When the inventory names NUMA nodes, GPUs of one NUMA node are preferred: the group
    ///   that can hold all N and that the policy likes best wins; only when no NUMA node can,
    ///   the GPUs are taken across NUMA nodes.
    /// - The twin rule pins the request to the GPU set of a pending container of the same
    ///   size, exactly as for one GPU.
    fn decide_multi(&self, request: &Request, policy: Policy) -> Result<Choice, Unfit> {
        self.check_node()?;
        let wanted = request.gpus.max(1);
        let per_gpu = request.gib_per_gpu();
        let exclusive = request.exclusive;
        // Never, as things stand (unresolvable), before "retry later".
        if !self
            .gpus
            .iter()
            .any(|u| request.models.allows(&u.gpu.model))
        {
            return Err(self.no_model(request));
        }
        let large_enough = self
            .gpus
            .iter()
            .filter(|u| u.healthy && u.total_gib >= per_gpu && request.models.allows(&u.gpu.model))
            .count();
        if large_enough < wanted as usize {
            return Err(Unfit::TooFewGpus {
                wanted,
                per_gpu,
                exclusive,
                large_enough,
            });
        }
        if let Some((set, size)) = self.pin(request)? {
            return self.decide_multi_pinned(request, set, size);
        }
        let mut fitting: Vec<usize> = (0..self.gpus.len())
            .filter(|&pos| self.takes_slice(pos, request))
            .collect();
        if fitting.len() < wanted as usize {
            return Err(Unfit::TooFewFree {
                wanted,
                per_gpu,
                exclusive,
                compute: request.compute,
                fitting: fitting.len(),
            });
        }
        // Best first under the policy: binpack least free, spread most free; index breaks ties.
        let free = |pos: usize| self.gpus[pos].free_gib();
        match policy {
            Policy::Binpack | Policy::Fragmentation => {
                fitting.sort_by_key(|&pos| (free(pos), self.gpus[pos].index));
            }
            Policy::Spread => {
                fitting.sort_by_key(|&pos| (std::cmp::Reverse(free(pos)), self.gpus[pos].index));
            }
        }
        let mut chosen = self
            .numa_group(&fitting, wanted as usize, policy)
            .unwrap_or_else(|| fitting[..wanted as usize].to_vec());
        let first = chosen.remove(0);
        Ok(Choice {
            first,
            more: chosen,
        })
    }

    /// [`Node::decide_multi`] for a request the twin rule pins to `set` (by a pending
    /// container of `size` GiB): those GPUs if the set has the request's width and each
    /// takes its slice, else why not.
    fn decide_multi_pinned(
        &self,
        request: &Request,
        set: &[u32],
        size: u64,
    ) -> Result<Choice, Unfit> {
        let wanted = request.gpus.max(1);
        if set.len() != wanted as usize {
            return Err(Unfit::TwinShape {
                size,
                gpus: GpuList(set.to_vec()),
                wanted,
            });
        }
        let positions: Vec<Option<usize>> = set.iter().map(|&g| self.position(g)).collect();
        let blocked = positions
            .iter()
            .zip(set.iter())
            .find(|(pos, _)| pos.is_none_or(|pos| !self.takes_slice(pos, request)));
        if let Some((pos, &gpu)) = blocked {
            let usage = pos.map(|pos| &self.gpus[pos]);
            return Err(Unfit::TwinBlocked {
                size,
                gpus: GpuList(vec![gpu]),
                need: request.gib_per_gpu(),
                free: usage.map_or(0, GpuUsage::free_gib),
                healthy: usage.is_some_and(|u| u.healthy),
                compute: usage
                    .and_then(|u| compute_short(u, request.gib_per_gpu(), request.compute)),
            });
        }
        let mut positions = positions.into_iter().flatten();
        let first = positions.next().ok_or(Unfit::NoGpus)?;
        Ok(Choice {
            first,
            more: positions.collect(),
        })
    }

    /// The `wanted` GPUs of one NUMA node the policy likes best, from `fitting` (sorted best
    /// first): per NUMA node its best `wanted`, and among the NUMA nodes that have that many,
    /// the snuggest group under binpack, the roomiest under spread (the first on ties).
    /// `None` when no NUMA node can hold them all (or the inventory names none).
    fn numa_group(&self, fitting: &[usize], wanted: usize, policy: Policy) -> Option<Vec<usize>> {
        let free = |pos: usize| self.gpus[pos].free_gib();
        let mut chosen: Option<Vec<usize>> = None;
        let mut numas: Vec<i64> = fitting
            .iter()
            .filter_map(|&pos| self.gpus[pos].gpu.numa)
            .collect();
        numas.sort_unstable();
        numas.dedup();
        let mut best_key: Option<(u64, u64)> = None;
        for numa in numas {
            let group: Vec<usize> = fitting
                .iter()
                .copied()
                .filter(|&pos| self.gpus[pos].gpu.numa == Some(numa))
                .take(wanted)
                .collect();
            if group.len() < wanted {
                continue;
            }
            let sum: u64 = group.iter().map(|&pos| free(pos)).sum();
            // Binpack wants the snuggest group, spread the roomiest.
            let key = match policy {
                Policy::Spread => (u64::MAX - sum, 0),
                Policy::Binpack | Policy::Fragmentation => (sum, 0),
            };
            if best_key.is_none_or(|best| key < best) {
                best_key = Some(key);
                chosen = Some(group);
            }
        }
        chosen
    }

    /// The GPU set the twin rule pins `request` to, with the container size that pins it.
    pub(super) fn pin(&self, request: &Request) -> Result<Option<(&[u32], u64)>, Unfit> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        let mut pin: Option<(&[u32], u64)> = None;
        for &size in &request.containers {
            let from = (size, GpuSet::default());
            for gpus in self
                .pending
                .range(from..)
                .take_while(|((entry_size, _), _)| *entry_size == size)
                .map(|((_, gpus), _)| &**gpus)
            {
                match pin {
                    None => pin = Some((gpus, size)),
                    Some((pinned, first_size)) if pinned != gpus => {
                        return Err(Unfit::TwinConflict {
                            first_size,
                            first_gpus: GpuList(pinned.to_vec()),
                            second_size: size,
                            second_gpus: GpuList(gpus.to_vec()),
                        });
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(pin)
    }
}

/// `(compute needed, compute free)` when `usage` has `gib` free but not `compute`.
fn compute_short(usage: &GpuUsage, gib: u64, compute: u32) -> Option<(u32, u32)> {
    (usage.free_gib() >= gib && usage.free_compute() < compute)
        .then(|| (compute, usage.free_compute()))
}

/// What [`Node::scan_slice`] found on a node for a one-GPU request.
struct SliceScan {
    /// Position and free GiB of the GPU the policy prefers among those with room.
    best: Option<(usize, u64)>,
    /// Index and free GiB of the healthy allowed GPU with the most free (the first of them).
    largest_free: Option<(u32, u64)>,
    /// GiB of the largest healthy allowed GPU.
    largest_total: u64,
    /// Whether any GPU is of a model the request allows.
    any_model: bool,
    /// Index and free compute of the GPU with the most compute free among those with the
    /// memory free but too little compute (the first of them).
    most_compute: Option<(u32, u32)>,
}

impl SliceScan {
    /// Why no GPU took `request` on a node of `gpus` GPUs: none healthy, none large enough,
    /// all too full for now, or those with the memory free short of compute.
    fn refusal(&self, request: &Request, gpus: usize) -> Unfit {
        let need = request.pod_gib;
        if let (Some((gpu, free)), Some(_)) = (self.most_compute, self.largest_free) {
            return Unfit::ComputeBusy {
                need,
                compute: request.compute,
                free,
                gpu,
            };
        }
        match self.largest_free {
            None => Unfit::AllUnhealthy { count: gpus },
            Some(_) if self.largest_total < need => Unfit::TooLarge {
                need,
                largest_total: self.largest_total,
            },
            Some((gpu, largest_free)) => Unfit::Busy {
                need,
                largest_free,
                gpu,
            },
        }
    }
}
