//! The operator's tool-server registry (`ABADA_AGENT_TOOLS_FILE`): which tool servers exist,
//! at which URL, and how the worker authenticates to each. Read once at start-up; each task then
//! resolves the servers its definition names against it ([`ToolRegistry::resolve`]), so that a
//! definition (possibly sent by the engine) chooses *which* servers an agent uses, never where a
//! credential goes.
//!
//! ```toml
//! [servers.orders]
//! url = "https://orders-mcp:8080/mcp"
//! auth = "bearer"                 # "none" | "bearer" | "oauth2" | "engine"
//! tokenFile = "/var/run/secrets/abada/orders-token"
//! approval = "writes"             # optional; "never" | "writes" | "always" | [rule, ...]
//! ```
//!
//! `processes`, `topics` and `approvers` say which tasks may use the server and who decides on
//! its calls ([`super::server_scope`]).
//!
//! `approval` is the operator's word on which calls of this server wait for a person
//! ([`approval_policy`](super::approval_policy), the same grammar as a definition's `approval`): it applies to
//! every agent whose definition uses the server, on top of the definition's own, so a definition
//! (possibly sent by the engine) can add approvals but never remove this one.
//!
//! With a registry, the registry is the list: a definition naming a server it does not list is
//! refused unless `ABADA_AGENT_TOOLS_UNREGISTERED=allow` ([`UnregisteredPolicy`]); then such a
//! server may still not be a registered one under another name, by spelling or by address
//! ([`super::alias`]), so no definition reaches a registered server around its `approval`.
//!
//! Credentials: `bearer` re-reads its token file when it changes ([`SecretSource`]); `oauth2`
//! is one client-credentials token per server, shared by every task, owned by the generic token
//! actor ([`crate::auth::token`]: refreshed ahead of expiry, one grant at a time, a forced
//! refresh when the server refuses it); `engine` is the agent/1 per-task credential. A credential
//! is only ever looked up by the name of the server a session is opened to, whose URL is the
//! registry's, and the tools' HTTP client follows no redirect: it reaches no other origin.
//!
//! URLs: a server is named by its name in every error, never by its URL. A registry URL holds
//! no secret: user information, a query or a fragment in a server's `url` (user information in
//! a `tokenUrl`) is refused at start-up, naming the server and the field (`parse_url`), since
//! the libraries that report a failed request print the URL whole.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use oauth2::TokenUrl;
use serde::Deserialize;

use super::address::{self, ForbiddenAddress};
use super::alias::{AliasGuard, ClientBuilderFactory, Endpoint, normalized_path};
use super::{CredentialError, CredentialSource, ToolServerRef, UnregisteredServers};
use crate::auth::token::{self, GrantedToken, TokenError, TokenHandle, TokenSource};
use crate::auth::{ClientAuth, ClientCredentials, GrantError, IssuerHttpClient};
use crate::secret::{Secret, SecretSource};
use crate::tools::approval_policy::ApprovalPolicy;
use crate::tools::server_scope::{self, Approvers, OutOfScope, ServerScope, TaskOrigin};

/// Bound on one token grant for a tool server.
const GRANT_TIMEOUT: Duration = Duration::from_secs(30);

/// The variable naming the registry file (also in [`crate::config`]).
const VAR: &str = "ABADA_AGENT_TOOLS_FILE";
/// The variable saying whether definitions may use servers the registry does not list.
const UNREGISTERED_VAR: &str = "ABADA_AGENT_TOOLS_UNREGISTERED";

/// Whether an agent definition may use a tool server the registry does not list, given with
/// its URL (`ABADA_AGENT_TOOLS_UNREGISTERED`; without a registry every server is such a one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum UnregisteredPolicy {
    /// The registry is the list: any other server is an incident naming it.
    #[default]
    Refuse,
    /// Allowed, with the engine's per-task credential, unless it reaches a registered server
    /// by its spelling or, at connect time, by its address ([`super::alias`]).
    Allow,
}

/// How the worker authenticates to one registered server.
#[derive(Clone, Debug)]
pub enum ServerAuth {
    /// No `Authorization` header.
    None,
    /// A static token from a file, re-read when the file changes.
    Bearer { token: Arc<SecretSource> },
    /// The OAuth 2.0 client-credentials grant at `token_url`.
    OAuth2(OAuth2Settings),
    /// The engine's per-task credential (protocol.md B.3, agent/1 engines only).
    Engine,
}

/// A registered server's client-credentials settings.
#[derive(Clone, Debug)]
pub struct OAuth2Settings {
    pub token_url: TokenUrl,
    pub client_id: String,
    /// Re-read at every grant, so a rotated secret is used without a restart.
    pub client_secret: Arc<SecretSource>,
    pub scopes: Vec<String>,
    /// RFC 8707 resource indicator, for issuers that issue tokens per audience.
    pub resource: Option<String>,
    pub client_auth: ClientAuth,
}

/// One server of the registry.
#[derive(Clone, Debug)]
pub struct RegisteredServer {
    pub name: String,
    pub url: reqwest::Url,
    pub auth: ServerAuth,
    /// Which calls of this server wait for a person, whatever the definition says.
    pub approval: ApprovalPolicy,
    /// Which tasks may use it ([`super::server_scope`]); default every task.
    pub scope: ServerScope,
    /// Who may decide on its calls, as the engine records it; `None`: whatever the process
    /// writes into the decision variable counts (the start-up warns).
    pub approvers: Option<Approvers>,
}

/// The registry file, parsed and checked (no token fetched yet).
#[derive(Clone, Debug, Default)]
pub struct ToolsFile {
    pub servers: BTreeMap<String, RegisteredServer>,
}

