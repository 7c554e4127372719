//! Ports on 127.0.0.1 for the servers the harness starts: any free one, or one a server can
//! restart on without an outgoing connection taking it meanwhile.
//!
//! Separate because both the cluster and tests that start their own replicas pick ports.

use std::net::TcpListener;

use anyhow::bail;

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests on one machine).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A port on 127.0.0.1 for a server that restarts on the same address: free now, and below
/// the kernel's ephemeral range, so that no outgoing connection and no [`free_port`] takes it
/// while the server is down.
pub fn service_port() -> anyhow::Result<u16> {
    use rand::Rng;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let (low, high) = (
        ephemeral_low.saturating_sub(12_000).max(1024),
        ephemeral_low,
    );
    let mut rng = rand::rng();
    for _ in 0..100 {
        let port = rng.random_range(low..high);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port between {low} and {high}")
}
