//! Whether a tool server's URL reaches a registered server under another spelling, so that no
//! definition escapes the registry's `approval` or credential route through an alias.
//!
//! Two checks, as for forbidden addresses ([`super::address`]):
//! - by spelling, before anything is sent ([`Endpoint`]): the host without case, root dot or
//!   IPv4-mapped form, and the port with its default (`http://Orders.:80/x` is `orders:80`);
//! - by address, where a session to a server the registry does not list opens
//!   ([`AliasGuard::client_for`]): its host and every registered server's host are resolved,
//!   and a shared socket address (IP and port; every loopback or unspecified address counts
//!   as one, since each reaches this host's listeners) makes it the registered server. The session then
//!   connects with a client pinned to exactly the addresses checked, so a name cannot resolve
//!   elsewhere between the check and the connection (DNS rebinding).
//!
//! What an address cannot tell: a server also reachable at addresses its registered name does
//! not resolve to (a pod's own IP behind a Service, a NodePort, another interface of its host)
//! is not recognised there. The default, `ABADA_AGENT_TOOLS_UNREGISTERED=refuse`, has no such
//! gap: with a registry, only its servers are used.
//!
//! The path is not part of a server's identity here: a server may route `/mcp`, `/MCP`,
//! `/mcp;x` or `//mcp` alike, so a URL at a registered server's host and port is that server,
//! whatever its path. (A registered server named with its URL compares paths too, after
//! [`normalized_path`], since the registry's URL is used either way.)

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use reqwest::dns::{Name, Resolve};

use super::address::{self, ForbiddenAddress, GuardedResolver};

/// Builds the tool servers' client builder, with the worker's trust roots, for each pinned
/// client ([`crate::tools::pinned_http_client`]).
pub(crate) type ClientBuilderFactory = Arc<dyn Fn() -> reqwest::ClientBuilder + Send + Sync>;

/// A server's host and port, compared without their spelling.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Endpoint {
    host: Host,
    port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Host {
    Ip(IpAddr),
    /// Lower case, without the root's trailing dot.
    Name(String),
}

impl Endpoint {
    /// `None` for a URL without a host or a known port.
    pub(crate) fn of(url: &reqwest::Url) -> Option<Endpoint> {
        let port = url.port_or_known_default()?;
        let host = url.host_str().filter(|h| !h.is_empty())?;
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host)
            .trim_end_matches('.')
            .to_ascii_lowercase();
        // (A trailing dot on an IPv4 literal is dropped by the URL parser; on a name it is kept.)
        let host = match bare.parse::<IpAddr>() {
            Ok(ip) => Host::Ip(ip.to_canonical()),
            Err(_) => Host::Name(bare),
        };
        Some(Endpoint { host, port })
    }
}

/// `url`'s path with percent-encoded unreserved characters decoded, other escapes in upper
/// case, and no trailing slash (dot segments, `%2e` included, are removed by the URL parser).
pub(crate) fn normalized_path(url: &reqwest::Url) -> String {
    let raw = url.path();
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| raw.get(i + 1..i + 3))
            .flatten()
            .filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match escaped {
            Some(b) if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') => {
                out.push(char::from(b));
                i += 3;
            }
            Some(b) => {
                out.push_str(&format!("%{b:02X}"));
                i += 3;
            }
            None => {
                out.push(char::from(bytes[i]));
                i += 1;
            }
        }
    }
    while out.len() > 1 && out.ends_with('/') {
        out.pop();
    }
    if out == "/" {
        out.clear();
    }
    out
}

/// The address standing for every address that reaches the same listeners: any loopback or
/// unspecified address (`127.0.0.2`, `0.0.0.0`, `::`) reaches a server of this host listening
/// on every interface, so they are one host here. Other addresses stand for themselves.
fn same_host_as(address: SocketAddr) -> SocketAddr {
    let ip = address.ip().to_canonical();
    if ip.is_loopback() || ip.is_unspecified() {
        SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), address.port())
    } else {
        address
    }
}

