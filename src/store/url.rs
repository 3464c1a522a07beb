//! The run store's URL (`ABADA_AGENT_STORE_URL`): one reading of it, tokio-postgres's, checked
//! so that no other reader could see another URL in the same text, and the TLS rules the worker
//! holds the password to.
//!
//! **One parser.** The URL is split once by tokio-postgres's own rules (the user information ends
//! at the first `@`, the hosts at the first `/` or `?`, the database name at the first `?`,
//! parameters at `&` and their first `=`), and whatever another reader could split differently
//! is refused: a raw `@` anywhere but at the end of the user information, a raw `/`, `?` or `#`
//! before that `@`, a `#` anywhere, a `%` that does not start an escape, a `+` in a parameter, a
//! space, a control or non-ASCII character, a percent-encoded host name, an empty or `=`-less
//! parameter, and a parameter named twice or restating a part of the URL. The text then goes,
//! without its `sslmode` (tokio-postgres knows no `verify-ca` or `verify-full`), to
//! `tokio_postgres::Config`'s parser, and every check runs on what it read. Errors name the part
//! of the URL that is wrong, never its value. The redacted form is rebuilt from the parsed
//! `Config`: hosts, ports, database, user and `sslmode`; never the password.
//!
//! **TLS that means it.** A store is *local* when every address the worker connects to is
//! loopback by address (127.0.0.0/8, `::1`, `crate::channel::is_loopback_ip`), given as an IP
//! literal host or as `hostaddr`, or a unix socket. A host name, `localhost` included, is remote:
//! the worker does not trust a name to resolve to this machine. For a remote store:
//! - the default `sslmode` is `verify-full`; `disable`, `prefer` and `require` are refused unless
//!   `ABADA_AGENT_STORE_ALLOW_INSECURE=true`;
//! - wherever TLS may be used, `channel_binding=require`: tokio-postgres then answers only
//!   SCRAM-SHA-256-PLUS bound to the certificate it saw, and refuses a request for a cleartext
//!   or MD5 password (and trust authentication) before sending anything. A weaker
//!   `channel_binding` in the URL is accepted with `verify-full` only (a cleartext or MD5
//!   password then goes to the verified server only, e.g. behind PgBouncer), or under
//!   `ABADA_AGENT_STORE_ALLOW_INSECURE=true`.
//!
//! A local store keeps libpq's defaults (`sslmode=prefer`, `channel_binding=prefer`): nobody is
//! in the middle of loopback.

use std::collections::HashSet;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use tokio_postgres::config::{ChannelBinding, Host};

/// How the connection uses TLS: libpq's `sslmode`, honoured as libpq does
/// (docs/OPERATIONS.md's `sslmode` table says what each mode does).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
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
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A part of a store URL, as errors name it (never with its value).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UrlPart {
    /// `user:password@`
    UserInfo,
    /// `host:port,host:port`
    Hosts,
    /// `/dbname`
    Database,
    /// `?name=value&...`
    Query,
}

impl fmt::Display for UrlPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UrlPart::UserInfo => "user information (user:password@)",
            UrlPart::Hosts => "host list",
            UrlPart::Database => "database name (the path)",
            UrlPart::Query => "query (?name=value&...)",
        })
    }
}

/// Why a store URL cannot be used. No variant carries any part of the URL except names from
/// fixed lists, so printing one can never reveal a password.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum UrlError {
    #[error("is not a PostgreSQL URL: it must start with postgres:// or postgresql://")]
    Scheme,
    #[error(
        "has a raw '@' where another URL reader would split it differently (in the host list, database name or query, or a second '@' in the user information, or a '/', '?' or '#' before the '@'): percent-encode every '@' but the one that ends the user information as %40, and '/', '?', '#' in the password as %2F, %3F, %23"
    )]
    AmbiguousAt,
    #[error("has {what} in the {part}: {remedy}")]
    Character {
        part: UrlPart,
        what: &'static str,
        remedy: &'static str,
    },
    #[error(
        "has sslmode={0}, which is not supported here: allowed disable, prefer, require, verify-ca, verify-full"
    )]
    SslModeUnsupported(&'static str),
    #[error(
        "has an sslmode value that is not one of disable, prefer, require, verify-ca, verify-full (lower case)"
    )]
    SslModeInvalid,
    #[error("names the parameter {0} twice: give it once")]
    Repeated(&'static str),
    #[error(
        "gives the {part} twice, in the URL and as the parameter {param}: give it once (another reader could take either)"
    )]
    Restated { param: &'static str, part: UrlPart },
    #[error(
        "has the parameter {0}, which is not supported here: trust roots come from ABADA_AGENT_CA_FILE, and client certificates are not supported"
    )]
    TlsFileParameter(&'static str),
    #[error(
        "has a query parameter that is not supported (allowed: {}); check its spelling (names are lower case, never percent-encoded)",
        ALLOWED_PARAMETERS.join(", ")
    )]
    UnknownParameter,
    #[error(
        "has a query entry that is not name=value (an empty one, or one without '='): separate parameters with one '&'"
    )]
    MalformedParameter,
    #[error("names no host: give one, e.g. postgres://user:password@db.example:5432/abada")]
    NoHost,
    #[error(
        "has a host that is neither an IP address, a DNS name nor a socket directory (/path, written %2Fpath)"
    )]
    HostName,
    #[error(
        "gives {hosts} host(s) but {count} {what}: give one per host (or a single port for all)"
    )]
    HostCount {
        hosts: usize,
        count: usize,
        what: &'static str,
    },
    #[error(
        "is read differently by tokio-postgres in the {0}: write it as a plain URL, percent-encoding reserved characters"
    )]
    Ambiguous(UrlPart),
    #[error(
        "has sslmode={mode} for a store that is not on a loopback address: {risk}. Use sslmode=verify-full (with ABADA_AGENT_CA_FILE for a private CA), or set ABADA_AGENT_STORE_ALLOW_INSECURE=true to accept that. A host name, even localhost, counts as remote: write 127.0.0.1 or [::1], or add hostaddr=127.0.0.1"
    )]
    Insecure { mode: SslMode, risk: &'static str },
    #[error(
        "has channel_binding={binding} with sslmode={mode} for a store that is not on a loopback address: without channel binding, the password (cleartext or MD5, if the server asks) could go to a server whose certificate does not name the host. Remove channel_binding (the worker then requires it), use sslmode=verify-full, or set ABADA_AGENT_STORE_ALLOW_INSECURE=true"
    )]
    WeakChannelBinding {
        binding: &'static str,
        mode: SslMode,
    },
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
pub(crate) struct StoreUrl {
    config: tokio_postgres::Config,
    ssl_mode: SslMode,
    exposure: Option<&'static str>,
    redacted: String,
}

