//! Reclaiming the slots of dead processes, so that what a process held when it died without
//! freeing goes back to the container.
//!
//! - Liveness: a marked slot's holder is alive exactly while its lock is held, asked with
//!   one `F_OFD_GETLK` through the budget's own descriptor (which holds no slot lock): the
//!   kernel drops the lock when the holder dies or `exec`s, whatever PID namespace it lived
//!   in and whatever its pid is reused for. An unmarked slot is dead when `kill(pid, 0)`
//!   fails with ESRCH, or the process is a zombie, or its start time differs (the pid was
//!   reused): that only holds within one PID namespace. A slot seen alive within 50 ms is
//!   not asked about again.
//! - Reclaim: a dead slot is taken by CAS to `u32::MAX`, its bytes are subtracted from the
//!   totals, its mark cleared, and it is freed. Run when an allocation would otherwise be
//!   refused and whenever memory is queried.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use gpushare_isolation_budget::layout::{RECLAIMING, SLOTS};

use super::Budget;

/// One slot's last proof of life, see [`Budget::reclaim_dead`].
#[derive(Default)]
pub(super) struct SeenAlive {
    pid: AtomicU32,
    start: AtomicU64,
    /// Milliseconds after the budget's epoch, plus one; 0 never.
    at_ms: AtomicU64,
}

/// How long a process seen alive through `/proc` is taken as alive while `kill(pid, 0)`
/// still finds it.
const SEEN_ALIVE_MS: u64 = 1000;
/// How long a process seen alive through `/proc` is taken as alive without asking: a
/// process that dies is reclaimed at most this much later (refusals come in bursts, an
/// allocator retrying after it emptied its cache).
const TRUSTED_ALIVE_MS: u64 = 50;

impl Budget {
    /// Frees the slots of dead processes and gives their bytes back; returns those bytes.
    pub fn reclaim_dead(&self) -> u64 {
        self.reclaim_dead_holding(None)
    }

    /// As [`reclaim_dead`](Self::reclaim_dead), looking only at slots that hold bytes on
    /// `gpu` when one is named (a refused allocation there gains nothing from the others).
    ///
    /// Cheap enough for the refusal path: a slot seen alive within the last 50 ms is not
    /// asked about at all. A slot marked [`SLOT_LOCKED`] is alive while its lock is held
    /// (one `F_OFD_GETLK`, whatever PID namespace its holder is in). Any other is judged by
    /// pid: `/proc/PID/stat` (zombie, reused pid) is read only for a process this one has
    /// not seen alive under the same pid and start time in the last second; within that
    /// second it is asked with `kill(pid, 0)`.
    ///
    /// [`SLOT_LOCKED`]: gpushare_isolation_budget::layout::SLOT_LOCKED
    pub fn reclaim_dead_holding(&self, gpu: Option<usize>) -> u64 {
        let mut reclaimed = 0;
        // Milliseconds after the epoch plus one, read once a pass (a clock read each slot
        // would be most of a refusal's cost).
        let mut now = None;
        for slot in 0..SLOTS {
            let p = self.slot_pid(slot);
            let pid = p.load(Ordering::Acquire);
            if pid == 0 || pid == RECLAIMING {
                continue;
            }
            if let Some(gpu) = gpu
                && self.slot_bytes(slot, gpu) == 0
            {
                continue;
            }
            let start = self.slot_start(slot).load(Ordering::Acquire);
            let now = *now.get_or_insert_with(|| self.epoch.elapsed().as_millis() as u64 + 1);
            if !self.is_dead(slot, pid, start, now) {
                continue;
            }
            if p.compare_exchange(pid, RECLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            reclaimed += self.empty_reclaimed(slot);
        }
        reclaimed
    }

    /// Whether the process in `slot` is gone at `now` (milliseconds after the epoch, plus
    /// one), remembering a proof of life (see
    /// [`reclaim_dead_holding`](Self::reclaim_dead_holding)).
    fn is_dead(&self, slot: usize, pid: u32, start: u64, now: u64) -> bool {
        let seen = &self.seen_alive[slot];
        let at = seen.at_ms.load(Ordering::Acquire);
        let age = (at != 0
            && seen.pid.load(Ordering::Relaxed) == pid
            && seen.start.load(Ordering::Relaxed) == start)
            .then(|| now.saturating_sub(at));
        // Seen alive a moment ago: no system call at all.
        if age.is_some_and(|age| age < TRUSTED_ALIVE_MS) {
            return false;
        }
        let dead = match self.slot_lock_held(slot) {
            // A lock tells, whatever the pid means here.
            Some(held) => !held,
            None => match age {
                // Seen alive lately: only whether it still exists.
                Some(age) if age < SEEN_ALIVE_MS => return !process_exists(pid),
                _ => process_is_dead(pid, start),
            },
        };
        if !dead {
            seen.at_ms.store(0, Ordering::Release);
            seen.pid.store(pid, Ordering::Relaxed);
            seen.start.store(start, Ordering::Relaxed);
            seen.at_ms.store(now, Ordering::Release);
        }
        dead
    }
}

/// `(state, start time)` of `pid` from `/proc/PID/stat`, `None` if unreadable.
pub(crate) fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3) come fields 4..; the start time is field 22.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether a process `pid` exists (a zombie does): `kill(pid, 0)` does not answer ESRCH.
fn process_exists(pid: u32) -> bool {
    let Ok(pid_t) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let answered = unsafe { libc::kill(pid_t, 0) };
    answered == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether process `pid`, started at `start_time` (0 unknown), is gone.
pub(crate) fn process_is_dead(pid: u32, start_time: u64) -> bool {
    if !process_exists(pid) {
        return true;
    }
    match proc_stat(pid) {
        Some((state, _)) if state == 'Z' || state == 'X' => true,
        Some((_, start)) => start_time != 0 && start != start_time,
        None => false,
    }
}

/// This process's pid and start time (0 if /proc cannot tell).
pub(crate) fn this_process() -> (u32, u64) {
    let pid = std::process::id();
    (pid, proc_stat(pid).map(|(_, start)| start).unwrap_or(0))
}
