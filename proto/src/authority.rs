//! Rewrites the HTTP/2 `:authority` of the requests a gRPC server reads, before `h2` sees them.
//!
//! kubelet's plugin watcher dials a registration socket with grpc-go's
//! `grpc.DialContext(ctx, socketPath, ..)` and no `WithAuthority`, so its requests carry the
//! socket path (`/var/lib/kubelet/plugins_registry/<driver>-reg.sock`) as `:authority`. `h2`,
//! under tonic, refuses a value that is not a URI authority and resets the stream with
//! PROTOCOL_ERROR (hyperium/h2#487, still open), and kubelet logs `RegisterPlugin error --
//! failed to get plugin info using RPC GetInfo ... RST_STREAM with error code: PROTOCOL_ERROR`.
//! grpc-java, bazel and older grpcurl send such authorities too.
//!
//! [`RewriteAuthority`] sits between the socket and `h2` and touches header blocks only:
//!
//! ```text
//!  client ──▶ RewriteAuthority ──▶ h2 (tonic server)
//!             preface, SETTINGS, DATA, ..  byte for byte
//!             HEADERS + CONTINUATION       HPACK-decoded with the client's dynamic table,
//!                                          `:authority` rewritten, re-encoded without the
//!                                          dynamic table (h2's own table stays empty)
//! ```
//!
//! Servers take their connections from [`unix_incoming`]. [`connect_with_authority`] is the
//! other side: a client that sends a chosen `:authority`, as kubelet does, for tests.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use fluke_hpack::Decoder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::{Stream, StreamExt, wrappers::UnixListenerStream};
use tonic::transport::server::Connected;

const PREFACE_LEN: usize = 24;
const FRAME_HEAD: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// HTTP/2's default SETTINGS_MAX_FRAME_SIZE: the largest frame every peer accepts.
const MAX_FRAME: usize = 16_384;
/// HTTP/2's default SETTINGS_HEADER_TABLE_SIZE, which tonic's server keeps: the most a client
/// may grow its dynamic table to.
const HEADER_TABLE_SIZE: usize = 4_096;
/// The largest header block accepted, encoded or decoded (a field counts name + value + 32,
/// as in RFC 7541 section 4.1).
const MAX_BLOCK: usize = 1 << 20;
/// The request entries at the top of HPACK's static table (RFC 7541 appendix A); an entry's
/// index is its position + 1.
const STATIC: [(&[u8], &[u8]); 7] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
];

/// What to do with a request's `:authority`: `None` keeps it, `Some` replaces it.
pub type Rewrite = Arc<dyn Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync>;

/// The server side's rewrite: an `:authority` that `h2` would refuse (not a URI authority)
/// becomes `localhost`, as grpc-go's own server would read it; a valid one is kept.
pub fn localhost_unless_valid(authority: &[u8]) -> Option<Vec<u8>> {
    http::uri::Authority::try_from(authority)
        .is_err()
        .then(|| b"localhost".to_vec())
}

/// A connection whose inbound HTTP/2 header blocks carry a rewritten `:authority`; writes pass
/// through. Malformed input ends the connection with [`io::ErrorKind::InvalidData`], as `h2`
/// would end it.
pub struct RewriteAuthority<S> {
    io: S,
    rewrite: Rewrite,
    /// The client's HPACK context: it must see every header block, in order.
    decoder: Decoder<'static>,
    /// Read from `io`, not yet parsed.
    raw: BytesMut,
    /// Parsed (and rewritten), not yet handed to the reader.
    parsed: BytesMut,
    /// Bytes to pass through as they are: the rest of the preface or of a frame's payload.
    passthrough: usize,
    /// A header block waiting for its CONTINUATION frames.
    block: Option<Block>,
}

struct Block {
    stream: u32,
    /// END_STREAM and PRIORITY, as the HEADERS frame had them.
    flags: u8,
    /// The PRIORITY fields, when present.
    priority: Vec<u8>,
    fragment: Vec<u8>,
}