impl StoreUrl {
    /// Parses and checks a URL, and applies the TLS rules (module docs); `allow_insecure` is
    /// `ABADA_AGENT_STORE_ALLOW_INSECURE`.
    pub fn parse(raw: &str, allow_insecure: bool) -> Result<StoreUrl, UrlError> {
        let raw = raw.trim();
        let split = Split::of(raw)?;
        let given = split.check()?;
        // tokio-postgres's parse errors name an option or a problem, never a value: the names
        // reaching it are all from ALLOWED_PARAMETERS.
        let mut config = tokio_postgres::Config::from_str(&split.without_sslmode())
            .map_err(|e| UrlError::Invalid(crate::errors::chain(&e)))?;
        split.agrees_with(&config)?;
        check_hosts(&config)?;
        let local = is_local(&config);
        let ssl_mode = given.ssl_mode.unwrap_or(if local {
            SslMode::Prefer
        } else {
            SslMode::VerifyFull
        });
        let exposure = if local {
            None
        } else {
            apply_remote_rules(&mut config, ssl_mode, given.channel_binding, allow_insecure)?
        };
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
            exposure,
            redacted,
        })
    }

    pub(crate) fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// Every address the worker connects to is loopback or a unix socket.
    #[cfg(test)]
    fn is_local(&self) -> bool {
        is_local(&self.config)
    }

    /// What `ABADA_AGENT_STORE_ALLOW_INSECURE=true` let through for this URL, for the one
    /// warning at start-up; `None` when the URL keeps the rules.
    pub(crate) fn exposure(&self) -> Option<&'static str> {
        self.exposure
    }

    /// The connection settings (the password inside; `tokio_postgres::Config`'s own `Debug`
    /// hides it too).
    pub(crate) fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// `postgres://user@host:port/dbname?sslmode=...`: no password, no other parameter.
    pub fn redacted(&self) -> &str {
        &self.redacted
    }
}

/// The rules for a store that is not local: refuses what they forbid, sets
/// `channel_binding=require` wherever TLS may be used, and returns what an allowed exception
/// exposes.
fn apply_remote_rules(
    config: &mut tokio_postgres::Config,
    mode: SslMode,
    binding: Option<ChannelBinding>,
    allow_insecure: bool,
) -> Result<Option<&'static str>, UrlError> {
    let risk = match mode {
        SslMode::Disable => Some(
            "the password and every prompt and answer travel in clear, and anyone in the middle can read and change them",
        ),
        SslMode::Prefer => Some(
            "anyone in the middle can refuse TLS or show any certificate, and read what then travels",
        ),
        SslMode::Require => Some(
            "the certificate is not checked: anyone in the middle can show their own and capture a SCRAM exchange, from which a weak password can be guessed offline",
        ),
        SslMode::VerifyCa | SslMode::VerifyFull => None,
    };
    if let Some(risk) = risk
        && !allow_insecure
    {
        return Err(UrlError::Insecure { mode, risk });
    }
    let mut exposure = risk.map(|_| match mode {
        SslMode::Disable => "the run-store connection is plain TCP to a remote host (sslmode=disable): the password may travel in clear",
        SslMode::Prefer => "the run-store connection may fall back to plain TCP and does not check the server's certificate (sslmode=prefer)",
        _ => "the run-store connection does not check the server's certificate (sslmode=require)",
    });
    match binding {
        // The worker's default wherever TLS may be used.
        None if mode != SslMode::Disable => {
            config.channel_binding(ChannelBinding::Require);
        }
        None | Some(ChannelBinding::Require) => {}
        Some(weak) => {
            if mode != SslMode::VerifyFull && mode != SslMode::Disable {
                let binding = match weak {
                    ChannelBinding::Disable => "disable",
                    _ => "prefer",
                };
                if !allow_insecure {
                    return Err(UrlError::WeakChannelBinding { binding, mode });
                }
                exposure.get_or_insert(
                    "the run-store password may go, cleartext or MD5, to a server whose certificate does not name the host (a weak channel_binding)",
                );
            }
        }
    }
    Ok(exposure)
}

/// Whether every address the worker connects to is loopback by address or a unix socket.
fn is_local(config: &tokio_postgres::Config) -> bool {
    let hostaddrs = config.get_hostaddrs();
    config
        .get_hosts()
        .iter()
        .enumerate()
        .all(|(i, host)| match (hostaddrs.get(i), host) {
            (Some(addr), _) => crate::channel::is_loopback_ip(*addr),
            (None, Host::Tcp(name)) => name
                .parse::<IpAddr>()
                .is_ok_and(crate::channel::is_loopback_ip),
            #[cfg(unix)]
            (None, Host::Unix(_)) => true,
        })
}

