//! The one place the core takes its synchronisation primitives from.
//!
//! Under `cfg(loom)` every atomic, lock and `Arc` comes from loom so that the loom models in
//! `tests/loom_rendezvous.rs` explore every interleaving of the real code, not of a copy.
//! Build them with `RUSTFLAGS="--cfg loom" cargo test -p kvpush-core --test loom_rendezvous --release`.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicUsize, Ordering},
    Mutex, MutexGuard,
};

#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Mutex, MutexGuard,
};

/// Locks `mutex`, recovering the guard if another thread panicked while holding it.
///
/// Every critical section in the core leaves its data consistent before it can panic (they are
/// O(1) map operations), so a poisoned lock carries no torn state and refusing service forever
/// would only turn one bug into an outage.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// `T` alone on its cache line (two 64-byte lines: x86's spatial prefetcher pulls pairs, and
/// some Arm cores have 128-byte lines), so that a value one thread writes often does not slow
/// down another thread reading or writing its neighbours (false sharing).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}
