//! The supervisor: a binary's long-lived tasks (servers, watches, workers) run until shutdown,
//! and one that ends or panics before it ends the process loudly, rather than leaving it up
//! with part of it gone (a pod watch that died would leave Allocate answering from a frozen
//! view).
//!
//! The extender, the device plugin and the DRA plugin run their tasks the same way:
//!
//! ```text
//!   tasks = TaskSet::default(); tasks.spawn("pod watch", …) …   named, owned by the set
//!   tasks.until_shutdown(shutdown)             Ok at shutdown; the first task to end before
//!                                              it: its error, or TaskStopped, logged
//!   (the extender selects on first_ended itself: any end of its tasks is an error there)
//!   then stop in the binary's own order:  take(name) and await the tasks that go first
//!                                         (the extender's Lease, the DRA plugin's health),
//!                                         join_all() the rest, or drop the set (aborts them)
//! ```
//!
//! Why the owner and not the set decides the order: each binary's shutdown has one of its
//! own (the extender hands its Lease over before its servers drain; the DRA plugin stops
//! re-publishing health before its sockets go), which one cancellation for all could not say.

use std::future::Future;

use tokio::task::{JoinError, JoinHandle};

/// A supervised task that stopped before shutdown without an error of its own.
#[derive(Debug, thiserror::Error)]
pub enum TaskStopped {
    /// It returned.
    #[error("the {0} task ended before shutdown")]
    Ended(&'static str),
    /// It panicked.
    #[error("the {task} task crashed: {source}")]
    Crashed {
        /// Which task.
        task: &'static str,
        /// The panic.
        #[source]
        source: JoinError,
    },
}

/// Named long-lived tasks owned together: each is aborted when the set is dropped (so
/// dropping a server's future stops everything it started), and [`TaskSet::first_ended`]
/// names the first to end. `T` is what each task returns: `()`, or a `Result` for tasks that
/// can fail, whose error [`TaskSet::first_outcome`] hands back with the task's name.
#[derive(Debug)]
pub struct TaskSet<T = ()> {
    /// In the order they were spawned.
    tasks: Vec<(&'static str, JoinHandle<T>)>,
}

impl<T> Default for TaskSet<T> {
    fn default() -> Self {
        Self { tasks: Vec::new() }
    }
}

impl<T: Send + 'static> TaskSet<T> {
    /// Spawns `task` under `name`.
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = T> + Send + 'static) {
        self.tasks.push((name, tokio::spawn(task)));
    }

    /// Waits for the first task to end (return, panic or abort) and names it; it leaves the
    /// set. Never completes while the set is empty.
    pub async fn first_ended(&mut self) -> &'static str {
        self.first_outcome().await.0
    }

    /// Like [`TaskSet::first_ended`], with how the task ended: what it returned, or its panic
    /// (or abort) as the `Err`.
    pub async fn first_outcome(&mut self) -> (&'static str, Result<T, JoinError>) {
        if self.tasks.is_empty() {
            return std::future::pending().await;
        }
        let (outcome, ended) = {
            let handles = self.tasks.iter_mut().map(|(_, handle)| handle);
            let (outcome, index, _) = futures::future::select_all(handles).await;
            (outcome, index)
        };
        let (name, _) = self.tasks.remove(ended);
        (name, outcome)
    }

    /// Takes the task named `name` out of the set (it is no longer aborted with the set),
    /// to wait for it on its own. `None` when there is none, or it already ended.
    pub fn take(&mut self, name: &str) -> Option<JoinHandle<T>> {
        let index = self.tasks.iter().position(|(n, _)| *n == name)?;
        Some(self.tasks.remove(index).1)
    }

    /// Waits for every task left, one after the other in the order they were spawned, and
    /// names each with how it ended. For the end of a shutdown the owner has already asked
    /// for: a task that does not stop keeps this waiting. Dropped before it completes, it
    /// aborts the tasks not yet awaited, as dropping the set does.
    pub async fn join_all(mut self) -> Vec<(&'static str, Result<T, JoinError>)> {
        let mut ended = Vec::with_capacity(self.tasks.len());
        while let Some((_, handle)) = self.tasks.first_mut() {
            let outcome = handle.await;
            let (name, _) = self.tasks.remove(0);
            ended.push((name, outcome));
        }
        ended
    }
}

impl<E> TaskSet<Result<(), E>>
where
    E: std::fmt::Display + From<TaskStopped> + Send + 'static,
{
    /// Runs until `shutdown` (`Ok`) or until a task ends first: then its error, or a
    /// [`TaskStopped`] when it returned or panicked, logged with the task's name. The tasks
    /// left stay in the set, for the owner to stop in its own order.
    pub async fn until_shutdown(&mut self, shutdown: impl Future<Output = ()>) -> Result<(), E> {
        tokio::select! {
            () = shutdown => Ok(()),
            (task, ended) = self.first_outcome() => {
                let error = match ended {
                    Ok(Ok(())) => E::from(TaskStopped::Ended(task)),
                    Ok(Err(error)) => error,
                    Err(source) => E::from(TaskStopped::Crashed { task, source }),
                };
                tracing::error!(task, %error, "stopping");
                Err(error)
            }
        }
    }
}