/// Why the registry file cannot be used (a start-up error).
#[derive(Debug, thiserror::Error)]
pub enum ToolsFileError {
    #[error("cannot read the tools file {path}: {source}; check {VAR}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the tools file {path} ({VAR}) is not valid: {reason}")]
    Syntax { path: PathBuf, reason: String },
    #[error("the tools file {path} ({VAR}), server {server:?}{}: {problem}", field.as_deref().map(|f| format!(", field {f}")).unwrap_or_default())]
    Server {
        path: PathBuf,
        server: String,
        /// The field at fault, when one is.
        field: Option<String>,
        problem: String,
    },
    /// A client secret that would go to its token endpoint in clear (`http://` to a host that
    /// is not loopback) while `ABADA_AGENT_ALLOW_INSECURE_HTTP` does not allow it.
    #[error("the tools file {path} ({VAR}), server {server:?}, field {field}: {source}")]
    InsecureChannel {
        path: PathBuf,
        server: String,
        field: &'static str,
        #[source]
        source: crate::channel::InsecureChannel,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileWire {
    #[serde(default)]
    servers: BTreeMap<String, toml::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ServerWire {
    url: Option<String>,
    auth: Option<String>,
    token_file: Option<String>,
    token_url: Option<String>,
    client_id: Option<String>,
    client_secret_file: Option<String>,
    scopes: Option<Vec<String>>,
    resource: Option<String>,
    client_auth: Option<String>,
    approval: Option<toml::Value>,
    processes: Option<toml::Value>,
    topics: Option<toml::Value>,
    approvers: Option<toml::Value>,
}

impl ToolsFile {
    /// Reads and checks the file; secret files must be readable now (they are re-read later).
    pub fn load(path: &Path) -> Result<Self, ToolsFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ToolsFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses the text of a registry file; `path` names it in errors and relative secret files
    /// are taken as they are (relative to the working directory).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ToolsFileError> {
        let wire: FileWire = toml::from_str(text).map_err(|e| ToolsFileError::Syntax {
            path: path.to_path_buf(),
            reason: e.message().to_string(),
        })?;
        let mut servers = BTreeMap::new();
        for (name, value) in wire.servers {
            let server =
                parse_server(&name, value).map_err(|(field, problem)| ToolsFileError::Server {
                    path: path.to_path_buf(),
                    server: name.clone(),
                    field: field.map(str::to_string),
                    problem,
                })?;
            servers.insert(name, server);
        }
        Ok(ToolsFile { servers })
    }
}

impl ToolsFile {
    /// Whether every secret this file sends at its own say-so may travel to where it goes:
    /// refuses (naming the file, the server and the field) a client secret bound for an
    /// `http://` token endpoint that is not loopback, unless `allow_insecure`
    /// (`ABADA_AGENT_ALLOW_INSECURE_HTTP=true`). Checked at start-up, before any token request.
    /// (The credential sent to a server's own `url` is checked where a session opens.)
    pub(crate) fn check_channels(
        &self,
        path: &Path,
        allow_insecure: bool,
    ) -> Result<(), ToolsFileError> {
        for c in self.credential_channels() {
            crate::channel::check(c.url, &c.what, allow_insecure).map_err(|source| {
                ToolsFileError::InsecureChannel {
                    path: path.to_path_buf(),
                    server: c.server.to_string(),
                    field: c.field,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// What this file sends in clear once `ABADA_AGENT_ALLOW_INSECURE_HTTP=true` allowed it,
    /// for the one start-up warning (URLs redacted).
    pub fn credentials_in_clear(&self) -> Vec<String> {
        self.credential_channels()
            .filter(|c| {
                crate::channel::check(c.url, &c.what, true) == Ok(crate::channel::Channel::Clear)
            })
            .map(|c| format!("{} to {}", c.what, crate::redact::url(c.url)))
            .collect()
    }

    /// Every secret the file sends to a URL of its own (not a session's): today the `oauth2`
    /// client secret, to `tokenUrl`.
    fn credential_channels(&self) -> impl Iterator<Item = CredentialChannel<'_>> {
        self.servers.values().filter_map(|s| match &s.auth {
            ServerAuth::OAuth2(o) => Some(CredentialChannel {
                server: &s.name,
                field: "tokenUrl",
                what: format!("the OAuth 2.0 client secret of tool server {}", s.name),
                url: o.token_url.as_str(),
            }),
            ServerAuth::None | ServerAuth::Bearer { .. } | ServerAuth::Engine => None,
        })
    }
}

/// Where one secret of the registry file travels.
struct CredentialChannel<'a> {
    server: &'a str,
    /// The file's field naming the URL.
    field: &'static str,
    /// What travels, as the warning and the error say it.
    what: String,
    url: &'a str,
}

type FieldProblem = (Option<&'static str>, String);

fn parse_server(name: &str, value: toml::Value) -> Result<RegisteredServer, FieldProblem> {
    let valid_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !valid_name {
        return Err((
            None,
            "a server name is made of letters, digits, '-', '_' or '.'".into(),
        ));
    }
    let wire: ServerWire = value
        .try_into()
        .map_err(|e: toml::de::Error| (None, e.message().to_string()))?;
    let url = wire.url.as_deref().ok_or((
        Some("url"),
        "is required, e.g. \"https://orders-mcp:8080/mcp\"".into(),
    ))?;
    let url = parse_url(url, UrlField::Server).map_err(|p| (Some("url"), p))?;
    let auth = wire.auth.as_deref().ok_or((
        Some("auth"),
        "is required: \"none\", \"bearer\", \"oauth2\" or \"engine\"".into(),
    ))?;
    let oauth2_fields = [
        ("tokenUrl", wire.token_url.is_some()),
        ("clientId", wire.client_id.is_some()),
        ("clientSecretFile", wire.client_secret_file.is_some()),
        ("scopes", wire.scopes.is_some()),
        ("resource", wire.resource.is_some()),
        ("clientAuth", wire.client_auth.is_some()),
    ];
    let not_for = |fields: &[(&'static str, bool)]| -> Result<(), FieldProblem> {
        match fields.iter().find(|(_, set)| *set) {
            Some((field, _)) => Err((
                Some(field),
                format!("does not apply to auth = {auth:?}; remove it"),
            )),
            None => Ok(()),
        }
    };
    let auth = match auth {
        "none" | "engine" => {
            not_for(&oauth2_fields)?;
            not_for(&[("tokenFile", wire.token_file.is_some())])?;
            if auth == "none" {
                ServerAuth::None
            } else {
                ServerAuth::Engine
            }
        }
        "bearer" => {
            not_for(&oauth2_fields)?;
            let file = wire.token_file.as_deref().ok_or((
                Some("tokenFile"),
                "is required with auth = \"bearer\": the file holding the token".into(),
            ))?;
            ServerAuth::Bearer {
                token: secret_file(file).map_err(|p| (Some("tokenFile"), p))?,
            }
        }
        "oauth2" => {
            not_for(&[("tokenFile", wire.token_file.is_some())])?;
            let required = |field: &'static str, value: Option<String>| {
                value.filter(|v| !v.trim().is_empty()).ok_or((
                    Some(field),
                    "is required with auth = \"oauth2\"".to_string(),
                ))
            };
            let token_url = required("tokenUrl", wire.token_url)?;
            let parsed =
                parse_url(&token_url, UrlField::TokenUrl).map_err(|p| (Some("tokenUrl"), p))?;
            let client_id = required("clientId", wire.client_id)?;
            let secret = required("clientSecretFile", wire.client_secret_file)?;
            let client_secret = secret_file(&secret).map_err(|p| (Some("clientSecretFile"), p))?;
            let scopes = wire.scopes.unwrap_or_default();
            if let Some(blank) = scopes
                .iter()
                .find(|s| s.trim().is_empty() || s.contains(' '))
            {
                return Err((
                    Some("scopes"),
                    format!("{blank:?} is not a scope: give one scope per string"),
                ));
            }
            let client_auth = match wire.client_auth.as_deref() {
                None | Some("basic") => ClientAuth::Basic,
                Some("request-body") => ClientAuth::RequestBody,
                Some(other) => {
                    return Err((
                        Some("clientAuth"),
                        format!("{other:?} is not allowed: \"basic\" or \"request-body\""),
                    ));
                }
            };
            ServerAuth::OAuth2(OAuth2Settings {
                token_url: TokenUrl::from_url(parsed),
                client_id,
                client_secret,
                scopes,
                resource: wire.resource,
                client_auth,
            })
        }
        other => {
            return Err((
                Some("auth"),
                format!("{other:?} is not allowed: \"none\", \"bearer\", \"oauth2\" or \"engine\""),
            ));
        }
    };
    let approval = match wire.approval {
        None => ApprovalPolicy::Never,
        Some(value) => serde_json::to_value(value)
            .map_err(|e| e.to_string())
            .and_then(|v| ApprovalPolicy::from_value(&v))
            .map_err(|p| (Some("approval"), p))?,
    };
    let json = |field: &'static str, value: toml::Value| {
        serde_json::to_value(value).map_err(|e| (Some(field), e.to_string()))
    };
    let names = |field: &'static str, value: Option<toml::Value>| {
        value
            .map(|v| {
                server_scope::parse_names(field, &json(field, v)?).map_err(|p| (Some(field), p))
            })
            .transpose()
    };
    let scope = ServerScope {
        processes: names("processes", wire.processes)?,
        topics: names("topics", wire.topics)?,
    };
    let approvers = wire
        .approvers
        .map(|v| {
            server_scope::parse_approvers(&json("approvers", v)?)
                .map_err(|p| (Some("approvers"), p))
        })
        .transpose()?;
    Ok(RegisteredServer {
        name: name.to_string(),
        url,
        auth,
        approval,
        scope,
        approvers,
    })
}

/// Which URL of a server's entry is read: its own (`url`), or its issuer's (`tokenUrl`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum UrlField {
    Server,
    TokenUrl,
}

/// An http(s) URL with a host that is not link-local or a metadata service, and without the
/// parts that carry secrets in a URL: user information (both fields) and, in a server's `url`,
/// a query (an `api_key=`) or a fragment. A URL is an address, not a secret: the libraries that
/// report a failed request (reqwest, rmcp) print it whole, so a credential belongs in `auth`.
/// (A token endpoint keeps its query: some issuers select a policy by it, `?p=...`; it is shown
/// only redacted.) The problem never repeats the URL: the error names the server and the field.
fn parse_url(raw: &str, field: UrlField) -> Result<reqwest::Url, String> {
    let url = reqwest::Url::parse(raw.trim()).map_err(|e| format!("is not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err("is not an http(s) URL with a host".into());
    }
    let credential_instead =
        "give the credential with auth = \"bearer\" (tokenFile) or \"oauth2\" instead";
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!(
            "holds user information (`user:password@`), which is refused: it would be sent with every request and printed by the libraries that report a failed one; {}",
            match field {
                UrlField::Server => credential_instead,
                UrlField::TokenUrl => "the client authenticates with clientId and clientSecretFile",
            }
        ));
    }
    if field == UrlField::Server {
        if url.query().is_some() {
            return Err(format!(
                "has a query (`?...`), which is refused: a query is where a URL carries keys (`api_key=`), and the libraries that report a failed request print it whole; {credential_instead}"
            ));
        }
        if url.fragment().is_some() {
            return Err("has a fragment (`#...`), which is never sent: remove it".into());
        }
    }
    address::check_url(&url).map_err(|e| e.to_string())?;
    Ok(url)
}

fn secret_file(path: &str) -> Result<Arc<SecretSource>, String> {
    let source = SecretSource::file(PathBuf::from(path.trim()));
    source.load().map_err(|e| e.to_string())?;
    Ok(Arc::new(source))
}

/// Why a tool server named by a definition cannot be used; the task becomes an incident naming
/// the server. Nothing has been sent to any URL of that server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServerResolutionError {
    #[error(
        "tool server {server:?} is named by the agent definition, but {VAR} has no server of that name; add it there"
    )]
    Unknown { server: String },
    #[error(
        "tool server {server:?} is named by the agent definition without a URL, and no {VAR} is set; give the URL in the definition or register the server"
    )]
    NoRegistry { server: String },
    #[error(
        "tool server {server:?}: the agent definition gives it a URL other than the one {VAR} registers; nothing was sent to either. Name the server without a URL in the definition (the registry's is used), or fix the registry"
    )]
    UrlMismatch { server: String },
    #[error(
        "tool server {server:?}: the agent definition gives it a URL which {VAR} registers as server {registered:?}; nothing was sent. Name the server {registered:?} in the definition: the registry's credential and approval then apply"
    )]
    RegisteredUnderAnotherName { server: String, registered: String },
    #[error(
        "tool server {server:?} is not in {VAR}, and {UNREGISTERED_VAR} is refuse (the default): a definition uses registered servers only; nothing was sent. Register the server, or set {UNREGISTERED_VAR}=allow"
    )]
    Unregistered { server: String },
    #[error("tool server {server:?}: the definition's URL is not usable: {reason}")]
    BadUrl { server: String, reason: String },
    #[error("tool server {server:?}: {source}")]
    Forbidden {
        server: String,
        #[source]
        source: ForbiddenAddress,
    },
    #[error(
        "tool server {server:?} needs the engine's per-task credential (auth = \"engine\"), which this engine does not issue (its tasks carry no attempt); register the server in {VAR} with auth \"none\", \"bearer\" or \"oauth2\""
    )]
    NoEngineCredentials { server: String },
}