/// Hosts are IP addresses, DNS names or socket directories, and there are as many `hostaddr`
/// (and ports, unless one) as hosts: what tokio-postgres would otherwise refuse only when
/// connecting, or resolve in surprising ways.
fn check_hosts(config: &tokio_postgres::Config) -> Result<(), UrlError> {
    let hosts = config.get_hosts();
    if hosts.is_empty() {
        return Err(UrlError::NoHost);
    }
    for host in hosts {
        match host {
            Host::Tcp(name) if name.parse::<IpAddr>().is_ok() || is_dns_name(name) => {}
            Host::Tcp(_) => return Err(UrlError::HostName),
            #[cfg(unix)]
            Host::Unix(path) if path.is_absolute() => {}
            #[cfg(unix)]
            Host::Unix(_) => return Err(UrlError::HostName),
        }
    }
    let addrs = config.get_hostaddrs().len();
    if addrs != 0 && addrs != hosts.len() {
        return Err(UrlError::HostCount {
            hosts: hosts.len(),
            count: addrs,
            what: "hostaddr",
        });
    }
    let ports = config.get_ports().len();
    if ports > 1 && ports != hosts.len() {
        return Err(UrlError::HostCount {
            hosts: hosts.len(),
            count: ports,
            what: "ports",
        });
    }
    Ok(())
}

fn is_dns_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// What the URL itself says about TLS (`Config` cannot tell a default from a given value).
struct Given {
    ssl_mode: Option<SslMode>,
    channel_binding: Option<ChannelBinding>,
}

/// The raw URL cut where tokio-postgres cuts it.
struct Split<'a> {
    scheme: &'a str,
    user_info: Option<&'a str>,
    hosts: &'a str,
    database: Option<&'a str>,
    query: Vec<(&'a str, &'a str)>,
}