/// Why a session to a server the registry does not list is not opened.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AliasRefusal {
    /// It reaches a registered server: the registry's name is the only way to it.
    #[error(
        "its URL reaches {address}, an address of tool server {registered:?} of ABADA_AGENT_TOOLS_FILE; nothing was sent. Name the server {registered:?} in the definition: the registry's credential and approval then apply"
    )]
    Registered {
        registered: String,
        address: SocketAddr,
    },
    #[error("{0}")]
    Forbidden(#[from] ForbiddenAddress),
    /// A host could not be resolved now; worth retrying.
    #[error(
        "cannot resolve {host} to tell it from the registered servers: {reason}; nothing was sent"
    )]
    Unresolved { host: String, reason: String },
    #[error("its URL has no host or port")]
    NoEndpoint,
    #[error("cannot build its HTTP client: {0}")]
    Client(String),
}

impl AliasRefusal {
    /// True when the same session may open later (a resolver outage, a client not built).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            AliasRefusal::Unresolved { .. } | AliasRefusal::Client(_)
        )
    }
}

/// The registered servers' addresses, checked where a session to a server the registry does
/// not list opens (`ABADA_AGENT_TOOLS_UNREGISTERED=allow`).
pub struct AliasGuard {
    registered: Vec<(String, reqwest::Url)>,
    resolver: Arc<dyn Resolve>,
    clients: ClientBuilderFactory,
}

impl AliasGuard {
    /// A guard over `registered` (name, URL), resolving through the system resolver behind
    /// [`GuardedResolver`], building pinned clients from `clients`.
    pub fn new(registered: Vec<(String, reqwest::Url)>, clients: ClientBuilderFactory) -> Self {
        AliasGuard {
            registered,
            resolver: Arc::new(GuardedResolver::system()),
            clients,
        }
    }

    /// Resolves through `inner` (behind the guard) instead: tests give their own DNS.
    pub(crate) fn with_resolver(mut self, inner: Arc<dyn Resolve>) -> Self {
        self.resolver = Arc::new(GuardedResolver::over(inner));
        self
    }

    /// The client a session to `url` (of a server the registry does not list) opens with:
    /// `shared` for an address literal (no resolution), otherwise one pinned to the addresses
    /// checked here. Refused when any of its socket addresses is one of a registered server's.
    pub(crate) async fn client_for(
        &self,
        url: &str,
        shared: &reqwest::Client,
    ) -> Result<reqwest::Client, AliasRefusal> {
        let parsed = reqwest::Url::parse(url.trim()).map_err(|_| AliasRefusal::NoEndpoint)?;
        let endpoint = Endpoint::of(&parsed).ok_or(AliasRefusal::NoEndpoint)?;
        let addresses = self.addresses(&endpoint).await?;
        for (name, registered) in &self.registered {
            let Some(theirs) = Endpoint::of(registered) else {
                continue;
            };
            if theirs.port != endpoint.port {
                continue;
            }
            let theirs: BTreeSet<SocketAddr> = self
                .addresses(&theirs)
                .await?
                .into_iter()
                .map(same_host_as)
                .collect();
            if let Some(shared_address) = addresses
                .iter()
                .find(|a| theirs.contains(&same_host_as(**a)))
            {
                return Err(AliasRefusal::Registered {
                    registered: name.clone(),
                    address: *shared_address,
                });
            }
        }
        match (&endpoint.host, parsed.host_str()) {
            (Host::Name(_), Some(host)) => {
                let pinned: Vec<SocketAddr> = addresses.into_iter().collect();
                crate::tools::pinned_http_client((self.clients)(), host, &pinned)
                    .map_err(|e| AliasRefusal::Client(crate::errors::chain(&e)))
            }
            _ => Ok(shared.clone()),
        }
    }

