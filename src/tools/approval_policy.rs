//! Which tool calls need a person's approval: the policy grammar (`"never"`, `"writes"`,
//! `"always"`, or rules naming tools, optionally bounding a numeric argument), shared by the agent
//! definitions and the operator's tool-server registry, and its pure evaluation on a tool's spec
//! and a call's arguments (failing safe on hostile arguments); a bound on an argument holds for
//! each call and for the total of the run's calls of that tool performed without approval. What
//! happens to a call that needs approval is the agent's (`agent::approval`).

use std::cmp::Ordering;

use serde_json::Value;

use crate::conversation::ToolSpec;

/// Which calls need a person's approval: `"never"`, `"writes"`, `"always"`, or a list of
/// [`ToolRule`]s (tool names, or tool names with a condition on an argument).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ApprovalPolicy {
    #[default]
    Never,
    /// Every tool not annotated `readOnlyHint: true`, and every tool annotated
    /// `destructiveHint: true` (even one that also claims to be read-only: the stricter hint wins).
    Writes,
    Always,
    /// These tools, each always or only when its condition holds.
    Tools(Vec<ToolRule>),
}

/// One entry of a policy's list: `"issue_refund"` (every call of that tool), or
/// `{tool = "issue_refund", argument = "amountCents", above = 10000}` (only calls whose
/// argument is out of bounds).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRule {
    pub tool: String,
    /// None: every call of the tool needs approval.
    pub when: Option<ArgumentBound>,
}

/// A condition on one numeric argument of a call. The arguments are the model's output, hostile
/// input: a call whose argument is missing, not a JSON number, or not finite needs approval
/// (fail safe), so only a call that provably stays within the bounds goes through at once.
#[derive(Clone, Debug, PartialEq)]
pub struct ArgumentBound {
    /// A top-level argument name, or a JSON pointer (`/refund/amountCents`) into nested
    /// arguments.
    pub argument: String,
    /// Approval when the argument is greater than this.
    pub above: Option<Bound>,
    /// Approval when the argument is less than this (e.g. `below = 0` for a negative refund,
    /// which a tool might take as a charge).
    pub below: Option<Bound>,
}

/// A bound as written: an integer is kept exactly (a bound past 2^53 is not rounded, which
/// could let a call just past it through), any other number as a finite float.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    Integer(i128),
    Float(f64),
}

impl Bound {
    /// A JSON number as a bound or an argument; `None` when it is not finite.
    fn of(n: &serde_json::Number) -> Option<Bound> {
        match n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from))
        {
            Some(i) => Some(Bound::Integer(i)),
            None => n.as_f64().filter(|f| f.is_finite()).map(Bound::Float),
        }
    }
}

impl std::fmt::Display for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bound::Integer(i) => write!(f, "{i}"),
            Bound::Float(x) => write!(f, "{x}"),
        }
    }
}

/// The keys a conditional rule may have; any other is an error, so a typo (`abvoe`) is not a
/// rule that silently never asks.
const RULE_KEYS: [&str; 4] = ["tool", "argument", "above", "below"];

