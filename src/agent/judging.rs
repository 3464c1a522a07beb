//! The verdict on a final answer that needs the validator, journal first, so no answer can
//! crash the worker in a loop.
//!
//! A final answer with an `outputSchema` (not cut, within the schema's answer cap) is journaled
//! before it is judged: its model step, then, once the validator has spoken, `output/accepted`
//! or `output/rejected` (with the repair message the model reads next). An attempt that finds
//! the answer journaled without a verdict (the worker died while validating) does not pay the
//! model again: it journals `output/judging` and judges once more. Two passes begun and none
//! finished make the task an incident naming the schema, with `output/unfinished` journaled,
//! not a third crash; a retry of the incident gets two passes again. A validation past its
//! deadline ([`output::VALIDATION_DEADLINE`]) is given up: `output/unfinished`, an incident. A
//! stop (shutdown) abandons the validation and releases the task at once.
//!
//! This holds wherever the journal lives and can remember (the engine's, the run store's). A
//! task without a journal (a plain v1 engine, no run store) starts over after a crash: what
//! protects it is that the bounds make every accepted schema's validation cost a measured,
//! small amount (`agent::output`), and the deadline.

use serde_json::Value;

use super::attempt::Attempt;
use super::definition::AgentDefinition;
use super::journal::{self, Judging};
use super::output::{self, Unjudged, Verdict};
use super::scope::{Step, incident};

/// Passes at judging one answer that may begin without finishing; then an incident.
pub(super) const MAX_UNFINISHED_PASSES: u32 = 2;

/// Whether this attempt journaled the answer (its first pass) or found it unjudged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pass {
    /// The answer's model step was just journaled by this attempt: that was the pass's mark.
    First,
    /// The answer was found journaled without a verdict.
    Again,
}

impl Attempt<'_> {
    /// The value the task stores for the run's final answer `answer`, judged now if it was not
    /// yet; `None` when it was rejected with a repair turn left (the loop asks the model again).
    pub(super) async fn judged_value(&mut self, answer: &str) -> Step<Option<Value>> {
        let schema = self.def.output_schema.as_ref();
        if self.state.judging.as_ref().is_some_and(|j| j.accepted) {
            // Judged a match before this attempt: it is the JSON the schema took.
            return Ok(Some(output::parse_answer(answer)));
        }
        if !output::needs_validator(schema, answer, "") {
            // No schema, or an answer judged at once (over the schema's answer cap).
            return output::judge(schema, answer, "", None)
                .map(Some)
                .map_err(|r| {
                    incident(
                        "the agent's final answer cannot be stored",
                        r.incident_details(&self.def.name, self.state.output_repairs),
                    )
                });
        }
        self.judge_final_answer(answer, Pass::Again).await
    }

    /// Judges the journaled final answer against the schema and journals the verdict: the value
    /// to store, or `None` after a rejection with a repair turn left.
    pub(super) async fn judge_final_answer(
        &mut self,
        answer: &str,
        pass: Pass,
    ) -> Step<Option<Value>> {
        let Some(judging) = self.state.judging.clone() else {
            return Err(self.scope.technical(
                "internal error: a final answer to judge without its journal record".into(),
            ));
        };
        if pass == Pass::Again {
            if judging.passes_begun >= MAX_UNFINISHED_PASSES {
                return Err(self.unfinished(&judging, None).await);
            }
            let step = journal::output_judging_step(
                self.state.next_seq,
                judging.answer_seq,
                judging.passes_begun + 1,
            );
            self.record(step).await?;
        }
        let schema = self.def.output_schema.as_ref();
        let inline = self.scope.rt.settings.validate_inline;
        let validation = async {
            if inline {
                Ok(output::judge(schema, answer, "", None))
            } else {
                output::judge_off_runtime(schema, answer, "", None, output::VALIDATION_DEADLINE)
                    .await
            }
        };
        // Biased, the verdict first: a validation that ended as the worker stops is kept.
        let judged = tokio::select! {
            biased;
            judged = validation => judged,
            // Shutting down: the validation is abandoned (its thread ends by itself, bounded),
            // the task released; the next attempt judges again (a pass counted).
            _ = self.scope.ctx.stopped() => return Err(self.scope.released()),
        };
        match judged {
            Ok(Ok(value)) => {
                let step = journal::output_accepted_step(self.state.next_seq, judging.answer_seq);
                self.record(step).await?;
                Ok(Some(value))
            }
            Ok(Err(rejection)) => {
                let record = output::journal_record(&rejection);
                let verdict = Verdict::of(
                    Err(rejection),
                    self.state.output_repairs,
                    self.def.output_repair_turns,
                );
                let step =
                    journal::output_rejected_step(self.state.next_seq, judging.answer_seq, record);
                self.record(step).await?;
                self.output_verdict(verdict)?;
                Ok(None)
            }
            Err(Unjudged::OverBudget { limit }) => {
                Err(self.unfinished(&judging, Some(limit)).await)
            }
            Err(Unjudged::ShuttingDown) => Err(self.scope.released()),
        }
    }

    /// The judging of `judging`'s answer gave up: past the deadline (`over`), or begun
    /// [`MAX_UNFINISHED_PASSES`] times without finishing. Journaled (`output/unfinished`: a
    /// retry of the incident begins counting again), then the incident naming the schema.
    async fn unfinished(
        &mut self,
        judging: &Judging,
        over: Option<std::time::Duration>,
    ) -> crate::handler::Outcome {
        let step = journal::output_unfinished_step(
            self.state.next_seq,
            judging.answer_seq,
            judging.passes_begun,
        );
        if let Err(outcome) = self.record(step).await {
            return outcome;
        }
        let schema = schema_named(&self.def);
        let why = match over {
            Some(limit) => format!(
                "validating its final answer (journal step {}) against {schema} took over {} ms, the deadline of one validation",
                judging.answer_seq,
                limit.as_millis()
            ),
            None => format!(
                "validating its final answer (journal step {}) against {schema} began {} times and never finished: the worker stopped or crashed while validating",
                judging.answer_seq, judging.passes_begun
            ),
        };
        incident(
            "the agent's final answer cannot be judged",
            format!(
                "agent {:?}: {why}. The answer is kept in the journal, not stored; check the schema, then retry the incident (a retry validates it again, at most {MAX_UNFINISHED_PASSES} times)",
                self.def.name
            ),
        )
    }
}

/// The schema as an operator finds it: where it is defined and a digest of it.
fn schema_named(def: &AgentDefinition) -> String {
    use sha2::{Digest, Sha256};
    let Some(schema) = &def.output_schema else {
        return "no outputSchema".into();
    };
    let digest = Sha256::digest(super::canonical::canonical(schema.value()).as_bytes());
    let digest: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    let place = match &def.origin {
        Some(o) => format!(
            "the abada.agent.outputSchema property of service task {:?} in BPMN process {:?}{}",
            o.activity,
            o.process,
            o.version
                .map(|v| format!(" version {v}"))
                .unwrap_or_default()
        ),
        None => format!(
            "the outputSchema of agent {:?} (the task's agent definition or the agents file)",
            def.name
        ),
    };
    format!("{place} (sha256 {digest}…)")
}