/// A server a definition names: by name alone (the registry's), or with the URL it expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedServer {
    pub name: String,
    pub url: Option<String>,
}

/// Where a task's credential for one server comes from.
#[derive(Clone)]
enum Route {
    None,
    Bearer(Arc<SecretSource>),
    OAuth2(TokenHandle<ToolTokenError>),
    Engine,
}

/// The registry, live: the servers and the token actor of each `oauth2` server.
pub struct ToolRegistry {
    servers: BTreeMap<String, (RegisteredServer, Route)>,
    /// What the file sends in clear ([`ToolsFile::credentials_in_clear`]), kept from the one
    /// reading of the file for the start-up warning.
    credentials_in_clear: Vec<String>,
    /// Set when definitions may use servers the registry does not list
    /// ([`UnregisteredPolicy::Allow`]): it keeps them off the registered servers' addresses.
    unregistered: Option<Arc<AliasGuard>>,
}

impl ToolRegistry {
    /// Starts one token actor per `oauth2` server (nothing is fetched before the first use),
    /// talking to its issuer through a client built from `http` (redirects off). Must be called
    /// within a tokio runtime.
    pub fn start(file: ToolsFile, http: reqwest::ClientBuilder) -> Result<Self, reqwest::Error> {
        let issuer = Arc::new(IssuerHttpClient::new(http)?);
        let credentials_in_clear = file.credentials_in_clear();
        let servers = file
            .servers
            .into_iter()
            .map(|(name, server)| {
                let route = match &server.auth {
                    ServerAuth::None => Route::None,
                    ServerAuth::Engine => Route::Engine,
                    ServerAuth::Bearer { token } => Route::Bearer(token.clone()),
                    ServerAuth::OAuth2(settings) => Route::OAuth2(token::spawn(
                        ServerTokenSource::new(&name, settings, issuer.clone()),
                        GRANT_TIMEOUT,
                        format!("tool server {name}"),
                    )),
                };
                (name, (server, route))
            })
            .collect();
        Ok(ToolRegistry {
            servers,
            credentials_in_clear,
            unregistered: None,
        })
    }

    /// What the registry's file sends in clear once `ABADA_AGENT_ALLOW_INSECURE_HTTP=true`
    /// allowed it (URLs redacted), for the one start-up warning.
    pub fn credentials_in_clear(&self) -> &[String] {
        &self.credentials_in_clear
    }

