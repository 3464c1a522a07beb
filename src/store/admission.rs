//! Which claim may take a run, and how: the pure rule that keeps the conversations of different
//! tasks and visits apart. It reads the run as the claim found it, locked,
//! and answers begin (a fresh journal), resume (the journal so far) or refuse; it does no I/O.
//!
//! The rule:
//! - No run, or a finished one under a visit's key: **begin**. The process came back to the node
//!   for new work; a finished conversation is never replayed into it.
//! - A task's run ([`RunKey::for_task`](super::RunKey::for_task)) otherwise: **resume**, since
//!   only that task ever claims it (a redelivery, or another worker after a lost lease).
//! - A visit's running run ([`RunKey::for_visit`](super::RunKey::for_visit)):
//!   - claimed by the task that holds it (a redelivery): **resume**;
//!   - held by another task that stopped for a person's decision (its last step is an
//!     `approval/requested`): **resume**, this is the task that carries the decision;
//!   - held by another task whose final answer is journaled (the previous visit ended, and its
//!     finish failed or has not run yet): **begin**, the answer is never replayed;
//!   - held by another task that claimed or wrote within the hold (the lock duration): **refuse**,
//!     two live tokens at one node must not share a conversation;
//!   - held by another task silent for longer: **begin** (that task is fenced by the new attempt
//!     and stops without reporting if it wakes).
//! - Every resume requires the claimant's input (its rendered instructions and input, as the
//!   input step it offers) to equal the journaled one, compared by [`InputDigest`]; otherwise
//!   **refuse**, naming both digests. A claim that offers no input step is not checked.
//!
//! The fencing token itself never repeats: every claim takes its attempt from a database
//! sequence that outlives the rows (`migrations/0002_run_attempts.sql`).

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::engine::JournalStep;

/// The journal kinds the rule looks at (protocol.md B.2, and the run store's `approval` kind).
const KIND_INPUT: &str = "input";
const KIND_MODEL: &str = "model";
const KIND_APPROVAL: &str = "approval";
const STATE_REQUESTED: &str = "requested";
/// A final answer judged a match (`agent::journal::KIND_OUTPUT`): the conversation is over.
const KIND_OUTPUT: &str = "output";
const STATE_ACCEPTED: &str = "accepted";

/// SHA-256 of a task's rendered instructions and input: what makes two tasks' conversations the
/// same conversation. Computed over the texts as the store keeps them (NUL as U+FFFD), the
/// instructions' length in bytes first (8 bytes, big-endian), so no two pairs share a digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InputDigest([u8; 32]);

impl InputDigest {
    pub fn of(instructions: &str, input: &str) -> InputDigest {
        let instructions = instructions.replace('\0', "\u{FFFD}");
        let input = input.replace('\0', "\u{FFFD}");
        let mut hasher = Sha256::new();
        hasher.update((instructions.len() as u64).to_be_bytes());
        hasher.update(instructions.as_bytes());
        hasher.update(input.as_bytes());
        InputDigest(hasher.finalize().into())
    }

    /// The digest of an input step (`{"instructions", "input"}`, instructions optional as in
    /// replay); `None` for any other step.
    pub fn of_step(step: &JournalStep) -> Option<InputDigest> {
        if step.kind != KIND_INPUT {
            return None;
        }
        let input = step.data.get("input")?.as_str()?;
        let instructions = step
            .data
            .get("instructions")
            .and_then(Value::as_str)
            .unwrap_or_default();
        Some(InputDigest::of(instructions, input))
    }
}

impl std::fmt::Display for InputDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("sha256:")?;
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Why a claim may not take the run. Nothing was changed: the run stays with its holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimRefusal {
    /// The run was started with another input: resuming would continue another conversation.
    InputDiffers {
        /// `None`: the run's journal holds no input step.
        journaled: Option<InputDigest>,
        offered: InputDigest,
        /// The agent definition journaled with the run's input step (a BPMN-defined run's
        /// snapshot, [`crate::agent::bpmn::journal_snapshot`]); `None` for a definition of the
        /// agents file or of the task. A claimant that rendered its input from another
        /// definition (the process was redeployed since the run began) renders it again from
        /// this one and claims again.
        journaled_definition: Option<Value>,
    },
    /// Another task holds the visit's run and claimed or wrote it within the hold.
    HeldByAnotherTask { holder: String, hold_ms: u64 },
}

