//! Where tool traffic may never go: link-local addresses (169.254.0.0/16, fe80::/10) and the
//! cloud providers' instance-metadata services, by address or by name. A tool server's URL comes
//! from an agent definition, which the engine may send: without this guard, a definition could
//! point the worker (and the credential it sends) at the metadata service of the node it runs
//! on.
//!
//! Two checks, because reqwest resolves names only: [`check_url`] refuses a URL whose host is a
//! forbidden name or address literal before anything is sent (an IP literal never reaches a DNS
//! resolver), and [`GuardedResolver`], installed on the tools' HTTP client, resolves every host
//! name at connect time and refuses it when any address it resolves to is forbidden. Checking at
//! connect time, not when the definition is read, leaves no window between the check and the
//! connection in which the name could be made to resolve elsewhere (DNS rebinding).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};

use crate::channel::is_localhost;

/// Host names of instance-metadata services (lower case, no trailing dot). Most resolve to a
/// link-local address, refused by address too; Equinix Metal's resolves to a public one.
const METADATA_NAMES: &[&str] = &[
    "metadata.google.internal",
    "metadata.goog",
    "metadata",
    "instance-data",
    "instance-data.ec2.internal",
    "metadata.tencentyun.com",
    "api.metadata.cloud.ibm.com",
    "metadata.platformequinix.com",
];

/// Metadata addresses outside the link-local ranges.
const METADATA_ADDRESSES: &[IpAddr] = &[
    // AWS instance metadata over IPv6 (IMDS), and the other instance service of that range.
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0023)),
    // Google Cloud's metadata server over IPv6.
    IpAddr::V6(Ipv6Addr::new(0xfd20, 0x00ce, 0, 0, 0, 0, 0, 0x0254)),
    // Alibaba Cloud.
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    // Azure's wireserver (host agent, extension configuration, certificates).
    IpAddr::V4(Ipv4Addr::new(168, 63, 129, 16)),
    // Oracle Cloud Infrastructure Classic.
    IpAddr::V4(Ipv4Addr::new(192, 0, 0, 192)),
];

/// Why a tool server address is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ForbiddenAddress {
    #[error(
        "{host} is a link-local or cloud-metadata address, which tool traffic never goes to; give the tool server's own address"
    )]
    Address { host: String },
    #[error(
        "{host} resolves to {address}, a link-local or cloud-metadata address, which tool traffic never goes to"
    )]
    Resolved { host: String, address: IpAddr },
    #[error(
        "{host} resolves to {address}, which is not a loopback address: the name localhost is trusted as loopback only when it resolves to loopback addresses only; fix the host's resolver or give 127.0.0.1"
    )]
    LocalhostNotLoopback { host: String, address: IpAddr },
}

/// True for an address tool traffic must never reach: a link-local or metadata address, or an
/// IPv6 address that carries one of those IPv4 addresses in a form that reaches it
/// ([`embedded_ipv4`]).
pub(crate) fn is_forbidden_ip(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_forbidden_v4(v4),
        IpAddr::V6(v6) => {
            METADATA_ADDRESSES.contains(&ip)
                || v6.is_unicast_link_local()
                || embedded_ipv4(v6).into_iter().any(is_forbidden_v4)
        }
    }
}

fn is_forbidden_v4(v4: Ipv4Addr) -> bool {
    v4.is_link_local() || METADATA_ADDRESSES.contains(&IpAddr::V4(v4))
}

