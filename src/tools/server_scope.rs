//! What the operator's registry says about *who* may use a tool server and *who* may approve its
//! calls, beside where it is ([`super::registry`]): the server's scope (the process definition
//! keys and the topics whose tasks may name it; default all, as before scopes existed) and its
//! approvers (the engine users whose completion of the approval user task counts as a decision
//! on its calls). Both are the operator's floor against a process author, who otherwise chooses
//! which registered servers a definition names and designs the graph that writes the decision.
//!
//! ```toml
//! [servers.billing]
//! url = "https://billing-mcp:8443/mcp"
//! auth = "bearer"
//! tokenFile = "/var/run/secrets/abada/billing-token"
//! approval = [{ tool = "issue_refund", argument = "amountCents", above = 10000 }]
//! processes = ["refundApproval"]          # optional: process definition keys; default all
//! topics = ["abada:agent"]                # optional: topics; default all
//! approvers = { users = ["alice", "bob"] } # optional: who decides, as the engine records it
//! ```
//!
//! Approvers are engine user names, compared exactly with the `actor` the engine's activity
//! history records for the completion of the user task (`agent::approver`). Groups cannot be
//! listed: Abada 0.11 records the actor's name and not its groups, and no engine API tells a
//! worker which groups a user is in, so a group could not be checked against the engine's
//! word; the file refuses it, saying so. The engine's own placeholders for "nobody" (`system`,
//! `anonymous`) are refused as approvers.

use serde_json::Value;

/// The names the engine records as the actor when it knows nobody: `system` (no request, e.g. a
/// timer) and `anonymous` (a request without an identity), in the engine's
/// `ActivityHistoryService` and `IdentityContextInterceptor`.
pub(crate) const ENGINE_PLACEHOLDER_ACTORS: [&str; 2] = ["system", "anonymous"];

/// The longest name accepted in a scope or an approver list (the engine's ids are far shorter).
const MAX_NAME_CHARS: usize = 256;
/// The most names in one list: a scope or an allow-list is a short, reviewed list.
const MAX_NAMES: usize = 1000;

/// Which tasks may use a server: every listed dimension must match (a process key *and* a
/// topic when both are listed); `None` is every value, as before scopes existed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerScope {
    /// Process definition keys (the BPMN process id, `refundApproval`).
    pub processes: Option<Vec<String>>,
    /// External-task topics (`abada:agent`).
    pub topics: Option<Vec<String>>,
}

/// Who may decide on this server's calls: the engine users whose completion of the approval
/// user task counts (an empty set is refused when the file is read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Approvers {
    pub users: Vec<String>,
}

impl Approvers {
    pub(crate) fn allows(&self, actor: &str) -> bool {
        self.users.iter().any(|u| u == actor)
    }
}

/// What a task is, as far as a scope looks at it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TaskOrigin<'a> {
    pub topic: &'a str,
    /// The process definition key of the task's instance, when it was read (only when a scope
    /// lists processes); `None` when the task belongs to no instance or it could not be read.
    pub process: Option<&'a str>,
}

/// A server named by a definition whose task is outside the server's scope: an incident naming
/// the server and its scope, before any model or tool call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tool server {server:?} is scoped in ABADA_AGENT_TOOLS_FILE to {scope}, and this task is {origin}; nothing was sent to any model or tool. Use a server registered for this process and topic, or add them to the server's scope"
)]
pub struct OutOfScope {
    pub server: String,
    /// The scope as the file says it.
    pub scope: String,
    /// The task's process key and topic.
    pub origin: String,
}

impl ServerScope {
    /// Whether the scope lists processes (then the task's process key must be read).
    pub(crate) fn lists_processes(&self) -> bool {
        self.processes.is_some()
    }