    /// Lets definitions use servers the registry does not list ([`UnregisteredPolicy::Allow`]):
    /// each session to one opens on a client from `clients` pinned to addresses that are no
    /// registered server's. `resolver` replaces the system's (tests).
    pub fn allow_unregistered(
        mut self,
        clients: ClientBuilderFactory,
        resolver: Option<Arc<dyn reqwest::dns::Resolve>>,
    ) -> Self {
        let registered = self
            .servers
            .iter()
            .map(|(name, (server, _))| (name.clone(), server.url.clone()))
            .collect();
        let guard = AliasGuard::new(registered, clients);
        let guard = match resolver {
            Some(inner) => guard.with_resolver(inner),
            None => guard,
        };
        self.unregistered = Some(Arc::new(guard));
        self
    }

    /// The registered servers' names.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.servers.keys().map(String::as_str)
    }

    /// Number of registered servers.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The name of the registered server at `url`'s host and port, however the URL is written
    /// (case, the root's trailing dot, default port, an IPv4-mapped address) and whatever its
    /// scheme, path, query or user info: one socket is one server ([`super::alias`]).
    fn server_at(&self, url: &reqwest::Url) -> Option<&str> {
        let wanted = Endpoint::of(url)?;
        self.servers
            .iter()
            .find(|(_, (server, _))| Endpoint::of(&server.url).as_ref() == Some(&wanted))
            .map(|(name, _)| name.as_str())
    }

    /// The `approval` of each registered server among `named` that has one (not `"never"`),
    /// for [`crate::agent::approval::ApprovalRules::servers`].
    pub(crate) fn approval_policies(&self, named: &[NamedServer]) -> Vec<(String, ApprovalPolicy)> {
        named
            .iter()
            .filter_map(|n| self.servers.get(&n.name))
            .filter(|(server, _)| server.approval != ApprovalPolicy::Never)
            .map(|(server, _)| (server.name.clone(), server.approval.clone()))
            .collect()
    }

    /// Whether any registered server among `named` is scoped to processes: the task's process
    /// key must then be read from the engine before [`ToolRegistry::check_scope`].
    pub(crate) fn scope_lists_processes(&self, named: &[NamedServer]) -> bool {
        named
            .iter()
            .filter_map(|n| self.servers.get(&n.name))
            .any(|(server, _)| server.scope.lists_processes())
    }

    /// Whether a task from `origin` may use every registered server among `named`: the first
    /// whose scope does not admit it, else `Ok`. Servers the registry does not list have no
    /// scope (their own checks are [`ToolRegistry::resolve`]'s).
    pub(crate) fn check_scope(
        &self,
        named: &[NamedServer],
        origin: TaskOrigin<'_>,
    ) -> Result<(), OutOfScope> {
        named
            .iter()
            .filter_map(|n| self.servers.get(&n.name))
            .try_for_each(|(server, _)| server.scope.admit(&server.name, origin))
    }

    /// Who may decide on calls of the registered server `name`, when the operator said.
    pub(crate) fn approvers(&self, name: &str) -> Option<&Approvers> {
        self.servers
            .get(name)
            .and_then(|(server, _)| server.approvers.as_ref())
    }

    /// The servers that name approvers: their decisions are checked against the engine's
    /// record of who completed the approval task (`agent::approver`).
    pub fn servers_with_approvers(&self) -> Vec<String> {
        self.servers
            .values()
            .filter(|(server, _)| server.approvers.is_some())
            .map(|(server, _)| server.name.clone())
            .collect()
    }

    /// The servers whose `approval` a process author could lower, for the start-up warning:
    /// those with an `approval` but no `approvers`, where a decision is whatever the process
    /// writes into its decision variable (a script task can copy the `requestId`).
    pub fn approvals_without_approvers(&self) -> Vec<String> {
        self.servers
            .values()
            .filter(|(server, _)| {
                server.approval != ApprovalPolicy::Never && server.approvers.is_none()
            })
            .map(|(server, _)| server.name.clone())
            .collect()
    }

    /// The servers a task may use and where each one's credential comes from, or the first
    /// server that cannot be used. `engine_credentials` says whether the task's engine issues
    /// per-task credentials (an agent/1 task).
    pub fn resolve(
        registry: Option<&ToolRegistry>,
        named: &[NamedServer],
        engine_credentials: bool,
    ) -> Result<ResolvedServers, ServerResolutionError> {
        let mut servers = Vec::new();
        let mut routes = HashMap::new();
        let mut unregistered: Option<UnregisteredServers> = None;
        for n in named {
            let registered = registry.and_then(|r| r.servers.get(&n.name));
            let (url, route) = match (registered, &n.url) {
                (Some((server, route)), Some(url)) => {
                    let same = reqwest::Url::parse(url.trim())
                        .is_ok_and(|u| same_server_url(&u, &server.url));
                    if !same {
                        return Err(ServerResolutionError::UrlMismatch {
                            server: n.name.clone(),
                        });
                    }
                    (server.url.to_string(), route.clone())
                }
                (Some((server, route)), None) => (server.url.to_string(), route.clone()),
                (None, None) if registry.is_none() => {
                    return Err(ServerResolutionError::NoRegistry {
                        server: n.name.clone(),
                    });
                }
                (None, None) => {
                    return Err(ServerResolutionError::Unknown {
                        server: n.name.clone(),
                    });
                }
                // A server the registry does not know, named with its URL: as before the
                // registry, with the engine's per-task credential (agent/1 engines only).
                (None, Some(url)) => {
                    let parsed = reqwest::Url::parse(url.trim()).map_err(|e| {
                        ServerResolutionError::BadUrl {
                            server: n.name.clone(),
                            reason: e.to_string(),
                        }
                    })?;
                    // A registered server under another name would escape the registry's
                    // credential and its `approval` (which a definition can add to, never
                    // remove): the registry's server is named by its registered name only.
                    if let Some(registered) = registry.and_then(|r| r.server_at(&parsed)) {
                        return Err(ServerResolutionError::RegisteredUnderAnotherName {
                            server: n.name.clone(),
                            registered: registered.to_string(),
                        });
                    }
                    address::check_url(&parsed).map_err(|source| {
                        ServerResolutionError::Forbidden {
                            server: n.name.clone(),
                            source,
                        }
                    })?;
                    // With a registry, the registry is the list unless the operator allowed
                    // more; those sessions then open through the registry's address guard.
                    if let Some(r) = registry {
                        let Some(guard) = &r.unregistered else {
                            return Err(ServerResolutionError::Unregistered {
                                server: n.name.clone(),
                            });
                        };
                        unregistered
                            .get_or_insert_with(|| UnregisteredServers {
                                names: Default::default(),
                                guard: guard.clone(),
                            })
                            .names
                            .insert(n.name.clone());
                    }
                    (url.clone(), Route::Engine)
                }
            };
            if matches!(route, Route::Engine) && !engine_credentials {
                return Err(ServerResolutionError::NoEngineCredentials {
                    server: n.name.clone(),
                });
            }
            routes.insert(n.name.clone(), route);
            servers.push(ToolServerRef {
                name: n.name.clone(),
                url,
            });
        }
        Ok(ResolvedServers {
            servers,
            routes,
            unregistered,
        })
    }
}

/// Whether a definition's URL for a registered server is the registry's, however it is written:
/// scheme, host and port as [`Endpoint`] compares them, the path after [`normalized_path`]
/// (percent-encoding, dot segments, trailing slash), the same query; user info and fragment are
/// not sent as part of the request line and do not count.
fn same_server_url(definition: &reqwest::Url, registry: &reqwest::Url) -> bool {
    definition.scheme() == registry.scheme()
        && Endpoint::of(definition).is_some_and(|e| Endpoint::of(registry) == Some(e))
        && normalized_path(definition) == normalized_path(registry)
        && definition.query() == registry.query()
}

