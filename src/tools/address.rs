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

/// Host names of instance-metadata services (lower case, no trailing dot).
const METADATA_NAMES: &[&str] = &[
    "metadata.google.internal",
    "metadata.goog",
    "metadata",
    "instance-data",
    "instance-data.ec2.internal",
];

/// Metadata addresses outside the link-local ranges: AWS over IPv6, Alibaba Cloud.
const METADATA_ADDRESSES: &[IpAddr] = &[
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
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
}

/// True for an address tool traffic must never reach. IPv4-mapped IPv6 addresses are judged as
/// the IPv4 address they carry.
pub fn is_forbidden_ip(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    if METADATA_ADDRESSES.contains(&ip) {
        return true;
    }
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    }
}

/// True for a host name of a metadata service.
fn is_metadata_name(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    METADATA_NAMES.contains(&host.as_str())
}

/// Refuses a URL whose host is a forbidden address literal or metadata name. Names that merely
/// resolve to a forbidden address are refused at connect time by [`GuardedResolver`].
pub fn check_url(url: &reqwest::Url) -> Result<(), ForbiddenAddress> {
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
}
