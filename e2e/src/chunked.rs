//! HTTP/1.1's chunked transfer coding, decoded: plain protocol code that both of our minimal
//! HTTP/1.1 clients need, the harness's ([`crate::cluster::http_get`] and friends) and the API
//! server's webhook client.
//!
//! It lives below both so that neither reaches into the other for it: the API server knows
//! nothing of the harness built on top of it.

/// The body of a `Transfer-Encoding: chunked` answer, joined.
pub(crate) fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::dechunk;

    #[test]
    fn chunks_are_joined_up_to_the_last_chunk() {
        let body = "5\r\nhello\r\nB\r\n, chunked!\n\r\n0\r\n\r\n";
        assert_eq!(dechunk(body), "hello, chunked!\n");
    }

    #[test]
    fn a_truncated_or_malformed_body_keeps_what_came_whole() {
        assert_eq!(dechunk("5\r\nhello\r\n10\r\nshort"), "hello");
        assert_eq!(dechunk("5\r\nhello\r\nzz\r\nmore"), "hello");
        assert_eq!(dechunk(""), "");
    }
}
