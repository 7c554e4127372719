//! A spin lock that `fork` can take and give back by hand.
//!
//! `std::sync::Mutex` cannot be taken in an atfork handler and released in the child: the
//! atfork handlers take every lock the interposer has before the fork and let go after it in
//! both processes, so the child never inherits a lock held by a thread that does not exist
//! there. Critical sections are a few map operations long.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is only reached by the thread that holds `locked`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    pub(crate) fn raw_lock(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// # Safety
    /// The caller holds the lock (took it with `raw_lock`) and keeps no reference into it.
    pub(crate) unsafe fn raw_unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// The value without the lock.
    ///
    /// # Safety
    /// The caller holds the lock (by `raw_lock`) and no other reference into it lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn locked_value(&self) -> &mut T {
        // SAFETY: the caller holds the lock and the only reference.
        unsafe { &mut *self.value.get() }
    }

    pub(crate) fn lock(&self) -> Guard<'_, T> {
        self.raw_lock();
        Guard { lock: self }
    }
}

pub(crate) struct Guard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard holds the lock, and &mut self makes this the only reference.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the guard took the lock and its borrows end with it.
        unsafe { self.lock.raw_unlock() };
    }
}
