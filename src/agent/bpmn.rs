//! Agent definitions that BPMN authors write on the service task: Camunda extension properties
//! `abada.agent.<key>` under `camunda:properties` on the `camunda:topic` service task, read from
//! the process definition the engine serves (`GET /v1/processes/{id}`), mapped into the same raw
//! definition the agents file parses into, and parsed by the one parser
//! ([`AgentDefinition::from_value`]).
//!
//! Where a task's definition comes from, first match wins: the task's own `agent` (agent/1),
//! the agents file's entry for the activity id (the operator overrides the author, said once in
//! the log), the BPMN service task's properties, the agents file's entry for the topic.
//!
//! Versions (protocol.md Part D): the engine names an instance's definition by its process key
//! and serves only the key's latest version. So a run journals the definition it started with
//! (its raw definition, with the key and version, in the input step; the agents file's and the
//! engine's are journaled alike, [`journal_snapshot`]) and a resumed run keeps it (found before
//! any definition is read: `run_home`);
//! a task first reached after a redeployment uses the latest version. Parsed definitions are
//! cached per (key, version, digest of the XML) in a bounded map; which version is the latest is re-learned at most
//! every [`BpmnSettings::latest_for`] (one definition read per key in that window, concurrent
//! tasks share it); an instance's key never changes and is cached in a bounded map too.
//!
//! An id given to two elements of a process makes that activity's definition an error (which
//! one a task runs cannot be told). The XML is outside input: at most [`MAX_XML_BYTES`], no DTD (so no entity expansion), at
//! most [`MAX_XML_NODES`] nodes, at most [`MAX_XML_DEPTH`] levels of elements (measured by a
//! linear scan before parsing: the parser's stack grows with depth).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::definition::{self, AgentDefinition, AgentsFile, DefinitionError};
use crate::engine::{EngineError, Task};
use crate::handler::{TaskContext, TaskError};

/// The prefix of every property that defines an agent.
pub(crate) const PROPERTY_PREFIX: &str = "abada.agent.";
/// The largest BPMN XML parsed (the engine answer's own cap is a little above).
pub(crate) const MAX_XML_BYTES: usize = crate::body::PROCESS_DEFINITION_MAX_BYTES;
/// The most XML nodes (elements, attributes' text, comments) parsed in one definition.
pub(crate) const MAX_XML_NODES: u32 = 200_000;
/// The deepest element nesting parsed: a BPMN model nests a few levels (sub-processes add
/// some); the XML parser's stack use grows with depth, so a deeper document is refused first.
pub(crate) const MAX_XML_DEPTH: usize = 256;
/// The largest raw definition of one service task, as journaled: its instructions and input
/// are prompts, not data.
pub(crate) const MAX_DEFINITION_BYTES: usize = 256 * 1024;

const BPMN_MODEL_NS: &str = "http://www.omg.org/spec/BPMN/20100524/MODEL";
const CAMUNDA_NS: &str = "http://camunda.org/schema/1.0/bpmn";

/// The keys of `abada.agent.<key>`, as the agents file spells them, and how a property's text
/// becomes the value the agents file would hold.
const KEYS: &[(&str, Kind)] = &[
    ("name", Kind::Text),
    ("model", Kind::Text),
    ("fallbackModels", Kind::List),
    ("instructions", Kind::Text),
    ("renderInstructions", Kind::Bool),
    ("input", Kind::Text),
    ("toolServers", Kind::RegistryNames),
    ("maxTurns", Kind::Integer),
    ("tokenBudget", Kind::Integer),
    ("maxOutputTokens", Kind::Integer),
    ("maxToolCallsPerAnswer", Kind::Integer),
    ("maxToolCalls", Kind::Integer),
    ("maxKeyedWrites", Kind::Integer),
    ("maxDurationMs", Kind::Integer),
    ("resultVariable", Kind::Text),
    ("approval", Kind::Approval),
    ("approvalVariables.status", Kind::Text),
    ("approvalVariables.request", Kind::Text),
    ("approvalVariables.decision", Kind::Text),
    ("loopCounterVariable", Kind::Text),
    ("outputSchema", Kind::Json),
    ("outputRepairTurns", Kind::Integer),
    ("answerRepairTurns", Kind::Integer),
];

#[derive(Clone, Copy, Debug)]
enum Kind {
    Text,
    /// Comma-separated, blanks trimmed, empty items dropped.
    List,
    /// A list of names of the operator's tool-server registry (never a URL: where tools are is
    /// the operator's to say).
    RegistryNames,
    Integer,
    Bool,
    /// `never`, `writes`, `always`, a comma-separated list of tool names, or a JSON list of
    /// rules (`[{"tool": ..., "argument": ..., "above": ...}]`).
    Approval,
    /// JSON text.
    Json,
}

pub(crate) use super::definition::BpmnOrigin;

