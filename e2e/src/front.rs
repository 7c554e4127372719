//! A round-robin TCP front, as a ClusterIP Service is to kube-scheduler: each new connection
//! goes to the next backend in turn and stays there (kube-scheduler keeps its connections
//! alive, so it talks to one replica until that connection breaks). TLS passes through
//! untouched: the replicas' certificate is the Service's.
//!
//! One liberty: a backend that refuses the connection (its process is dead) is skipped at
//! once, as if the endpoints controller had already removed it; in a real cluster that takes
//! a readiness period or two, during which some calls fail and kube-scheduler retries.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// The front: a listener and the backends it spreads connections over.
pub struct Front {
    addr: SocketAddr,
    backends: Arc<Mutex<Vec<SocketAddr>>>,
    task: JoinHandle<()>,
}

impl Front {
    /// Listens on `listen` (retrying for up to 10 s while the port is still held, e.g. by a
    /// process just killed) and spreads connections over `backends`.
    pub async fn start(listen: SocketAddr, backends: Vec<SocketAddr>) -> anyhow::Result<Self> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match TcpListener::bind(listen).await {
                Ok(listener) => break listener,
                Err(error) if tokio::time::Instant::now() < deadline => {
                    tracing::debug!(%error, %listen, "front: port still held; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => return Err(error.into()),
            }
        };
        let addr = listener.local_addr()?;
        let backends = Arc::new(Mutex::new(backends));
        let task = tokio::spawn(accept(listener, backends.clone()));
        Ok(Self {
            addr,
            backends,
            task,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replaces the backends (new connections only; open ones stay where they are).
    pub fn set_backends(&self, backends: Vec<SocketAddr>) {
        *self.backends.lock().unwrap_or_else(|e| e.into_inner()) = backends;
    }
}

impl Drop for Front {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, backends: Arc<Mutex<Vec<SocketAddr>>>) {
    let next = AtomicUsize::new(0);
    let mut connections = JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let list = backends.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let first = next.fetch_add(1, Ordering::Relaxed);
        connections.spawn(async move {
            for i in 0..list.len() {
                let backend = list[(first + i) % list.len()];
                if let Ok(mut server) = TcpStream::connect(backend).await {
                    let _ = server.set_nodelay(true);
                    let mut client = client;
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    return;
                }
            }
        });
        // Reap finished connections so the set does not grow without bound.
        while connections.try_join_next().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_name(name: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let _ = stream.write_all(name.as_bytes()).await;
            }
        });
        addr
    }

    async fn ask(addr: SocketAddr) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut out = String::new();
        let _ = stream.read_to_string(&mut out).await;
        out
    }

    #[tokio::test]
    async fn connections_take_turns_and_a_dead_backend_is_skipped() {
        let a = echo_name("a").await;
        let b = echo_name("b").await;
        let front = Front::start("127.0.0.1:0".parse().unwrap(), vec![a, b])
            .await
            .unwrap();
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(ask(front.addr()).await);
        }
        assert_eq!(seen, ["a", "b", "a", "b"]);
        // A port nobody listens on: refused, skipped.
        let dead = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        front.set_backends(vec![dead, b]);
        for _ in 0..3 {
            assert_eq!(ask(front.addr()).await, "b");
        }
    }
}