impl<S> RewriteAuthority<S> {
    /// Wraps `io`, rewriting each request's `:authority` with `rewrite`.
    pub fn new(io: S, rewrite: impl Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync + 'static) -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Self {
            io,
            rewrite: Arc::new(rewrite),
            decoder,
            raw: BytesMut::new(),
            parsed: BytesMut::new(),
            passthrough: PREFACE_LEN,
            block: None,
        }
    }

    /// Wraps `io`, sending `authority` as every request's `:authority`, whatever it was.
    pub fn fixed(io: S, authority: impl Into<Vec<u8>>) -> Self {
        let authority = authority.into();
        Self::new(io, move |_| Some(authority.clone()))
    }

    /// Moves what `raw` holds, as far as it is complete, into `parsed`.
    fn parse(&mut self) -> io::Result<()> {
        loop {
            if self.passthrough > 0 {
                let n = self.passthrough.min(self.raw.len());
                if n == 0 {
                    return Ok(());
                }
                self.parsed.extend_from_slice(&self.raw.split_to(n));
                self.passthrough -= n;
                continue;
            }
            let Some(head) = self.raw.get(..FRAME_HEAD) else {
                return Ok(());
            };
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            if kind != HEADERS && kind != CONTINUATION {
                if self.block.is_some() {
                    return Err(invalid("a header block interrupted by another frame"));
                }
                self.parsed
                    .extend_from_slice(&self.raw.split_to(FRAME_HEAD));
                self.passthrough = len;
                continue;
            }
            if len > MAX_BLOCK {
                return Err(invalid("a header frame over 1 MiB"));
            }
            if self.raw.len() < FRAME_HEAD + len {
                return Ok(());
            }
            let frame = self.raw.split_to(FRAME_HEAD + len);
            let payload = &frame[FRAME_HEAD..];
            let block = match (kind, self.block.take()) {
                (HEADERS, None) => Block::new(stream, flags, payload)?,
                (CONTINUATION, Some(mut block)) if block.stream == stream => {
                    block.fragment.extend_from_slice(payload);
                    block
                }
                _ => return Err(invalid("a CONTINUATION frame out of place")),
            };
            if block.fragment.len() > MAX_BLOCK {
                return Err(invalid("a header block over 1 MiB"));
            }
            if flags & END_HEADERS == 0 {
                self.block = Some(block);
                continue;
            }
            let mut fields = self.decode(&block.fragment)?;
            for (name, value) in &mut fields {
                if name == b":authority"
                    && let Some(rewritten) = (self.rewrite)(value)
                {
                    *value = rewritten;
                }
            }
            let mut payload = block.priority;
            encode(&fields, &mut payload);
            put_frames(&mut self.parsed, block.stream, block.flags, &payload);
        }
    }

    fn decode(&mut self, fragment: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        // fluke-hpack unwraps the integer of a table size update: walk the block first, so that
        // a malformed integer is an error rather than a panic.
        check_integers(fragment).ok_or_else(|| invalid("HPACK: a malformed integer"))?;
        let (mut fields, mut size) = (Vec::new(), 0usize);
        self.decoder
            .decode_with_cb(fragment, |name, value| {
                size = size.saturating_add(name.len() + value.len() + 32);
                if size <= MAX_BLOCK {
                    fields.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|err| invalid(format!("HPACK: {err:?}")))?;
        if size > MAX_BLOCK {
            return Err(invalid("a header list over 1 MiB"));
        }
        Ok(fields)
    }
}

impl Block {
    fn new(stream: u32, flags: u8, mut payload: &[u8]) -> io::Result<Self> {
        let malformed = || invalid("a malformed HEADERS frame");
        let mut pad = 0;
        if flags & PADDED != 0 {
            let (&n, rest) = payload.split_first().ok_or_else(malformed)?;
            (pad, payload) = (usize::from(n), rest);
        }
        let mut priority = Vec::new();
        if flags & PRIORITY != 0 {
            let (fields, rest) = payload.split_at_checked(5).ok_or_else(malformed)?;
            (priority, payload) = (fields.to_vec(), rest);
        }
        let end = payload.len().checked_sub(pad).ok_or_else(malformed)?;
        Ok(Self {
            stream,
            flags: flags & (END_STREAM | PRIORITY),
            priority,
            fragment: payload[..end].to_vec(),
        })
    }
}

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// Reads an HPACK integer (RFC 7541 section 5.1) with a `prefix`-bit prefix, as fluke-hpack
/// does (at most 5 octets): its value and length.
fn integer(buf: &[u8], prefix: u8) -> Option<(usize, usize)> {
    let max = (1u8 << prefix) - 1;
    let first = buf.first()? & max;
    if first < max {
        return Some((usize::from(first), 1));
    }
    let mut value = usize::from(max);
    for (i, &b) in buf.get(1..)?.iter().take(4).enumerate() {
        value += usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, i + 2));
        }
    }
    None
}

