//! Agent definitions (protocol.md B.1): parsed from the task's `agent` field, else looked up in
//! the local agents file by activity id, then by topic; and the `${name}` template that renders
//! the instructions and the first user message from the process variables.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Map, Value};

use super::approval::{ApprovalPolicy, ApprovalVariables};
use crate::engine::Task;
use crate::provider::ModelRef;
use crate::tools::ToolServerRef;

pub const DEFAULT_MAX_TURNS: u32 = 20;
pub const DEFAULT_RESULT_VARIABLE: &str = "agentResult";

/// A validated agent definition.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentDefinition {
    pub name: String,
    /// The model first, then the fallbacks, in order.
    pub models: Vec<ModelRef>,
    pub instructions: String,
    pub input: String,
    pub tool_servers: Vec<ToolServerRef>,
    pub max_turns: u32,
    pub token_budget: Option<u64>,
    pub result_variable: String,
    /// Which tool calls wait for a person's decision (`approval`); `Never` when not set.
    pub approval: ApprovalPolicy,
    /// The process variables of the approval flow (`approvalVariables`), defaults
    /// `agentStatus`, `agentApprovalRequest`, `agentApproval`.
    pub approval_variables: ApprovalVariables,
    /// `loopCounterVariable`: a variable counting the visits of the node, part of the run key,
    /// for a node the process re-enters for new work and not only with a decision.
    pub loop_counter_variable: Option<String>,
}

