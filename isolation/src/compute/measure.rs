//! What each held launch took on the GPU, from a pair of CUDA events around it.
//!
//! Events are made per context (an event can only be recorded on a stream of its own
//! context) and kept for reuse: a held launch records two and a program launches thousands
//! of kernels a second. The pairs in flight are looked at, oldest first, at the next held
//! launch of the process and while a launch is held: the first that has not completed
//! stops the look (completions on one stream are in order; across streams, a later one
//! waits for an earlier one, which only delays its count). Past [`MAX_IN_FLIGHT`] the oldest
//! is waited for, so a program that queues without end cannot grow the queue without end.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use super::Charge;
use crate::driver::{CUDA_ERROR_NOT_READY, Cuda, Handle};

/// Launches measured at once per process, at most.
const MAX_IN_FLIGHT: usize = 1024;
/// Spare pairs kept per context.
const MAX_SPARE: usize = 64;
/// `CU_EVENT_DEFAULT`: timing on.
const EVENT_DEFAULT: u32 = 0;

/// A launch being measured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InFlight {
    ctx: u64,
    start: u64,
    end: u64,
    charge: Charge,
}

/// This process's events: spare pairs per context, and the launches in flight.
#[derive(Debug, Default)]
pub(crate) struct Measure {
    spare: FxHashMap<u64, Vec<(u64, u64)>>,
    in_flight: VecDeque<InFlight>,
}

impl Measure {
    /// A pair of timing events of context `ctx` (the current one): a spare, else two made
    /// now; `None` if the driver cannot make them.
    pub(crate) fn take_pair(&mut self, ctx: u64, cuda: &Cuda) -> Option<(u64, u64)> {
        if let Some(pair) = self.spare.get_mut(&ctx).and_then(Vec::pop) {
            return Some(pair);
        }
        let create = cuda.event_create?;
        let mut start: Handle = std::ptr::null_mut();
        let mut end: Handle = std::ptr::null_mut();
        // SAFETY: places for the new events, in the current context.
        let made = unsafe {
            create(&mut start, EVENT_DEFAULT) == 0 && create(&mut end, EVENT_DEFAULT) == 0
        };
        if made {
            Some((start as u64, end as u64))
        } else {
            destroy(cuda, &[start as u64, end as u64]);
            None
        }
    }

    /// Keeps a pair for the next launch in `ctx`.
    pub(crate) fn give_back(&mut self, ctx: u64, pair: (u64, u64), cuda: &Cuda) {
        let spare = self.spare.entry(ctx).or_default();
        if spare.len() < MAX_SPARE {
            spare.push(pair);
        } else {
            destroy(cuda, &[pair.0, pair.1]);
        }
    }

    /// A launch charged `charge` was made between the events of `pair`.
    pub(crate) fn launched(&mut self, ctx: u64, pair: (u64, u64), charge: Charge) {
        self.in_flight.push_back(InFlight {
            ctx,
            start: pair.0,
            end: pair.1,
            charge,
        });
    }

    /// Hands every completed launch, oldest first, to `settle` with what it took (`None`:
    /// it cannot be told, its context is gone); waits for the oldest while there are more
    /// than [`MAX_IN_FLIGHT`].
    pub(crate) fn poll(&mut self, cuda: &Cuda, mut settle: impl FnMut(Charge, Option<u64>)) {
        let (Some(query), Some(elapsed)) = (cuda.event_query, cuda.event_elapsed) else {
            return;
        };
        while let Some(&oldest) = self.in_flight.front() {
            let end = oldest.end as Handle;
            // SAFETY: an event this process made and recorded.
            let mut status = unsafe { query(end) };
            if status == CUDA_ERROR_NOT_READY && self.in_flight.len() > MAX_IN_FLIGHT {
                status = match cuda.event_synchronize {
                    // SAFETY: as above.
                    Some(wait) => unsafe { wait(end) },
                    None => status,
                };
            }
            if status == CUDA_ERROR_NOT_READY {
                return;
            }
            self.in_flight.pop_front();
            let mut ms: f32 = 0.0;
            // SAFETY: a place for the answer and two events this process recorded, in order.
            let took = (status == 0
                && unsafe { elapsed(&mut ms, oldest.start as Handle, end) } == 0)
                .then(|| (f64::from(ms.max(0.0)) * 1e6) as u64);
            if took.is_some() {
                self.give_back(oldest.ctx, (oldest.start, oldest.end), cuda);
            } else {
                destroy(cuda, &[oldest.start, oldest.end]);
            }
            settle(oldest.charge, took);
        }
    }

    /// In a fork child: the parent's events are not the child's.
    pub(crate) fn forget(&mut self) {
        self.spare.clear();
        self.in_flight.clear();
    }
}

/// Destroys events (errors ignored: a dead context took them with it).
pub(crate) fn destroy(cuda: &Cuda, events: &[u64]) {
    if let Some(destroy) = cuda.event_destroy {
        for &event in events.iter().filter(|e| **e != 0) {
            // SAFETY: an event this process made, destroyed once.
            unsafe { destroy(event as Handle) };
        }
    }
}