/// The IPv4 addresses an IPv6 address may stand for, in every form by which a connection to it
/// can reach that IPv4 host: IPv4-mapped (`::ffff:a.b.c.d`), IPv4-translated
/// (`::ffff:0:a.b.c.d`, RFC 6145), IPv4-compatible (`::a.b.c.d`, deprecated but still routed by
/// some stacks), and NAT64: the well-known prefix `64:ff9b::/96` and the local-use
/// `64:ff9b:1::/48` (RFC 8215), read at each prefix length RFC 6052 allows inside it (/48, /56,
/// /64, /96), since the translator's length is not known here.
pub(crate) fn embedded_ipv4(v6: Ipv6Addr) -> Vec<Ipv4Addr> {
    let o = v6.octets();
    let v4 = |a: u8, b: u8, c: u8, d: u8| Ipv4Addr::new(a, b, c, d);
    let last = v4(o[12], o[13], o[14], o[15]);
    let s = v6.segments();
    let mut found = Vec::new();
    // ::/96 (compatible), ::ffff:0:0/96 (mapped), ::ffff:0:0:0/96 (translated).
    if s[..5] == [0; 5] && (s[5] == 0 || s[5] == 0xffff) && !(s[5] == 0 && s[6] == 0) {
        found.push(last);
    }
    if s[..4] == [0; 4] && s[4] == 0xffff && s[5] == 0 {
        found.push(last);
    }
    // 64:ff9b::/96, the well-known NAT64 prefix.
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        found.push(last);
    }
    // 64:ff9b:1::/48, local-use NAT64 prefixes of any RFC 6052 length (octet 8 is reserved).
    if s[..3] == [0x64, 0xff9b, 1] {
        found.push(v4(o[6], o[7], o[9], o[10]));
        found.push(v4(o[7], o[9], o[10], o[11]));
        found.push(v4(o[9], o[10], o[11], o[12]));
        found.push(last);
    }
    found
}

/// True for a host name of a metadata service.
fn is_metadata_name(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    METADATA_NAMES.contains(&host.as_str())
}

/// Refuses a URL whose host is a forbidden address literal or metadata name. Names that merely
/// resolve to a forbidden address are refused at connect time by [`GuardedResolver`].
pub(crate) fn check_url(url: &reqwest::Url) -> Result<(), ForbiddenAddress> {
    let host = url.host_str().unwrap_or_default();
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .trim_end_matches('.');
    let forbidden = is_metadata_name(bare) || bare.parse::<IpAddr>().is_ok_and(is_forbidden_ip);
    if forbidden {
        return Err(ForbiddenAddress::Address {
            host: host.to_string(),
        });
    }
    Ok(())
}

/// Resolves host names for the tools' HTTP client and refuses a name when any of its addresses
/// is forbidden (one forbidden address among good ones is a sign of rebinding, not a choice).
#[derive(Clone)]
pub struct GuardedResolver {
    inner: Arc<dyn Resolve>,
}

impl GuardedResolver {
    /// The system resolver behind the guard.
    pub fn system() -> Self {
        GuardedResolver::over(Arc::new(SystemResolver))
    }