    /// `Ok` when `origin` is in scope; else why not, naming `server` and the scope.
    pub(crate) fn admit(&self, server: &str, origin: TaskOrigin<'_>) -> Result<(), OutOfScope> {
        let topic_ok = self
            .topics
            .as_ref()
            .is_none_or(|t| t.iter().any(|t| t == origin.topic));
        let process_ok = match (&self.processes, origin.process) {
            (None, _) => true,
            (Some(keys), Some(key)) => keys.iter().any(|k| k == key),
            (Some(_), None) => false,
        };
        if topic_ok && process_ok {
            return Ok(());
        }
        Err(OutOfScope {
            server: server.to_string(),
            scope: self.describe(),
            origin: format!(
                "{} on topic {:?}",
                origin.process.map_or_else(
                    || "of no process instance the engine named".to_string(),
                    |p| format!("of process {p:?}")
                ),
                origin.topic
            ),
        })
    }

    fn describe(&self) -> String {
        let list = |v: &Option<Vec<String>>| {
            v.as_ref()
                .map_or_else(|| "any".to_string(), |v| format!("{v:?}"))
        };
        format!(
            "processes {} and topics {}",
            list(&self.processes),
            list(&self.topics)
        )
    }
}

/// Parses `processes` or `topics`: a non-empty list of non-empty names.
pub(crate) fn parse_names(field: &str, value: &Value) -> Result<Vec<String>, String> {
    let items = value.as_array().ok_or_else(|| {
        format!("{field} is a list of names, e.g. [\"refundApproval\"]; leave it out for all")
    })?;
    if items.is_empty() {
        return Err(format!(
            "{field} is an empty list, which no task matches; leave it out for all, or name them"
        ));
    }
    if items.len() > MAX_NAMES {
        return Err(format!("{field} lists more than {MAX_NAMES} names"));
    }
    items
        .iter()
        .map(|item| match item.as_str().map(str::trim) {
            Some(name) if !name.is_empty() && name.chars().count() <= MAX_NAME_CHARS => {
                Ok(name.to_string())
            }
            _ => Err(format!(
                "{field} holds {item}, which is not a name (a non-empty string of at most {MAX_NAME_CHARS} characters)"
            )),
        })
        .collect()
}

