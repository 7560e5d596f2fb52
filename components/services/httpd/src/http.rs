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

/// Where the request head at the start of `buf` ends: the length of its
/// lines and of the head with its blank line. Lines end in CRLF or, as RFC
/// 9112 allows a recipient to accept, a bare LF.
fn head_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut line_start = 0;
    for (i, &b) in buf.iter().enumerate() {
        if b != b'\n' {
            continue;
        }
        let line = &buf[line_start..i];
        if line.is_empty() || line == b"\r" {
            return Some((line_start.saturating_sub(1), i + 1));
        }
        line_start = i + 1;
    }
    None
}

/// The head's lines, each without its CR.
fn lines(head: &str) -> impl Iterator<Item = &str> {
    head.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l))
}

/// A token (RFC 9110 §5.6.2): a method or a header name.
fn token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// The request line: method, target and whether the connection persists by
/// default; none if it is malformed (HTTP/0.9's `GET /` among them).
fn request_line(line: &str) -> Option<(&str, &str, bool)> {
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let keep_alive = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        _ => return None,
    };
    token(method).then_some((method, target, keep_alive))
}

/// Parses the request head at the start of `buf`.
pub fn parse(buf: &[u8]) -> Parse {
    let Some((end, head_len)) = head_end(buf) else {
        // A complete request line is judged at once: a malformed one (or
        // HTTP/0.9) is answered now, not after a blank line that never comes.
        if let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let first = std::str::from_utf8(&buf[..nl]).ok();
            if first.and_then(|l| request_line(lines(l).next()?)).is_none() {
                return Parse::Fail(400);
            }
        }
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
    let mut lines = lines(head);
    let Some((method, target, mut keep_alive)) = lines.next().and_then(request_line) else {
        return Parse::Fail(400);
    };
    let Some(path) = decode_path(target) else {
        return Parse::Fail(400);
    };
    let mut body: Option<u64> = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Parse::Fail(400);
        };
        // A bare CR, or whitespace before the colon, is refused (RFC 9112 §2.2, §5.1).
        if !token(name) || value.contains('\r') {
            return Parse::Fail(400);
        }
        let value = value.trim_matches([' ', '\t']);
        if name.eq_ignore_ascii_case("content-length") {
            // Digits only (no sign), and every Content-Length the same:
            // anything else is how requests are smuggled past a proxy.
            let n = match value.bytes().all(|b| b.is_ascii_digit()) {
                true => value.parse::<u64>().ok(),
                false => None,
            };
            match (n, body) {
                (Some(n), None) => body = Some(n),
                (Some(n), Some(b)) if n == b => {}
                _ => return Parse::Fail(400),
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
    let body = body.unwrap_or(0);
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
        head_len,
    })
}

/// The path of an origin-form target: percent-decoded, without query, with
/// empty and `.` segments dropped and `..` resolved (RFC 3986 §5.2.4); none
/// for a path that climbs above the root or holds a NUL.
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
    let decoded = String::from_utf8(out).ok()?;
    if decoded.contains('\0') {
        return None;
    }
    let mut segments: Vec<&str> = Vec::new();
    for s in decoded.split('/') {
        match s {
            "" | "." => {}
            ".." => {
                segments.pop()?;
            }
            s => segments.push(s),
        }
    }
    // A directory keeps its trailing slash (its index is served).
    let dir = decoded.ends_with('/') || decoded.ends_with("/.") || decoded.ends_with("/..");
    let mut path = format!("/{}", segments.join("/"));
    if dir && !segments.is_empty() {
        path.push('/');
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
        assert_eq!(
            done("GET /a HTTP/1.1\nHost: x\n\n").head_len,
            "GET /a HTTP/1.1\nHost: x\n\n".len(),
            "bare LF lines"
        );
        assert_eq!(
            done("GET / HTTP/1.1\r\nContent-Length: 3\r\ncontent-length: 3\r\n\r\n").body,
            3,
            "repeated, equal"
        );
    }

    #[test]
    fn paths_are_normalized_within_the_root() {
        for (target, path) in [
            ("//etc/passwd", "/etc/passwd"),
            ("/./index.html", "/index.html"),
            ("/a//b", "/a/b"),
            ("/a/../b", "/b"),
            ("/a/b/..", "/a/"),
            ("/a/", "/a/"),
            ("/", "/"),
            ("/.", "/"),
            ("/%2e%2e/x/../y", ""),
        ] {
            let req = format!("GET {target} HTTP/1.1\r\n\r\n");
            match parse(req.as_bytes()) {
                Parse::Done(r) => assert_eq!(r.path, path, "{target}"),
                Parse::Fail(400) => assert_eq!(path, "", "{target} refused"),
                other => panic!("{target}: {other:?}"),
            }
        }
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
            "GET /..%2f HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
            "GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "GET / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
            "GET / HTTP/1.1\r\nContent-Length: 5, 6\r\n\r\n",
            "GET / HTTP/1.1\r\nHost : x\r\n\r\n",
            "GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",
        ] {
            assert_eq!(parse(bad.as_bytes()), Parse::Fail(400), "{bad:?}");
        }
        assert_eq!(
            parse(b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n"),
            Parse::Fail(413)
        );
        assert_eq!(parse(&vec![b'a'; MAX_HEAD + 1]), Parse::Fail(413));
        // A malformed request line is answered at once, not after a blank
        // line that never comes: HTTP/0.9, and a bare-LF one as well.
        assert_eq!(parse(b"GET /\r\n"), Parse::Fail(400));
        assert_eq!(parse(b"GET /\n"), Parse::Fail(400));
        assert_eq!(parse(b"GET / HTTP/1.1\r\n"), Parse::Partial);
    }
}