/// A BPMN definition that cannot be read, or a service task whose agent cannot be used: an
/// error of the process model, not of the worker; the task becomes an incident.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum BpmnError {
    #[error(
        "process {process:?} (version {version}): its BPMN XML is {bytes} bytes, over the {limit}-byte cap; split the process or shorten the agents' instructions"
    )]
    TooLarge {
        process: String,
        version: String,
        bytes: usize,
        limit: usize,
    },
    #[error(
        "process {process:?} (version {version}): its BPMN XML cannot be read: {reason}; deploy a valid BPMN 2.0 file (no DTD, at most {MAX_XML_NODES} nodes)"
    )]
    Xml {
        process: String,
        version: String,
        reason: String,
    },
    #[error(
        "process {process:?} (version {version}): {count} elements have the id {activity:?}, so which one a task of that activity runs cannot be told; no agent definition of that id is used. Give every element its own id and redeploy"
    )]
    DuplicateId {
        process: String,
        version: String,
        activity: String,
        count: usize,
    },
    #[error(
        "process {process:?}, service task {activity:?}: property {property:?} {reason}; fix it in the process model and redeploy"
    )]
    Property {
        process: String,
        activity: String,
        property: String,
        reason: String,
    },
    #[error(
        "the run's journaled definition ({source_kind} entry {entry:?}) no longer parses: {source}; the run cannot go on with the definition it started with"
    )]
    Journaled {
        source_kind: &'static str,
        entry: String,
        #[source]
        source: DefinitionError,
    },
    #[error(
        "process {process:?}, service task {activity:?}: the agent defined by its abada.agent.* properties cannot be used: {source}; fix it in the process model and redeploy"
    )]
    Definition {
        process: String,
        activity: String,
        #[source]
        source: DefinitionError,
    },
}

/// The agents of one deployed version of a process, by service task id.
#[derive(Debug)]
pub(crate) struct ProcessAgents {
    /// A service task whose properties do not make a definition keeps its error, so only the
    /// tasks of that node become incidents.
    by_activity: HashMap<String, Result<AgentDefinition, BpmnError>>,
}

impl ProcessAgents {
    fn agent(&self, activity: &str) -> Option<&Result<AgentDefinition, BpmnError>> {
        self.by_activity.get(activity)
    }
}

fn version_text(version: Option<i64>) -> String {
    version.map_or_else(|| "unknown".to_string(), |v| v.to_string())
}

/// Reads every `camunda:topic` service task's `abada.agent.*` properties from a process
/// definition's XML. An XML that cannot be read is an error for the whole process; a bad
/// definition is an error for its service task only.
pub(crate) fn parse_process(
    process: &str,
    version: Option<i64>,
    xml: &str,
) -> Result<ProcessAgents, BpmnError> {
    if xml.len() > MAX_XML_BYTES {
        return Err(BpmnError::TooLarge {
            process: process.to_string(),
            version: version_text(version),
            bytes: xml.len(),
            limit: MAX_XML_BYTES,
        });
    }
    let depth = element_depth(xml);
    if depth > MAX_XML_DEPTH {
        return Err(BpmnError::Xml {
            process: process.to_string(),
            version: version_text(version),
            reason: format!("its elements nest over {MAX_XML_DEPTH} levels deep"),
        });
    }
    let options = roxmltree::ParsingOptions {
        // No DTD: no entity can expand (a "billion laughs" is refused, not computed).
        allow_dtd: false,
        nodes_limit: MAX_XML_NODES,
    };
    let doc =
        roxmltree::Document::parse_with_options(xml, options).map_err(|e| BpmnError::Xml {
            process: process.to_string(),
            version: version_text(version),
            reason: e.to_string(),
        })?;
    // An id given to two elements of the model: which one a task of that id runs cannot be
    // told, so neither's definition is used (the last one read would otherwise win).
    let mut seen_ids: HashMap<&str, usize> = HashMap::new();
    for id in doc
        .descendants()
        .filter(|n| n.is_element() && n.tag_name().namespace() == Some(BPMN_MODEL_NS))
        .filter_map(|n| n.attribute("id"))
    {
        *seen_ids.entry(id).or_default() += 1;
    }
    let mut by_activity = HashMap::new();
    for task in doc.descendants().filter(|n| {
        n.is_element()
            && n.tag_name().name() == "serviceTask"
            && n.tag_name().namespace() == Some(BPMN_MODEL_NS)
            && n.attribute((CAMUNDA_NS, "topic")).is_some()
    }) {
        let Some(activity) = task.attribute("id") else {
            continue;
        };
        let count = seen_ids.get(activity).copied().unwrap_or(0);
        if count > 1 {
            by_activity.insert(
                activity.to_string(),
                Err(BpmnError::DuplicateId {
                    process: process.to_string(),
                    version: version_text(version),
                    activity: activity.to_string(),
                    count,
                }),
            );
            continue;
        }
        let properties: Vec<(&str, &str)> = task
            .children()
            .filter(|c| c.has_tag_name((BPMN_MODEL_NS, "extensionElements")))
            .flat_map(|e| e.children())
            .filter(|c| c.has_tag_name((CAMUNDA_NS, "properties")))
            .flat_map(|p| p.children())
            .filter(|c| c.has_tag_name((CAMUNDA_NS, "property")))
            .filter_map(|p| Some((p.attribute("name")?, p.attribute("value").unwrap_or(""))))
            .filter(|(name, _)| name.starts_with(PROPERTY_PREFIX))
            .collect();
        if properties.is_empty() {
            continue;
        }
        let parsed = definition_of(process, version, activity, &properties);
        by_activity.insert(activity.to_string(), parsed);
    }
    Ok(ProcessAgents { by_activity })
}