impl<T> Drop for TaskSet<T> {
    fn drop(&mut self) {
        for (_, handle) in &self.tasks {
            handle.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::*;

    #[derive(Debug, PartialEq, Eq)]
    struct Broken;

    /// The first task to end comes back named, with how it ended: a clean return, its
    /// error, or its panic; the others stay in the set.
    #[tokio::test]
    async fn the_first_task_to_end_is_named_with_how_it_ended() {
        let mut set: TaskSet<Result<(), Broken>> = TaskSet::default();
        set.spawn("server", std::future::pending());
        set.spawn("pod watch", async { Ok(()) });
        let (task, outcome) = set.first_outcome().await;
        assert_eq!(task, "pod watch");
        assert!(matches!(outcome, Ok(Ok(()))), "{outcome:?}");

        set.spawn("worker", async { Err(Broken) });
        let (task, outcome) = set.first_outcome().await;
        assert_eq!(task, "worker");
        assert!(matches!(outcome, Ok(Err(Broken))), "{outcome:?}");

        set.spawn("reflector", async { panic!("the watch stream broke") });
        let (task, outcome) = set.first_outcome().await;
        assert_eq!(task, "reflector");
        assert!(outcome.is_err_and(|join| join.is_panic()));

        let names: Vec<_> = set.tasks.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["server"]);
    }

    /// The set names the first task to end, and aborts the rest when dropped.
    #[tokio::test]
    async fn a_task_set_names_the_first_to_end_and_aborts_the_rest_when_dropped() {
        let mut set = TaskSet::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        set.spawn("server", std::future::pending());
        set.spawn("pod watch", async {
            let _ = rx.await;
        });
        let waiting = set.take("server").unwrap();
        set.spawn("server", std::future::pending());
        drop(tx);
        assert_eq!(set.first_ended().await, "pod watch");
        assert!(set.take("pod watch").is_none());
        let server = set.take("server").unwrap();
        set.spawn("server", async {});
        assert_eq!(set.first_ended().await, "server");
        set.spawn("server", std::future::pending());
        let still_held = set.tasks[0].1.abort_handle();
        drop(set);
        wait_finished(&still_held).await;
        assert!(!waiting.is_finished() && !server.is_finished());
        waiting.abort();
        server.abort();
    }

    /// At the end of a shutdown every task left is waited for, and comes back in the order
    /// it was spawned (not the order it ended in), named with how it ended; dropped before
    /// it is done, the wait aborts what it has not awaited yet.
    #[tokio::test]
    async fn join_all_waits_for_the_rest_in_spawn_order() {
        let token = CancellationToken::new();
        let stops = |result| {
            let token = token.clone();
            async move {
                token.cancelled().await;
                result
            }
        };
        let mut set = TaskSet::default();
        set.spawn("probes", stops(Ok(())));
        set.spawn("dra", stops(Err(Broken)));
        set.spawn("already done", async { Ok(()) });
        token.cancel();
        let ended: Vec<_> = set
            .join_all()
            .await
            .into_iter()
            .map(|(name, outcome)| (name, outcome.unwrap()))
            .collect();
        assert_eq!(
            ended,
            [
                ("probes", Ok(())),
                ("dra", Err(Broken)),
                ("already done", Ok(()))
            ]
        );

        let mut set = TaskSet::default();
        set.spawn("stuck", std::future::pending::<()>());
        let stuck = set.tasks[0].1.abort_handle();
        let gave_up = tokio::time::timeout(Duration::ZERO, set.join_all()).await;
        assert!(gave_up.is_err());
        wait_finished(&stuck).await;
    }

    /// Yields until the aborted task behind `handle` is gone (an abort lands at the task's
    /// next poll).
    async fn wait_finished(handle: &tokio::task::AbortHandle) {
        for _ in 0..100 {
            if handle.is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(handle.is_finished());
    }

    #[derive(Debug, thiserror::Error)]
    enum Failed {
        #[error("own: {0}")]
        Own(&'static str),
        #[error(transparent)]
        Stopped(#[from] TaskStopped),
    }

    /// `until_shutdown`: a clean end at shutdown; before it, the first task to end stops the
    /// owner, with its own error or why it stopped, and the others stay in the set.
    #[tokio::test]
    async fn until_shutdown_hands_up_the_first_end_before_shutdown() {
        let mut set: TaskSet<Result<(), Failed>> = TaskSet::default();
        set.spawn("server", std::future::pending());
        assert!(set.until_shutdown(std::future::ready(())).await.is_ok());

        set.spawn("pod watch", async { Ok(()) });
        let outcome = set.until_shutdown(std::future::pending()).await;
        assert!(
            matches!(
                outcome,
                Err(Failed::Stopped(TaskStopped::Ended("pod watch")))
            ),
            "{outcome:?}"
        );
        set.spawn("keyring", async { Err(Failed::Own("unreadable")) });
        let outcome = set.until_shutdown(std::future::pending()).await;
        assert!(
            matches!(outcome, Err(Failed::Own("unreadable"))),
            "{outcome:?}"
        );
        set.spawn("reflector", async { panic!("the watch stream broke") });
        let outcome = set.until_shutdown(std::future::pending()).await;
        assert!(
            matches!(
                outcome,
                Err(Failed::Stopped(TaskStopped::Crashed {
                    task: "reflector",
                    ..
                }))
            ),
            "{outcome:?}"
        );
        let names: Vec<_> = set.tasks.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["server"]);
    }
}