/// A definition that cannot be used: an error of the definition, not of the worker; the task
/// becomes an incident an operator can fix and retry.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DefinitionError {
    #[error(
        "task {task_id} carries no agent definition and the agents file has none for activity {activity:?} or topic {topic:?}; add one to ABADA_AGENT_AGENTS_FILE or let the engine send it"
    )]
    Missing {
        task_id: String,
        activity: String,
        topic: String,
    },
    #[error("agent definition {name:?} is invalid: {reason}")]
    Invalid { name: String, reason: String },
    #[error(
        "agent {name:?}: its {field} uses ${{{variable}}}, but the process has no variable {variable:?}; set it before the agent node or fix the template"
    )]
    MissingVariable {
        name: String,
        field: &'static str,
        variable: String,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AgentWire {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default, alias = "fallback_models")]
    fallback_models: Vec<String>,
    #[serde(default)]
    instructions: String,
    #[serde(default)]
    input: String,
    #[serde(default, alias = "tool_servers")]
    tool_servers: Vec<ToolServerWire>,
    #[serde(default, alias = "max_turns")]
    max_turns: Option<u32>,
    #[serde(default, alias = "token_budget")]
    token_budget: Option<u64>,
    #[serde(default, alias = "result_variable")]
    result_variable: Option<String>,
    #[serde(default)]
    approval: Option<Value>,
    #[serde(default, alias = "approval_variables")]
    approval_variables: Option<ApprovalVariablesWire>,
    #[serde(default, alias = "loop_counter_variable")]
    loop_counter_variable: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApprovalVariablesWire {
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    request: Option<String>,
    #[serde(default)]
    decision: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolServerWire {
    name: String,
    url: String,
}

impl AgentDefinition {
    /// Parses and validates a definition (`fallback_name` names it in errors when it has none).
    pub fn from_value(value: &Value, fallback_name: &str) -> Result<Self, DefinitionError> {
        let invalid = |reason: String| DefinitionError::Invalid {
            name: value
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or(fallback_name)
                .to_string(),
            reason,
        };
        // Unknown fields are kept by engines for newer workers: ignore them, but only them.
        let mut known = value.clone();
        if let Some(obj) = known.as_object_mut() {
            obj.retain(|k, _| KNOWN_FIELDS.contains(&k.as_str()));
        } else {
            return Err(invalid("it is not a JSON object".into()));
        }
        let wire: AgentWire = serde_json::from_value(known).map_err(|e| invalid(e.to_string()))?;
        let name = wire
            .name
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| fallback_name.to_string());
        let invalid = |reason: String| DefinitionError::Invalid {
            name: name.clone(),
            reason,
        };
        let model = wire.model.filter(|m| !m.trim().is_empty()).ok_or_else(|| {
            invalid("it names no \"model\" (e.g. \"openai/gpt-4.1-mini\")".into())
        })?;
        let mut models = vec![ModelRef::parse(&model).map_err(|e| invalid(e.to_string()))?];
        for m in &wire.fallback_models {
            models.push(ModelRef::parse(m).map_err(|e| invalid(format!("fallbackModels: {e}")))?);
        }
        let mut tool_servers: Vec<ToolServerRef> = Vec::new();
        for s in wire.tool_servers {
            if s.name.trim().is_empty() {
                return Err(invalid("a tool server has a blank name".into()));
            }
            if !(s.url.starts_with("http://") || s.url.starts_with("https://")) {
                return Err(invalid(format!(
                    "tool server {:?} has url {:?}, which is not http(s)",
                    s.name, s.url
                )));
            }
            if tool_servers.iter().any(|t| t.name == s.name) {
                return Err(invalid(format!("tool server {:?} is listed twice", s.name)));
            }
            tool_servers.push(ToolServerRef {
                name: s.name,
                url: s.url,
            });
        }
        let max_turns = wire.max_turns.unwrap_or(DEFAULT_MAX_TURNS);
        if max_turns == 0 {
            return Err(invalid("maxTurns must be at least 1".into()));
        }
        if wire.token_budget == Some(0) {
            return Err(invalid(
                "tokenBudget must be at least 1 (omit it for none)".into(),
            ));
        }
        let result_variable = wire
            .result_variable
            .filter(|v| !v.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_RESULT_VARIABLE.to_string());
        if wire.input.trim().is_empty() {
            return Err(invalid(
                "its \"input\" (the first user message) is empty".into(),
            ));
        }
        let approval = match &wire.approval {
            None => ApprovalPolicy::Never,
            Some(v) => ApprovalPolicy::from_value(v).map_err(invalid)?,
        };
        let mut approval_variables = ApprovalVariables::default();
        if let Some(names) = wire.approval_variables {
            for (field, given, slot) in [
                ("status", names.status, &mut approval_variables.status),
                ("request", names.request, &mut approval_variables.request),
                ("decision", names.decision, &mut approval_variables.decision),
            ] {
                match given {
                    Some(n) if n.trim().is_empty() => {
                        return Err(invalid(format!("approvalVariables.{field} is blank")));
                    }
                    Some(n) => *slot = n,
                    None => {}
                }
            }
        }
        let names = [
            ("resultVariable", &result_variable),
            ("approvalVariables.status", &approval_variables.status),
            ("approvalVariables.request", &approval_variables.request),
            ("approvalVariables.decision", &approval_variables.decision),
        ];
        for (i, (a, name_a)) in names.iter().enumerate() {
            if let Some((b, _)) = names[i + 1..].iter().find(|(_, n)| n == name_a) {
                return Err(invalid(format!(
                    "{a} and {b} both name the variable {name_a:?}; give each its own"
                )));
            }
        }
        let loop_counter_variable = match wire.loop_counter_variable {
            Some(v) if v.trim().is_empty() => {
                return Err(invalid(
                    "loopCounterVariable is blank (omit it for none)".into(),
                ));
            }
            other => other,
        };
        Ok(AgentDefinition {
            name,
            models,
            instructions: wire.instructions,
            input: wire.input,
            tool_servers,
            max_turns,
            token_budget: wire.token_budget,
            result_variable,
            approval,
            approval_variables,
            loop_counter_variable,
        })
    }

    /// The rendered instructions and first user message.
    pub fn render(
        &self,
        variables: &Map<String, Value>,
    ) -> Result<(String, String), DefinitionError> {
        let render = |field: &'static str, template: &str| {
            render_template(template, variables).map_err(|variable| {
                DefinitionError::MissingVariable {
                    name: self.name.clone(),
                    field,
                    variable,
                }
            })
        };
        Ok((
            render("instructions", &self.instructions)?,
            render("input", &self.input)?,
        ))
    }
}

