//! The names a model sees for MCP tools: `server__tool`, sanitised to the function-name rule
//! both providers enforce (`^[a-zA-Z0-9_-]{1,64}$`), and the way back from such a name to the
//! MCP server and tool.
//!
//! A name that is too long, or that two tools would share after sanitising, gets a short hash
//! of its server and tool instead of its tail, for every tool of the clash, so the result does
//! not depend on the order tools are listed in.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use crate::conversation::{ToolCall, ToolSpec};

/// Longest function name providers accept.
pub(crate) const MAX_NAME_LEN: usize = 64;
const HASH_HEX_LEN: usize = 8;

/// The mapping between MCP tools and the function names offered to a model in one request.
#[derive(Clone, Debug, Default)]
pub(crate) struct ToolNames {
    /// (server, tool) -> function name, in the order of the tool list.
    forward: Vec<((String, String), String)>,
    backward: HashMap<String, (String, String)>,
}

impl ToolNames {
    pub fn new(tools: &[ToolSpec]) -> Self {
        let bases: Vec<String> = tools
            .iter()
            .map(|t| sanitise(&format!("{}__{}", t.server, t.tool)))
            .collect();
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for b in &bases {
            *counts.entry(b.as_str()).or_default() += 1;
        }
        let mut names = ToolNames::default();
        for (spec, base) in tools.iter().zip(&bases) {
            let name = if base.len() > MAX_NAME_LEN || counts[base.as_str()] > 1 {
                hashed(base, &spec.server, &spec.tool)
            } else {
                base.clone()
            };
            let key = (spec.server.clone(), spec.tool.clone());
            names
                .backward
                .entry(name.clone())
                .or_insert_with(|| key.clone());
            names.forward.push((key, name));
        }
        names
    }

    /// The function name for a tool, also for calls in the history whose tool is no longer
    /// offered (sanitised the same way; the raw name alone when the server is empty).
    pub(crate) fn function_name(&self, server: &str, tool: &str) -> String {
        if let Some((_, name)) = self
            .forward
            .iter()
            .find(|((s, t), _)| s == server && t == tool)
        {
            return name.clone();
        }
        let base = if server.is_empty() {
            sanitise(tool)
        } else {
            sanitise(&format!("{server}__{tool}"))
        };
        if base.len() > MAX_NAME_LEN {
            hashed(&base, server, tool)
        } else {
            base
        }
    }

    /// The MCP (server, tool) for a name the model used; an unknown name maps to an empty
    /// server and the raw name.
    pub fn resolve(&self, function_name: &str) -> (String, String) {
        self.backward
            .get(function_name)
            .cloned()
            .unwrap_or_else(|| (String::new(), function_name.to_string()))
    }

    /// A tool call from a model's function name, id and arguments.
    pub(crate) fn tool_call(
        &self,
        call_id: String,
        function_name: &str,
        arguments: serde_json::Value,
    ) -> ToolCall {
        let (server, tool) = self.resolve(function_name);
        ToolCall {
            call_id,
            server,
            tool,
            arguments,
        }
    }
}

/// Replaces every character outside `[a-zA-Z0-9_-]`; an empty name becomes `tool`.
fn sanitise(raw: &str) -> String {
    let s: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() { "tool".to_string() } else { s }
}

fn hashed(base: &str, server: &str, tool: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(server.as_bytes());
    hasher.update([0u8]);
    hasher.update(tool.as_bytes());
    let digest = hasher.finalize();
    let hex: String = digest
        .iter()
        .take(HASH_HEX_LEN / 2)
        .map(|b| format!("{b:02x}"))
        .collect();
    let keep = MAX_NAME_LEN - HASH_HEX_LEN - 1;
    // `base` is ASCII after sanitising, so any byte index is a char boundary.
    let prefix = &base[..base.len().min(keep)];
    format!("{prefix}_{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(server: &str, tool: &str) -> ToolSpec {
        ToolSpec {
            server: server.into(),
            tool: tool.into(),
            description: String::new(),
            input_schema: json!({"type": "object"}),
            read_only: false,
            destructive: false,
        }
    }

    fn valid(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= MAX_NAME_LEN
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    }

    #[test]
    fn plain_names_and_the_way_back() {
        let names = ToolNames::new(&[spec("orders", "issue_refund"), spec("crm", "get.customer")]);
        assert_eq!(
            names.function_name("orders", "issue_refund"),
            "orders__issue_refund"
        );
        assert_eq!(
            names.function_name("crm", "get.customer"),
            "crm__get_customer"
        );
        assert_eq!(
            names.resolve("crm__get_customer"),
            ("crm".to_string(), "get.customer".to_string())
        );
        assert_eq!(names.resolve("nope"), (String::new(), "nope".to_string()));
    }

    #[test]
    fn collisions_and_long_names_are_hashed_independently_of_order() {
        let long = "x".repeat(100);
        let tools = [spec("a", "b.c"), spec("a", "b/c"), spec("srv", &long)];
        let names = ToolNames::new(&tools);
        let mut reversed = tools.to_vec();
        reversed.reverse();
        let names_rev = ToolNames::new(&reversed);
        let all: Vec<String> = tools
            .iter()
            .map(|t| names.function_name(&t.server, &t.tool))
            .collect();
        for (t, n) in tools.iter().zip(&all) {
            assert!(valid(n), "{n}");
            assert_eq!(names.resolve(n), (t.server.clone(), t.tool.clone()));
            assert_eq!(&names_rev.function_name(&t.server, &t.tool), n);
        }
        assert_ne!(all[0], all[1]);
    }
}
