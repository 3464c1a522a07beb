//! The run store's URL (`ABADA_AGENT_STORE_URL`): a `postgres://` or `postgresql://` URL parsed
//! once into a `tokio_postgres::Config` plus the libpq `sslmode`, and a redacted form that is the
//! only way the URL is ever printed.
//!
//! The password never reaches an error or a log line: the redacted form is rebuilt from the
//! parsed hosts, ports and database name (no user information, no query), and error messages
//! name only the problem and, for an unsupported parameter, a name from a fixed list.

use std::fmt;
use std::str::FromStr;

/// How the connection uses TLS: libpq's `sslmode`, honoured as libpq does (see [`SslMode::describe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    /// The value as written in a URL.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// What the mode does here, exactly as README.md says it.
    pub fn describe(self) -> &'static str {
        match self {
            SslMode::Disable => "no TLS: plain TCP",
            SslMode::Prefer => {
                "TLS when the server offers it, plain TCP when it does not; the certificate is not checked"
            }
            SslMode::Require => "TLS or no connection; the certificate is not checked",
            SslMode::VerifyCa => {
                "TLS or no connection; the certificate must chain to a trusted root (system roots and ABADA_AGENT_CA_FILE); the host name is not checked"
            }
            SslMode::VerifyFull => {
                "TLS or no connection; the certificate must chain to a trusted root and name the host"
            }
        }
    }

    fn parse(value: &str) -> Option<SslMode> {
        Some(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// Whether the certificate is checked against trust roots.
    pub fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a store URL cannot be used. No variant carries any part of the URL except parameter names
/// from fixed lists, so printing one can never reveal a password.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UrlError {
    #[error("is not a PostgreSQL URL: it must start with postgres:// or postgresql://")]
    Scheme,
    #[error(
        "has sslmode={0}, which is not supported here: allowed disable, prefer, require, verify-ca, verify-full"
    )]
    SslModeUnsupported(&'static str),
    #[error(
        "has an sslmode value that is not one of disable, prefer, require, verify-ca, verify-full (lower case)"
    )]
    SslModeInvalid,
    #[error("names sslmode twice: give it once")]
    SslModeTwice,
    #[error(
        "has the parameter {0}, which is not supported here: trust roots come from ABADA_AGENT_CA_FILE, and client certificates are not supported"
    )]
    TlsFileParameter(&'static str),
    #[error(
        "has a query parameter that is not supported (allowed: {}); check its spelling",
        ALLOWED_PARAMETERS.join(", ")
    )]
    UnknownParameter,
    #[error("has a fragment (#...): remove it")]
    Fragment,
    #[error("names no host: give one, e.g. postgres://user:password@db.example:5432/abada")]
    NoHost,
    #[error("is not a valid PostgreSQL URL: {0}")]
    Invalid(String),
}

/// Query parameters passed on to tokio-postgres (libpq's names), besides `sslmode`.
const ALLOWED_PARAMETERS: &[&str] = &[
    "sslmode",
    "user",
    "password",
    "dbname",
    "options",
    "application_name",
    "host",
    "hostaddr",
    "port",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
];

/// libpq's TLS file parameters: refused with a pointer to `ABADA_AGENT_CA_FILE`.
const TLS_FILE_PARAMETERS: &[&str] = &[
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslpassword",
    "sslcrl",
    "sslcrldir",
];

/// A parsed store URL. Its `Debug` and `Display` print the redacted form only.
#[derive(Clone)]
pub struct StoreUrl {
    config: tokio_postgres::Config,
    ssl_mode: SslMode,
    redacted: String,
}

