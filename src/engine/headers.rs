//! Extra request headers for every engine call (`ABADA_AGENT_ENGINE_HEADERS_FILE`), for engines
//! behind an authenticating proxy, e.g. the real engine's `proxy` security mode, which trusts
//! `X-Auth-Request-User` and `X-Auth-Request-Groups`.
//!
//! The file holds `Name: value` lines; blank lines and lines starting with `#` are skipped. The
//! values are secrets: they are never logged, never part of an error (a bad line is named by its
//! number and header name only), and are marked sensitive on the wire. The file is read at
//! start-up (any problem is a start-up error) and read again whenever its modification time or
//! size changes, like the other `_FILE` secrets; a changed file that no longer parses is
//! reported once and the last good headers stay in use.
//!
//! Refused names: hop-by-hop headers and those the worker sets itself (`Host`,
//! `Content-Length`, `Content-Type`, `Accept`, `Idempotency-Key`, `traceparent`, the protocol
//! version), and `Authorization` when the worker obtains an OIDC token.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use reqwest::header::{HeaderName, HeaderValue};

use crate::secret::{Secret, SecretError, SecretSource};

/// Header names the file may not set: hop-by-hop headers (RFC 9110 7.6.1, and the legacy
/// `Keep-Alive`, `Proxy-Connection`), framing, and what the engine client sets itself.
const FORBIDDEN: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "content-type",
    "content-encoding",
    "accept",
    "expect",
    "idempotency-key",
    "traceparent",
    "tracestate",
    "x-abada-worker-protocol-version",
];

/// At most this many headers (a proxy identity needs two or three).
const MAX_HEADERS: usize = 32;

/// Why the headers file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HeadersFileError {
    #[error(transparent)]
    Read(#[from] SecretError),
    #[error("{path} line {line}: {problem}")]
    Line {
        path: PathBuf,
        line: usize,
        problem: String,
    },
    #[error("{path} holds no header: write one `Name: value` line per header")]
    NoHeader { path: PathBuf },
    #[error("{path} holds more than {MAX_HEADERS} headers")]
    TooMany { path: PathBuf },
}

/// The parsed headers, values marked sensitive.
type HeaderList = Arc<Vec<(HeaderName, HeaderValue)>>;

/// The headers file: its path, and the last good parse of its content.
pub struct EngineHeaders {
    source: SecretSource,
    path: PathBuf,
    /// Whether `Authorization` is refused (the worker sends its OIDC token).
    oidc: bool,
    /// The content last read and what it gave: the headers in use, and the content that last
    /// failed to parse (so a bad file is reported once, not on every request).
    state: Mutex<State>,
}

struct State {
    good_raw: Secret,
    good: HeaderList,
    bad_raw: Option<Secret>,
}

impl EngineHeaders {
    /// Reads and checks the file now; `oidc` refuses an `Authorization` header.
    pub fn load(path: &Path, oidc: bool) -> Result<Self, HeadersFileError> {
        let source = SecretSource::file(path);
        let raw = source.load()?;
        let good = parse(path, raw.expose(), oidc)?;
        Ok(EngineHeaders {
            source,
            path: path.to_path_buf(),
            oidc,
            state: Mutex::new(State {
                good_raw: raw,
                good: Arc::new(good),
                bad_raw: None,
            }),
        })
    }

    /// The headers to send now: the file's, re-read if it changed; the last good ones when it
    /// can no longer be read or parsed (reported once per change).
    pub fn current(&self) -> HeaderList {
        let raw = match self.source.load() {
            Ok(raw) => raw,
            Err(e) => {
                let mut state = self.state.lock().expect("headers lock");
                if state.bad_raw.is_none() {
                    tracing::error!(error = %e, "ABADA_AGENT_ENGINE_HEADERS_FILE cannot be read; the last good headers stay in use");
                    state.bad_raw = Some(Secret::new(String::new()));
                }
                return state.good.clone();
            }
        };
        let mut state = self.state.lock().expect("headers lock");
        if raw == state.good_raw || state.bad_raw.as_ref() == Some(&raw) {
            return state.good.clone();
        }
        match parse(&self.path, raw.expose(), self.oidc) {
            Ok(headers) => {
                tracing::info!(path = %self.path.display(), headers = headers.len(), "engine headers file changed: new headers in use");
                state.good_raw = raw;
                state.good = Arc::new(headers);
                state.bad_raw = None;
            }
            Err(e) => {
                tracing::error!(error = %e, "ABADA_AGENT_ENGINE_HEADERS_FILE changed and cannot be used; the last good headers stay in use");
                state.bad_raw = Some(raw);
            }
        }
        state.good.clone()
    }

    /// The header names (never the values), for start-up logs.
    pub fn names(&self) -> Vec<String> {
        let state = self.state.lock().expect("headers lock");
        state.good.iter().map(|(n, _)| n.to_string()).collect()
    }
}

impl std::fmt::Debug for EngineHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHeaders")
            .field("path", &self.path)
            .field("names", &self.names())
            .finish()
    }
}

