//! Label values of the metrics that name an agent, a model, a tool server or a tool, from a
//! closed set the operator declared: a definition sent by the engine or read from the BPMN is a
//! process author's, and 60 tasks naming 60 new agents and models made 5,808 series. So:
//!
//! - only names in the operator's files become label values ([`Vocabulary`]): the agents file's
//!   agent names, their models and tool servers, and the tool registry's servers
//!   (`ABADA_AGENT_AGENTS_FILE`, `ABADA_AGENT_TOOLS_FILE`); a model must also be one the task's
//!   definition names, a tool one its declared server listed ([`DeclaredNames`]);
//! - each label takes at most [`MAX_DISTINCT_VALUES`] distinct values for the worker's life,
//!   shared by every family that carries it (so no family holds more), first come first kept:
//!   the operator's names at start-up in order, the tools as their servers list them;
//! - each value is cut to [`MAX_LABEL_LEN`] bytes;
//! - anything else is [`OTHER`]: an engine-sent agent, a model no operator file names, a tool a
//!   model invented or a server listed past the cap. A hostile definition, model or tool
//!   server therefore cannot create new Prometheus series.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};

use crate::conversation::ToolSpec;
use crate::provider::ModelRef;

/// The label value of every name nobody declared.
pub(crate) const OTHER: &str = "other";
/// The longest label value, in bytes; longer declared names are cut at a character boundary.
pub(crate) const MAX_LABEL_LEN: usize = 64;
/// The most distinct values one label (agent, model, server, tool) takes, [`OTHER`] aside.
pub(crate) const MAX_DISTINCT_VALUES: usize = 64;

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

/// What the operator's files declare, as read at start-up.
#[derive(Clone, Debug, Default)]
pub(crate) struct OperatorNames {
    pub(crate) agents: BTreeSet<String>,
    pub(crate) models: BTreeSet<(String, String)>,
    pub(crate) servers: BTreeSet<String>,
}

/// The values a label may take: the operator's names, and, for tools, what their servers list,
/// each set capped at [`MAX_DISTINCT_VALUES`]. One per worker, shared by every task.
#[derive(Debug, Default)]
pub(crate) struct Vocabulary {
    agents: HashSet<String>,
    models: HashSet<(String, String)>,
    servers: HashSet<String>,
    /// `(server, tool)` pairs admitted so far; grows as declared servers list tools.
    tools: Mutex<HashSet<(String, String)>>,
}

impl Vocabulary {
    /// The operator's names, each label's first [`MAX_DISTINCT_VALUES`] (in order) admitted;
    /// the rest will show as [`OTHER`] (said once at start-up, by the caller).
    pub(crate) fn new(names: &OperatorNames) -> Vocabulary {
        fn first<T: Clone + Eq + std::hash::Hash>(set: &BTreeSet<T>) -> HashSet<T> {
            set.iter().take(MAX_DISTINCT_VALUES).cloned().collect()
        }
        Vocabulary {
            agents: first(&names.agents),
            models: first(&names.models),
            servers: first(&names.servers),
            tools: Mutex::new(HashSet::new()),
        }
    }

    /// The names past a label's cap, by label, for the start-up warning.
    pub(crate) fn overflow(names: &OperatorNames) -> Vec<(&'static str, usize)> {
        [
            ("agent", names.agents.len()),
            ("model", names.models.len()),
            ("server", names.servers.len()),
        ]
        .into_iter()
        .filter(|(_, n)| *n > MAX_DISTINCT_VALUES)
        .map(|(label, n)| (label, n - MAX_DISTINCT_VALUES))
        .collect()
    }

    /// The `agent` label value of a definition named `name`.
    pub(crate) fn agent(&self, name: &str) -> String {
        if self.agents.contains(name) {
            capped(name)
        } else {
            OTHER.to_string()
        }
    }

    /// Admits the tool `(server, tool)` if there is room left; whether it is admitted.
    fn admit_tool(&self, server: &str, tool: &str) -> bool {
        let mut tools = self.tools.lock().unwrap_or_else(|p| p.into_inner());
        let key = (server.to_string(), tool.to_string());
        if tools.contains(&key) {
            return true;
        }
        if tools.len() >= MAX_DISTINCT_VALUES {
            return false;
        }
        tools.insert(key);
        true
    }
}

/// The names a task may label metrics with: its definition's, within the worker's
/// [`Vocabulary`].
#[derive(Clone, Debug)]
pub(crate) struct DeclaredNames {
    vocabulary: Arc<Vocabulary>,
    models: HashSet<(String, String)>,
    servers: HashSet<String>,
    tools: HashSet<(String, String)>,
}