impl<'a> Split<'a> {
    fn of(raw: &'a str) -> Result<Split<'a>, UrlError> {
        let scheme = ["postgresql://", "postgres://"]
            .into_iter()
            .find(|s| raw.starts_with(s))
            .ok_or(UrlError::Scheme)?;
        let rest = &raw[scheme.len()..];
        // tokio-postgres: the user information ends at the first '@'. A reader of RFC 3986 ends
        // the authority at the first '/', '?' or '#', and the user information at the last '@'
        // before it. Both agree only with one '@', before any of those.
        let (user_info, after) = match rest.split_once('@') {
            Some((info, after)) => {
                if info.contains(['/', '?', '#']) || after.contains('@') {
                    return Err(UrlError::AmbiguousAt);
                }
                (Some(info), after)
            }
            None => (None, rest),
        };
        let hosts_end = after.find(['/', '?']).unwrap_or(after.len());
        let (hosts, mut tail) = after.split_at(hosts_end);
        let mut database = None;
        if let Some(path) = tail.strip_prefix('/') {
            let end = path.find('?').unwrap_or(path.len());
            database = Some(&path[..end]);
            tail = &path[end..];
        }
        let mut query = Vec::new();
        // A bare '?' is an empty query to every reader.
        if let Some(q) = tail.strip_prefix('?').filter(|q| !q.is_empty()) {
            for pair in q.split('&') {
                // tokio-postgres reads a name up to the next '=' whatever '&' lie between.
                let (name, value) = pair.split_once('=').ok_or(UrlError::MalformedParameter)?;
                if name.is_empty() {
                    return Err(UrlError::MalformedParameter);
                }
                query.push((name, value));
            }
        }
        Ok(Split {
            scheme,
            user_info,
            hosts,
            database,
            query,
        })
    }

    /// The characters of every part, the parameters' names and repetitions; reads `sslmode`
    /// and `channel_binding`.
    fn check(&self) -> Result<Given, UrlError> {
        if let Some(info) = self.user_info {
            check_characters(UrlPart::UserInfo, info, false)?;
            // tokio-postgres reads `user:@` as an empty password, URL readers as none.
            if info.ends_with(':') && info.matches(':').count() == 1 {
                return Err(UrlError::Character {
                    part: UrlPart::UserInfo,
                    what: "a ':' with no password after it",
                    remedy: "remove the ':' or write the password after it",
                });
            }
        }
        check_characters(UrlPart::Hosts, self.hosts, false)?;
        for chunk in self.hosts.split(',') {
            // Only a socket directory is percent-encoded (%2Fvar%2Frun%2Fpostgresql): an encoded
            // name or address is read differently by different parsers.
            if chunk.contains('%')
                && !chunk
                    .get(..3)
                    .is_some_and(|p| p.eq_ignore_ascii_case("%2F"))
            {
                return Err(UrlError::Character {
                    part: UrlPart::Hosts,
                    what: "a percent-encoded host name",
                    remedy: "write names and addresses plainly; only a socket directory is percent-encoded (%2Fvar%2Frun%2Fpostgresql)",
                });
            }
            // Brackets hold an IPv6 address and nothing else: tokio-postgres takes `[a]` as the
            // name `a`, a URL reader refuses it.
            if let Some(bracketed) = chunk.strip_prefix('[') {
                let inside = bracketed.split_once(']').map(|(inside, _)| inside);
                if inside.is_none_or(|a| a.parse::<std::net::Ipv6Addr>().is_err()) {
                    return Err(UrlError::Character {
                        part: UrlPart::Hosts,
                        what: "brackets around something that is not an IPv6 address",
                        remedy: "write an IPv6 address in brackets ([::1]) and a name or IPv4 address without them",
                    });
                }
            }
            // Rust reads `+5432` as a number, URL readers do not.
            let port = match chunk.strip_prefix('[') {
                Some(bracketed) => bracketed
                    .split_once(']')
                    .and_then(|(_, p)| p.strip_prefix(':')),
                None => chunk.split_once(':').map(|(_, p)| p),
            };
            if port.is_some_and(|p| !p.bytes().all(|b| b.is_ascii_digit())) {
                return Err(UrlError::Character {
                    part: UrlPart::Hosts,
                    what: "a port that is not written in digits",
                    remedy: "write the port as digits only, e.g. :5432",
                });
            }
        }
        if let Some(database) = self.database {
            check_characters(UrlPart::Database, database, false)?;
        }
        let mut seen = HashSet::new();
        let mut given = Given {
            ssl_mode: None,
            channel_binding: None,
        };
        for (name, value) in &self.query {
            check_characters(UrlPart::Query, name, true)?;
            check_characters(UrlPart::Query, value, true)?;
            if let Some(file) = TLS_FILE_PARAMETERS.iter().find(|n| *n == name) {
                return Err(UrlError::TlsFileParameter(file));
            }
            let name: &'static str = ALLOWED_PARAMETERS
                .iter()
                .find(|n| *n == name)
                .ok_or(UrlError::UnknownParameter)?;
            if !seen.insert(name) {
                return Err(UrlError::Repeated(name));
            }
            if let Some(part) = self.restates(name) {
                return Err(UrlError::Restated { param: name, part });
            }
            match name {
                "sslmode" => {
                    given.ssl_mode = Some(match SslMode::parse(value) {
                        Some(mode) => mode,
                        None if *value == "allow" => {
                            return Err(UrlError::SslModeUnsupported("allow"));
                        }
                        None => return Err(UrlError::SslModeInvalid),
                    });
                }
                "channel_binding" => {
                    // The value itself is checked by tokio-postgres.
                    given.channel_binding = match *value {
                        "disable" => Some(ChannelBinding::Disable),
                        "prefer" => Some(ChannelBinding::Prefer),
                        "require" => Some(ChannelBinding::Require),
                        _ => None,
                    };
                }
                // tokio-postgres takes a `host` parameter whole (no list), a comma would be
                // part of a name.
                "host" if value.contains(',') => return Err(UrlError::HostName),
                _ => {}
            }
        }
        Ok(given)
    }

    /// The part of the URL a parameter would give a second time, if it does.
    fn restates(&self, name: &str) -> Option<UrlPart> {
        let info = self.user_info.unwrap_or("");
        match name {
            "user" if !info.split(':').next().unwrap_or("").is_empty() => Some(UrlPart::UserInfo),
            "password" if info.contains(':') => Some(UrlPart::UserInfo),
            "dbname" if self.database.is_some_and(|d| !d.is_empty()) => Some(UrlPart::Database),
            "host" | "port" if !self.hosts.is_empty() => Some(UrlPart::Hosts),
            _ => None,
        }
    }

    /// The URL without its `sslmode` parameter, for tokio-postgres (which knows no
    /// `verify-ca` or `verify-full`; the mode is set on the parsed `Config`).
    fn without_sslmode(&self) -> String {
        let mut url = String::from(self.scheme);
        if let Some(info) = self.user_info {
            url.push_str(info);
            url.push('@');
        }
        url.push_str(self.hosts);
        if let Some(database) = self.database {
            url.push('/');
            url.push_str(database);
        }
        let kept: Vec<String> = self
            .query
            .iter()
            .filter(|(name, _)| *name != "sslmode")
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        if !kept.is_empty() {
            url.push('?');
            url.push_str(&kept.join("&"));
        }
        url
    }

    /// Fails closed should tokio-postgres have read the user, the password or the database name
    /// otherwise than this split.
    fn agrees_with(&self, config: &tokio_postgres::Config) -> Result<(), UrlError> {
        if let Some(info) = self.user_info {
            let (user, password) = match info.split_once(':') {
                Some((user, password)) => (user, Some(password)),
                None => (info, None),
            };
            let user = percent_encoding::percent_decode_str(user).decode_utf8_lossy();
            let password: Option<Vec<u8>> =
                password.map(|p| percent_encoding::percent_decode_str(p).collect());
            let password_param = self.query.iter().any(|(n, _)| *n == "password");
            let user_param = self.query.iter().any(|(n, _)| *n == "user");
            if (!user_param && config.get_user() != Some(&*user))
                || (!password_param && config.get_password() != password.as_deref())
            {
                return Err(UrlError::Ambiguous(UrlPart::UserInfo));
            }
        }
        if let Some(database) = self.database.filter(|d| !d.is_empty()) {
            let database = percent_encoding::percent_decode_str(database).decode_utf8_lossy();
            if config.get_dbname() != Some(&*database) {
                return Err(UrlError::Ambiguous(UrlPart::Database));
            }
        }
        Ok(())
    }
}

/// Refuses what readers of URLs disagree on: spaces, controls and non-ASCII characters (some
/// encode them, some cut there), a `#` (a fragment to some, a character to tokio-postgres), a
/// `%` that starts no `%XX` escape (kept by some, refused by others), and in a parameter a `+`
/// (a space to form decoders, a plus to libpq).
fn check_characters(part: UrlPart, text: &str, in_query: bool) -> Result<(), UrlError> {
    // A WHATWG reader drops a `.` or `..` path segment (`%2e` too); tokio-postgres keeps it as
    // the database name.
    if part == UrlPart::Database
        && matches!(
            text.to_ascii_lowercase().replace("%2e", ".").as_str(),
            "." | ".."
        )
    {
        return Err(UrlError::Character {
            part,
            what: "a '.' or '..' name (a dot segment other readers remove)",
            remedy: "give the name in the dbname parameter instead (?dbname=...)",
        });
    }
    let bytes = text.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        let refused = |what, remedy| Err(UrlError::Character { part, what, remedy });
        match b {
            0..=0x20 | 0x7f => {
                return refused(
                    "a space or a control character",
                    "percent-encode it (a space is %20)",
                );
            }
            0x80.. => {
                return refused(
                    "a character outside ASCII",
                    "percent-encode its UTF-8 bytes",
                );
            }
            b'#' => return refused("a raw '#'", "percent-encode it as %23"),
            b'%' if !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit)) =>
            {
                return refused(
                    "a '%' that does not start a %XX escape",
                    "write a literal '%' as %25",
                );
            }
            // A WHATWG reader removes `.` and `..` segments from a path; tokio-postgres keeps
            // the name as written.
            b'/' if part == UrlPart::Database => {
                return refused("a raw '/'", "percent-encode it as %2F");
            }
            b'+' if in_query => {
                return refused(
                    "a raw '+'",
                    "percent-encode it as %2B (and a space as %20, never '+')",
                );
            }
            _ => {}
        }
    }
    Ok(())
}