    /// The socket addresses of `endpoint`, canonical (an IPv4-mapped address as its IPv4).
    async fn addresses(&self, endpoint: &Endpoint) -> Result<BTreeSet<SocketAddr>, AliasRefusal> {
        let ips: Vec<IpAddr> = match &endpoint.host {
            Host::Ip(ip) => {
                if address::is_forbidden_ip(*ip) {
                    return Err(ForbiddenAddress::Address {
                        host: ip.to_string(),
                    }
                    .into());
                }
                vec![*ip]
            }
            Host::Name(name) => {
                let unresolved = |reason: String| AliasRefusal::Unresolved {
                    host: name.clone(),
                    reason,
                };
                let dns_name = Name::from_str(name).map_err(|e| unresolved(e.to_string()))?;
                match self.resolver.resolve(dns_name).await {
                    Ok(addrs) => {
                        let ips: Vec<IpAddr> = addrs.map(|a| a.ip()).collect();
                        if ips.is_empty() {
                            return Err(unresolved("no address".into()));
                        }
                        ips
                    }
                    Err(e) => {
                        if let Some(forbidden) = address::find_forbidden(&*e) {
                            return Err(forbidden.clone().into());
                        }
                        return Err(unresolved(crate::errors::chain(&*e)));
                    }
                }
            }
        };
        Ok(ips
            .into_iter()
            .map(|ip| SocketAddr::new(ip.to_canonical(), endpoint.port))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::dns::{Addrs, Resolving};
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// A DNS of fixed answers per name; each name's answers are given in turn (the last one
    /// repeats), and every query is counted.
    #[derive(Default)]
    struct Dns {
        answers: HashMap<String, Vec<Vec<&'static str>>>,
        asked: Mutex<HashMap<String, usize>>,
    }

    impl Dns {
        fn with(mut self, name: &str, answers: Vec<Vec<&'static str>>) -> Self {
            self.answers.insert(name.to_string(), answers);
            self
        }
    }

    impl Resolve for Dns {
        fn resolve(&self, name: Name) -> Resolving {
            let name = name.as_str().to_string();
            let turn = {
                let mut asked = self.asked.lock().unwrap();
                let n = asked.entry(name.clone()).or_default();
                *n += 1;
                *n - 1
            };
            let answer = self.answers.get(&name).map(|all| {
                all[turn.min(all.len() - 1)]
                    .iter()
                    .map(|ip| SocketAddr::new(ip.parse().unwrap(), 0))
                    .collect::<Vec<_>>()
            });
            Box::pin(async move {
                match answer {
                    Some(addrs) => Ok(Box::new(addrs.into_iter()) as Addrs),
                    None => Err(format!("no such name {name}").into()),
                }
            })
        }
    }

    fn guard(dns: Dns) -> AliasGuard {
        guard_over(
            vec![
                ("orders", "http://orders.internal:8080/mcp"),
                ("ledger", "https://10.0.0.5/mcp"),
            ],
            dns,
        )
    }

    fn guard_over(registered: Vec<(&str, &str)>, dns: Dns) -> AliasGuard {
        let registered = registered
            .into_iter()
            .map(|(n, u)| (n.to_string(), reqwest::Url::parse(u).unwrap()))
            .collect();
        AliasGuard::new(registered, Arc::new(reqwest::Client::builder)).with_resolver(Arc::new(dns))
    }

    fn dns() -> Dns {
        Dns::default()
            .with("orders.internal", vec![vec!["10.1.2.3", "fd00::3"]])
            .with("orders.ns.svc.cluster.local", vec![vec!["10.1.2.3"]])
            .with("orders-v6.example", vec![vec!["fd00::3"]])
            .with("ledger.example", vec![vec!["10.9.9.9", "10.0.0.5"]])
            .with("elsewhere.example", vec![vec!["10.7.7.7"]])
            .with("imds.example", vec![vec!["10.7.7.7", "169.254.169.254"]])
    }

    async fn check(guard: &AliasGuard, url: &str) -> Result<(), AliasRefusal> {
        guard
            .client_for(url, &reqwest::Client::new())
            .await
            .map(drop)
    }

    /// A URL whose host resolves to a registered server's address at its port is
    /// that server, whatever the name: the cluster FQDN, another name, an address literal.
    #[tokio::test]
    async fn a_url_reaching_a_registered_servers_address_is_refused() {
        let g = guard(dns());
        for (alias, registered, address) in [
            (
                "http://orders.ns.svc.cluster.local:8080/mcp",
                "orders",
                "10.1.2.3:8080",
            ),
            (
                "http://orders-v6.example:8080/other",
                "orders",
                "[fd00::3]:8080",
            ),
            ("http://10.1.2.3:8080/mcp", "orders", "10.1.2.3:8080"),
            (
                "http://[::ffff:10.1.2.3]:8080/mcp",
                "orders",
                "10.1.2.3:8080",
            ),
            ("https://ledger.example/x", "ledger", "10.0.0.5:443"),
            ("http://ledger.example:443/x", "ledger", "10.0.0.5:443"),
        ] {
            match check(&g, alias).await {
                Err(AliasRefusal::Registered {
                    registered: r,
                    address: a,
                }) => {
                    assert_eq!(
                        (r.as_str(), a),
                        (registered, address.parse().unwrap()),
                        "{alias}"
                    );
                }
                other => panic!("{alias}: {other:?}"),
            }
        }
        // Every loopback or unspecified address is this host.
        let local = guard_over(
            vec![("dev", "http://127.0.0.1:7000/mcp")],
            Dns::default().with("dev.test", vec![vec!["127.0.0.53"]]),
        );
        for alias in [
            "http://0.0.0.0:7000/mcp",
            "http://127.1.2.3:7000/mcp",
            "http://[::]:7000/mcp",
            "http://[::1]:7000/mcp",
            "http://[::ffff:127.0.0.2]:7000/mcp",
            "http://dev.test:7000/mcp",
        ] {
            let e = check(&local, alias).await.unwrap_err();
            assert!(matches!(e, AliasRefusal::Registered { .. }), "{alias}: {e}");
        }
        check(&local, "http://0.0.0.0:7001/mcp").await.unwrap();
        // Another port or another address is another server.
        for other in [
            "http://orders.ns.svc.cluster.local:8081/mcp",
            "http://elsewhere.example:8080/mcp",
            "http://10.1.2.4:8080/mcp",
            "https://10.0.0.5:8443/mcp",
        ] {
            check(&g, other)
                .await
                .unwrap_or_else(|e| panic!("{other}: {e}"));
        }
    }

    #[tokio::test]
    async fn a_forbidden_or_unresolvable_host_is_refused_and_only_the_outage_is_transient() {
        let g = guard(dns());
        let e = check(&g, "http://imds.example:8080/").await.unwrap_err();
        assert!(
            matches!(e, AliasRefusal::Forbidden(_)) && !e.is_transient(),
            "{e}"
        );
        let e = check(&g, "http://nowhere.example:8080/").await.unwrap_err();
        assert!(e.is_transient(), "{e}");
        assert!(e.to_string().contains("nowhere.example"), "{e}");
        // A registered server that cannot be resolved now cannot be told apart: retry later.
        let g = guard(Dns::default().with("elsewhere.example", vec![vec!["10.7.7.7"]]));
        let e = check(&g, "http://elsewhere.example:8080/")
            .await
            .unwrap_err();
        assert!(
            e.is_transient() && e.to_string().contains("orders.internal"),
            "{e}"
        );
    }

    #[test]
    fn endpoints_and_paths_are_compared_without_their_spelling() {
        let e = |u: &str| Endpoint::of(&reqwest::Url::parse(u).unwrap()).unwrap();
        assert_eq!(e("http://Orders.:80/a"), e("http://orders/b"));
        assert_eq!(e("http://[::ffff:127.0.0.1]:1/"), e("http://127.0.0.1:1/"));
        assert_eq!(e("http://2130706433:1/"), e("http://127.0.0.1.:1/"));
        assert_ne!(e("http://orders:81/"), e("http://orders/"));
        assert_ne!(e("http://localhost:1/"), e("http://127.0.0.1:1/"));
        let p = |u: &str| normalized_path(&reqwest::Url::parse(u).unwrap());
        assert_eq!(p("http://h/%6D%63%70/"), "/mcp");
        assert_eq!(p("http://h/a/./b/../mcp"), "/a/mcp");
        assert_eq!(p("http://h/%2E%2E/mcp"), "/mcp");
        assert_eq!(p("http://h/x%2fy"), "/x%2Fy");
        assert_eq!(p("http://h/"), "");
        assert_eq!(p("http://h"), "");
        assert_eq!(p("http://h/%zz%4"), "/%zz%4");
    }
}
