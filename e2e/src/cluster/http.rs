//! A minimal HTTP/1.1 client: one request per connection, answer read to the end, chunked
//! bodies joined. Enough for health probes and the extender's calls, with no client library.
//!
//! Separate because it is plain protocol code, used by the extender handle and the tests;
//! chunked bodies are joined by [`crate::chunked`], which the API server's webhook client
//! shares.

use std::net::SocketAddr;

use anyhow::Context;

use crate::chunked::dechunk;

/// A minimal HTTP/1.1 GET over a fresh connection (no client library needed for two probes).
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    http_exchange(addr, &get_request(addr, path)).await
}

pub(super) fn get_request(addr: SocketAddr, path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
}

/// A minimal HTTP/1.1 POST of a JSON `body` over a fresh connection.
pub async fn http_post_json(
    addr: SocketAddr,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    http_exchange(addr, &post_json_request(addr, path, body)).await
}

pub(super) fn post_json_request(addr: SocketAddr, path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `request` and reads the answer to the end: status and (de-chunked) body.
pub(super) async fn http_exchange(
    addr: SocketAddr,
    request: &str,
) -> anyhow::Result<(u16, String)> {
    exchange_on(tokio::net::TcpStream::connect(addr).await?, request).await
}

/// [`http_exchange`] on an open stream (plain or TLS; the API server's webhook calls too).
pub(crate) async fn exchange_on(
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    request: &str,
) -> anyhow::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    match stream.read_to_end(&mut raw).await {
        Ok(_) => {}
        // A TLS peer that closes without close_notify after a whole answer: the answer stands.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e.into()),
    }
    let text = String::from_utf8_lossy(&raw);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("malformed HTTP answer")?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let body = if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Ok((status, body))
}