/// How deep the elements of `xml` nest, at least (a linear scan, no recursion): comments,
/// CDATA, processing instructions and declarations are skipped, quoted attribute values are
/// not mistaken for tag ends. Errs on the deep side for malformed XML, which the parser refuses
/// anyway.
fn element_depth(xml: &str) -> usize {
    let b = xml.as_bytes();
    let find = |from: usize, end: &[u8]| {
        b.get(from..)
            .and_then(|rest| rest.windows(end.len()).position(|w| w == end))
            .map_or(b.len(), |at| from + at + end.len())
    };
    let (mut i, mut depth, mut deepest) = (0, 0usize, 0usize);
    while i < b.len() {
        if b[i] != b'<' {
            i += 1;
            continue;
        }
        let rest = &b[i..];
        if rest.starts_with(b"<!--") {
            i = find(i + 4, b"-->");
            continue;
        }
        if rest.starts_with(b"<![CDATA[") {
            i = find(i + 9, b"]]>");
            continue;
        }
        if rest.starts_with(b"<?") {
            i = find(i + 2, b"?>");
            continue;
        }
        if rest.starts_with(b"<!") {
            i = find(i + 2, b">");
            continue;
        }
        let closing = rest.get(1) == Some(&b'/');
        let mut j = i + 1;
        let mut quote = None;
        while j < b.len() {
            match (quote, b[j]) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, c @ (b'"' | b'\'')) => quote = Some(c),
                (None, b'>') => break,
                (None, _) => {}
            }
            j += 1;
        }
        let self_closing = !closing && j > i + 1 && b.get(j - 1) == Some(&b'/');
        if closing {
            depth = depth.saturating_sub(1);
        } else if !self_closing {
            depth += 1;
            deepest = deepest.max(depth);
        }
        i = j + 1;
    }
    deepest
}

/// A service task's id with its definition, or the text of the error naming what is wrong.
pub(crate) type BpmnAgent = (String, Result<AgentDefinition, String>);

/// [`parse_process`] as plain values, for `decoders` (property tests and fuzzing): each agent's
/// service task id with its definition or the error's text, sorted by id.
pub(crate) fn agents_of_xml(
    process: &str,
    version: Option<i64>,
    xml: &str,
) -> Result<Vec<BpmnAgent>, String> {
    let agents = parse_process(process, version, xml).map_err(|e| e.to_string())?;
    let mut all: Vec<_> = agents
        .by_activity
        .into_iter()
        .map(|(id, def)| (id, def.map_err(|e| e.to_string())))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(all)
}

/// One service task's definition: its properties mapped into the raw definition, then parsed by
/// the agents file's parser.
fn definition_of(
    process: &str,
    version: Option<i64>,
    activity: &str,
    properties: &[(&str, &str)],
) -> Result<AgentDefinition, BpmnError> {
    let raw = raw_definition(properties).map_err(|(property, reason)| BpmnError::Property {
        process: process.to_string(),
        activity: activity.to_string(),
        property,
        reason,
    })?;
    from_raw(process, version, activity, raw)
}

fn from_raw(
    process: &str,
    version: Option<i64>,
    activity: &str,
    raw: Value,
) -> Result<AgentDefinition, BpmnError> {
    let size = serde_json::to_vec(&raw).map_or(usize::MAX, |v| v.len());
    if size > MAX_DEFINITION_BYTES {
        return Err(BpmnError::Definition {
            process: process.to_string(),
            activity: activity.to_string(),
            source: DefinitionError::Invalid {
                name: activity.to_string(),
                reason: format!(
                    "its properties hold {size} bytes, over the {MAX_DEFINITION_BYTES}-byte cap of a definition"
                ),
            },
        });
    }
    let mut def =
        AgentDefinition::from_value(&raw, activity).map_err(|source| BpmnError::Definition {
            process: process.to_string(),
            activity: activity.to_string(),
            source,
        })?;
    def.origin = Some(BpmnOrigin {
        process: process.to_string(),
        version,
        activity: activity.to_string(),
        raw,
    });
    Ok(def)
}

/// Maps `abada.agent.<key>` properties to the raw definition (the agents file's shape). An
/// error names the property.
fn raw_definition(properties: &[(&str, &str)]) -> Result<Value, (String, String)> {
    let mut raw = Map::new();
    let mut approval_variables = Map::new();
    for (property, text) in properties {
        let err = |reason: String| (property.to_string(), reason);
        let key = &property[PROPERTY_PREFIX.len()..];
        let Some((_, kind)) = KEYS.iter().find(|(k, _)| *k == key) else {
            let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
            return Err(err(format!(
                "is not an agent setting; the settings are abada.agent.{}",
                known.join(", abada.agent.")
            )));
        };
        let value = value_of(*kind, text).map_err(err)?;
        let slot = match key.strip_prefix("approvalVariables.") {
            Some(sub) => approval_variables.insert(sub.to_string(), value),
            None => raw.insert(key.to_string(), value),
        };
        if slot.is_some() {
            return Err(err("is set twice".into()));
        }
    }
    if !approval_variables.is_empty() {
        raw.insert(
            "approvalVariables".into(),
            Value::Object(approval_variables),
        );
    }
    Ok(Value::Object(raw))
}

fn value_of(kind: Kind, text: &str) -> Result<Value, String> {
    let list = |text: &str| -> Vec<Value> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| Value::String(s.to_string()))
            .collect()
    };
    Ok(match kind {
        Kind::Text => Value::String(text.to_string()),
        Kind::List => Value::Array(list(text)),
        Kind::RegistryNames => {
            let names = list(text);
            if let Some(bad) = names
                .iter()
                .filter_map(Value::as_str)
                .find(|n| n.contains("://") || n.contains('/') || n.contains(' '))
            {
                return Err(format!(
                    "names {bad:?}, which is not a tool-server name; list names of the operator's registry (ABADA_AGENT_TOOLS_FILE), comma-separated: where a server is and how to reach it is the operator's to say"
                ));
            }
            Value::Array(names)
        }
        Kind::Integer => {
            let n: u64 = text.trim().parse().map_err(|_| {
                format!("is {text:?}, not a whole number (write digits only, e.g. 20)")
            })?;
            Value::from(n)
        }
        Kind::Bool => match text.trim() {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            other => return Err(format!("is {other:?}; write true or false")),
        },
        Kind::Approval => match text.trim() {
            t @ ("never" | "writes" | "always") => Value::String(t.to_string()),
            t if t.starts_with('[') => serde_json::from_str(t)
                .map_err(|e| format!("is not a JSON list of approval rules: {e}"))?,
            t => Value::Array(list(t)),
        },
        Kind::Json => {
            serde_json::from_str(text).map_err(|e| format!("is not valid JSON text: {e}"))?
        }
    })
}