const KNOWN_FIELDS: &[&str] = &[
    "name",
    "model",
    "fallbackModels",
    "fallback_models",
    "instructions",
    "input",
    "toolServers",
    "tool_servers",
    "maxTurns",
    "max_turns",
    "tokenBudget",
    "token_budget",
    "resultVariable",
    "result_variable",
    "approval",
    "approvalVariables",
    "approval_variables",
    "loopCounterVariable",
    "loop_counter_variable",
];

/// Replaces every `${name}` by the variable: strings as they are, other values as JSON. `$${`
/// writes a literal `${`. Returns the name of the first missing variable.
pub fn render_template(template: &str, variables: &Map<String, Value>) -> Result<String, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(pos) = rest.find("${") {
        if pos > 0 && rest.as_bytes()[pos - 1] == b'$' {
            out.push_str(&rest[..pos - 1]);
            out.push_str("${");
            rest = &rest[pos + 2..];
            continue;
        }
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 2..];
        let Some(end) = after.find('}') else {
            // No closing brace: not a placeholder, keep the text.
            out.push_str(&rest[pos..]);
            return Ok(out);
        };
        let name = after[..end].trim();
        match variables.get(name) {
            Some(Value::String(s)) => out.push_str(s),
            Some(other) => out.push_str(&other.to_string()),
            None => return Err(name.to_string()),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Why the agents file cannot be used (a start-up error).
#[derive(Debug, thiserror::Error)]
pub enum AgentsFileError {
    #[error("cannot read the agents file {path}: {source}; check ABADA_AGENT_AGENTS_FILE")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the agents file {path} is not valid TOML: {reason}")]
    Syntax { path: PathBuf, reason: String },
    #[error("the agents file {path}: {source}")]
    Definition {
        path: PathBuf,
        #[source]
        source: DefinitionError,
    },
}

/// Local agent definitions for engines that send none, keyed by activity id or topic.
///
/// ```toml
/// [agents.refundAgent]            # an activity id
/// model = "openai/gpt-4.1-mini"
/// input = "Customer ${customerId} wrote: ${message}"
///
/// [agents."abada:agent"]          # a topic
/// model = "anthropic/claude-haiku-4-5"
/// input = "${message}"
/// ```
#[derive(Clone, Debug, Default)]
pub struct AgentsFile {
    by_key: HashMap<String, AgentDefinition>,
}

impl AgentsFile {
    pub fn load(path: &Path) -> Result<Self, AgentsFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| AgentsFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ParseError::Syntax(reason) => AgentsFileError::Syntax {
                path: path.to_path_buf(),
                reason,
            },
            ParseError::Definition(source) => AgentsFileError::Definition {
                path: path.to_path_buf(),
                source,
            },
        })
    }

    /// Parses the text of an agents file (TOML).
    pub fn parse_str(text: &str) -> Result<Self, String> {
        Self::parse(text).map_err(|e| match e {
            ParseError::Syntax(reason) => reason,
            ParseError::Definition(source) => source.to_string(),
        })
    }

    fn parse(text: &str) -> Result<Self, ParseError> {
        #[derive(Deserialize)]
        struct FileWire {
            #[serde(default)]
            agents: HashMap<String, toml::Value>,
        }
        let wire: FileWire = toml::from_str(text).map_err(|e| ParseError::Syntax(e.to_string()))?;
        let mut by_key = HashMap::new();
        for (key, value) in wire.agents {
            let json =
                serde_json::to_value(&value).map_err(|e| ParseError::Syntax(e.to_string()))?;
            let def = AgentDefinition::from_value(&json, &key).map_err(ParseError::Definition)?;
            by_key.insert(key, def);
        }
        Ok(AgentsFile { by_key })
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    fn lookup(&self, task: &Task) -> Option<&AgentDefinition> {
        task.activity_id
            .as_deref()
            .and_then(|a| self.by_key.get(a))
            .or_else(|| self.by_key.get(&task.topic))
    }
}