/// Bytes kept as they are in the redacted form; everything else is percent-encoded, so the
/// printed URL is unambiguous too.
const REDACTED_KEEP: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Built from the parsed `Config`: user, hosts, ports, database and `sslmode`; never the
/// password or another parameter.
fn redact(config: &tokio_postgres::Config, mode: SslMode) -> String {
    let encode = |text: &[u8]| percent_encoding::percent_encode(text, REDACTED_KEEP).to_string();
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
                Host::Tcp(name) => format!("{}:{port}", encode(name.as_bytes())),
                #[cfg(unix)]
                Host::Unix(path) => {
                    use std::os::unix::ffi::OsStrExt;
                    format!("{}:{port}", encode(path.as_os_str().as_bytes()))
                }
            }
        })
        .collect();
    let user = config
        .get_user()
        .map(|u| format!("{}@", encode(u.as_bytes())))
        .unwrap_or_default();
    let dbname = encode(config.get_dbname().unwrap_or("").as_bytes());
    format!(
        "postgres://{user}{}/{dbname}?sslmode={}",
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
            !text.contains("pw-marker") && !text.contains("7f3a"),
            "part of the password leaked: {text}"
        );
    }

    /// Strict rules (no insecure allowance).
    fn parse(raw: &str) -> Result<StoreUrl, UrlError> {
        StoreUrl::parse(raw, false)
    }

    #[test]
    fn a_plain_url_parses_and_prints_without_the_password() {
        let url = parse(&format!("postgres://abada:{PASSWORD}@db.example:6543/runs")).unwrap();
        assert_eq!(url.ssl_mode(), SslMode::VerifyFull, "remote: verify-full");
        assert_eq!(
            url.redacted(),
            "postgres://abada@db.example:6543/runs?sslmode=verify-full"
        );
        assert_eq!(url.config().get_user(), Some("abada"));
        assert_eq!(url.config().get_password(), Some(PASSWORD.as_bytes()));
        assert_eq!(url.config().get_channel_binding(), ChannelBinding::Require);
        assert!(!url.is_local());
        assert_eq!(url.exposure(), None);
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
            let url = parse(&format!("postgresql://127.0.0.1/db?sslmode={value}")).unwrap();
            assert_eq!(url.ssl_mode(), mode);
            assert!(url.redacted().ends_with(&format!("sslmode={value}")));
        }
        for bad in ["VERIFY-FULL", "verify_full", "true", "", "on"] {
            let e = parse(&format!("postgres://h/db?sslmode={bad}")).unwrap_err();
            assert_eq!(e, UrlError::SslModeInvalid, "{bad}");
            assert!(
                e.to_string()
                    .contains("disable, prefer, require, verify-ca, verify-full")
            );
        }
        assert_eq!(
            parse("postgres://h/db?sslmode=allow").unwrap_err(),
            UrlError::SslModeUnsupported("allow")
        );
        assert_eq!(
            parse("postgres://h/db?sslmode=require&sslmode=disable").unwrap_err(),
            UrlError::Repeated("sslmode")
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
                format!("postgres://u:{PASSWORD}@h/db?ssl%6dode=disable"),
                UrlError::UnknownParameter,
            ),
        ];
        for (raw, expected) in cases {
            let e = parse(&raw).unwrap_err();
            assert_eq!(e, expected, "{raw}");
            no_password(&format!("{e} {e:?}"));
        }
        let e = parse(&format!("postgres://u:{PASSWORD}@h:notaport/db")).unwrap_err();
        assert!(
            matches!(
                e,
                UrlError::Character {
                    part: UrlPart::Hosts,
                    ..
                }
            ),
            "{e:?}"
        );
        no_password(&format!("{e} {e:?}"));
        let e = parse(&format!("postgres://u:{PASSWORD}@h:99999/db")).unwrap_err();
        assert!(matches!(e, UrlError::Invalid(_)), "{e:?}");
        no_password(&format!("{e} {e:?}"));
    }

    /// tokio-postgres ends the user information at the first '@', the old
    /// parser at the last. A raw '@' in the query made the worker see no query at all (and
    /// `sslmode=require` became `prefer`); one in the password printed its tail.
    #[test]
    fn a_raw_at_sign_anywhere_but_the_end_of_the_user_information_is_refused() {
        for raw in [
            // In the query, with and without user information.
            "postgres://u:pw-marker-7f3a@db/runs?application_name=worker@prod&sslmode=require",
            "postgres://db/runs?user=name@server&password=pw-marker-7f3a&sslmode=require",
            "postgres://db/runs?sslmode=require&password=pw-marker@7f3a",
            // In the password, raw.
            "postgres://abada:pw-marker@7f3a@db:5432/runs?sslmode=verify-full",
            "postgres://abada:pw-marker-7f3a@@db:5432/runs",
            // In the database name.
            "postgres://u:pw-marker-7f3a@db/ru@ns",
            // A '/' or '?' in the password before the '@'.
            "postgres://abada:pw-marker/7f3a@db/runs",
            "postgres://abada:pw-marker?7f3a@db/runs",
            "postgres://abada:pw-marker-7f3a@?&=/#x@db:5432/runs?sslmode=require",
        ] {
            let e = parse(raw).unwrap_err();
            assert_eq!(e, UrlError::AmbiguousAt, "{raw}");
            no_password(&format!("{e} {e:?}"));
            let text = e.to_string();
            assert!(text.contains("%40"), "the remedy is said: {text}");
        }
        // Percent-encoded, the same URLs are read one way by everyone.
        let url = parse(
            "postgres://db.example/runs?user=name%40server&password=pw-marker%407f3a&application_name=worker%40prod",
        )
        .unwrap();
        assert_eq!(url.config().get_user(), Some("name@server"));
        assert_eq!(url.config().get_password(), Some(&b"pw-marker@7f3a"[..]));
        assert_eq!(url.config().get_application_name(), Some("worker@prod"));
        assert_eq!(url.ssl_mode(), SslMode::VerifyFull);
        assert_eq!(
            url.redacted(),
            "postgres://name%40server@db.example:5432/runs?sslmode=verify-full"
        );
        no_password(&format!("{url} {url:?}"));
        let url =
            parse("postgres://abada:pw-marker%407f3a@127.0.0.1/runs?sslmode=require").unwrap();
        assert_eq!(url.config().get_password(), Some(&b"pw-marker@7f3a"[..]));
        assert_eq!(url.ssl_mode(), SslMode::Require);
        no_password(&format!("{url} {url:?}"));
    }

    #[test]
    fn what_other_readers_could_split_differently_is_refused_naming_the_part() {
        let cases: &[(&str, UrlError)] = &[
            ("postgres://u:pw-marker#7f3a@db/runs", UrlError::AmbiguousAt),
            (
                "postgres://u:pw-marker-7f3a@db/runs#frag",
                UrlError::Character {
                    part: UrlPart::Database,
                    what: "a raw '#'",
                    remedy: "percent-encode it as %23",
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?application_name=a#b",
                UrlError::Character {
                    part: UrlPart::Query,
                    what: "a raw '#'",
                    remedy: "percent-encode it as %23",
                },
            ),
            (
                "postgres://u:pw-marker%g7f3a@db/runs",
                UrlError::Character {
                    part: UrlPart::UserInfo,
                    what: "a '%' that does not start a %XX escape",
                    remedy: "write a literal '%' as %25",
                },
            ),
            (
                "postgres://u:pw marker-7f3a@db/runs",
                UrlError::Character {
                    part: UrlPart::UserInfo,
                    what: "a space or a control character",
                    remedy: "percent-encode it (a space is %20)",
                },
            ),
            (
                "postgres://u:pw-marker-7f3a-é@db/runs",
                UrlError::Character {
                    part: UrlPart::UserInfo,
                    what: "a character outside ASCII",
                    remedy: "percent-encode its UTF-8 bytes",
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?application_name=a+b",
                UrlError::Character {
                    part: UrlPart::Query,
                    what: "a raw '+'",
                    remedy: "percent-encode it as %2B (and a space as %20, never '+')",
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db%2Eexample/runs",
                UrlError::Character {
                    part: UrlPart::Hosts,
                    what: "a percent-encoded host name",
                    remedy: "write names and addresses plainly; only a socket directory is percent-encoded (%2Fvar%2Frun%2Fpostgresql)",
                },
            ),
            // tokio-postgres would read the name `a&b`.
            (
                "postgres://u:pw-marker-7f3a@db/runs?a&sslmode=disable",
                UrlError::MalformedParameter,
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?sslmode=verify-full&",
                UrlError::MalformedParameter,
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?sslmode=verify-full&&user=x",
                UrlError::MalformedParameter,
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?password=other",
                UrlError::Restated {
                    param: "password",
                    part: UrlPart::UserInfo,
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?user=other",
                UrlError::Restated {
                    param: "user",
                    part: UrlPart::UserInfo,
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?dbname=other",
                UrlError::Restated {
                    param: "dbname",
                    part: UrlPart::Database,
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?host=evil.example",
                UrlError::Restated {
                    param: "host",
                    part: UrlPart::Hosts,
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/runs?application_name=a&application_name=b",
                UrlError::Repeated("application_name"),
            ),
            ("postgres://u:pw-marker-7f3a@db!x/runs", UrlError::HostName),
            (
                "postgres://u:pw-marker-7f3a@/runs?host=a,b",
                UrlError::HostName,
            ),
            (
                "postgres://u:pw-marker-7f3a@a,b/runs?hostaddr=127.0.0.1",
                UrlError::HostCount {
                    hosts: 2,
                    count: 1,
                    what: "hostaddr",
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/.",
                UrlError::Character {
                    part: UrlPart::Database,
                    what: "a '.' or '..' name (a dot segment other readers remove)",
                    remedy: "give the name in the dbname parameter instead (?dbname=...)",
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/..",
                UrlError::Character {
                    part: UrlPart::Database,
                    what: "a '.' or '..' name (a dot segment other readers remove)",
                    remedy: "give the name in the dbname parameter instead (?dbname=...)",
                },
            ),
            (
                "postgres://u:pw-marker-7f3a@db/%2E%2e",
                UrlError::Character {
                    part: UrlPart::Database,
                    what: "a '.' or '..' name (a dot segment other readers remove)",
                    remedy: "give the name in the dbname parameter instead (?dbname=...)",
                },
            ),
        ];
        for (raw, expected) in cases {
            let e = match parse(raw) {
                Err(e) => e,
                Ok(url) => panic!("accepted {raw}: {url}"),
            };
            assert_eq!(&e, expected, "{raw}");
            no_password(&format!("{e} {e:?}"));
        }
    }

    #[test]
    fn a_password_parameter_is_used_and_never_printed() {
        let url = parse(&format!(
            "postgres://127.0.0.1:5432/db?user=abada&password={PASSWORD}&application_name=x"
        ))
        .unwrap();
        assert_eq!(url.config().get_password(), Some(PASSWORD.as_bytes()));
        assert_eq!(
            url.redacted(),
            "postgres://abada@127.0.0.1:5432/db?sslmode=prefer"
        );
        no_password(&format!("{url} {url:?}"));
    }

    #[test]
    fn several_hosts_ipv6_and_sockets_are_shown_with_their_ports() {
        let url = parse("postgres://u@a:1,b:2/db?sslmode=verify-full").unwrap();
        assert_eq!(
            url.redacted(),
            "postgres://u@a:1,b:2/db?sslmode=verify-full"
        );
        let url = parse("postgres://u@[::1]:7/db").unwrap();
        assert_eq!(url.redacted(), "postgres://u@[::1]:7/db?sslmode=prefer");
        let url = parse("postgres://u@%2Fvar%2Frun%2Fpostgresql/db").unwrap();
        assert!(url.is_local());
        assert_eq!(
            url.redacted(),
            "postgres://u@%2Fvar%2Frun%2Fpostgresql:5432/db?sslmode=prefer"
        );
        let url = parse("postgres://u@/db?host=%2Fvar%2Frun%2Fpostgresql").unwrap();
        assert!(url.is_local());
    }

    #[test]
    fn a_url_without_a_host_is_refused() {
        assert_eq!(parse("postgres:///db").unwrap_err(), UrlError::NoHost);
    }

    /// Loopback is decided by address: 127.0.0.0/8, ::1 (and its IPv4-mapped form), a
    /// `hostaddr`, or a unix socket. A name, `localhost` included, is remote.
    #[test]
    fn loopback_is_decided_by_address_and_names_are_remote() {
        for local in [
            "postgres://u@127.0.0.1/db",
            "postgres://u@127.1.2.3:5433/db",
            "postgres://u@[::1]/db",
            "postgres://u@[::ffff:127.0.0.1]/db",
            "postgres://u@localhost/db?hostaddr=127.0.0.1",
            "postgres://u@db.example/db?hostaddr=::1",
            "postgres://u@127.0.0.1,[::1]/db",
        ] {
            let url = parse(local).unwrap();
            assert!(url.is_local(), "{local}");
            assert_eq!(url.ssl_mode(), SslMode::Prefer, "{local}");
            assert_eq!(
                url.config().get_channel_binding(),
                ChannelBinding::Prefer,
                "{local}"
            );
            parse(&format!(
                "{local}{}sslmode=disable",
                if local.contains('?') { "&" } else { "?" }
            ))
            .unwrap();
        }
        for remote in [
            "postgres://u@localhost/db",
            "postgres://u@localhost./db",
            "postgres://u@a.localhost/db",
            "postgres://u@10.0.0.1/db",
            "postgres://u@[::ffff:10.0.0.1]/db",
            "postgres://u@127.0.0.1,db.example/db",
            "postgres://u@127.0.0.1/db?hostaddr=10.0.0.1",
        ] {
            let url = parse(remote).unwrap();
            assert!(!url.is_local(), "{remote}");
            assert_eq!(url.ssl_mode(), SslMode::VerifyFull, "{remote}");
        }
    }

    /// `prefer` and `require` gave the password to anyone in the
    /// middle, and `disable` sent it over plain TCP to any host.
    #[test]
    fn a_remote_store_without_verified_tls_is_refused_unless_allowed() {
        for mode in ["disable", "prefer", "require"] {
            let raw = format!("postgres://u:{PASSWORD}@db.example/runs?sslmode={mode}");
            let e = parse(&raw).unwrap_err();
            assert!(matches!(e, UrlError::Insecure { .. }), "{mode}: {e:?}");
            let text = e.to_string();
            assert!(
                text.contains("ABADA_AGENT_STORE_ALLOW_INSECURE=true")
                    && text.contains("sslmode=verify-full")
                    && text.contains("counts as remote"),
                "{text}"
            );
            no_password(&format!("{e} {e:?}"));
            let url = StoreUrl::parse(&raw, true).unwrap();
            assert!(url.exposure().is_some(), "{mode}");
            let binding = url.config().get_channel_binding();
            if mode == "disable" {
                assert_eq!(binding, ChannelBinding::Prefer);
            } else {
                assert_eq!(binding, ChannelBinding::Require, "{mode}");
            }
        }
        for mode in ["verify-ca", "verify-full"] {
            let url = parse(&format!("postgres://u@db.example/runs?sslmode={mode}")).unwrap();
            assert_eq!(url.config().get_channel_binding(), ChannelBinding::Require);
            assert_eq!(url.exposure(), None);
        }
    }

    #[test]
    fn channel_binding_is_required_over_tls_and_weakened_only_where_safe() {
        // verify-full: a cleartext or MD5 password goes to the verified server only.
        for binding in ["prefer", "disable"] {
            let url = parse(&format!(
                "postgres://u@db.example/runs?sslmode=verify-full&channel_binding={binding}"
            ))
            .unwrap();
            assert_ne!(url.config().get_channel_binding(), ChannelBinding::Require);
            assert_eq!(url.exposure(), None);
        }
        // verify-ca does not check the name: without binding, a certificate of another host
        // from the same CA could take the password.
        let raw = "postgres://u@db.example/runs?sslmode=verify-ca&channel_binding=prefer";
        assert_eq!(
            parse(raw).unwrap_err(),
            UrlError::WeakChannelBinding {
                binding: "prefer",
                mode: SslMode::VerifyCa
            }
        );
        assert!(StoreUrl::parse(raw, true).unwrap().exposure().is_some());
        let url = parse("postgres://u@db.example/runs?channel_binding=require").unwrap();
        assert_eq!(url.config().get_channel_binding(), ChannelBinding::Require);
        assert!(matches!(
            parse("postgres://u@db.example/runs?channel_binding=maybe").unwrap_err(),
            UrlError::Invalid(_)
        ));
    }

    /// Whether tokio-postgres (the raw text, with an sslmode it knows) and a WHATWG reader
    /// (`url::Url`, as reqwest and most tools read URLs) read an accepted URL as the worker
    /// does: user, password, hosts, port and database. `Ok(false)`: refused.
    fn read_alike(raw: &str) -> Result<bool, String> {
        // The worker trims the variable's value; the other readers get what it reads.
        let raw = raw.trim();
        let Ok(url) = StoreUrl::parse(raw, true) else {
            return Ok(false);
        };
        let ours = url.config();
        let mapped = raw
            .replace("sslmode=verify-full", "sslmode=require")
            .replace("sslmode=verify-ca", "sslmode=require");
        let theirs = tokio_postgres::Config::from_str(&mapped).map_err(|e| format!("{e}"))?;
        let same = |what: &str, a: String, b: String| {
            if a == b {
                Ok(())
            } else {
                Err(format!("{what}: the worker read {a}, the other reader {b}"))
            }
        };
        same(
            "user",
            format!("{:?}", ours.get_user()),
            format!("{:?}", theirs.get_user()),
        )?;
        same(
            "password",
            format!("{:?}", ours.get_password()),
            format!("{:?}", theirs.get_password()),
        )?;
        same(
            "hosts",
            format!("{:?}", ours.get_hosts()),
            format!("{:?}", theirs.get_hosts()),
        )?;
        same(
            "ports",
            format!("{:?}", ours.get_ports()),
            format!("{:?}", theirs.get_ports()),
        )?;
        same(
            "dbname",
            format!("{:?}", ours.get_dbname()),
            format!("{:?}", theirs.get_dbname()),
        )?;
        if ours.get_hosts().len() > 1 {
            // libpq's host lists are no WHATWG syntax: such a reader refuses them whole.
            return Ok(true);
        }
        let whatwg = reqwest::Url::parse(raw).map_err(|e| format!("WHATWG refused it: {e}"))?;
        let decode = |s: &str| percent_encoding::percent_decode_str(s).collect::<Vec<u8>>();
        let params: Vec<String> = whatwg.query_pairs().map(|(k, _)| k.into_owned()).collect();
        if !params.iter().any(|k| k == "user") {
            same(
                "user (WHATWG)",
                format!("{:?}", ours.get_user().map(|u| u.as_bytes().to_vec())),
                format!(
                    "{:?}",
                    Some(decode(whatwg.username())).filter(|u| !u.is_empty() || raw.contains('@'))
                ),
            )?;
        }
        if !params.iter().any(|k| k == "password") {
            same(
                "password (WHATWG)",
                format!("{:?}", ours.get_password()),
                format!("{:?}", whatwg.password().map(decode).as_deref()),
            )?;
        }
        if let [Host::Tcp(host)] = ours.get_hosts() {
            let host = if host.contains(':') {
                format!("[{host}]")
            } else {
                host.clone()
            };
            same(
                "host (WHATWG)",
                format!("{:?}", Some(host)),
                format!("{:?}", whatwg.host_str()),
            )?;
            same(
                "port (WHATWG)",
                format!("{:?}", ours.get_ports()),
                format!("{:?}", [whatwg.port().unwrap_or(5432)]),
            )?;
        }
        same(
            "dbname (WHATWG)",
            format!("{:?}", ours.get_dbname().unwrap_or("").as_bytes()),
            format!(
                "{:?}",
                decode(whatwg.path().strip_prefix('/').unwrap_or(whatwg.path()))
            ),
        )?;
        if !params.iter().any(|k| k == "sslmode")
            && ours.get_channel_binding() != ChannelBinding::Require
        {
            return Err("a remote URL without sslmode did not get channel_binding=require".into());
        }
        same(
            "fragment (WHATWG)",
            "None".into(),
            format!("{:?}", whatwg.fragment()),
        )?;
        Ok(true)
    }

    /// Every URL accepted is read alike (above); a grid of the characters that split URLs.
    #[test]
    fn every_accepted_url_is_read_alike_by_tokio_postgres_and_a_whatwg_parser() {
        let pieces = [
            "", "a", "@", ":", "/", "?", "#", "%", "%40", "%2F", "&", "=", "+", " ", "é", "[", "]",
            ",", "%25", "%3F", "x@y", ".", "-", "_", "~", "!", "$", "'", "(", "*", ";", "..", "\\",
            "%00", "%ff",
        ];
        let mut accepted = 0;
        for a in pieces {
            for b in pieces {
                for raw in [
                    format!(
                        "postgres://us{a}er:pa{b}ss@db.example:5432/da{a}ta?application_name=x{b}y"
                    ),
                    format!("postgres://user:pass{a}{b}@db{a}.example/data"),
                    format!("postgres://user{a}:{b}pass@db.example/data{b}?sslmode=verify-full{a}"),
                    format!("postgres://db.example/d{a}?user=u{b}&password=p{a}w"),
                    format!("postgresql://u{a}@db.example:{b}5432/x{a}{b}"),
                ] {
                    match read_alike(&raw) {
                        Ok(true) => accepted += 1,
                        Ok(false) => {}
                        Err(e) => panic!("{raw}: {e}"),
                    }
                }
            }
        }
        assert!(
            accepted > 100,
            "the grammar accepts ordinary URLs: {accepted}"
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        /// Random text made of the characters that split URLs: whatever the worker accepts,
        /// the other readers read alike.
        #[test]
        fn a_random_url_accepted_is_read_alike(
            body in "[a-z0-9@:/?#%&=+.,\\[\\] _-]{0,40}",
        ) {
            let raw = format!("postgres://{body}");
            if let Err(e) = read_alike(&raw) {
                proptest::prop_assert!(false, "{}: {}", raw, e);
            }
        }
    }
}
