//! Secrets stay on their channel: whether a credential (the OIDC token and client secret, a tool
//! credential, a provider key) may be sent to a URL. Over `http://` it travels in clear, so it
//! is refused unless the host is loopback or the operator allowed it
//! (`ABADA_AGENT_ALLOW_INSECURE_HTTP=true`), in which case the worker says once at start-up what
//! travels in clear. Every place that sends a credential asks [`check`].

/// A credential that would travel in clear.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} would travel in clear to {url} (http:// to a host that is not loopback); use https://, or set ABADA_AGENT_ALLOW_INSECURE_HTTP=true to allow it"
)]
pub struct InsecureChannel {
    /// What would travel ("the OIDC client secret", "the credential for tool server orders").
    pub what: String,
    /// Where it would go: the URL's scheme, host and port ([`crate::redact::origin`]).
    pub url: String,
}

/// How a credential would travel to a URL that [`check`] let through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    /// https, or http to loopback: nothing leaves the host in clear.
    Protected,
    /// http to another host, allowed by the operator: say so.
    Clear,
}

/// Whether `what` may be sent to `url`: refused over http:// to a host that is not loopback
/// unless `allow_insecure` (then [`Channel::Clear`]). A URL that does not parse is refused too.
pub fn check(url: &str, what: &str, allow_insecure: bool) -> Result<Channel, InsecureChannel> {
    let refused = || InsecureChannel {
        what: what.to_string(),
        url: crate::redact::origin(url),
    };
    let parsed = reqwest::Url::parse(url.trim()).map_err(|_| refused())?;
    match parsed.scheme() {
        "https" => Ok(Channel::Protected),
        "http" if is_loopback(&parsed) => Ok(Channel::Protected),
        "http" if allow_insecure => Ok(Channel::Clear),
        _ => Err(refused()),
    }
}

/// A loopback address literal, or the name `localhost` itself. Names under it (`a.localhost`)
/// are not: a resolver may send them to DNS, which can answer any address. The tools' resolver
/// also refuses `localhost` when it resolves to an address that is not loopback
/// (the tools' guarded resolver).
fn is_loopback(url: &reqwest::Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => is_loopback_ip(ip),
        Err(_) => is_localhost(host),
    }
}

/// Whether an address is loopback: 127.0.0.0/8, `::1`, or the IPv4-mapped form of one
/// (`::ffff:127.0.0.1`), which reaches 127.0.0.1. The one notion of loopback by address that
/// every secret's channel uses (here and the run store's `sslmode` rules).
pub(crate) fn is_loopback_ip(ip: std::net::IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// True for the name `localhost` (any case, with or without the root's trailing dot); not for
/// names under it (`a.localhost`), which a resolver may send to DNS like any other.
pub(crate) fn is_localhost(host: &str) -> bool {
    host.trim_end_matches('.').eq_ignore_ascii_case("localhost")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_go_over_https_or_to_loopback_only() {
        for ok in [
            "https://issuer.example/realms/x",
            "http://127.0.0.1:8080/mcp",
            "http://[::1]:9/x",
            "http://localhost:3000",
            "http://LOCALHOST.:3000",
        ] {
            assert_eq!(check(ok, "x", false), Ok(Channel::Protected), "{ok}");
        }

        let err = check(
            "http://u:pw@orders:8080/mcp?k=1",
            "the tool credential",
            false,
        )
        .unwrap_err();
        assert_eq!(
            err.url, "http://orders:8080",
            "the origin only: a path may be a key"
        );
        let text = err.to_string();
        assert!(
            text.contains("the tool credential would travel in clear"),
            "{text}"
        );
        assert!(
            text.contains("ABADA_AGENT_ALLOW_INSECURE_HTTP=true"),
            "{text}"
        );
        assert!(!text.contains("pw") && !text.contains("k=1"), "{text}");
        assert_eq!(
            check("http://orders:8080/mcp", "x", true),
            Ok(Channel::Clear)
        );
        assert!(check("ftp://orders/x", "x", true).is_err());
        assert_eq!(
            check("http://[::ffff:127.0.0.1]:9/x", "x", false),
            Ok(Channel::Protected)
        );
        for remote in [
            "http://[::ffff:10.0.0.1]/x",
            "http://128.0.0.1/x",
            "http://[::2]/x",
        ] {
            assert!(check(remote, "x", false).is_err(), "{remote}");
        }
        assert!(check("not a url", "x", true).is_err());
    }

    /// A name under `localhost` is decided by its address, which this check does not
    /// know, so it is not loopback: a DNS answer for `evil.localhost` could be anywhere.
    #[test]
    fn a_name_under_localhost_is_not_trusted_as_loopback() {
        for clear in [
            "http://a.localhost/x",
            "http://evil.localhost.:8080/mcp",
            "http://localhost.evil.example/x",
        ] {
            assert!(check(clear, "x", false).is_err(), "{clear}");
            assert_eq!(check(clear, "x", true), Ok(Channel::Clear), "{clear}");
        }
    }
}
