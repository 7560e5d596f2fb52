//! HTTP/1.1 requests: parsing a request head, and the responses httpd sends.

/// Longest request head (request line and headers).
pub const MAX_HEAD: usize = 16 * 1024;
/// Longest request body httpd reads (and ignores); longer ones get 413.
pub const MAX_BODY: u64 = 1024 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Head,
    /// Any other well-formed method: 405.
    Other,
}

#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    pub method: Method,
    /// The decoded path, without query.
    pub path: String,
    pub keep_alive: bool,
    pub body: u64,
    /// Bytes of the head, including the blank line.
    pub head_len: usize,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Parse {
    /// More bytes needed.
    Partial,
    Done(Request),
    /// A response status and reason; the connection is closed after it.
    Fail(u16),
}

/// Parses the request head at the start of `buf`.
pub fn parse(buf: &[u8]) -> Parse {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD {
            Parse::Fail(413)
        } else {
            Parse::Partial
        };
    };
    if end > MAX_HEAD {
        return Parse::Fail(413);
    }
    let Ok(head) = std::str::from_utf8(&buf[..end]) else {
        return Parse::Fail(400);
    };
    let mut lines = head.split("\r\n");
    let mut parts = lines.next().unwrap_or("").split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Parse::Fail(400);
    };
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    if !token(method) {
        return Parse::Fail(400);
    }
    let mut keep_alive = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        _ => return Parse::Fail(400),
    };
    let Some(path) = decode_path(target) else {
        return Parse::Fail(400);
    };
    let mut body = 0;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Parse::Fail(400);
        };
        if !token(name) {
            return Parse::Fail(400);
        }
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            match value.parse::<u64>() {
                Ok(n) => body = n,
                Err(_) => return Parse::Fail(400),
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Parse::Fail(400); // no chunked request bodies
        } else if name.eq_ignore_ascii_case("connection") {
            let v = value.to_ascii_lowercase();
            if v.contains("close") {
                keep_alive = false;
            } else if v.contains("keep-alive") {
                keep_alive = true;
            }
        }
    }
    if body > MAX_BODY {
        return Parse::Fail(413);
    }
    let method = match method {
        "GET" => Method::Get,
        "HEAD" => Method::Head,
        _ => Method::Other,
    };
    Parse::Done(Request {
        method,
        path,
        keep_alive,
        body,
        head_len: end + 4,
    })
}

/// The path of an origin-form target, percent-decoded, without query;
/// none for anything that could leave the document root.
fn decode_path(target: &str) -> Option<String> {
    let path = target.split(['?', '#']).next()?;
    if !path.starts_with('/') {
        return None;
    }
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    let path = String::from_utf8(out).ok()?;
    if path.contains('\0') || path.split('/').any(|s| s == "..") {
        return None;
    }
    Some(path)
}

pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Content Too Large",
        _ => "Internal Server Error",
    }
}

pub fn content_type(path: &str) -> &'static str {
    match path.rsplit_once('.').map(|(_, e)| e) {
        Some("html" | "htm") => "text/html",
        Some("txt") => "text/plain",
        Some("css") => "text/css",
        Some("js") => "text/javascript",
        Some("json") => "application/json",
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("svg") => "image/svg+xml",
        _ => "application/octet-stream",
    }
}

/// A response head.
pub fn head(status: u16, ctype: &str, len: u64, keep_alive: bool) -> String {
    let conn = if keep_alive { "keep-alive" } else { "close" };
    let allow = if status == 405 {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {status} {}\r\nServer: kintsugi\r\nContent-Type: {ctype}\r\nContent-Length: {len}\r\n{allow}Connection: {conn}\r\n\r\n",
        reason(status)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(s: &str) -> Request {
        match parse(s.as_bytes()) {
            Parse::Done(r) => r,
            other => panic!("{s:?}: {other:?}"),
        }
    }

    #[test]
    fn requests_parse() {
        let r = done("GET /a%20b.txt?x=1 HTTP/1.1\r\nHost: x\r\n\r\nrest");
        assert_eq!(
            (r.method, r.path.as_str(), r.keep_alive, r.head_len),
            (Method::Get, "/a b.txt", true, 40)
        );
        assert!(!done("HEAD / HTTP/1.0\r\n\r\n").keep_alive);
        assert!(done("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive);
        assert!(!done("GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive);
        assert_eq!(
            done("POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\n").method,
            Method::Other
        );
        assert_eq!(parse(b"GET / HTTP/1.1\r\nHost: x\r\n"), Parse::Partial);
    }

    #[test]
    fn bad_requests_fail() {
        for bad in [
            "GET /\r\n\r\n",
            "GET / HTTP/2.0\r\n\r\n",
            "GET a HTTP/1.1\r\n\r\n",
            "GET /../etc/passwd HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nno colon\r\n\r\n",
            "GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n",
            "G(T / HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(parse(bad.as_bytes()), Parse::Fail(400), "{bad:?}");
        }
        assert_eq!(
            parse(b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n"),
            Parse::Fail(413)
        );
        assert_eq!(parse(&vec![b'a'; MAX_HEAD + 1]), Parse::Fail(413));
    }
}