impl std::fmt::Display for ClaimRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClaimRefusal::InputDiffers {
                journaled, offered, ..
            } => {
                let journaled = journaled.map_or("no input step".to_string(), |d| d.to_string());
                write!(
                    f,
                    "the run was started with input {journaled}, this task renders {offered} (SHA-256 of the rendered instructions and input)"
                )
            }
            ClaimRefusal::HeldByAnotherTask { holder, hold_ms } => write!(
                f,
                "task {holder} holds the run and claimed or wrote it within the last {hold_ms} ms"
            ),
        }
    }
}

/// Where the run's conversation stands, from its last step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The holder stopped for a person's decision: the next task of the visit carries it.
    AwaitsDecision,
    /// The final answer is journaled: the conversation is over.
    Answered,
    /// Anything else: the holder is (or was) working.
    Working,
}

impl Phase {
    /// `tool_calls`: the number of tool calls of a model step (0 when it has none).
    pub fn of_last_step(kind: &str, state: &str, tool_calls: i64) -> Phase {
        match (kind, state) {
            (KIND_APPROVAL, STATE_REQUESTED) => Phase::AwaitsDecision,
            (KIND_MODEL, _) if tool_calls == 0 => Phase::Answered,
            (KIND_OUTPUT, STATE_ACCEPTED) => Phase::Answered,
            _ => Phase::Working,
        }
    }
}

/// The run as the claim found it, its row locked.
#[derive(Clone, Debug)]
pub struct Seen {
    pub running: bool,
    /// The task of the latest claim; `None` for runs claimed before migration 0002.
    pub holder: Option<String>,
    /// The holder claimed or wrote within the hold.
    pub held: bool,
    /// The digest of the journaled input step; `None` when seq 1 is no input step.
    pub journaled_input: Option<InputDigest>,
    /// The JSON text of the journaled input step's `definition`, when it has one.
    pub journaled_definition: Option<String>,
    /// From the last step; `Working` when there is none.
    pub phase: Phase,
}

/// Who claims, as the rule sees it.
#[derive(Clone, Copy, Debug)]
pub struct Asking<'a> {
    pub per_visit: bool,
    pub task_id: &'a str,
    /// From the input step the claim offers; `None` when it offers none.
    pub input: Option<InputDigest>,
    pub hold_ms: u64,
}

/// What the claim does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// A fresh journal (the row created, or its steps deleted), a new attempt.
    Begin,
    /// The journal so far, a new attempt.
    Resume,
    Refuse(ClaimRefusal),
}