fn parse(
    path: &Path,
    content: &str,
    oidc: bool,
) -> Result<Vec<(HeaderName, HeaderValue)>, HeadersFileError> {
    let problem = |line: usize, problem: String| HeadersFileError::Line {
        path: path.to_path_buf(),
        line,
        problem,
    };
    let mut headers: Vec<(HeaderName, HeaderValue)> = Vec::new();
    for (index, line) in content.lines().enumerate() {
        let number = index + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(problem(
                number,
                "is not `Name: value` (no colon); the value is not shown".into(),
            ));
        };
        let name = name.trim();
        let header = HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            problem(
                number,
                format!(
                    "{name:?} is not a valid header name (letters, digits and !#$%&'*+-.^_`|~ only)"
                ),
            )
        })?;
        if FORBIDDEN.contains(&header.as_str()) {
            return Err(problem(
                number,
                format!("{name} may not be set here: it is hop-by-hop or set by the worker itself"),
            ));
        }
        if oidc && header == reqwest::header::AUTHORIZATION {
            return Err(problem(
                number,
                "Authorization may not be set here while ABADA_AGENT_OIDC_ISSUER_URL is set: the worker sends its OIDC token in it".into(),
            ));
        }
        if headers.iter().any(|(n, _)| *n == header) {
            return Err(problem(
                number,
                format!("{name} is set twice: give each header once"),
            ));
        }
        let mut value = HeaderValue::from_str(value.trim()).map_err(|_| {
            problem(
                number,
                format!("the value of {name} holds characters not allowed in a header (control characters or non-ASCII); the value is not shown"),
            )
        })?;
        if value.is_empty() {
            return Err(problem(number, format!("{name} has an empty value")));
        }
        value.set_sensitive(true);
        headers.push((header, value));
        if headers.len() > MAX_HEADERS {
            return Err(HeadersFileError::TooMany {
                path: path.to_path_buf(),
            });
        }
    }
    if headers.is_empty() {
        return Err(HeadersFileError::NoHeader {
            path: path.to_path_buf(),
        });
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(content: &str, oidc: bool) -> Result<Vec<(HeaderName, HeaderValue)>, HeadersFileError> {
        parse(Path::new("/h"), content, oidc)
    }

    #[test]
    fn lines_become_sensitive_headers_and_comments_are_skipped() {
        let h = p(
            "# proxy identity\n\nX-Auth-Request-User: abada-agent-worker\r\nX-Auth-Request-Groups:  abada-worker \n",
            false,
        )
        .unwrap();
        assert_eq!(h.len(), 2);
        assert_eq!(h[0].0, "x-auth-request-user");
        assert_eq!(h[1].1, "abada-worker");
        assert!(h.iter().all(|(_, v)| v.is_sensitive()));
        // A value may hold colons.
        let h = p("X-Token: a:b:c", false).unwrap();
        assert_eq!(h[0].1, "a:b:c");
    }

    #[test]
    fn bad_lines_are_named_without_their_value() {
        for (content, expect) in [
            ("Connection: close", "hop-by-hop"),
            ("Transfer-Encoding: chunked", "hop-by-hop"),
            ("Proxy-Authorization: Basic c2VjcmV0", "hop-by-hop"),
            ("Host: evil", "set by the worker"),
            ("Idempotency-Key: k", "set by the worker"),
            ("X-A: 1\nx-a: 2", "set twice"),
            ("no colon s3cr3t-value", "no colon"),
            ("Bad Name: s3cr3t-value", "not a valid header name"),
            ("X-A:", "empty value"),
            ("X-A: s3cr3t\u{7}value", "not allowed"),
            ("# only a comment\n", "holds no header"),
        ] {
            let e = p(content, false).unwrap_err().to_string();
            assert!(e.contains(expect), "{content:?}: {e}");
            assert!(!e.contains("s3cr3t"), "{e}");
            assert!(!e.contains("c2VjcmV0"), "{e}");
        }
        let e = p("Authorization: Bearer s3cr3t", true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("OIDC") && !e.contains("s3cr3t"), "{e}");
        assert!(p("Authorization: Bearer s3cr3t", false).is_ok());
        let many: String = (0..40).map(|i| format!("X-H{i}: v\n")).collect();
        assert!(matches!(
            p(&many, false),
            Err(HeadersFileError::TooMany { .. })
        ));
    }

    #[test]
    fn the_file_is_read_again_when_it_changes_and_a_bad_change_keeps_the_last_good_headers() {
        let dir = std::env::temp_dir().join(format!("abada-headers-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("headers");
        std::fs::write(&path, "X-Auth-Request-User: one\n").unwrap();
        let h = EngineHeaders::load(&path, false).unwrap();
        assert_eq!(h.current()[0].1, "one");
        std::fs::write(&path, "X-Auth-Request-User: second\n").unwrap();
        assert_eq!(h.current()[0].1, "second");
        std::fs::write(&path, "Connection: close, and longer\n").unwrap();
        assert_eq!(h.current()[0].1, "second", "the last good headers");
        assert_eq!(h.names(), ["x-auth-request-user"]);
        assert!(!format!("{h:?}").contains("second"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