/// Walks a header block's representations (RFC 7541 section 6), checking every integer and
/// string length.
fn check_integers(mut block: &[u8]) -> Option<()> {
    while let Some(&first) = block.first() {
        // (prefix bits, whether a literal follows)
        let (prefix, literal) = match first {
            0x80.. => (7, false),
            0x40.. => (6, true),
            0x20.. => (5, false),
            _ => (4, true),
        };
        let (index, used) = integer(block, prefix)?;
        block = &block[used..];
        let strings = match (literal, index) {
            (false, _) => 0,
            (true, 0) => 2, // a literal name, then the value
            (true, _) => 1,
        };
        for _ in 0..strings {
            let (len, used) = integer(block, 7)?;
            block = block.get(used.checked_add(len)?..)?;
        }
    }
    Some(())
}

fn put_integer(out: &mut Vec<u8>, mut value: usize, prefix: u8, pattern: u8) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(pattern | value as u8);
        return;
    }
    out.push(pattern | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Encodes `fields` without touching the receiver's dynamic table: indexed from the static
/// table where exact, else a literal without indexing (raw, not Huffman).
fn encode(fields: &[(Vec<u8>, Vec<u8>)], out: &mut Vec<u8>) {
    for (name, value) in fields {
        let index = |exact: bool| {
            STATIC
                .iter()
                .position(|&(n, v)| n == name && (!exact || v == value))
                .map(|i| i + 1)
        };
        if let Some(i) = index(true) {
            put_integer(out, i, 7, 0x80);
            continue;
        }
        match index(false) {
            Some(i) => put_integer(out, i, 4, 0x00),
            None => {
                out.push(0x00);
                put_integer(out, name.len(), 7, 0x00);
                out.extend_from_slice(name);
            }
        }
        put_integer(out, value.len(), 7, 0x00);
        out.extend_from_slice(value);
    }
}

/// Writes `payload` as a HEADERS frame with `flags`, and CONTINUATION frames where it exceeds
/// [`MAX_FRAME`]; the last frame carries END_HEADERS.
fn put_frames(out: &mut BytesMut, stream: u32, flags: u8, mut payload: &[u8]) {
    let (mut kind, mut flags) = (HEADERS, flags);
    loop {
        let (chunk, rest) = payload.split_at(payload.len().min(MAX_FRAME));
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        out.extend_from_slice(&(chunk.len() as u32).to_be_bytes()[1..]);
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(chunk);
        if rest.is_empty() {
            return;
        }
        (kind, flags, payload) = (CONTINUATION, 0, rest);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for RewriteAuthority<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        while this.parsed.is_empty() {
            let mut chunk = [0; 8 * 1024];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                // End of stream; a frame cut short reaches h2 as the end, as it would unwrapped.
                return Poll::Ready(Ok(()));
            }
            this.raw.extend_from_slice(read.filled());
            this.parse()?;
        }
        let n = this.parsed.len().min(buf.remaining());
        buf.put_slice(&this.parsed.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for RewriteAuthority<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<S: Connected> Connected for RewriteAuthority<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// The connections of `listener`, each rewritten with [`localhost_unless_valid`]: pass it to
/// tonic's `serve_with_incoming_shutdown` for a server that kubelet can call.
pub fn unix_incoming(
    listener: UnixListener,
) -> impl Stream<Item = io::Result<RewriteAuthority<UnixStream>>> {
    UnixListenerStream::new(listener)
        .map(|stream| Ok(RewriteAuthority::new(stream?, localhost_unless_valid)))
}

/// A gRPC channel over the unix socket at `socket` whose requests carry `authority` as their
/// `:authority`, byte for byte: how kubelet's plugin watcher dials (with the socket path).
pub async fn connect_with_authority(
    socket: &Path,
    authority: impl Into<Vec<u8>>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let (socket, authority) = (socket.to_owned(), authority.into());
    // The URI is required by the API but ignored: the connector dials the socket.
    tonic::transport::Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let (socket, authority) = (socket.clone(), authority.clone());
            async move {
                let mut server = UnixStream::connect(socket).await?;
                // The client writes into `client`; its bytes reach the socket rewritten.
                let (client, pump) = tokio::io::duplex(64 * 1024);
                let mut pump = RewriteAuthority::fixed(pump, authority);
                tokio::spawn(async move {
                    // Either side failing ends the connection, which the client sees.
                    let _ = tokio::io::copy_bidirectional(&mut pump, &mut server).await;
                });
                Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(client))
            }
        }))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const DATA: u8 = 0x0;
    const SETTINGS: u8 = 0x4;
    const SOCKET: &[u8] = b"/var/lib/kubelet/plugins_registry/gpushare.example.com-reg.sock";

    /// Header fields, as text for readable failures.
    type Fields = Vec<(String, String)>;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        out.extend([kind, flags]);
        out.extend(stream.to_be_bytes());
        out.extend(payload);
        out
    }

    /// A raw HPACK string (no Huffman).
    fn string(value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        put_integer(&mut out, value.len(), 7, 0);
        out.extend(value);
        out
    }

    /// A literal with incremental indexing and an indexed name: what grpc-go's encoder sends
    /// the first time it sees a field, adding it to the dynamic table.
    fn indexing(name_index: u8, value: &[u8]) -> Vec<u8> {
        [vec![0x40 | name_index], string(value)].concat()
    }

    fn fields(fields: &[(&str, &[u8])]) -> Fields {
        fields
            .iter()
            .map(|(name, value)| (name.to_string(), String::from_utf8_lossy(value).into()))
            .collect()
    }

    /// Feeds the preface and `frames` through a [`RewriteAuthority`] `chunk` bytes a read.
    async fn rewrite(
        frames: &[Vec<u8>],
        chunk: usize,
        rewrite: impl Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync + 'static,
    ) -> io::Result<Vec<u8>> {
        let input = [PREFACE.to_vec(), frames.concat()].concat();
        let (mut tx, rx) = tokio::io::duplex(chunk);
        // Writing fails once the reader gave up on malformed input, which is the point.
        let writer = tokio::spawn(async move { tx.write_all(&input).await });
        let mut out = Vec::new();
        let read = RewriteAuthority::new(rx, rewrite)
            .read_to_end(&mut out)
            .await;
        let _ = writer.await;
        read.map(|_| out)
    }

    /// The frames after the preface, which must come through unchanged.
    fn parse(out: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let (preface, mut rest) = out.split_at(PREFACE_LEN);
        assert_eq!(preface, PREFACE);
        let mut frames = Vec::new();
        while !rest.is_empty() {
            let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            frames.push((rest[3], rest[4], stream, rest[9..9 + len].to_vec()));
            rest = &rest[9 + len..];
        }
        frames
    }

    /// Decodes a rewritten block with a decoder of its own: it must not need the dynamic table.
    fn decode(block: &[u8]) -> Fields {
        let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
        let fields = Decoder::new().decode(block).unwrap().into_iter();
        fields
            .map(|(name, value)| (text(name), text(value)))
            .collect()
    }

    #[tokio::test]
    async fn grpc_go_dynamic_table_authority_is_rewritten_in_every_request() {
        let get_info = b"/pluginregistration.Registration/GetInfo";
        let notify = b"/pluginregistration.Registration/NotifyRegistrationStatus";
        // grpc-go indexes :path, :authority and te; its second request refers to the entries
        // (newest first from 62: path, te, authority, path).
        let first = [
            vec![0x83, 0x86],
            indexing(4, get_info),
            indexing(1, SOCKET),
            vec![0x40],
            string(b"te"),
            string(b"trailers"),
        ]
        .concat();
        let second = [
            vec![0x83, 0x86],
            indexing(4, notify),
            vec![0x80 | 64, 0x80 | 63],
        ]
        .concat();
        let input = [
            frame(SETTINGS, 0, 0, &[0, 4, 0, 1, 0, 0]),
            frame(HEADERS, END_HEADERS, 1, &first),
            frame(DATA, END_STREAM, 1, &[0, 0, 0, 0, 0]),
            frame(HEADERS, END_HEADERS, 3, &second),
            frame(DATA, END_STREAM, 3, &[0, 0, 0, 0, 2, 8, 1]),
        ];
        let out = rewrite(&input, 1, localhost_unless_valid).await.unwrap();
        let whole = rewrite(&input, 1 << 16, localhost_unless_valid).await;
        assert_eq!(whole.unwrap(), out, "one byte a read or all at once");

        let frames = parse(&out);
        assert_eq!(frames.len(), 5);
        for i in [0, 2, 4] {
            assert_eq!(
                frame(frames[i].0, frames[i].1, frames[i].2, &frames[i].3),
                input[i]
            );
        }
        let expected = |path: &[u8]| {
            fields(&[
                (":method", b"POST"),
                (":scheme", b"http"),
                (":path", path),
                (":authority", b"localhost"),
                ("te", b"trailers"),
            ])
        };
        assert_eq!(
            (frames[1].0, frames[1].1, frames[1].2),
            (HEADERS, END_HEADERS, 1)
        );
        assert_eq!(decode(&frames[1].3), expected(get_info));
        assert_eq!(
            (frames[3].0, frames[3].1, frames[3].2),
            (HEADERS, END_HEADERS, 3)
        );
        assert_eq!(decode(&frames[3].3), expected(notify));
    }

    /// RFC 7541 C.4.1 and C.4.2: Huffman-coded strings, the second request indexing the
    /// first's `:authority` in the dynamic table.
    const RFC_FIRST: &[u8] = &[
        0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90,
        0xf4, 0xff,
    ];
    const RFC_SECOND: &[u8] = &[
        0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf,
    ];

    #[tokio::test]
    async fn a_fixed_authority_replaces_huffman_and_indexed_ones() {
        let input = [
            frame(HEADERS, END_HEADERS | END_STREAM, 1, RFC_FIRST),
            frame(HEADERS, END_HEADERS | END_STREAM, 3, RFC_SECOND),
        ];
        let out = rewrite(&input, 1, |_| Some(b"/sock".to_vec()))
            .await
            .unwrap();
        let frames = parse(&out);
        let flags = END_HEADERS | END_STREAM;
        // Static-table indexed where exact; a literal without indexing with an indexed name.
        let first = [&[0x82, 0x86, 0x84, 0x01, 0x05][..], b"/sock"].concat();
        assert_eq!(frames[0], (HEADERS, flags, 1, first));
        let second = fields(&[
            (":method", b"GET"),
            (":scheme", b"http"),
            (":path", b"/"),
            (":authority", b"/sock"),
            ("cache-control", b"no-cache"),
        ]);
        assert_eq!((frames[1].0, frames[1].1, frames[1].2), (HEADERS, flags, 3));
        assert_eq!(decode(&frames[1].3), second);
    }

    #[tokio::test]
    async fn a_valid_authority_is_kept() {
        let input = [
            frame(HEADERS, END_HEADERS, 1, RFC_FIRST),
            frame(HEADERS, END_HEADERS, 3, RFC_SECOND),
        ];
        let out = rewrite(&input, 1, localhost_unless_valid).await.unwrap();
        for (_, _, _, block) in parse(&out) {
            let authority = (":authority".into(), "www.example.com".into());
            assert!(decode(&block).contains(&authority));
        }
        assert_eq!(localhost_unless_valid(b"[::]:50051"), None);
        assert_eq!(localhost_unless_valid(b"localhost:8080"), None);
        assert_eq!(localhost_unless_valid(SOCKET), Some(b"localhost".to_vec()));
        assert_eq!(localhost_unless_valid(b""), Some(b"localhost".to_vec()));
    }

    #[tokio::test]
    async fn padding_is_dropped_and_priority_kept() {
        let priority = [0x80, 0, 0, 1, 15];
        let payload = [&[3][..], &priority, RFC_FIRST, &[0, 0, 0]].concat();
        let flags = PADDED | PRIORITY | END_HEADERS | END_STREAM;
        let input = [frame(HEADERS, flags, 5, &payload)];
        let frames = parse(&rewrite(&input, 1, localhost_unless_valid).await.unwrap());
        assert_eq!(frames.len(), 1);
        let (kind, flags, stream, payload) = &frames[0];
        assert_eq!(
            (*kind, *flags, *stream),
            (HEADERS, PRIORITY | END_HEADERS | END_STREAM, 5)
        );
        assert_eq!(payload[..5], priority);
        assert_eq!(decode(&payload[5..]), decode(RFC_FIRST));
    }

    #[tokio::test]
    async fn a_large_block_spans_continuation_frames_both_ways() {
        let big = vec![b'x'; 20_000];
        let block = [
            RFC_FIRST.to_vec(),
            vec![0x40],
            string(b"x-big"),
            string(&big),
        ]
        .concat();
        let (a, rest) = block.split_at(10_000);
        let (b, c) = rest.split_at(7_000);
        let input = [
            frame(HEADERS, 0, 7, a),
            frame(CONTINUATION, 0, 7, b),
            frame(CONTINUATION, END_HEADERS, 7, c),
        ];
        let frames = parse(&rewrite(&input, 1, localhost_unless_valid).await.unwrap());
        let heads: Vec<_> = frames.iter().map(|f| (f.0, f.1, f.2, f.3.len())).collect();
        let encoded: usize = heads.iter().map(|h| h.3).sum();
        assert_eq!(
            heads,
            [
                (HEADERS, 0, 7, MAX_FRAME),
                (CONTINUATION, END_HEADERS, 7, encoded - MAX_FRAME)
            ]
        );
        let block: Vec<u8> = frames.into_iter().flat_map(|f| f.3).collect();
        let mut expected = decode(RFC_FIRST);
        expected.push(("x-big".into(), String::from_utf8(big).unwrap()));
        assert_eq!(decode(&block), expected);
    }

    #[tokio::test]
    async fn malformed_input_is_invalid_data() {
        let end = END_HEADERS;
        let bomb = [
            vec![0x40],
            string(b"x"),
            string(&[b'y'; 4000]),
            vec![0xbe; 300],
        ]
        .concat();
        let cases: [(&str, Vec<Vec<u8>>); 13] = [
            (
                "CONTINUATION without HEADERS",
                vec![frame(CONTINUATION, end, 1, &[0x82])],
            ),
            (
                "a frame inside a header block",
                vec![frame(HEADERS, 0, 1, &[0x82]), frame(DATA, 0, 1, &[])],
            ),
            (
                "CONTINUATION on another stream",
                vec![
                    frame(HEADERS, 0, 1, &[0x82]),
                    frame(CONTINUATION, end, 3, &[0x84]),
                ],
            ),
            (
                "an index past the tables",
                vec![frame(HEADERS, end, 1, &[0xbe])],
            ),
            (
                "a truncated size update",
                vec![frame(HEADERS, end, 1, &[0x3f])],
            ),
            (
                "a size update of six octets",
                vec![frame(
                    HEADERS,
                    end,
                    1,
                    &[0x3f, 0xff, 0xff, 0xff, 0xff, 0x01, 0x82],
                )],
            ),
            (
                "a table over SETTINGS_HEADER_TABLE_SIZE",
                vec![frame(HEADERS, end, 1, &[0x3f, 0xe1, 0x3f, 0x82])],
            ),
            (
                "a string past the block",
                vec![frame(HEADERS, end, 1, &[0x00, 0x05, b'a'])],
            ),
            (
                "bad Huffman",
                vec![frame(HEADERS, end, 1, &[0x00, 0x81, 0xff, 0x00])],
            ),
            // Only the head: the frame is refused before its payload is awaited.
            (
                "a 16 MiB header frame",
                vec![vec![0xff, 0xff, 0xff, HEADERS, end, 0, 0, 0, 1]],
            ),
            (
                "padding past the frame",
                vec![frame(HEADERS, end | PADDED, 1, &[5, 0x82])],
            ),
            (
                "a cut PRIORITY",
                vec![frame(HEADERS, end | PRIORITY, 1, &[0, 0])],
            ),
            (
                "a header list over 1 MiB",
                vec![frame(HEADERS, end, 1, &bomb)],
            ),
        ];
        for (case, input) in cases {
            let err = rewrite(&input, 1, localhost_unless_valid)
                .await
                .unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{case}: {err}");
        }
    }
}