impl StoreUrl {
    /// Parses and checks a URL. `sslmode` defaults to `prefer`, as in libpq.
    pub fn parse(raw: &str) -> Result<StoreUrl, UrlError> {
        let raw = raw.trim();
        let scheme_len = ["postgresql://", "postgres://"]
            .iter()
            .find(|s| raw.starts_with(*s))
            .map(|s| s.len())
            .ok_or(UrlError::Scheme)?;
        // User information ends at the last '@': a password written with a raw '@' stays in it.
        // Nothing before that point is ever examined further or echoed.
        let after_scheme = &raw[scheme_len..];
        let rest_start = scheme_len + after_scheme.rfind('@').map_or(0, |i| i + 1);
        let (head, rest) = raw.split_at(rest_start);
        if rest.contains('#') {
            return Err(UrlError::Fragment);
        }
        let (location, query) = match rest.split_once('?') {
            Some((l, q)) => (l, Some(q)),
            None => (rest, None),
        };
        let mut ssl_mode = None;
        let mut kept = Vec::new();
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            if pair.is_empty() {
                continue;
            }
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if key == "sslmode" {
                if ssl_mode.is_some() {
                    return Err(UrlError::SslModeTwice);
                }
                ssl_mode = Some(match SslMode::parse(value) {
                    Some(mode) => mode,
                    None if value == "allow" => return Err(UrlError::SslModeUnsupported("allow")),
                    None => return Err(UrlError::SslModeInvalid),
                });
            } else if let Some(name) = TLS_FILE_PARAMETERS.iter().find(|n| **n == key) {
                return Err(UrlError::TlsFileParameter(name));
            } else if ALLOWED_PARAMETERS.contains(&key) {
                kept.push(pair);
            } else {
                return Err(UrlError::UnknownParameter);
            }
        }
        let ssl_mode = ssl_mode.unwrap_or(SslMode::Prefer);
        let mut rebuilt = format!("{head}{location}");
        if !kept.is_empty() {
            rebuilt.push('?');
            rebuilt.push_str(&kept.join("&"));
        }
        // tokio-postgres's parse errors name an option or a problem, never a value.
        let mut config = tokio_postgres::Config::from_str(&rebuilt)
            .map_err(|e| UrlError::Invalid(crate::errors::chain(&e)))?;
        if config.get_hosts().is_empty() {
            return Err(UrlError::NoHost);
        }
        config.ssl_mode(match ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        let redacted = redact(&config, ssl_mode);
        Ok(StoreUrl {
            config,
            ssl_mode,
            redacted,
        })
    }

    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// The connection settings (the password inside; `tokio_postgres::Config`'s own `Debug`
    /// hides it too).
    pub(crate) fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// `postgres://host:port/dbname?sslmode=...`: no user, no password, no other parameter.
    pub fn redacted(&self) -> &str {
        &self.redacted
    }
}