/// A task's servers, resolved: their URLs and where each one's credential comes from.
pub struct ResolvedServers {
    pub servers: Vec<ToolServerRef>,
    routes: HashMap<String, Route>,
    unregistered: Option<UnregisteredServers>,
}

impl ResolvedServers {
    /// The servers the registry does not list, for
    /// [`McpSessions::with_unregistered`](super::McpSessions::with_unregistered): their
    /// sessions open only through the registry's address guard. `None` without a registry.
    pub fn unregistered(&self) -> Option<UnregisteredServers> {
        self.unregistered.clone()
    }

    /// The task's credential source: each server's own route; `engine` asks the engine for the
    /// task's lease through `engine`.
    pub fn credentials(&self, engine: Arc<dyn CredentialSource>) -> TaskCredentials {
        TaskCredentials {
            routes: self.routes.clone(),
            engine,
        }
    }
}

/// The credentials of one task's servers, each from its own route and for that server only.
pub struct TaskCredentials {
    routes: HashMap<String, Route>,
    engine: Arc<dyn CredentialSource>,
}

#[async_trait]
impl CredentialSource for TaskCredentials {
    // Where a registry credential is attached to a server's session. The rule against sending a
    // credential over plain http:// (except loopback) belongs here once it exists.
    async fn credential(&self, server: &str) -> Result<Option<Secret>, CredentialError> {
        match self.routes.get(server) {
            // A server the task does not use gets nothing (the session layer never asks).
            None | Some(Route::None) => Ok(None),
            Some(Route::Engine) => self.engine.credential(server).await,
            Some(Route::Bearer(file)) => {
                file.load()
                    .map(Some)
                    .map_err(|e| CredentialError::Transient {
                        server: server.to_string(),
                        reason: e.to_string(),
                    })
            }
            Some(Route::OAuth2(tokens)) => {
                tokens
                    .token()
                    .await
                    .map(Some)
                    .map_err(|e| CredentialError::Transient {
                        server: server.to_string(),
                        reason: e.to_string(),
                    })
            }
        }
    }

    async fn rejected(
        &self,
        server: &str,
        refused: &Secret,
    ) -> Result<Option<Secret>, CredentialError> {
        match self.routes.get(server) {
            None | Some(Route::None) => Ok(None),
            Some(Route::Engine) => self.engine.rejected(server, refused).await,
            // A rotated file: the new token once; the same token again would be refused again.
            Some(Route::Bearer(file)) => Ok(file.load().ok().filter(|t| t != refused)),
            Some(Route::OAuth2(tokens)) => tokens
                .refresh_after_rejection(refused)
                .await
                .map(Some)
                .map_err(|e| CredentialError::Transient {
                    server: server.to_string(),
                    reason: e.to_string(),
                }),
        }
    }
}

/// Why no token could be had for an `oauth2` server. Never carries the secret or a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ToolTokenError {
    #[error(
        "cannot read the client secret of tool server {server}: {reason}; check clientSecretFile in {VAR}"
    )]
    SecretUnavailable { server: String, reason: String },
    #[error(
        "the issuer rejected the client credentials of tool server {server} (client id {client_id}); check clientId and clientSecretFile in {VAR}"
    )]
    InvalidClient { server: String, client_id: String },
    #[error(
        "the issuer refused a token for tool server {server}: {error}{description}; check scopes and resource in {VAR}"
    )]
    Refused {
        server: String,
        error: String,
        description: String,
    },
    /// `reason` is shown without the URLs in it; the token URL is named by its field.
    #[error("the token request for tool server {server} (its tokenUrl in {VAR}) failed: {reason}")]
    Endpoint { server: String, reason: String },
    #[error("no token: {reason}")]
    Unavailable { reason: String },
}

impl TokenError for ToolTokenError {
    fn is_configuration_error(&self) -> bool {
        matches!(
            self,
            ToolTokenError::SecretUnavailable { .. }
                | ToolTokenError::InvalidClient { .. }
                | ToolTokenError::Refused { .. }
        )
    }

    fn unavailable(reason: String) -> Self {
        ToolTokenError::Unavailable { reason }
    }
}

/// The client-credentials grant of one registered server, at its token URL.
struct ServerTokenSource {
    server: String,
    grant: ClientCredentials,
    token_url: TokenUrl,
    http: Arc<IssuerHttpClient>,
}

impl ServerTokenSource {
    fn new(server: &str, settings: &OAuth2Settings, http: Arc<IssuerHttpClient>) -> Self {
        ServerTokenSource {
            server: server.to_string(),
            grant: ClientCredentials {
                client_id: settings.client_id.clone(),
                client_secret: settings.client_secret.clone(),
                scopes: settings.scopes.clone(),
                client_auth: settings.client_auth,
                resource: settings.resource.clone(),
            },
            token_url: settings.token_url.clone(),
            http,
        }
    }
}

impl TokenSource for ServerTokenSource {
    type Error = ToolTokenError;