impl DeclaredNames {
    /// The models and tool servers a definition names, within `vocabulary`.
    pub(crate) fn of_definition<'a>(
        vocabulary: Arc<Vocabulary>,
        models: impl IntoIterator<Item = &'a ModelRef>,
        servers: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let models = models
            .into_iter()
            .map(|m| (m.provider.clone(), m.model.clone()))
            .filter(|m| vocabulary.models.contains(m))
            .collect();
        let servers = servers
            .into_iter()
            .filter(|s| vocabulary.servers.contains(*s))
            .map(str::to_string)
            .collect();
        DeclaredNames {
            vocabulary,
            models,
            servers,
            tools: HashSet::new(),
        }
    }

    /// The tools a declared server listed, as far as the vocabulary has room.
    pub(crate) fn declare_tools(&mut self, specs: &[ToolSpec]) {
        for s in specs {
            if self.servers.contains(&s.server) && self.vocabulary.admit_tool(&s.server, &s.tool) {
                self.tools.insert((s.server.clone(), s.tool.clone()));
            }
        }
    }

    /// The `agent` label value of the definition named `name`.
    pub(crate) fn agent(&self, name: &str) -> String {
        self.vocabulary.agent(name)
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

    fn operator(agents: &[&str], models: &[&str], servers: &[&str]) -> Arc<Vocabulary> {
        let names = OperatorNames {
            agents: agents.iter().map(|a| a.to_string()).collect(),
            models: models
                .iter()
                .map(|m| {
                    let m = ModelRef::parse(m).unwrap();
                    (m.provider, m.model)
                })
                .collect(),
            servers: servers.iter().map(|s| s.to_string()).collect(),
        };
        Arc::new(Vocabulary::new(&names))
    }

    #[test]
    fn only_declared_names_become_label_values() {
        let model = ModelRef::parse("openai/gpt-4.1-mini").unwrap();
        let vocabulary = operator(&["refunds"], &["openai/gpt-4.1-mini"], &["orders", "rogue"]);
        let mut names = DeclaredNames::of_definition(vocabulary, [&model], ["orders"]);
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
        assert_eq!(names.agent("refunds"), "refunds");
        assert_eq!(names.agent("engine-sent"), OTHER);
    }

    /// A definition the operator did not write (sent by the engine, read from the BPMN) names
    /// what it likes: none of it is a label value unless an operator's file names it too.
    #[test]
    fn a_definitions_own_names_are_other_unless_the_operator_declared_them() {
        let vocabulary = operator(&["refunds"], &["openai/refund"], &["orders"]);
        let invented = ModelRef::parse("openai/invented-7").unwrap();
        let declared = ModelRef::parse("openai/refund").unwrap();
        let mut names = DeclaredNames::of_definition(
            vocabulary,
            [&invented, &declared],
            ["orders", "payments-7"],
        );
        names.declare_tools(&[spec("payments-7", "pay"), spec("orders", "refund")]);
        assert_eq!(names.model(&invented), (OTHER.into(), OTHER.into()));
        assert_eq!(names.model(&declared), ("openai".into(), "refund".into()));
        assert_eq!(
            names.tool("payments-7", "pay"),
            (OTHER.into(), OTHER.into())
        );
        assert_eq!(names.agent("agent-7"), OTHER);
    }

    /// Each label's distinct values are capped for the worker's life: the operator's names past
    /// the cap, and tools listed past it, are `other`.
    #[test]
    fn each_label_takes_at_most_the_cap_of_distinct_values() {
        let many: Vec<String> = (0..MAX_DISTINCT_VALUES + 10)
            .map(|i| format!("a-{i:03}"))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        let names = OperatorNames {
            agents: many.iter().cloned().collect(),
            models: BTreeSet::new(),
            servers: ["orders".to_string()].into(),
        };
        assert_eq!(Vocabulary::overflow(&names), [("agent", 10)]);
        let vocabulary = Arc::new(Vocabulary::new(&names));
        let kept: HashSet<String> = refs.iter().map(|a| vocabulary.agent(a)).collect();
        assert_eq!(kept.len(), MAX_DISTINCT_VALUES + 1, "the cap and `other`");
        let mut distinct_tools = HashSet::new();
        for task in 0..3 {
            let mut names = DeclaredNames::of_definition(vocabulary.clone(), [], ["orders"]);
            let listed: Vec<ToolSpec> = (0..50)
                .map(|i| spec("orders", &format!("tool-{task}-{i}")))
                .collect();
            names.declare_tools(&listed);
            for t in &listed {
                distinct_tools.insert(names.tool("orders", &t.tool).1);
            }
        }
        assert_eq!(distinct_tools.len(), MAX_DISTINCT_VALUES + 1);
        assert!(distinct_tools.contains(OTHER));
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