enum ParseError {
    Syntax(String),
    Definition(DefinitionError),
}

/// The definition for a task: its own `agent`, else the agents file's.
pub fn resolve(task: &Task, file: Option<&AgentsFile>) -> Result<AgentDefinition, DefinitionError> {
    let fallback_name = task.activity_id.as_deref().unwrap_or(&task.topic);
    if let Some(agent) = &task.agent {
        return AgentDefinition::from_value(agent, fallback_name);
    }
    file.and_then(|f| f.lookup(task))
        .cloned()
        .ok_or_else(|| DefinitionError::Missing {
            task_id: task.id.clone(),
            activity: task.activity_id.clone().unwrap_or_default(),
            topic: task.topic.clone(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vars() -> Map<String, Value> {
        json!({"customerId": "c-17", "message": "refund please", "amount": 12.5, "tags": ["a"]})
            .as_object()
            .unwrap()
            .clone()
    }

    #[test]
    fn templates_render_strings_raw_and_other_values_as_json() {
        let v = vars();
        assert_eq!(
            render_template("Customer ${customerId} wrote: ${message}", &v).unwrap(),
            "Customer c-17 wrote: refund please"
        );
        assert_eq!(
            render_template("${amount} ${tags}", &v).unwrap(),
            "12.5 [\"a\"]"
        );
        assert_eq!(
            render_template("cost $${amount}", &v).unwrap(),
            "cost ${amount}"
        );
        assert_eq!(render_template("open ${brace", &v).unwrap(), "open ${brace");
        assert_eq!(render_template("${missing}", &v).unwrap_err(), "missing");
        assert_eq!(render_template("", &v).unwrap(), "");
        assert_eq!(render_template("é${customerId}ü", &v).unwrap(), "éc-17ü");
    }

    #[test]
    fn the_documented_definition_parses_with_defaults() {
        let def = AgentDefinition::from_value(
            &json!({
                "name": "refund-agent",
                "model": "openai/gpt-4.1-mini",
                "fallbackModels": ["anthropic/claude-haiku-4-5"],
                "instructions": "You handle refund requests",
                "input": "Customer ${customerId} wrote: ${message}",
                "toolServers": [{"name": "orders", "url": "http://orders-mcp:8080/mcp"}],
                "maxTurns": 12,
                "tokenBudget": 40000,
                "resultVariable": "refundDecision",
                "fromTheFuture": 1
            }),
            "x",
        )
        .unwrap();
        assert_eq!(def.models.len(), 2);
        assert_eq!(def.models[1].provider, "anthropic");
        assert_eq!(def.max_turns, 12);
        let min =
            AgentDefinition::from_value(&json!({"model": "p/m", "input": "hi"}), "act").unwrap();
        assert_eq!(min.name, "act");
        assert_eq!(min.max_turns, DEFAULT_MAX_TURNS);
        assert_eq!(min.result_variable, DEFAULT_RESULT_VARIABLE);
        assert_eq!(min.token_budget, None);
        assert_eq!(min.approval, ApprovalPolicy::Never);
        assert_eq!(min.approval_variables, ApprovalVariables::default());
        assert_eq!(min.loop_counter_variable, None);
    }

    #[test]
    fn approval_settings_parse_and_bad_ones_say_what_is_wrong() {
        let def = AgentDefinition::from_value(
            &json!({"model": "p/m", "input": "x", "approval": ["refund"],
                "approvalVariables": {"decision": "refundDecision"},
                "loopCounterVariable": "round"}),
            "a",
        )
        .unwrap();
        assert_eq!(def.approval, ApprovalPolicy::Tools(vec!["refund".into()]));
        assert_eq!(def.approval_variables.decision, "refundDecision");
        assert_eq!(def.approval_variables.status, "agentStatus");
        assert_eq!(def.loop_counter_variable.as_deref(), Some("round"));
        let file = AgentsFile::parse_str(
            "[agents.a]\nmodel = \"p/m\"\ninput = \"x\"\napproval = \"writes\"\n[agents.a.approvalVariables]\nstatus = \"refundStatus\"\n",
        )
        .unwrap();
        assert_eq!(file.by_key["a"].approval, ApprovalPolicy::Writes);
        assert_eq!(file.by_key["a"].approval_variables.status, "refundStatus");

        let err = |extra: Value| {
            let mut v = json!({"model": "p/m", "input": "x"});
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            AgentDefinition::from_value(&v, "a")
                .unwrap_err()
                .to_string()
        };
        assert!(err(json!({"approval": "maybe"})).contains("\"writes\""));
        assert!(err(json!({"approvalVariables": {"status": " "}})).contains("status is blank"));
        assert!(err(json!({"approvalVariables": {"other": "x"}})).contains("unknown field"));
        assert!(
            err(json!({"approvalVariables": {"decision": "agentResult"}}))
                .contains("resultVariable and approvalVariables.decision")
        );
        assert!(err(json!({"loopCounterVariable": ""})).contains("loopCounterVariable"));
    }

    #[test]
    fn bad_definitions_say_what_is_wrong() {
        let err = |v: Value| {
            AgentDefinition::from_value(&v, "act")
                .unwrap_err()
                .to_string()
        };
        assert!(err(json!("nope")).contains("not a JSON object"));
        assert!(err(json!({"input": "x"})).contains("names no \"model\""));
        assert!(err(json!({"model": "nomodel", "input": "x"})).contains("provider/model"));
        assert!(err(json!({"model": "p/m", "input": "x", "maxTurns": 0})).contains("maxTurns"));
        assert!(err(json!({"model": "p/m", "input": "x", "maxTurns": "many"})).contains("invalid"));
        assert!(err(json!({"model": "p/m", "input": "x", "toolServers": [{"name": "a", "url": "ftp://x"}]})).contains("not http"));
        let def =
            AgentDefinition::from_value(&json!({"model": "p/m", "input": "${nope}"}), "a").unwrap();
        let e = def.render(&Map::new()).unwrap_err();
        assert!(e.to_string().contains("no variable \"nope\""));
    }

    #[test]
    fn the_agents_file_is_looked_up_by_activity_then_topic() {
        let file = AgentsFile::parse(
            r#"
            [agents.refundAgent]
            model = "openai/a"
            input = "by activity"
            max_turns = 3

            [agents."abada:agent"]
            model = "openai/b"
            input = "by topic"
            "#,
        )
        .ok()
        .unwrap();
        let mut task = crate::engine::Task {
            id: "t".into(),
            topic: "abada:agent".into(),
            variables: Map::new(),
            process_instance_id: None,
            activity_id: Some("refundAgent".into()),
            retries: None,
            lock_expiration_time: None,
            trace_parent: None,
            attempt: Some(1),
            agent: None,
        };
        assert_eq!(resolve(&task, Some(&file)).unwrap().input, "by activity");
        assert_eq!(resolve(&task, Some(&file)).unwrap().max_turns, 3);
        task.activity_id = Some("other".into());
        assert_eq!(resolve(&task, Some(&file)).unwrap().input, "by topic");
        task.topic = "elsewhere".into();
        assert!(matches!(
            resolve(&task, Some(&file)),
            Err(DefinitionError::Missing { .. })
        ));
        assert!(AgentsFile::parse("[agents.x]\nmodel = 3").is_err());
    }
}