    async fn fetch(&self) -> Result<GrantedToken, ToolTokenError> {
        let server = self.server.clone();
        self.grant
            .request(&self.http, &self.token_url)
            .await
            .map_err(|e| match e {
                GrantError::SecretUnavailable(reason) => {
                    ToolTokenError::SecretUnavailable { server, reason }
                }
                GrantError::InvalidClient => ToolTokenError::InvalidClient {
                    server,
                    client_id: self.grant.client_id.clone(),
                },
                GrantError::Refused { error, description } => ToolTokenError::Refused {
                    server,
                    error,
                    description,
                },
                GrantError::Endpoint(reason) => ToolTokenError::Endpoint {
                    server,
                    reason: crate::redact::text_without_urls(&reason),
                },
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ToolsFile, ToolsFileError> {
        ToolsFile::parse(text, Path::new("/etc/abada/tools.toml"))
    }

    fn secret_path(content: &str) -> (tempdir::Dir, String) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("token");
        std::fs::write(&path, content).unwrap();
        let p = path.display().to_string();
        (dir, p)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                let p = std::env::temp_dir().join(format!("abada-tools-{}", uuid::Uuid::new_v4()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn every_auth_kind_parses() {
        let (_dir, token) = secret_path("tok-1\n");
        let file = parse(&format!(
            r#"
            [servers.orders]
            url = "https://orders-mcp:8080/mcp"
            auth = "bearer"
            tokenFile = "{token}"

            [servers.billing]
            url = "http://billing:9000/mcp"
            auth = "oauth2"
            tokenUrl = "http://issuer:8080/token"
            clientId = "worker"
            clientSecretFile = "{token}"
            scopes = ["billing:read", "billing:write"]
            resource = "http://billing:9000/mcp"

            [servers.public]
            url = "http://public:1/mcp"
            auth = "none"

            [servers.legacy]
            url = "http://legacy:1/mcp"
            auth = "engine"
            "#
        ))
        .unwrap();
        assert_eq!(file.servers.len(), 4);
        assert!(matches!(
            file.servers["orders"].auth,
            ServerAuth::Bearer { .. }
        ));
        assert!(matches!(file.servers["public"].auth, ServerAuth::None));
        assert!(matches!(file.servers["legacy"].auth, ServerAuth::Engine));
        let ServerAuth::OAuth2(o) = &file.servers["billing"].auth else {
            panic!()
        };
        assert_eq!(o.scopes, ["billing:read", "billing:write"]);
        assert_eq!(o.resource.as_deref(), Some("http://billing:9000/mcp"));
        assert_eq!(o.client_auth, ClientAuth::Basic);
        assert!(!format!("{file:?}").contains("tok-1"));
        assert!(parse("").unwrap().servers.is_empty());
    }

    #[test]
    fn a_client_secret_goes_to_its_token_endpoint_over_https_or_loopback_only() {
        let (_dir, secret) = secret_path("s3cret");
        let oauth2 = |token_url: &str| {
            format!(
                "[servers.billing]\nurl = \"https://billing/mcp\"\nauth = \"oauth2\"\ntokenUrl = \"{token_url}\"\nclientId = \"c\"\nclientSecretFile = \"{secret}\"\n"
            )
        };
        let path = Path::new("/etc/abada/tools.toml");
        for ok in [
            "https://issuer/token",
            "http://127.0.0.1:9/token",
            "http://localhost/t",
        ] {
            let file = parse(&oauth2(ok)).unwrap();
            file.check_channels(path, false).unwrap();
            assert!(file.credentials_in_clear().is_empty(), "{ok}");
        }
        let file = parse(&oauth2("http://issuer:8080/token?k=pw")).unwrap();
        let e = file.check_channels(path, false).unwrap_err();
        let ToolsFileError::InsecureChannel { server, field, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!((server.as_str(), *field), ("billing", "tokenUrl"));
        let text = e.to_string();
        assert!(
            text.starts_with(
                "the tools file /etc/abada/tools.toml (ABADA_AGENT_TOOLS_FILE), server \"billing\", field tokenUrl: the OAuth 2.0 client secret of tool server billing would travel in clear to http://issuer:8080 ("
            ),
            "{text}"
        );
        assert!(!text.contains("pw") && !text.contains("s3cret"), "{text}");
        file.check_channels(path, true).unwrap();
        assert_eq!(
            file.credentials_in_clear(),
            ["the OAuth 2.0 client secret of tool server billing to http://issuer:8080/token"]
        );
    }

    fn problem(text: &str) -> (String, Option<String>, String) {
        match parse(text).unwrap_err() {
            ToolsFileError::Server {
                server,
                field,
                problem,
                ..
            } => (server, field, problem),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn errors_name_the_file_the_server_and_the_field() {
        let (_dir, token) = secret_path("tok");
        let e = parse("[servers.orders]\nurl = \"http://x/mcp\"\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "the tools file /etc/abada/tools.toml (ABADA_AGENT_TOOLS_FILE), server \"orders\", field auth: is required: \"none\", \"bearer\", \"oauth2\" or \"engine\""
        );
        let cases: Vec<(String, &str, &str)> = vec![
            ("auth = \"none\"".into(), "url", "is required"),
            ("url = \"ftp://x\"\nauth = \"none\"".into(), "url", "not an http(s) URL"),
            ("url = \"http://169.254.169.254/\"\nauth = \"none\"".into(), "url", "link-local"),
            ("url = \"http://metadata.google.internal/\"\nauth = \"none\"".into(), "url", "metadata"),
            ("url = \"http://x/\"\nauth = \"magic\"".into(), "auth", "\"magic\" is not allowed"),
            ("url = \"http://x/\"\nauth = \"bearer\"".into(), "tokenFile", "is required"),
            ("url = \"http://x/\"\nauth = \"bearer\"\ntokenFile = \"/nonexistent/t\"".into(), "tokenFile", "cannot read"),
            (format!("url = \"http://x/\"\nauth = \"none\"\ntokenFile = \"{token}\""), "tokenFile", "does not apply"),
            ("url = \"http://x/\"\nauth = \"bearer\"\nclientId = \"c\"".into(), "clientId", "does not apply"),
            ("url = \"http://x/\"\nauth = \"oauth2\"".into(), "tokenUrl", "is required"),
            ("url = \"http://x/\"\nauth = \"oauth2\"\ntokenUrl = \"http://i/t\"".into(), "clientId", "is required"),
            ("url = \"http://x/\"\nauth = \"oauth2\"\ntokenUrl = \"http://i/t\"\nclientId = \"c\"".into(), "clientSecretFile", "is required"),
            (format!("url = \"http://x/\"\nauth = \"oauth2\"\ntokenUrl = \"http://i/t\"\nclientId = \"c\"\nclientSecretFile = \"{token}\"\nscopes = [\"a b\"]"), "scopes", "not a scope"),
            (format!("url = \"http://x/\"\nauth = \"oauth2\"\ntokenUrl = \"http://i/t\"\nclientId = \"c\"\nclientSecretFile = \"{token}\"\nclientAuth = \"jwt\""), "clientAuth", "not allowed"),
        ];
        for (body, field, wanted) in cases {
            let (server, f, p) = problem(&format!("[servers.orders]\n{body}\n"));
            assert_eq!(server, "orders");
            assert_eq!(f.as_deref(), Some(field), "{body}: {p}");
            assert!(p.contains(wanted), "{body}: {p}");
        }
        let (_, f, p) =
            problem("[servers.orders]\nurl = \"http://x/\"\nauth = \"none\"\ntokenfile = \"x\"\n");
        assert_eq!(f, None);
        assert!(p.contains("unknown field `tokenfile`"), "{p}");
        let (_, _, p) = problem("[servers.\"a b\"]\nurl = \"http://x/\"\nauth = \"none\"\n");
        assert!(p.contains("server name"), "{p}");
        assert!(matches!(
            parse("[server.x]"),
            Err(ToolsFileError::Syntax { .. })
        ));
        assert!(matches!(
            parse("[servers"),
            Err(ToolsFileError::Syntax { .. })
        ));
    }

    /// A registry URL with user information or a query (where URLs carry credentials) is
    /// refused at start-up, naming the server and the field, and the message repeats none of
    /// the URL: libraries print a URL whole, so it must hold nothing secret.
    #[test]
    fn a_registry_url_carrying_a_credential_is_refused_without_repeating_it() {
        let (_dir, secret) = secret_path("s");
        let oauth2 = |token_url: &str| {
            format!(
                "url = \"http://x/mcp\"\nauth = \"oauth2\"\ntokenUrl = \"{token_url}\"\nclientId = \"c\"\nclientSecretFile = \"{secret}\""
            )
        };
        for (body, field, wanted) in [
            (
                "url = \"http://svc-user:PASSMARK@orders:8080/mcp\"\nauth = \"none\"".to_string(),
                "url",
                "user information",
            ),
            (
                "url = \"http://svc-user@orders:8080/mcp\"\nauth = \"none\"".to_string(),
                "url",
                "user information",
            ),
            (
                "url = \"https://orders:8080/mcp/PATHMARK?api_key=KEYMARK\"\nauth = \"none\""
                    .to_string(),
                "url",
                "has a query",
            ),
            (
                "url = \"https://orders:8080/mcp#KEYMARK\"\nauth = \"none\"".to_string(),
                "url",
                "fragment",
            ),
            (
                "url = \"https://orders:PORTMARK/mcp?api_key=KEYMARK\"\nauth = \"none\""
                    .to_string(),
                "url",
                "is not a URL",
            ),
            (
                oauth2("https://u:PASSMARK@issuer/token"),
                "tokenUrl",
                "user information",
            ),
        ] {
            let e = parse(&format!("[servers.orders]\n{body}\n")).unwrap_err();
            let text = e.to_string();
            let ToolsFileError::Server {
                server,
                field: f,
                problem,
                ..
            } = e
            else {
                panic!("{text}")
            };
            assert_eq!(
                (server.as_str(), f.as_deref()),
                ("orders", Some(field)),
                "{text}"
            );
            assert!(problem.contains(wanted), "{body}: {text}");
            for part in [
                "PASSMARK", "KEYMARK", "PATHMARK", "PORTMARK", "svc-user", "://",
            ] {
                assert!(!text.contains(part), "{part} repeated: {text}");
            }
        }
        // A token endpoint keeps its query (an issuer's policy); it is shown redacted only.
        let file = parse(&format!(
            "[servers.orders]\n{}\n",
            oauth2("https://issuer/token?p=b2c_policy")
        ))
        .unwrap();
        assert_eq!(
            file.credentials_in_clear(),
            Vec::<String>::new(),
            "https: nothing in clear"
        );
    }

    #[test]
    fn a_server_may_require_approval_in_the_definitions_grammar() {
        let file = parse(
            r#"
            [servers.orders]
            url = "http://orders:1/mcp"
            auth = "none"
            approval = "writes"

            [servers.billing]
            url = "http://billing:1/mcp"
            auth = "none"
            approval = ["close_account", { tool = "refund", argument = "amountCents", above = 10000 }]

            [servers.public]
            url = "http://public:1/mcp"
            auth = "none"
            "#,
        )
        .unwrap();
        assert_eq!(file.servers["orders"].approval, ApprovalPolicy::Writes);
        assert_eq!(file.servers["public"].approval, ApprovalPolicy::Never);
        let ApprovalPolicy::Tools(rules) = &file.servers["billing"].approval else {
            panic!("{:?}", file.servers["billing"].approval)
        };
        assert_eq!(rules.len(), 2);
        assert_eq!(
            rules[1]
                .when
                .as_ref()
                .map(|b| (b.argument.as_str(), b.above)),
            Some((
                "amountCents",
                Some(crate::agent::approval::Bound::Integer(10000))
            ))
        );
        let cases = [
            ("approval = \"sometimes\"", "\"sometimes\" is not one of"),
            ("approval = 3", "approval is a number"),
            (
                "approval = [{ tool = \"refund\", argument = \"a\", above = \"1\" }]",
                "above is a string",
            ),
            (
                "approval = [{ tool = \"refund\", argument = \"a\", above = nan }]",
                "above is null, not a number",
            ),
            (
                "approval = [{ tool = \"refund\", argumnet = \"a\", above = 1 }]",
                "unknown key \"argumnet\"",
            ),
        ];
        for (line, wanted) in cases {
            let (server, field, p) = problem(&format!(
                "[servers.orders]\nurl = \"http://x/\"\nauth = \"none\"\n{line}\n"
            ));
            assert_eq!(
                (server.as_str(), field.as_deref()),
                ("orders", Some("approval"))
            );
            assert!(p.contains(wanted), "{line}: {p}");
        }
    }

    #[tokio::test]
    async fn a_servers_approval_applies_to_the_definitions_that_use_it() {
        let r = registry(
            "[servers.orders]\nurl = \"http://orders:1/mcp\"\nauth = \"none\"\napproval = \"writes\"\n\
             [servers.public]\nurl = \"http://public:1/mcp\"\nauth = \"none\"\napproval = \"never\"\n\
             [servers.billing]\nurl = \"http://billing:1/mcp\"\nauth = \"none\"\napproval = \"always\"\n",
        );
        assert_eq!(
            r.approval_policies(&[
                named("orders", None),
                named("public", None),
                named("unregistered", Some("http://u/"))
            ]),
            vec![("orders".to_string(), ApprovalPolicy::Writes)]
        );
        assert!(r.approval_policies(&[named("public", None)]).is_empty());
    }

    fn registry(text: &str) -> ToolRegistry {
        ToolRegistry::start(parse(text).unwrap(), reqwest::Client::builder()).unwrap()
    }

    fn named(name: &str, url: Option<&str>) -> NamedServer {
        NamedServer {
            name: name.into(),
            url: url.map(str::to_string),
        }
    }

    #[tokio::test]
    async fn definitions_choose_registered_servers_by_name_and_never_their_url() {
        let r = registry(
            "[servers.orders]\nurl = \"http://orders:8080/mcp\"\nauth = \"none\"\n[servers.old]\nurl = \"http://old:1/mcp\"\nauth = \"engine\"\n",
        );
        let resolved = ToolRegistry::resolve(Some(&r), &[named("orders", None)], false).unwrap();
        assert_eq!(resolved.servers[0].url, "http://orders:8080/mcp");
        // The same URL written differently is the same URL.
        let same = [named("orders", Some("HTTP://Orders:8080/mcp"))];
        assert!(ToolRegistry::resolve(Some(&r), &same, false).is_ok());
        let other = [named("orders", Some("http://evil:8080/mcp"))];
        let e = ToolRegistry::resolve(Some(&r), &other, true).err().unwrap();
        assert!(matches!(e, ServerResolutionError::UrlMismatch { .. }));
        assert!(e.to_string().contains("\"orders\""), "{e}");
        let e = ToolRegistry::resolve(Some(&r), &[named("payments", None)], true)
            .err()
            .unwrap();
        assert_eq!(
            e,
            ServerResolutionError::Unknown {
                server: "payments".into()
            }
        );
        // A registered server's URL under another name: refused, however the URL is written
        // (the registry's credential and approval would not apply to the alias).
        for alias in [
            "http://orders:8080/mcp",
            "http://ORDERS:8080/mcp/",
            "http://orders:8080/mcp?x=1#f",
            "http://user@orders:8080/mcp",
        ] {
            let e = ToolRegistry::resolve(Some(&r), &[named("orders-alias", Some(alias))], true)
                .err()
                .unwrap();
            assert!(
                matches!(
                    &e,
                    ServerResolutionError::RegisteredUnderAnotherName { registered, .. }
                        if registered == "orders"
                ),
                "{alias}: {e}"
            );
        }
        let e = ToolRegistry::resolve(
            Some(&r),
            &[named("a", Some("http://old:1/mcp?key=s3cret"))],
            true,
        )
        .err()
        .unwrap();
        assert!(!e.to_string().contains("s3cret"), "{e}");
        // Another port is another server (when unregistered servers are allowed); another
        // path or scheme at the same host and port is the same socket, so the same server.
        let allowing = allowing(r);
        let r = &allowing;
        assert!(
            ToolRegistry::resolve(Some(r), &[named("x", Some("http://orders:8081/mcp"))], true)
                .is_ok()
        );
        for same in ["http://orders:8080/mcp2", "https://orders:8080/mcp"] {
            let e = ToolRegistry::resolve(Some(r), &[named("x", Some(same))], true)
                .err()
                .unwrap();
            assert!(
                matches!(e, ServerResolutionError::RegisteredUnderAnotherName { .. }),
                "{same}: {e}"
            );
        }
        // Named with a URL and not registered: the engine's credential, as before.
        let p = ToolRegistry::resolve(Some(r), &[named("payments", Some("http://p/"))], true);
        assert_eq!(p.unwrap().servers[0].url, "http://p/");
        let e = ToolRegistry::resolve(Some(r), &[named("payments", Some("http://p/"))], false)
            .err()
            .unwrap();
        assert!(
            matches!(e, ServerResolutionError::NoEngineCredentials { .. }),
            "{e}"
        );
        let e = ToolRegistry::resolve(Some(r), &[named("old", None)], false)
            .err()
            .unwrap();
        assert!(
            matches!(e, ServerResolutionError::NoEngineCredentials { .. }),
            "{e}"
        );
        assert!(ToolRegistry::resolve(Some(r), &[named("old", None)], true).is_ok());
    }

    fn allowing(r: ToolRegistry) -> ToolRegistry {
        r.allow_unregistered(Arc::new(reqwest::Client::builder), None)
    }

    /// With a registry, a server it does not list is an incident naming the server
    /// unless `ABADA_AGENT_TOOLS_UNREGISTERED=allow`: an engine-sent definition cannot add one.
    #[tokio::test]
    async fn an_unregistered_server_is_refused_by_default() {
        let r = registry(
            "[servers.orders]\nurl = \"http://orders:8080/mcp\"\nauth = \"none\"\napproval = \"always\"\n",
        );
        let e = ToolRegistry::resolve(
            Some(&r),
            &[
                named("orders", None),
                named("payments", Some("http://payments:1/mcp?key=s3cret")),
            ],
            true,
        )
        .err()
        .unwrap();
        assert_eq!(
            e,
            ServerResolutionError::Unregistered {
                server: "payments".into(),
            }
        );
        let text = e.to_string();
        assert!(
            text.contains("ABADA_AGENT_TOOLS_UNREGISTERED=allow") && !text.contains("s3cret"),
            "{text}"
        );
        // A forbidden address says so first; without a registry nothing changes.
        let e = ToolRegistry::resolve(
            Some(&r),
            &[named("m", Some("http://[fd00:ec2::23]/"))],
            true,
        )
        .err()
        .unwrap();
        assert!(matches!(e, ServerResolutionError::Forbidden { .. }), "{e}");
        let ok =
            ToolRegistry::resolve(None, &[named("payments", Some("http://payments:1/"))], true)
                .unwrap();
        assert!(ok.unregistered().is_none());
        // Allowed: the server's session opens through the registry's address guard.
        let r = allowing(r);
        let ok = ToolRegistry::resolve(
            Some(&r),
            &[
                named("orders", None),
                named("payments", Some("http://payments:1/")),
            ],
            true,
        )
        .unwrap();
        let unregistered = ok.unregistered().unwrap();
        assert_eq!(
            unregistered.names.into_iter().collect::<Vec<_>>(),
            ["payments"]
        );
    }

    /// A registered server's host and port under another spelling is the registered
    /// server, refused under another name whichever the policy: no escape from its approval.
    #[tokio::test]
    async fn an_alias_of_a_registered_server_is_refused_however_it_is_spelled() {
        let text = "[servers.orders]\nurl = \"http://orders/mcp\"\nauth = \"none\"\napproval = \"always\"\n\
                    [servers.ledger]\nurl = \"https://10.0.0.5:8443/mcp\"\nauth = \"none\"\napproval = \"writes\"\n";
        for r in [registry(text), allowing(registry(text))] {
            for (alias, want) in [
                ("http://orders./mcp", "orders"),
                ("http://ORDERS/mcp", "orders"),
                ("http://Orders.:80/mcp", "orders"),
                ("http://orders:80/%6Dcp", "orders"),
                ("http://orders/x/../mcp", "orders"),
                ("http://orders/%2e/mcp/", "orders"),
                ("http://orders/MCP;x", "orders"),
                ("https://orders:80/mcp", "orders"),
                ("http://u:p@orders/mcp?x#y", "orders"),
                ("https://10.0.0.5.:8443/mcp", "ledger"),
                ("https://[::ffff:10.0.0.5]:8443/mcp", "ledger"),
                ("https://[::ffff:a00:5]:8443/other", "ledger"),
                ("https://167772165:8443/mcp", "ledger"),
                ("https://0xa.0.0.5:8443/mcp", "ledger"),
                ("http://10.0.0.5:8443/mcp", "ledger"),
            ] {
                let e = ToolRegistry::resolve(Some(&r), &[named("alias", Some(alias))], true)
                    .err()
                    .unwrap_or_else(|| panic!("{alias} was let through"));
                assert!(
                    matches!(
                        &e,
                        ServerResolutionError::RegisteredUnderAnotherName { server, registered, .. }
                            if server == "alias" && registered == want
                    ),
                    "{alias}: {e}"
                );
            }
        }
    }

    /// The registered server named with its URL: any spelling of that URL is accepted (the
    /// registry's URL is used), any other URL is refused.
    #[tokio::test]
    async fn a_registered_servers_url_is_compared_without_its_spelling() {
        let r = registry("[servers.orders]\nurl = \"http://orders/mcp\"\nauth = \"none\"\n");
        for same in [
            "http://orders/mcp",
            "HTTP://ORDERS.:80/%6d%63%70/",
            "http://orders/a/../mcp",
            "http://u@orders/mcp#f",
        ] {
            let ok = ToolRegistry::resolve(Some(&r), &[named("orders", Some(same))], true)
                .unwrap_or_else(|e| panic!("{same}: {e}"));
            assert_eq!(ok.servers[0].url, "http://orders/mcp", "{same}");
        }
        for other in [
            "http://orders/mcp2",
            "http://orders:81/mcp",
            "https://orders:80/mcp",
            "http://orders/mcp?x=1",
            "http://orders/%2Fmcp",
            "http://orders2/mcp",
        ] {
            let e = ToolRegistry::resolve(Some(&r), &[named("orders", Some(other))], true)
                .err()
                .unwrap_or_else(|| panic!("{other} was accepted"));
            assert!(
                matches!(e, ServerResolutionError::UrlMismatch { .. }),
                "{other}: {e}"
            );
        }
    }

    #[test]
    fn without_a_registry_definition_urls_are_used_except_forbidden_ones() {
        let ok = ToolRegistry::resolve(None, &[named("orders", Some("http://orders:1/mcp"))], true)
            .unwrap();
        assert_eq!(ok.servers[0].url, "http://orders:1/mcp");
        for bad in [
            "http://169.254.169.254/latest",
            "http://[fe80::1]:80/mcp",
            "http://[fd00:ec2::254]/",
            "http://metadata.google.internal/",
        ] {
            let e = ToolRegistry::resolve(None, &[named("orders", Some(bad))], true)
                .err()
                .unwrap();
            assert!(
                matches!(e, ServerResolutionError::Forbidden { .. }),
                "{bad}: {e}"
            );
        }
        let e = ToolRegistry::resolve(None, &[named("orders", None)], true)
            .err()
            .unwrap();
        assert!(matches!(e, ServerResolutionError::NoRegistry { .. }));
        let e = ToolRegistry::resolve(None, &[named("orders", Some("http://o/"))], false)
            .err()
            .unwrap();
        assert!(matches!(
            e,
            ServerResolutionError::NoEngineCredentials { .. }
        ));
    }
}