fn redact(config: &tokio_postgres::Config, mode: SslMode) -> String {
    use tokio_postgres::config::Host;
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports
                .get(i)
                .or_else(|| (ports.len() == 1).then(|| &ports[0]))
                .copied()
                .unwrap_or(5432);
            match host {
                Host::Tcp(name) if name.contains(':') => format!("[{name}]:{port}"),
                Host::Tcp(name) => format!("{name}:{port}"),
                #[cfg(unix)]
                Host::Unix(path) => format!("{}:{port}", path.display()),
            }
        })
        .collect();
    let dbname = config.get_dbname().unwrap_or("");
    format!(
        "postgres://{}/{dbname}?sslmode={}",
        hosts.join(","),
        mode.as_str()
    )
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted)
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreUrl({})", self.redacted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWORD: &str = "pw-marker-7f3a";

    fn no_password(text: &str) {
        assert!(!text.contains(PASSWORD), "the password leaked: {text}");
        assert!(
            !text.contains("pw-marker"),
            "part of the password leaked: {text}"
        );
    }

    #[test]
    fn a_plain_url_parses_with_libpq_defaults_and_prints_without_userinfo() {
        let url =
            StoreUrl::parse(&format!("postgres://abada:{PASSWORD}@db.example:6543/runs")).unwrap();
        assert_eq!(url.ssl_mode(), SslMode::Prefer);
        assert_eq!(
            url.redacted(),
            "postgres://db.example:6543/runs?sslmode=prefer"
        );
        assert_eq!(url.config().get_user(), Some("abada"));
        assert_eq!(url.config().get_password(), Some(PASSWORD.as_bytes()));
        no_password(&format!("{url} {url:?}"));
    }

    #[test]
    fn every_sslmode_is_understood_and_strictly_spelled() {
        for (value, mode) in [
            ("disable", SslMode::Disable),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify-ca", SslMode::VerifyCa),
            ("verify-full", SslMode::VerifyFull),
        ] {
            let url = StoreUrl::parse(&format!("postgresql://h/db?sslmode={value}")).unwrap();
            assert_eq!(url.ssl_mode(), mode);
            assert!(url.redacted().ends_with(&format!("sslmode={value}")));
        }
        for bad in ["VERIFY-FULL", "verify_full", "true", "", "on"] {
            let e = StoreUrl::parse(&format!("postgres://h/db?sslmode={bad}")).unwrap_err();
            assert_eq!(e, UrlError::SslModeInvalid, "{bad}");
            assert!(
                e.to_string()
                    .contains("disable, prefer, require, verify-ca, verify-full")
            );
        }
        assert_eq!(
            StoreUrl::parse("postgres://h/db?sslmode=allow").unwrap_err(),
            UrlError::SslModeUnsupported("allow")
        );
        assert_eq!(
            StoreUrl::parse("postgres://h/db?sslmode=require&sslmode=disable").unwrap_err(),
            UrlError::SslModeTwice
        );
    }

    #[test]
    fn bad_urls_are_refused_without_echoing_them() {
        let cases = [
            (format!("mysql://u:{PASSWORD}@h/db"), UrlError::Scheme),
            (format!("http://u:{PASSWORD}@h/db"), UrlError::Scheme),
            (
                format!("postgres://u:{PASSWORD}@h/db?sslrootcert=/ca.pem"),
                UrlError::TlsFileParameter("sslrootcert"),
            ),
            (
                format!("postgres://u:{PASSWORD}@h/db?sslkey=/k"),
                UrlError::TlsFileParameter("sslkey"),
            ),
            (
                format!("postgres://u:{PASSWORD}@h/db?pw-marker-7f3a=1"),
                UrlError::UnknownParameter,
            ),
            (
                format!("postgres://u:{PASSWORD}@h/db#x"),
                UrlError::Fragment,
            ),
        ];
        for (raw, expected) in cases {
            let e = StoreUrl::parse(&raw).unwrap_err();
            assert_eq!(e, expected, "{raw}");
            no_password(&format!("{e} {e:?}"));
        }
        let e = StoreUrl::parse(&format!("postgres://u:{PASSWORD}@h:notaport/db")).unwrap_err();
        assert!(matches!(e, UrlError::Invalid(_)), "{e:?}");
        no_password(&format!("{e} {e:?}"));
        let e = StoreUrl::parse(&format!("postgres://u:{PASSWORD}@h/db?port=x")).unwrap_err();
        assert!(matches!(e, UrlError::Invalid(_)), "{e:?}");
        no_password(&format!("{e} {e:?}"));
    }

    #[test]
    fn a_password_with_raw_reserved_characters_never_leaks() {
        // Not valid URL syntax, but people write it: the last '@' ends the user information.
        let raw = "postgres://abada:pw-marker-7f3a@?&=/#x@db:5432/runs?sslmode=require";
        let url = StoreUrl::parse(raw);
        match url {
            Ok(url) => no_password(&format!("{url} {url:?}")),
            Err(e) => no_password(&format!("{e} {e:?}")),
        }
        let raw = "postgres://abada:pw-marker-7f3a@?x=1@db:5432/runs";
        match StoreUrl::parse(raw) {
            Ok(url) => no_password(&format!("{url} {url:?}")),
            Err(e) => no_password(&format!("{e} {e:?}")),
        }
    }

    #[test]
    fn a_password_parameter_is_used_and_never_printed() {
        let url = StoreUrl::parse(&format!(
            "postgres://h:5432/db?user=abada&password={PASSWORD}&application_name=x"
        ))
        .unwrap();
        assert_eq!(url.config().get_password(), Some(PASSWORD.as_bytes()));
        no_password(&format!("{url} {url:?}"));
    }

    #[test]
    fn several_hosts_and_ipv6_are_shown_with_their_ports() {
        let url = StoreUrl::parse("postgres://u@a:1,b:2/db?sslmode=verify-full").unwrap();
        assert_eq!(url.redacted(), "postgres://a:1,b:2/db?sslmode=verify-full");
        let url = StoreUrl::parse("postgres://u@[::1]:7/db").unwrap();
        assert_eq!(url.redacted(), "postgres://[::1]:7/db?sslmode=prefer");
    }

    #[test]
    fn a_url_without_a_host_is_refused() {
        assert_eq!(
            StoreUrl::parse("postgres:///db").unwrap_err(),
            UrlError::NoHost
        );
    }
}