/// The rule of the module header.
pub fn admit(asking: &Asking<'_>, seen: Option<&Seen>) -> Admission {
    let Some(seen) = seen else {
        return Admission::Begin;
    };
    if asking.per_visit {
        if !seen.running {
            return Admission::Begin;
        }
        let own = seen.holder.as_deref() == Some(asking.task_id);
        if !own {
            match seen.phase {
                Phase::AwaitsDecision => {}
                Phase::Answered => return Admission::Begin,
                Phase::Working if seen.held => {
                    return Admission::Refuse(ClaimRefusal::HeldByAnotherTask {
                        holder: seen.holder.clone().unwrap_or_else(|| "(unknown)".into()),
                        hold_ms: asking.hold_ms,
                    });
                }
                Phase::Working => return Admission::Begin,
            }
        }
    }
    match asking.input {
        Some(offered) if seen.journaled_input != Some(offered) => {
            Admission::Refuse(ClaimRefusal::InputDiffers {
                journaled: seen.journaled_input,
                offered,
                // Text the store produced from a `jsonb` value: always valid JSON.
                journaled_definition: seen
                    .journaled_definition
                    .as_deref()
                    .and_then(|text| serde_json::from_str(text).ok()),
            })
        }
        _ => Admission::Resume,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn digest(input: &str) -> InputDigest {
        InputDigest::of("You handle refunds.", input)
    }

    fn asking(per_visit: bool, task: &str, input: &str) -> Asking<'static> {
        Asking {
            per_visit,
            task_id: Box::leak(task.to_string().into_boxed_str()),
            input: Some(digest(input)),
            hold_ms: 30_000,
        }
    }

    fn seen(holder: &str, held: bool, phase: Phase, input: &str) -> Seen {
        Seen {
            running: true,
            holder: Some(holder.into()),
            held,
            journaled_input: Some(digest(input)),
            journaled_definition: None,
            phase,
        }
    }

    #[test]
    fn a_missing_run_begins_and_a_finished_visit_begins_again() {
        assert_eq!(admit(&asking(true, "t-1", "a"), None), Admission::Begin);
        assert_eq!(admit(&asking(false, "t-1", "a"), None), Admission::Begin);
        let finished = Seen {
            running: false,
            ..seen("t-1", true, Phase::Answered, "a")
        };
        assert_eq!(
            admit(&asking(true, "t-2", "b"), Some(&finished)),
            Admission::Begin
        );
        // A task's finished run is that task's: reopened with its journal.
        assert_eq!(
            admit(&asking(false, "t-1", "a"), Some(&finished)),
            Admission::Resume
        );
    }

    #[test]
    fn the_holder_itself_resumes_whatever_the_phase() {
        for phase in [Phase::Working, Phase::Answered, Phase::AwaitsDecision] {
            for held in [true, false] {
                let s = seen("t-1", held, phase, "a");
                assert_eq!(
                    admit(&asking(true, "t-1", "a"), Some(&s)),
                    Admission::Resume,
                    "{phase:?} held {held}"
                );
            }
        }
    }

    #[test]
    fn another_task_takes_a_visit_only_when_handed_over_ended_or_silent() {
        let other = asking(true, "t-2", "a");
        let waiting = seen("t-1", true, Phase::AwaitsDecision, "a");
        assert_eq!(admit(&other, Some(&waiting)), Admission::Resume);
        let answered = seen("t-1", true, Phase::Answered, "a");
        assert_eq!(admit(&other, Some(&answered)), Admission::Begin);
        let live = seen("t-1", true, Phase::Working, "a");
        assert_eq!(
            admit(&other, Some(&live)),
            Admission::Refuse(ClaimRefusal::HeldByAnotherTask {
                holder: "t-1".into(),
                hold_ms: 30_000
            })
        );
        let silent = seen("t-1", false, Phase::Working, "a");
        assert_eq!(admit(&other, Some(&silent)), Admission::Begin);
        // A run claimed before the holder was recorded is never "the same task".
        let unknown = Seen {
            holder: None,
            ..live.clone()
        };
        assert!(matches!(
            admit(&asking(true, "t-1", "a"), Some(&unknown)),
            Admission::Refuse(ClaimRefusal::HeldByAnotherTask { .. })
        ));
    }

    #[test]
    fn a_resume_needs_the_same_input_and_names_both_digests_otherwise() {
        let waiting = seen("t-1", true, Phase::AwaitsDecision, "refund o-1");
        let refused = admit(&asking(true, "t-2", "refund o-2"), Some(&waiting));
        let Admission::Refuse(reason) = refused else {
            panic!("{refused:?}")
        };
        let text = reason.to_string();
        assert!(text.contains(&digest("refund o-1").to_string()), "{text}");
        assert!(text.contains(&digest("refund o-2").to_string()), "{text}");
        // The same task with changed variables, and a task's own run, are checked too.
        let own = seen("t-1", true, Phase::Working, "refund o-1");
        assert!(matches!(
            admit(&asking(true, "t-1", "refund o-9"), Some(&own)),
            Admission::Refuse(ClaimRefusal::InputDiffers { .. })
        ));
        assert!(matches!(
            admit(&asking(false, "t-1", "refund o-9"), Some(&own)),
            Admission::Refuse(ClaimRefusal::InputDiffers { .. })
        ));
        // A journal without an input step never matches an offered input.
        let bare = Seen {
            journaled_input: None,
            ..own.clone()
        };
        assert!(matches!(
            admit(&asking(false, "t-1", "x"), Some(&bare)),
            Admission::Refuse(ClaimRefusal::InputDiffers {
                journaled: None,
                ..
            })
        ));
        // A claim that offers no input is not checked.
        let blind = Asking {
            input: None,
            ..asking(false, "t-1", "x")
        };
        assert_eq!(admit(&blind, Some(&own)), Admission::Resume);
    }

    /// A refusal carries the run's journaled definition, so a claimant that rendered its input
    /// from a redeployed definition can render it again from the run's own.
    #[test]
    fn an_input_refusal_carries_the_journaled_definition() {
        let snapshot = json!({"source": "bpmn", "process": "refund", "version": 1});
        let bpmn = Seen {
            journaled_definition: Some(snapshot.to_string()),
            ..seen("t-1", true, Phase::Working, "refund o-1")
        };
        match admit(&asking(false, "t-1", "refund o-2"), Some(&bpmn)) {
            Admission::Refuse(ClaimRefusal::InputDiffers {
                journaled_definition,
                ..
            }) => assert_eq!(journaled_definition, Some(snapshot)),
            other => panic!("not an input refusal: {other:?}"),
        }
        let file = seen("t-1", true, Phase::Working, "refund o-1");
        assert!(matches!(
            admit(&asking(false, "t-1", "refund o-2"), Some(&file)),
            Admission::Refuse(ClaimRefusal::InputDiffers {
                journaled_definition: None,
                ..
            })
        ));
    }

    #[test]
    fn the_phase_comes_from_the_last_step() {
        assert_eq!(
            Phase::of_last_step("approval", "requested", 0),
            Phase::AwaitsDecision
        );
        assert_eq!(
            Phase::of_last_step("approval", "decided", 0),
            Phase::Working
        );
        assert_eq!(Phase::of_last_step("model", "finished", 0), Phase::Answered);
        assert_eq!(Phase::of_last_step("model", "finished", 2), Phase::Working);
        assert_eq!(
            Phase::of_last_step("output", "accepted", 0),
            Phase::Answered
        );
        assert_eq!(Phase::of_last_step("output", "judging", 0), Phase::Working);
        assert_eq!(Phase::of_last_step("output", "rejected", 0), Phase::Working);
        assert_eq!(Phase::of_last_step("tool", "finished", 0), Phase::Working);
        assert_eq!(Phase::of_last_step("input", "finished", 0), Phase::Working);
    }

    #[test]
    fn digests_tell_every_pair_apart_and_ignore_what_the_store_rewrites() {
        assert_ne!(InputDigest::of("ab", "c"), InputDigest::of("a", "bc"));
        assert_ne!(InputDigest::of("", "x"), InputDigest::of("x", ""));
        // NUL is stored as U+FFFD: the journaled and the rendered text digest alike.
        assert_eq!(
            InputDigest::of("i", "a\0b"),
            InputDigest::of("i", "a\u{FFFD}b")
        );
        let step = JournalStep {
            seq: 1,
            kind: "input".into(),
            state: "finished".into(),
            key: None,
            data: json!({"instructions": "i", "input": "x", "startedAtMs": 5, "traceparent": "t"}),
        };
        assert_eq!(InputDigest::of_step(&step), Some(InputDigest::of("i", "x")));
        let no_instructions = JournalStep {
            data: json!({"input": "x"}),
            ..step.clone()
        };
        assert_eq!(
            InputDigest::of_step(&no_instructions),
            Some(InputDigest::of("", "x"))
        );
        let model = JournalStep {
            kind: "model".into(),
            ..step
        };
        assert_eq!(InputDigest::of_step(&model), None);
        let d = InputDigest::of("i", "x").to_string();
        assert!(d.starts_with("sha256:") && d.len() == 7 + 64, "{d}");
    }
}
