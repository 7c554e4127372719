//! The supervisor: a binary's long-lived tasks (servers, watches, workers) run until shutdown,
//! and one that ends or panics before it ends the process loudly, rather than leaving it up
//! with part of it gone (a pod watch that died would leave Allocate answering from a frozen
//! view).

use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;

/// Why the supervised tasks stopped other than by shutdown.
#[derive(Debug, thiserror::Error)]
pub enum Stopped<E: std::error::Error + 'static> {
    /// A task returned before shutdown was asked for.
    #[error("{0} ended before shutdown")]
    Ended(&'static str),
    /// A task panicked.
    #[error("{task} crashed: {source}")]
    Crashed {
        /// The task's name.
        task: &'static str,
        /// Its panic.
        #[source]
        source: JoinError,
    },
    /// A task returned an error.
    #[error("{task} failed: {error}")]
    Failed {
        /// The task's name.
        task: &'static str,
        /// What it returned.
        #[source]
        error: E,
    },
}

/// A task that returns nothing, as [`supervise`] takes it: its panic stays a panic (so
/// [`supervise`] reports it as [`Stopped::Crashed`]); an abort counts as its end.
pub fn as_supervised<E: Send + 'static>(task: JoinHandle<()>) -> JoinHandle<Result<(), E>> {
    tokio::spawn(async move {
        match task.await {
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            _ => Ok(()),
        }
    })
}

/// Waits for the first of `tasks` to end; anything but a clean end once `token` is cancelled
/// (shutdown) is an error, logged. Then cancels `token`, so the others stop, and waits for
/// them (their errors during shutdown are logged, not returned).
pub async fn supervise<E: std::error::Error + Send + 'static>(
    tasks: Vec<(&'static str, JoinHandle<Result<(), E>>)>,
    token: CancellationToken,
) -> Result<(), Stopped<E>> {
    if tasks.is_empty() {
        token.cancelled().await;
        return Ok(());
    }
    let (names, handles): (Vec<_>, Vec<_>) = tasks.into_iter().unzip();
    let (first, index, rest) = futures::future::select_all(handles).await;
    let task = names[index];
    let outcome = match first {
        Ok(Ok(())) if token.is_cancelled() => Ok(()),
        Ok(Ok(())) => Err(Stopped::Ended(task)),
        Ok(Err(error)) => Err(Stopped::Failed { task, error }),
        Err(source) => Err(Stopped::Crashed { task, source }),
    };
    if let Err(error) = &outcome {
        tracing::error!(task, %error, "stopping");
    }
    token.cancel();
    for handle in rest {
        if let Ok(Err(error)) = handle.await {
            tracing::warn!(%error, "task failed during shutdown");
        }
    }
    outcome
}

/// Named long-lived tasks owned together: each is aborted when the set is dropped (so
/// dropping a server's future stops everything it started), and [`TaskSet::first_ended`]
/// names the first to end. For an owner whose shutdown has an order of its own (the
/// extender hands its Lease over before its servers drain), where [`supervise`]'s single
/// token would stop everything at once.
#[derive(Debug, Default)]
pub struct TaskSet {
    tasks: Vec<(&'static str, JoinHandle<()>)>,
}

impl TaskSet {
    /// Spawns `task` under `name`.
    pub fn spawn(
        &mut self,
        name: &'static str,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        self.tasks.push((name, tokio::spawn(task)));
    }

    /// Waits for the first task to end (return, panic or abort) and names it; it leaves the
    /// set. Never completes while the set is empty.
    pub async fn first_ended(&mut self) -> &'static str {
        if self.tasks.is_empty() {
            return std::future::pending().await;
        }
        let ended = {
            let handles = self.tasks.iter_mut().map(|(_, handle)| handle);
            let (_, index, _) = futures::future::select_all(handles).await;
            index
        };
        let (name, _) = self.tasks.swap_remove(ended);
        name
    }

    /// Takes the task named `name` out of the set (it is no longer aborted with the set),
    /// to wait for it on its own.
    pub fn take(&mut self, name: &str) -> Option<JoinHandle<()>> {
        let index = self.tasks.iter().position(|(n, _)| *n == name)?;
        Some(self.tasks.swap_remove(index).1)
    }
}

impl Drop for TaskSet {
    fn drop(&mut self) {
        for (_, handle) in &self.tasks {
            handle.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("broken")]
    struct Broken;

    fn waits(token: CancellationToken) -> JoinHandle<Result<(), Broken>> {
        tokio::spawn(async move {
            token.cancelled().await;
            Ok(())
        })
    }

    /// A long-lived task that ends before shutdown stops the rest, naming it; one that
    /// panics is a crash; one that fails hands its error up; the same end after shutdown is
    /// clean.
    #[tokio::test]
    async fn the_first_task_to_end_before_shutdown_stops_them_all() {
        let token = CancellationToken::new();
        let tasks = vec![
            ("server", waits(token.clone())),
            ("pod watch", tokio::spawn(async { Ok(()) })),
        ];
        let outcome = supervise(tasks, token.clone()).await;
        assert!(
            matches!(outcome, Err(Stopped::Ended("pod watch"))),
            "{outcome:?}"
        );
        assert!(token.is_cancelled());

        let token = CancellationToken::new();
        let panics = as_supervised(tokio::spawn(async {
            panic!("the watch stream broke");
        }));
        let outcome = supervise(
            vec![("server", waits(token.clone())), ("pod watch", panics)],
            token,
        )
        .await;
        assert!(
            matches!(
                outcome,
                Err(Stopped::Crashed {
                    task: "pod watch",
                    ..
                })
            ),
            "{outcome:?}"
        );

        let token = CancellationToken::new();
        let fails = tokio::spawn(async { Err(Broken) });
        let outcome = supervise(
            vec![("server", waits(token.clone())), ("worker", fails)],
            token,
        )
        .await;
        assert!(
            matches!(
                outcome,
                Err(Stopped::Failed {
                    task: "worker",
                    error: Broken
                })
            ),
            "{outcome:?}"
        );

        let token = CancellationToken::new();
        token.cancel();
        let outcome = supervise(vec![("server", waits(token.clone()))], token).await;
        assert!(outcome.is_ok(), "{outcome:?}");
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
        for _ in 0..100 {
            if still_held.is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(still_held.is_finished());
        assert!(!waiting.is_finished() && !server.is_finished());
        waiting.abort();
        server.abort();
    }
}
