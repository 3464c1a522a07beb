//! Label values of the metrics that name a model or a tool, from a closed set: only names an
//! operator or a process modeller declared become label values (the definition's models and tool
//! servers, the tools those servers listed), each cut to [`MAX_LABEL_LEN`]; anything else, such
//! as a tool name a model invented, is [`OTHER`]. A hostile model therefore cannot create new
//! Prometheus series.
//!
//! Declared names come from the task's definition today. Tool servers of the worker's registry
//! (`ABADA_AGENT_TOOLS_FILE`) join through [`DeclaredNames::declare_server`].

use std::collections::HashSet;

use crate::conversation::ToolSpec;
use crate::provider::ModelRef;

/// The label value of every name nobody declared.
pub(crate) const OTHER: &str = "other";
/// The longest label value, in bytes; longer declared names are cut at a character boundary.
pub(crate) const MAX_LABEL_LEN: usize = 64;

/// `value` cut to at most [`MAX_LABEL_LEN`] bytes.
pub fn capped(value: &str) -> String {
    if value.len() <= MAX_LABEL_LEN {
        return value.to_string();
    }
    let mut end = MAX_LABEL_LEN;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].to_string()
}

/// The names a task may label metrics with.
#[derive(Clone, Debug, Default)]
pub(crate) struct DeclaredNames {
    models: HashSet<(String, String)>,
    servers: HashSet<String>,
    tools: HashSet<(String, String)>,
}

impl DeclaredNames {
    /// The models and tool servers a definition names.
    pub(crate) fn of_definition<'a>(
        models: impl IntoIterator<Item = &'a ModelRef>,
        servers: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let mut names = DeclaredNames::default();
        for m in models {
            names.models.insert((m.provider.clone(), m.model.clone()));
        }
        for s in servers {
            names.declare_server(s);
        }
        names
    }

    /// A tool server declared elsewhere (the worker's tool registry).
    pub(crate) fn declare_server(&mut self, server: &str) {
        self.servers.insert(server.to_string());
    }

    /// The tools a declared server listed.
    pub(crate) fn declare_tools(&mut self, specs: &[ToolSpec]) {
        for s in specs {
            if self.servers.contains(&s.server) {
                self.tools.insert((s.server.clone(), s.tool.clone()));
            }
        }
    }

    /// `(provider, model)` label values.
    pub fn model(&self, model: &ModelRef) -> (String, String) {
        if self
            .models
            .contains(&(model.provider.clone(), model.model.clone()))
        {
            (capped(&model.provider), capped(&model.model))
        } else {
            (OTHER.to_string(), OTHER.to_string())
        }
    }

    /// `(server, tool)` label values: a declared server keeps its name even for a tool it did
    /// not list (that tool is `other`).
    pub fn tool(&self, server: &str, tool: &str) -> (String, String) {
        if !self.servers.contains(server) {
            return (OTHER.to_string(), OTHER.to_string());
        }
        let tool = if self.tools.contains(&(server.to_string(), tool.to_string())) {
            capped(tool)
        } else {
            OTHER.to_string()
        };
        (capped(server), tool)
    }
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

    #[test]
    fn only_declared_names_become_label_values() {
        let model = ModelRef::parse("openai/gpt-4.1-mini").unwrap();
        let mut names = DeclaredNames::of_definition([&model], ["orders"]);
        names.declare_tools(&[spec("orders", "refund"), spec("rogue", "x")]);
        assert_eq!(
            names.model(&model),
            ("openai".into(), "gpt-4.1-mini".into())
        );
        assert_eq!(
            names.model(&ModelRef::parse("openai/other-model").unwrap()),
            (OTHER.into(), OTHER.into())
        );
        assert_eq!(
            names.tool("orders", "refund"),
            ("orders".into(), "refund".into())
        );
        assert_eq!(
            names.tool("orders", "invented_1"),
            ("orders".into(), OTHER.into())
        );
        assert_eq!(names.tool("", "invented_2"), (OTHER.into(), OTHER.into()));
        assert_eq!(names.tool("rogue", "x"), (OTHER.into(), OTHER.into()));
    }

    #[test]
    fn long_names_are_cut_at_a_character_boundary() {
        assert_eq!(capped("short"), "short");
        let long = "é".repeat(100);
        let cut = capped(&long);
        assert!(cut.len() <= MAX_LABEL_LEN);
        assert_eq!(cut.len(), MAX_LABEL_LEN);
        assert!(long.starts_with(&cut));
        assert_eq!(capped(&"a".repeat(65)).len(), 64);
    }
}