/// The snapshot of a definition a run journals in its input step (`data.definition`): a BPMN
/// definition with its process, version and activity; the agents file's or the engine's with
/// its entry. `None` for a definition built in code.
pub(crate) fn journal_snapshot(def: &AgentDefinition) -> Option<Value> {
    let Some(origin) = def.origin.as_ref() else {
        let source = def.source.as_ref()?;
        return Some(json!({
            "source": source.kind,
            "entry": source.entry,
            "definition": source.raw,
        }));
    };
    Some(json!({
        "source": "bpmn",
        "process": origin.process,
        "version": origin.version,
        "activity": origin.activity,
        "definition": origin.raw,
    }))
}

/// The definition a run journaled when it started: a resumed run keeps it, whatever was
/// deployed since. Parsed by the same parser.
pub(crate) fn from_journal_snapshot(snapshot: &Value) -> Result<AgentDefinition, BpmnError> {
    let text = |k: &str| snapshot.get(k).and_then(Value::as_str).unwrap_or_default();
    let raw_source = match text("source") {
        definition::SOURCE_AGENTS_FILE => Some(definition::SOURCE_AGENTS_FILE),
        definition::SOURCE_ENGINE => Some(definition::SOURCE_ENGINE),
        _ => None,
    };
    if let Some(kind) = raw_source {
        let entry = text("entry");
        let raw = snapshot.get("definition").cloned().unwrap_or(Value::Null);
        let mut def =
            AgentDefinition::from_value(&raw, entry).map_err(|source| BpmnError::Journaled {
                source_kind: kind,
                entry: entry.to_string(),
                source,
            })?;
        def.source = Some(definition::RawSource {
            kind,
            entry: entry.to_string(),
            raw,
        });
        return Ok(def);
    }
    let (process, activity) = (text("process"), text("activity"));
    let version = snapshot.get("version").and_then(Value::as_i64);
    let raw = snapshot.get("definition").cloned().unwrap_or(Value::Null);
    from_raw(process, version, activity, raw)
}

/// The definition a run-store claim renders its input with after the store refused the input
/// it offered (`journaled`: the definition journaled with the run's input step): the run's own,
/// when the claimant rendered from another one (the process was redeployed since the run
/// began, and a resumed run keeps its definition). `None` when the claimant offered that very
/// definition: its input then differs because the variables did, and the refusal stands.
pub(crate) fn journaled_definition_to_render(
    journaled: &Value,
    offered: &AgentDefinition,
) -> Option<Result<AgentDefinition, BpmnError>> {
    if journal_snapshot(offered).as_ref() == Some(journaled) {
        return None;
    }
    Some(from_journal_snapshot(journaled))
}

/// The knobs of the BPMN definitions' caches.
#[derive(Clone, Copy, Debug)]
pub struct BpmnSettings {
    /// How long the latest version learned for a process key is trusted before the definition
    /// is read again (the engine serves no cheaper version check): a redeployment reaches new
    /// tasks within this time.
    pub latest_for: Duration,
    /// Parsed definitions kept, per (key, version).
    pub max_definitions: usize,
    /// Instance → key entries kept.
    pub max_instances: usize,
}

impl Default for BpmnSettings {
    fn default() -> Self {
        BpmnSettings {
            latest_for: Duration::from_secs(30),
            max_definitions: 64,
            max_instances: 4096,
        }
    }
}