impl ApprovalPolicy {
    /// Parses `"never" | "writes" | "always" | [rule, ...]`; the error says what is allowed.
    pub fn from_value(value: &Value) -> Result<Self, String> {
        match value {
            Value::String(s) => match s.as_str() {
                "never" => Ok(ApprovalPolicy::Never),
                "writes" => Ok(ApprovalPolicy::Writes),
                "always" => Ok(ApprovalPolicy::Always),
                other => Err(format!(
                    "approval {other:?} is not one of \"never\", \"writes\", \"always\" or a list of tool names"
                )),
            },
            Value::Array(items) if items.is_empty() => Err(
                "approval is an empty list, which asks for no call; use \"never\", or list the tools that need approval"
                    .to_string(),
            ),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    ToolRule::from_value(item).map_err(|e| format!("approval[{i}]: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(ApprovalPolicy::Tools),
            other => Err(format!(
                "approval is {}; use \"never\", \"writes\", \"always\" or a list of tool names",
                kind(other)
            )),
        }
    }

    /// Whether a call of `spec` with `arguments` needs approval under this policy alone, as the
    /// first call of its tool in a run.
    #[cfg(test)]
    pub(crate) fn covers(&self, spec: &ToolSpec, arguments: &Value) -> bool {
        self.covers_in_run(spec, arguments, &[])
    }

    /// Whether a call of `spec` with `arguments` needs approval under this policy alone, after
    /// `earlier`: the arguments of the calls of the same tool the run performed without a
    /// person's approval. A bound holds for each call and for the run's total, so twenty calls
    /// of 9,999 do not pass under `above = 10000` ([`ArgumentBound::holds_in_run`]).
    pub(crate) fn covers_in_run(
        &self,
        spec: &ToolSpec,
        arguments: &Value,
        earlier: &[&Value],
    ) -> bool {
        match self {
            ApprovalPolicy::Never => false,
            ApprovalPolicy::Always => true,
            ApprovalPolicy::Writes => spec.is_write(),
            ApprovalPolicy::Tools(rules) => rules.iter().any(|r| {
                r.tool == spec.tool
                    && r.when
                        .as_ref()
                        .is_none_or(|b| b.holds_in_run(arguments, earlier))
            }),
        }
    }
}

impl ToolRule {
    fn from_value(item: &Value) -> Result<Self, String> {
        let name = |v: Option<&Value>, field: &str| match v.and_then(Value::as_str).map(str::trim) {
            Some(n) if !n.is_empty() => Ok(n.to_string()),
            _ => Err(format!("{field} must be a non-empty string")),
        };
        let object = match item {
            Value::String(_) => {
                return Ok(ToolRule {
                    tool: name(Some(item), "a tool name")?,
                    when: None,
                });
            }
            Value::Object(o) => o,
            other => {
                return Err(format!(
                    "{} is neither a tool name nor {{tool, argument, above, below}}",
                    kind(other)
                ));
            }
        };
        if let Some(unknown) = object.keys().find(|k| !RULE_KEYS.contains(&k.as_str())) {
            return Err(format!(
                "unknown key {unknown:?}; a rule has tool, argument, above and below"
            ));
        }
        let tool = name(object.get("tool"), "tool")?;
        let argument = name(object.get("argument"), "argument")?;
        let bound = |field: &str| match object.get(field) {
            None => Ok(None),
            Some(Value::Number(n)) => Bound::of(n)
                .map(Some)
                .ok_or_else(|| format!("{field} must be a finite number")),
            Some(v) => Err(format!("{field} is {}, not a number", kind(v))),
        };
        let (above, below) = (bound("above")?, bound("below")?);
        match (above, below) {
            (None, None) => {
                return Err(format!(
                    "the rule for {tool:?} has argument {argument:?} but neither above nor below; give a bound, or list the tool by name to ask for every call"
                ));
            }
            (Some(a), Some(b)) if compare(b, a) == Ordering::Greater => {
                return Err(format!(
                    "below ({b}) is greater than above ({a}): every call would need approval; list the tool by name for that"
                ));
            }
            _ => {}
        }
        Ok(ToolRule {
            tool,
            when: Some(ArgumentBound {
                argument,
                above,
                below,
            }),
        })
    }
}

impl ArgumentBound {
    /// Whether a call with `arguments` needs approval: its argument is out of bounds, or not a
    /// finite number at all.
    pub fn holds(&self, arguments: &Value) -> bool {
        self.holds_in_run(arguments, &[])
    }

    /// Whether a call with `arguments` needs approval after `earlier` (the arguments of the
    /// calls of the same tool the run performed without approval): its own argument is out of
    /// bounds or not a finite number, or the total of its argument and theirs is out of bounds
    /// (a total that cannot be summed exactly, past `i128` or not finite, is out of bounds too).
    /// An earlier call whose argument is no number is left out of the total: such a call needed
    /// approval itself.
    pub fn holds_in_run(&self, arguments: &Value, earlier: &[&Value]) -> bool {
        let Some(n) = self.value(arguments) else {
            return true;
        };
        if self.out_of_bounds(n) {
            return true;
        }
        if earlier.is_empty() {
            return false;
        }
        match total(n, earlier.iter().filter_map(|a| self.value(a))) {
            Some(sum) => self.out_of_bounds(sum),
            None => true,
        }
    }

    /// The bounded argument of a call, when it is a finite number.
    fn value(&self, arguments: &Value) -> Option<Bound> {
        let value = if self.argument.starts_with('/') {
            arguments.pointer(&self.argument)
        } else {
            arguments.get(&self.argument)
        };
        value.and_then(Value::as_number).and_then(Bound::of)
    }

    fn out_of_bounds(&self, n: Bound) -> bool {
        let out = |bound: Option<Bound>, outside: Ordering| {
            bound.is_some_and(|b| compare(n, b) == outside)
        };
        out(self.above, Ordering::Greater) || out(self.below, Ordering::Less)
    }
}

/// `first` plus `rest`: exact while every value is an integer (`None` past `i128`), else as a
/// float (`None` when not finite).
fn total(first: Bound, mut rest: impl Iterator<Item = Bound>) -> Option<Bound> {
    rest.try_fold(first, |sum, n| match (sum, n) {
        (Bound::Integer(a), Bound::Integer(b)) => a.checked_add(b).map(Bound::Integer),
        (a, b) => {
            let f = as_float(a) + as_float(b);
            f.is_finite().then_some(Bound::Float(f))
        }
    })
}

fn as_float(b: Bound) -> f64 {
    match b {
        Bound::Integer(i) => i as f64,
        Bound::Float(f) => f,
    }
}

/// `a` against `b`, exactly: integers as integers (none rounded past 2^53), an integer against
/// a float through the float's floor, floats as floats (both are finite).
fn compare(a: Bound, b: Bound) -> Ordering {
    match (a, b) {
        (Bound::Integer(x), Bound::Integer(y)) => x.cmp(&y),
        (Bound::Integer(x), Bound::Float(f)) => integer_against_float(x, f),
        (Bound::Float(f), Bound::Integer(x)) => integer_against_float(x, f).reverse(),
        (Bound::Float(x), Bound::Float(y)) => x.partial_cmp(&y).unwrap_or(Ordering::Equal),
    }
}

fn integer_against_float(x: i128, f: f64) -> Ordering {
    let floor = f.floor();
    // Saturating: a float past i128's range is past every integer JSON holds.
    match x.cmp(&(floor as i128)) {
        Ordering::Equal if f > floor => Ordering::Less,
        o => o,
    }
}

/// JSON's name for a value's type, for messages (never the value: it may be long or private).
pub(crate) fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