/// Parses `approvers = { users = [...] }`.
pub(crate) fn parse_approvers(value: &Value) -> Result<Approvers, String> {
    let table = value.as_object().ok_or_else(|| {
        "approvers is a table, e.g. { users = [\"alice\", \"bob\"] }: the engine users whose completion of the approval task counts".to_string()
    })?;
    if table.contains_key("groups") {
        return Err("approvers.groups cannot be checked: the engine's activity history records who completed a task by user name only, and no engine API tells the worker a user's groups; list the users instead".into());
    }
    if let Some(unknown) = table.keys().find(|k| k.as_str() != "users") {
        return Err(format!(
            "approvers has an unknown key {unknown:?}; it has users"
        ));
    }
    let users = table
        .get("users")
        .ok_or("approvers.users is required: the engine users who may decide")?;
    let users = parse_names("approvers.users", users)?;
    if let Some(placeholder) = users
        .iter()
        .find(|u| ENGINE_PLACEHOLDER_ACTORS.contains(&u.as_str()))
    {
        return Err(format!(
            "approvers.users lists {placeholder:?}, the name the engine records when it knows nobody (no identity, or security disabled): it would let anyone decide"
        ));
    }
    Ok(Approvers { users })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn origin<'a>(topic: &'a str, process: Option<&'a str>) -> TaskOrigin<'a> {
        TaskOrigin { topic, process }
    }

    #[test]
    fn a_scope_admits_only_listed_processes_and_topics_and_says_which() {
        let all = ServerScope::default();
        assert!(all.admit("billing", origin("t", None)).is_ok());
        let scoped = ServerScope {
            processes: Some(vec!["refundApproval".into()]),
            topics: Some(vec!["abada:agent".into()]),
        };
        assert!(
            scoped
                .admit("billing", origin("abada:agent", Some("refundApproval")))
                .is_ok()
        );
        let e = scoped
            .admit("billing", origin("abada:agent", Some("expenses")))
            .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("\"billing\"")
                && text.contains("[\"refundApproval\"]")
                && text.contains("\"expenses\""),
            "{text}"
        );
        assert!(
            scoped
                .admit("billing", origin("other", Some("refundApproval")))
                .is_err()
        );
        // A process scope cannot be checked without the task's process: refused.
        assert!(
            scoped
                .admit("billing", origin("abada:agent", None))
                .is_err()
        );
    }

    #[test]
    fn approvers_are_users_never_groups_nor_the_engines_placeholders() {
        let ok = parse_approvers(&json!({"users": ["alice", " bob "]})).unwrap();
        assert!(ok.allows("alice") && ok.allows("bob") && !ok.allows("Alice"));
        for (bad, says) in [
            (json!({"users": ["alice"], "groups": ["g"]}), "groups"),
            (json!({"users": []}), "empty"),
            (json!({}), "required"),
            (json!({"users": ["anonymous"]}), "anyone"),
            (json!({"users": ["system"]}), "anyone"),
            (json!({"users": [""]}), "not a name"),
            (json!({"users": ["a"], "roles": []}), "unknown key"),
            (json!(["alice"]), "table"),
        ] {
            let e = parse_approvers(&bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert!(parse_names("processes", &json!("refund")).is_err());
    }

    /// The registry file carries both, and a bad one is a start-up error naming the file, the
    /// server and the field; a registry checks a task against each named server's scope.
    #[tokio::test]
    async fn the_registry_reads_scopes_and_approvers_and_checks_tasks_against_them() {
        use crate::tools::registry::{NamedServer, ToolRegistry, ToolsFile};
        let path = std::path::Path::new("/etc/abada/tools.toml");
        let text = r#"
[servers.billing]
url = "http://billing:1/mcp"
auth = "none"
approval = [{ tool = "issue_refund", argument = "amountCents", above = 10000 }]
processes = ["refundApproval"]
topics = ["abada:agent"]
approvers = { users = ["alice"] }

[servers.orders]
url = "http://orders:1/mcp"
auth = "none"
approval = "writes"
"#;
        let file = ToolsFile::parse(text, path).unwrap();
        let billing = &file.servers["billing"];
        assert_eq!(
            billing.scope.processes.as_deref(),
            Some(&["refundApproval".to_string()][..])
        );
        assert!(billing.approvers.as_ref().unwrap().allows("alice"));
        assert_eq!(file.servers["orders"].scope, ServerScope::default());
        let registry = ToolRegistry::start(file, reqwest::Client::builder()).unwrap();
        assert_eq!(registry.approvals_without_approvers(), vec!["orders"]);
        assert_eq!(registry.servers_with_approvers(), vec!["billing"]);
        let named = |n: &str| NamedServer {
            name: n.into(),
            url: None,
        };
        let both = [named("orders"), named("billing")];
        assert!(registry.scope_lists_processes(&both));
        assert!(!registry.scope_lists_processes(&[named("orders")]));
        let admitted = origin("abada:agent", Some("refundApproval"));
        assert!(registry.check_scope(&both, admitted).is_ok());
        let e = registry
            .check_scope(&both, origin("abada:agent", Some("expenseReport")))
            .unwrap_err();
        assert_eq!(e.server, "billing");
        for (field, value, says) in [
            ("approvers", r#"{ groups = ["g"] }"#, "groups"),
            ("processes", "[]", "empty"),
            ("topics", r#""abada:agent""#, "list of names"),
            ("approvers", r#"{ users = ["anonymous"] }"#, "anyone"),
        ] {
            let text = format!(
                "[servers.billing]\nurl = \"http://billing:1/mcp\"\nauth = \"none\"\n{field} = {value}\n"
            );
            let e = ToolsFile::parse(&text, path).unwrap_err().to_string();
            assert!(
                e.contains("/etc/abada/tools.toml")
                    && e.contains("\"billing\"")
                    && e.contains(&format!("field {field}"))
                    && e.contains(says),
                "{e}"
            );
        }
    }
}