/// Why a task's definition could not be resolved.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ResolveError {
    /// No usable definition: an incident.
    #[error(transparent)]
    Definition(#[from] DefinitionError),
    #[error(transparent)]
    Bpmn(#[from] BpmnError),
    /// Reading the process definition failed for a reason a retry may cure (or the lease is
    /// lost).
    #[error("{what}: {source}")]
    Engine {
        what: String,
        #[source]
        source: TaskError,
    },
    /// The engine refuses to serve the process definition (403 without `process:read`, 404):
    /// an incident naming what is missing.
    #[error("{what}: {source}; {advice}")]
    Refused {
        what: String,
        #[source]
        source: EngineError,
        advice: &'static str,
    },
}

/// A small map that forgets its oldest entry past its capacity.
struct Bounded<K, V> {
    map: HashMap<K, V>,
    order: VecDeque<K>,
    cap: usize,
}

impl<K: std::hash::Hash + Eq + Clone, V> Bounded<K, V> {
    fn new(cap: usize) -> Self {
        Bounded {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k)
    }

    fn insert(&mut self, k: K, v: V) {
        if self.map.insert(k.clone(), v).is_none() {
            self.order.push_back(k);
            while self.order.len() > self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }
}

/// A process key, one of its versions, and the SHA-256 of that version's XML: an engine that
/// sends no version (or the same one for another XML) never gets another XML's agents.
type VersionKey = (String, Option<i64>, [u8; 32]);

/// What is known of a process key: its latest version's agents, and since when.
#[derive(Clone)]
struct Latest {
    agents: Arc<ProcessAgents>,
    learned_at: Instant,
}

/// The BPMN source of agent definitions, shared by every task of the process: the caches and
/// the resolution order.
pub(crate) struct BpmnDefinitions {
    settings: BpmnSettings,
    /// Process key → latest version's agents (trusted for `latest_for`).
    latest: Mutex<Bounded<String, Latest>>,
    /// (key, version) → parsed agents: a version read again is not parsed again.
    parsed: Mutex<Bounded<VersionKey, Arc<ProcessAgents>>>,
    /// Process instance → process key: never changes for an instance.
    instances: Mutex<Bounded<String, String>>,
    /// One read of a key's definition at a time; concurrent tasks wait for it.
    loading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Activity ids with an agents-file entry already checked against the BPMN (an override is
    /// logged once each).
    overridden: Mutex<HashSet<String>>,
    /// When the process API last refused the worker's identity (403) or was not there (404):
    /// tasks the agents file covers by topic skip it for `latest_for`.
    denied_at: Mutex<Option<Instant>>,
}

impl BpmnDefinitions {
    pub fn new(settings: BpmnSettings) -> Self {
        BpmnDefinitions {
            settings,
            latest: Mutex::new(Bounded::new(settings.max_definitions)),
            parsed: Mutex::new(Bounded::new(settings.max_definitions)),
            instances: Mutex::new(Bounded::new(settings.max_instances)),
            loading: Mutex::new(HashMap::new()),
            overridden: Mutex::new(HashSet::new()),
            denied_at: Mutex::new(None),
        }
    }

    /// The definition `task` runs, first match wins: the task's own `agent`, the agents file
    /// by activity id, the BPMN service task's properties, the agents file by topic.
    pub async fn resolve(
        &self,
        task: &Task,
        ctx: &TaskContext,
        file: Option<&AgentsFile>,
    ) -> Result<AgentDefinition, ResolveError> {
        if let Some(def) = definition::sent_by_engine(task) {
            return Ok(def?);
        }
        let by_topic = file.and_then(|f| f.for_topic(task));
        if let Some(def) = file.and_then(|f| f.for_activity(task)) {
            // The operator's entry wins whatever the BPMN says; the first task of the activity
            // looks at the BPMN once, to say so in the log when it defines the agent too.
            if self.first_override_check(task)
                && let Ok(Some(_)) = self.read_bpmn(task, ctx).await
            {
                tracing::info!(
                    activity = task.activity_id.as_deref().unwrap_or_default(),
                    "the agents file's entry for this activity overrides the agent defined in the BPMN (abada.agent.* properties); said once"
                );
            }
            return Ok(def.clone());
        }
        if let Some(def) = by_topic
            && self.denied_recently()
        {
            return Ok(def.clone());
        }
        match self.read_bpmn(task, ctx).await {
            Ok(Some(def)) => Ok(def),
            Ok(None) => by_topic
                .cloned()
                .ok_or_else(|| definition::missing(task).into()),
            // Not allowed or not served: a node covered by the agents file's topic entry still
            // runs (as before BPMN definitions existed), said in the log. A refusal of the
            // worker's identity (403), or an engine without the process API (404: a live task's
            // instance always exists), holds for every task: the process API is left alone for
            // `latest_for` instead of being asked (and logged) once per task.
            Err(ResolveError::Refused {
                what,
                source,
                advice,
            }) if by_topic.is_some() => {
                if matches!(
                    source,
                    EngineError::AccessDenied { .. } | EngineError::NotFound { .. }
                ) {
                    *self.denied_at.lock().expect("bpmn denied lock") = Some(Instant::now());
                }
                tracing::warn!(error = %source, advice, "{what}; using the agents file's entry for the topic");
                Ok(by_topic.cloned().expect("checked"))
            }
            Err(e) => Err(e),
        }
    }

    /// The process API refused the worker's identity (403) or was not found (404) less than
    /// `latest_for` ago.
    fn denied_recently(&self) -> bool {
        self.denied_at
            .lock()
            .expect("bpmn denied lock")
            .is_some_and(|at| at.elapsed() < self.settings.latest_for)
    }

    /// True the first time an activity with an agents-file entry is seen (the set is bounded by
    /// the agents file's keys).
    fn first_override_check(&self, task: &Task) -> bool {
        let activity = task.activity_id.clone().unwrap_or_default();
        self.overridden
            .lock()
            .expect("bpmn overrides lock")
            .insert(activity)
    }

    /// The BPMN service task's definition, if it has one; `None` when the task belongs to no
    /// process instance or its service task has no `abada.agent.*` property.
    async fn read_bpmn(
        &self,
        task: &Task,
        ctx: &TaskContext,
    ) -> Result<Option<AgentDefinition>, ResolveError> {
        let (Some(instance), Some(activity)) = (&task.process_instance_id, &task.activity_id)
        else {
            return Ok(None);
        };
        let key = self.process_key(instance, ctx).await?;
        let agents = self.agents_of(&key, ctx).await?;
        match agents.agent(activity) {
            None => Ok(None),
            Some(Ok(def)) => Ok(Some(def.clone())),
            Some(Err(e)) => Err(e.clone().into()),
        }
    }

    async fn process_key(&self, instance: &str, ctx: &TaskContext) -> Result<String, ResolveError> {
        if let Some(key) = self
            .instances
            .lock()
            .expect("bpmn instances lock")
            .get(&instance.to_string())
        {
            return Ok(key.clone());
        }
        let read = ctx
            .process_instance(instance)
            .await
            .map_err(|e| refusal(e, format!("cannot read process instance {instance:?}")))?;
        self.instances
            .lock()
            .expect("bpmn instances lock")
            .insert(instance.to_string(), read.process_definition_id.clone());
        Ok(read.process_definition_id)
    }

    /// The latest agents of `key`: cached while fresh, else read (one read per key at a time).
    async fn agents_of(
        &self,
        key: &str,
        ctx: &TaskContext,
    ) -> Result<Arc<ProcessAgents>, ResolveError> {
        if let Some(fresh) = self.fresh(key) {
            return Ok(fresh);
        }
        let gate = self
            .loading
            .lock()
            .expect("bpmn loading lock")
            .entry(key.to_string())
            .or_default()
            .clone();
        let result = async {
            // Waits for another task's read of the same key, unless the lease goes first.
            let _one_read = ctx
                .fenced(async { Ok::<_, EngineError>(gate.lock().await) })
                .await
                .map_err(|source| ResolveError::Engine {
                    what: format!("waiting for process definition {key:?}"),
                    source,
                })?;
            if let Some(fresh) = self.fresh(key) {
                return Ok(fresh);
            }
            let read = ctx
                .process_definition(key)
                .await
                .map_err(|e| refusal(e, format!("cannot read process definition {key:?}")))?;
            let version_key: VersionKey = (
                key.to_string(),
                read.version,
                Sha256::digest(read.bpmn_xml.as_bytes()).into(),
            );
            let cached = self
                .parsed
                .lock()
                .expect("bpmn parsed lock")
                .get(&version_key)
                .cloned();
            let agents = match cached {
                Some(agents) => agents,
                None => {
                    let agents = Arc::new(parse_process(key, read.version, &read.bpmn_xml)?);
                    tracing::info!(
                        process = %key,
                        version = read.version,
                        agents = agents.by_activity.len(),
                        "process definition read for agents defined in the BPMN"
                    );
                    self.parsed
                        .lock()
                        .expect("bpmn parsed lock")
                        .insert(version_key, agents.clone());
                    agents
                }
            };
            self.latest.lock().expect("bpmn latest lock").insert(
                key.to_string(),
                Latest {
                    agents: agents.clone(),
                    learned_at: Instant::now(),
                },
            );
            Ok(agents)
        }
        .await;
        // Forget the gate once nobody else holds it, so the map holds only keys being read.
        let mut loading = self.loading.lock().expect("bpmn loading lock");
        if loading
            .get(key)
            .is_some_and(|g| Arc::ptr_eq(g, &gate) && Arc::strong_count(&gate) == 2)
        {
            loading.remove(key);
        }
        result
    }

    fn fresh(&self, key: &str) -> Option<Arc<ProcessAgents>> {
        let latest = self.latest.lock().expect("bpmn latest lock");
        let known = latest.get(&key.to_string())?;
        // Stale: the next read says which version is the latest (kept parsed by version).
        (known.learned_at.elapsed() < self.settings.latest_for).then(|| known.agents.clone())
    }
}

/// A failed process read: a refusal that retrying cannot cure (403, 404) is an incident naming
/// what to fix; anything else may pass (or the lease is gone).
fn refusal(e: TaskError, what: String) -> ResolveError {
    match e {
        TaskError::Engine(source @ EngineError::AccessDenied { .. }) => ResolveError::Refused {
            what,
            source,
            advice: "grant the worker's identity process:read (OIDC scope process:read; behind a proxy, the permission process:read or a group such as abada-task-user), or define the agent in ABADA_AGENT_AGENTS_FILE",
        },
        TaskError::Engine(
            source @ (EngineError::TooLarge { .. } | EngineError::MalformedResponse { .. }),
        ) => ResolveError::Refused {
            what,
            source,
            advice: "the engine's answer cannot be used as it is (a retry would read the same); fix the process definition, or define the agent in ABADA_AGENT_AGENTS_FILE",
        },
        TaskError::Engine(source @ EngineError::NotFound { .. }) => ResolveError::Refused {
            what,
            source,
            advice: "the engine does not serve it (an instance that ended, or an engine without GET /v1/processes); define the agent in ABADA_AGENT_AGENTS_FILE",
        },
        source => ResolveError::Engine { what, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bpmn(properties: &str) -> String {
        format!(
            r#"<?xml version="1.0" encoding="UTF-8"?>
<bpmn:definitions xmlns:bpmn="http://www.omg.org/spec/BPMN/20100524/MODEL"
    xmlns:camunda="http://camunda.org/schema/1.0/bpmn" id="d" targetNamespace="t">
  <bpmn:process id="refund" isExecutable="true">
    <bpmn:serviceTask id="refundAgent" camunda:type="external" camunda:topic="abada:agent">
      <bpmn:extensionElements>
        <camunda:properties>{properties}</camunda:properties>
      </bpmn:extensionElements>
    </bpmn:serviceTask>
    <bpmn:serviceTask id="plain" camunda:type="external" camunda:topic="other"/>
  </bpmn:process>
</bpmn:definitions>"#
        )
    }

    fn prop(name: &str, value: &str) -> String {
        format!(r#"<camunda:property name="abada.agent.{name}" value="{value}"/>"#)
    }

    fn agent(xml: &str) -> Result<AgentDefinition, BpmnError> {
        parse_process("refund", Some(3), xml)?
            .agent("refundAgent")
            .cloned()
            .expect("the service task has properties")
    }

    #[test]
    fn every_setting_maps_to_the_agents_file_key_and_parses_alike() {
        let xml = bpmn(&[
            prop("name", "refund-agent"),
            prop("model", "openai/gpt-4.1-mini"),
            prop("fallbackModels", "anthropic/claude-haiku-4-5, openai/gpt-4.1"),
            prop("instructions", "You handle refunds for ${customerId}"),
            prop("renderInstructions", "true"),
            prop("input", "Customer wrote: ${message}"),
            prop("toolServers", "orders, billing"),
            prop("maxTurns", "12"),
            prop("tokenBudget", "40000"),
            prop("maxOutputTokens", "512"),
            prop("maxToolCallsPerAnswer", "2"),
            prop("maxToolCalls", "9"),
            prop("maxKeyedWrites", "1"),
            prop("maxDurationMs", "60000"),
            prop("resultVariable", "refundDecision"),
            prop("approval", "issue_refund"),
            prop("approvalVariables.status", "refundStatus"),
            prop("loopCounterVariable", "round"),
            prop(
                "outputSchema",
                "{&quot;type&quot;:&quot;object&quot;,&quot;required&quot;:[&quot;decision&quot;]}",
            ),
            prop("outputRepairTurns", "2"),
            prop("answerRepairTurns", "3"),
        ]
        .concat());
        let from_bpmn = agent(&xml).unwrap();
        let file = AgentsFile::parse_str(
            r#"[agents.refundAgent]
name = "refund-agent"
model = "openai/gpt-4.1-mini"
fallbackModels = ["anthropic/claude-haiku-4-5", "openai/gpt-4.1"]
instructions = "You handle refunds for ${customerId}"
renderInstructions = true
input = "Customer wrote: ${message}"
toolServers = ["orders", "billing"]
maxTurns = 12
tokenBudget = 40000
maxOutputTokens = 512
maxToolCallsPerAnswer = 2
maxToolCalls = 9
maxKeyedWrites = 1
maxDurationMs = 60000
resultVariable = "refundDecision"
approval = ["issue_refund"]
loopCounterVariable = "round"
outputSchema = { type = "object", required = ["decision"] }
outputRepairTurns = 2
answerRepairTurns = 3
[agents.refundAgent.approvalVariables]
status = "refundStatus"
"#,
        )
        .unwrap();
        let (_, from_file) = file.definitions().next().unwrap();
        let mut without_origin = from_bpmn.clone();
        without_origin.origin = None;
        let mut from_file = from_file.clone();
        from_file.source = None;
        assert_eq!(without_origin, from_file);
        assert_eq!(
            from_bpmn.output_schema.as_ref().map(|s| s.value().clone()),
            Some(json!({"type": "object", "required": ["decision"]}))
        );
        assert_eq!(from_bpmn.output_repair_turns, 2);
        assert_eq!(from_bpmn.answer_repair_turns, 3);
        let origin = from_bpmn.origin.as_ref().unwrap();
        assert_eq!(
            (
                origin.process.as_str(),
                origin.version,
                origin.activity.as_str()
            ),
            ("refund", Some(3), "refundAgent")
        );
        // Only service tasks with properties are agents.
        let agents = parse_process("refund", Some(3), &xml).unwrap();
        assert!(agents.agent("plain").is_none());
    }

    /// The worked example defines its agent this way: it parses, as the agents file's entry of
    /// docs/REAL_ENGINE.md.
    #[test]
    fn the_worked_example_defines_its_agent_in_the_bpmn() {
        let xml = include_str!("../../examples/refund-approval.bpmn");
        let agents = parse_process("refundApproval", Some(1), xml).unwrap();
        let def = agents.agent("refundAgent").unwrap().clone().unwrap();
        assert_eq!(def.name, "refund-agent");
        assert_eq!(def.models[0].model, "refund");
        assert_eq!(def.tool_servers[0].name, "orders");
        assert_eq!(def.tool_servers[0].url, None);
        assert_eq!(def.approval, super::super::approval::ApprovalPolicy::Writes);
        assert_eq!(def.result_variable, "refundDecision");
        assert_eq!(def.max_turns, 8);
        assert!(def.output_schema.is_some());
        assert_eq!(agents.by_activity.len(), 1, "one agent in the process");
    }

    #[test]
    fn a_journaled_snapshot_gives_back_the_same_definition() {
        let def = agent(&bpmn(
            &[
                prop("model", "p/m"),
                prop("input", "hi"),
                prop("maxTurns", "4"),
            ]
            .concat(),
        ))
        .unwrap();
        let snapshot = journal_snapshot(&def).unwrap();
        assert_eq!(snapshot["version"], 3);
        assert_eq!(from_journal_snapshot(&snapshot).unwrap(), def);
    }

    /// A refused store claim renders again from the run's journaled definition only when the
    /// claimant offered another one; the same definition means the variables differ, and a
    /// journaled definition that no longer parses is an error, never a silent fallback.
    #[test]
    fn a_refused_claim_renders_from_the_journaled_definition_only_when_it_differs() {
        let v1 = agent(&bpmn(
            &[
                prop("model", "p/m"),
                prop("instructions", "v1"),
                prop("input", "hi"),
            ]
            .concat(),
        ))
        .unwrap();
        let v2 = agent(&bpmn(
            &[
                prop("model", "p/m"),
                prop("instructions", "v2"),
                prop("input", "hi"),
            ]
            .concat(),
        ))
        .unwrap();
        let journaled = journal_snapshot(&v1).unwrap();
        assert!(journaled_definition_to_render(&journaled, &v1).is_none());
        assert_eq!(
            journaled_definition_to_render(&journaled, &v2).map(Result::unwrap),
            Some(v1)
        );
        let mut broken = journaled.clone();
        broken["definition"]["maxTurns"] = json!("many");
        let e = journaled_definition_to_render(&broken, &v2);
        assert!(matches!(e, Some(Err(_))), "{e:?}");
    }

    #[test]
    fn a_bad_property_is_an_error_naming_it_and_the_process() {
        let err = |props: &str| agent(&bpmn(props)).unwrap_err().to_string();
        let base = [prop("model", "p/m"), prop("input", "hi")].concat();
        let e = err(&format!("{base}{}", prop("maxTurns", "many")));
        assert!(
            e.contains("process \"refund\"")
                && e.contains("\"refundAgent\"")
                && e.contains("\"abada.agent.maxTurns\"")
                && e.contains("not a whole number"),
            "{e}"
        );
        let e = err(&format!("{base}{}", prop("modle", "x")));
        assert!(
            e.contains("\"abada.agent.modle\" is not an agent setting"),
            "{e}"
        );
        let e = err(&format!("{base}{}", prop("outputSchema", "{nope")));
        assert!(
            e.contains("abada.agent.outputSchema") && e.contains("not valid JSON"),
            "{e}"
        );
        let e = err(&format!("{base}{}", prop("outputSchema", "[1]")));
        assert!(e.contains("outputSchema must be a JSON Schema"), "{e}");
        let e = err(&format!(
            "{base}{}",
            prop("toolServers", "orders, http://evil.example/mcp")
        ));
        assert!(
            e.contains("abada.agent.toolServers") && e.contains("registry"),
            "{e}"
        );
        let e = err(&format!("{base}{}", prop("renderInstructions", "yes")));
        assert!(e.contains("true or false"), "{e}");
        let e = err(&format!("{base}{}", prop("model", "q/m")));
        assert!(e.contains("is set twice"), "{e}");
        // A value the shared parser refuses: named with the process and the task.
        let e = err(&[
            prop("model", "p/m"),
            prop("input", "hi"),
            prop("maxTurns", "0"),
        ]
        .concat());
        assert!(
            e.contains("process \"refund\", service task \"refundAgent\"")
                && e.contains("maxTurns"),
            "{e}"
        );
        let e = err(&prop("input", "hi"));
        assert!(e.contains("names no \"model\""), "{e}");
        // Approval rules as JSON, and a tool list.
        let def = agent(&bpmn(&format!(
            "{base}{}",
            prop(
                "approval",
                "[{&quot;tool&quot;:&quot;refund&quot;,&quot;argument&quot;:&quot;amount&quot;,&quot;above&quot;:100}]"
            )
        )))
        .unwrap();
        assert!(
            matches!(def.approval, super::super::approval::ApprovalPolicy::Tools(ref r) if r[0].when.is_some())
        );
    }

    /// Two service tasks with one id: neither definition is used (the last one read used to
    /// win), and the error names the id and the count.
    #[test]
    fn a_duplicate_service_task_id_is_an_error_for_that_activity() {
        let xml = bpmn(&[prop("model", "p/m"), prop("input", "hi")].concat());
        let twin = r#"<bpmn:serviceTask id="refundAgent" camunda:topic="abada:agent">
      <bpmn:extensionElements><camunda:properties>
        <camunda:property name="abada.agent.model" value="p/evil"/>
        <camunda:property name="abada.agent.input" value="hi"/>
      </camunda:properties></bpmn:extensionElements>
    </bpmn:serviceTask>
    <bpmn:serviceTask id="plain""#;
        let xml = xml.replacen(r#"<bpmn:serviceTask id="plain""#, twin, 1);
        let e = agent(&xml).unwrap_err();
        assert!(matches!(e, BpmnError::DuplicateId { count: 2, .. }), "{e}");
        assert!(e.to_string().contains("\"refundAgent\""), "{e}");
        // Other activities of the process are not touched.
        let agents = parse_process("refund", Some(3), &xml).unwrap();
        assert!(agents.agent("plain").is_none());
    }

    #[test]
    fn hostile_xml_is_refused_with_a_clear_error_and_bounded() {
        // An entity bomb: refused at the DTD, nothing expands.
        let bomb = r#"<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<definitions xmlns="http://www.omg.org/spec/BPMN/20100524/MODEL">&lol3;</definitions>"#;
        let e = parse_process("p", Some(1), bomb).unwrap_err();
        assert!(matches!(e, BpmnError::Xml { .. }), "{e}");
        assert!(e.to_string().contains("process \"p\" (version 1)"), "{e}");
        // An external entity: refused the same way (no file is read).
        let xxe = r#"<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]><d>&x;</d>"#;
        assert!(matches!(
            parse_process("p", None, xxe),
            Err(BpmnError::Xml { .. })
        ));
        // Too large: refused before parsing.
        let huge = format!("<d>{}</d>", " ".repeat(MAX_XML_BYTES));
        assert!(matches!(
            parse_process("p", None, &huge),
            Err(BpmnError::TooLarge { .. })
        ));
        // Too many nodes.
        let many = format!("<d>{}</d>", "<a/>".repeat(MAX_XML_NODES as usize + 1));
        let e = parse_process("p", None, &many).unwrap_err();
        assert!(matches!(e, BpmnError::Xml { .. }), "{e}");
        // Deep nesting: refused before the parser's stack grows with it; the cap itself parses.
        let nest = |depth: usize| format!("{}{}", "<a>".repeat(depth), "</a>".repeat(depth));
        let e = parse_process("p", None, &nest(100_000)).unwrap_err();
        assert!(e.to_string().contains("nest over 256 levels"), "{e}");
        assert!(parse_process("p", None, &nest(MAX_XML_DEPTH)).is_ok());
        // Unclosed tags count as deep (the scan errs on the deep side).
        let open = "<a>".repeat(MAX_XML_DEPTH + 1);
        assert!(parse_process("p", None, &open).is_err());
        assert_eq!(
            element_depth(r#"<a x="/>" y='>'><!-- <b> --><![CDATA[<c>]]><?p <d>?><e/></a>"#),
            1
        );
        // Not XML at all.
        assert!(matches!(
            parse_process("p", None, "{\"json\": true}"),
            Err(BpmnError::Xml { .. })
        ));
    }

    #[test]
    fn the_bounded_map_forgets_its_oldest() {
        let mut m = Bounded::new(2);
        m.insert(1, "a");
        m.insert(2, "b");
        m.insert(1, "a2");
        m.insert(3, "c");
        assert_eq!(m.get(&1), None);
        assert_eq!(m.get(&2), Some(&"b"));
        assert_eq!(m.get(&3), Some(&"c"));
        assert_eq!(m.map.len(), 2);
    }
}