    /// `inner` behind the guard (tests give a resolver of their own).
    pub fn over(inner: Arc<dyn Resolve>) -> Self {
        GuardedResolver { inner }
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_string();
        if is_metadata_name(&host) {
            return Box::pin(async move { Err(Box::new(ForbiddenAddress::Address { host }) as _) });
        }
        let resolving = self.inner.resolve(name);
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = resolving.await?.collect();
            if let Some(bad) = addrs.iter().find(|a| is_forbidden_ip(a.ip())) {
                return Err(Box::new(ForbiddenAddress::Resolved {
                    host,
                    address: bad.ip(),
                }) as _);
            }
            // `localhost` is the one name the channel rule trusts as loopback
            // (`crate::channel`): it is, here, only when every address it resolves to is.
            if is_localhost(&host)
                && let Some(bad) = addrs.iter().find(|a| !a.ip().to_canonical().is_loopback())
            {
                return Err(Box::new(ForbiddenAddress::LocalhostNotLoopback {
                    host,
                    address: bad.ip(),
                }) as _);
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// The operating system's resolver (getaddrinfo on a blocking thread, as reqwest's default).
struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            // Port 0: reqwest puts the URL's port in.
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// Finds a [`ForbiddenAddress`] among an error and its sources (reqwest wraps the resolver's).
pub(crate) fn find_forbidden<'a>(
    top: &'a (dyn std::error::Error + 'static),
) -> Option<&'a ForbiddenAddress> {
    let mut current = Some(top);
    while let Some(error) = current {
        if let Some(found) = error.downcast_ref::<ForbiddenAddress>() {
            return Some(found);
        }
        current = error.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    #[test]
    fn link_local_and_metadata_addresses_are_forbidden_and_others_are_not() {
        for bad in [
            "169.254.169.254",
            "169.254.0.1",
            "169.254.170.2",
            "fe80::1",
            "febf::1",
            "fd00:ec2::254",
            "100.100.100.200",
            "::ffff:169.254.169.254",
        ] {
            assert!(is_forbidden_ip(bad.parse().unwrap()), "{bad}");
        }
        for good in [
            "127.0.0.1",
            "10.0.0.1",
            "::1",
            "fd00::1",
            "8.8.8.8",
            "fec0::1",
        ] {
            assert!(!is_forbidden_ip(good.parse().unwrap()), "{good}");
        }
    }

    #[test]
    fn urls_naming_a_forbidden_host_are_refused_before_anything_is_sent() {
        for bad in [
            "http://169.254.169.254/latest/meta-data",
            "http://[fe80::1%25eth0]:8080/mcp",
            "http://[fd00:ec2::254]/",
            "http://[::ffff:169.254.169.254]/",
            "http://metadata.google.internal/computeMetadata/v1",
            "http://METADATA.google.internal./",
            "https://instance-data/",
        ] {
            let Ok(url) = reqwest::Url::parse(bad) else {
                // A zone id is not valid in a URL: refused by the parser already.
                continue;
            };
            assert!(check_url(&url).is_err(), "{bad}");
        }
        for good in ["http://127.0.0.1:1/mcp", "https://orders-mcp:8080/mcp"] {
            assert_eq!(check_url(&reqwest::Url::parse(good).unwrap()), Ok(()));
        }
    }

    /// The metadata endpoints the list missed, and the IPv6 forms that carry a
    /// forbidden IPv4 address to it (mapped, translated, compatible, NAT64 at every prefix
    /// length of the local-use range).
    #[test]
    fn every_form_of_a_metadata_address_is_forbidden() {
        for bad in [
            // Azure wireserver, AWS IMDS over IPv6 (both its addresses), GCP over IPv6,
            // Alibaba, Oracle Classic.
            "168.63.129.16",
            "fd00:ec2::23",
            "fd00:ec2::254",
            "fd20:ce::254",
            "100.100.100.200",
            "192.0.0.192",
            // IPv4-mapped, -translated and -compatible forms.
            "::ffff:169.254.169.254",
            "::ffff:168.63.129.16",
            "::ffff:0:169.254.169.254",
            "::169.254.169.254",
            "::a9fe:a9fe",
            "::ffff:100.100.100.200",
            // NAT64, well-known prefix.
            "64:ff9b::169.254.169.254",
            "64:ff9b::a83f:8110",
            // NAT64, local-use prefix 64:ff9b:1::/48 read as /96, /64, /56 and /48.
            "64:ff9b:1::169.254.169.254",
            "64:ff9b:1:0:a9:fea9:fe00:0",
            "64:ff9b:1:a9:fe:a9fe::",
            "64:ff9b:1:a9fe:a9:fe00::",
            "64:ff9b:1:a83f:81:1000::",
        ] {
            let ip: IpAddr = bad.parse().unwrap();
            assert!(is_forbidden_ip(ip), "{bad}");
            let url = reqwest::Url::parse(&match ip {
                IpAddr::V4(_) => format!("http://{bad}:8080/mcp"),
                IpAddr::V6(_) => format!("http://[{bad}]:8080/mcp"),
            })
            .unwrap();
            assert!(check_url(&url).is_err(), "{url}");
        }
        // The same prefixes carrying an ordinary address, and neighbours of the endpoints.
        for good in [
            "::ffff:10.0.0.1",
            "::ffff:127.0.0.1",
            "64:ff9b::8.8.8.8",
            "64:ff9b:1::10.1.2.3",
            "::1",
            "::",
            "fd00:ec2::1",
            "fd20:ce::1",
            "168.63.129.17",
            "100.100.100.201",
            "2002:a9fe:a9fe::1",
        ] {
            assert!(!is_forbidden_ip(good.parse().unwrap()), "{good}");
        }
    }

    /// The URL parser turns every spelling of an IPv4 host into its dotted form, and of a
    /// name into lower case without percent-encoding, before the check sees it.
    #[test]
    fn other_spellings_of_a_forbidden_host_are_refused() {
        for bad in [
            "http://2852039166/",
            "http://0xa9fea9fe/",
            "http://0251.0376.0251.0376/",
            "http://169.254.43518/",
            "http://169.254.169.254./",
            "http://%31%36%39.254.169.254/",
            "http://metadata%2egoogle.internal/",
            "http://Metadata.Google.Internal./",
            "http://[::FFFF:A9FE:A9FE]/",
            "http://metadata.tencentyun.com/",
            "http://metadata.platformequinix.com/metadata",
        ] {
            let url = reqwest::Url::parse(bad).unwrap();
            assert!(check_url(&url).is_err(), "{bad} parsed as {url}");
        }
    }

    /// Answers every name with fixed addresses.
    struct Fixed(Vec<SocketAddr>);

    impl Resolve for Fixed {
        fn resolve(&self, _name: Name) -> Resolving {
            let addrs = self.0.clone();
            Box::pin(async move { Ok(Box::new(addrs.into_iter()) as Addrs) })
        }
    }

    async fn resolve(inner: Vec<&str>, name: &str) -> Result<Vec<SocketAddr>, String> {
        let inner = inner.into_iter().map(|a| a.parse().unwrap()).collect();
        let guard = GuardedResolver::over(Arc::new(Fixed(inner)));
        match guard.resolve(Name::from_str(name).unwrap()).await {
            Ok(addrs) => Ok(addrs.collect()),
            Err(e) => Err(e.to_string()),
        }
    }

    #[tokio::test]
    async fn the_resolver_refuses_names_resolving_to_any_forbidden_address() {
        assert_eq!(
            resolve(vec!["127.0.0.1:0"], "orders.test").await,
            Ok(vec!["127.0.0.1:0".parse().unwrap()])
        );
        let e = resolve(vec!["127.0.0.1:0", "169.254.169.254:0"], "orders.test")
            .await
            .unwrap_err();
        assert!(e.contains("orders.test resolves to 169.254.169.254"), "{e}");
        let e = resolve(vec!["[fe80::1]:0"], "orders.test")
            .await
            .unwrap_err();
        assert!(e.contains("fe80::1"), "{e}");
        let e = resolve(vec!["127.0.0.1:0"], "metadata.google.internal")
            .await
            .unwrap_err();
        assert!(e.contains("metadata.google.internal"), "{e}");
    }

    /// A resolver answer carrying a metadata address in an IPv6 form is refused like
    /// the address itself.
    #[tokio::test]
    async fn the_resolver_refuses_names_resolving_to_an_embedded_metadata_address() {
        for bad in [
            "[64:ff9b::a9fe:a9fe]:0",
            "[::ffff:168.63.129.16]:0",
            "[fd00:ec2::23]:0",
        ] {
            let e = resolve(vec!["127.0.0.1:0", bad], "orders.test")
                .await
                .unwrap_err();
            assert!(e.contains("orders.test resolves to"), "{bad}: {e}");
        }
    }

    /// `localhost` is loopback only when every address it resolves to is.
    #[tokio::test]
    async fn localhost_resolving_elsewhere_is_refused() {
        assert!(
            resolve(vec!["127.0.0.1:0", "[::1]:0"], "localhost")
                .await
                .is_ok()
        );
        assert!(
            resolve(vec!["[::ffff:127.0.0.1]:0"], "localhost.")
                .await
                .is_ok()
        );
        for name in ["localhost", "LOCALHOST.", "localhost."] {
            let e = resolve(vec!["127.0.0.1:0", "10.0.0.7:0"], name)
                .await
                .unwrap_err();
            assert!(
                e.contains("10.0.0.7, which is not a loopback address"),
                "{e}"
            );
        }
        // Another name may resolve anywhere (its channel rule treats it as remote).
        assert!(resolve(vec!["10.0.0.7:0"], "a.localhost").await.is_ok());
    }
}
