//! An attempt's examination of each model answer ([`answer_shape`](super::answer_shape)) and what
//! follows from it: the answer rewritten with what a tolerant parse took, the parse and the
//! repair turn recorded on the answer's model step and counted once it is journaled, the
//! incident once `answerRepairTurns` are spent, and a write repeated after its result answered
//! from that result, never performed again. The examination itself knows nothing of an
//! attempt; this is where the attempt acts on it.

use serde_json::Value;
use tracing::Instrument;

use super::answer_shape::{
    JOURNAL_FIELD, PARSED_FIELD, Tolerated, Verdict, before_last_answer, examine, journal_record,
    repeat_of, repeated_result,
};
use super::attempt::Attempt;
use super::journal::PendingCall;
use super::scope::{Step, incident};
use crate::provider::{ModelRef, ModelResponse};
use crate::telemetry::spans;

/// The examination of one answer as the attempt acts on it: what to journal beside it, and the
/// verdict.
pub(super) struct AnswerShape {
    tolerated: Vec<Tolerated>,
    record: Option<Value>,
    pub(super) verdict: Verdict,
    /// The answer's writes that repeat one already performed: answered, never sent, so no
    /// keyed write for `maxKeyedWrites`.
    pub(super) repeated_writes: u32,
}

impl AnswerShape {
    /// Records the tolerant parse and the repair turn on the answer's model step.
    pub(super) fn mark(&self, step: &mut crate::engine::JournalStep) {
        if let Some(record) = &self.record {
            step.data[PARSED_FIELD] = record.clone();
        }
        if let Some(m) = self.verdict.malformed() {
            step.data[JOURNAL_FIELD] = journal_record(m);
        }
    }

    /// Whether the answer gets a repair turn (or the incident): then it is no final answer to
    /// judge against the output schema.
    pub(super) fn is_malformed(&self) -> bool {
        self.verdict.malformed().is_some()
    }
}

impl Attempt<'_> {
    /// Examines the answer of `model` before it is limited, journaled or judged: under `parse`
    /// the answer is rewritten with what the tolerant parse took (so every rule of a tool call
    /// applies to it from here); a malformed one gets a repair turn while `answerRepairTurns`
    /// last.
    pub(super) fn examine_answer(
        &self,
        model: &ModelRef,
        response: &mut ModelResponse,
    ) -> AnswerShape {
        let policy = self.scope.rt.providers.text_tool_calls(&model.provider);
        let specs = self.tools.specs.as_deref().unwrap_or_default();
        let examined = examine(
            std::mem::take(&mut response.message),
            &response.stop_reason,
            specs,
            &self.state.messages,
            policy,
            self.state.next_seq,
        );
        let record = examined.tolerated_record();
        response.message = examined.message;
        let repeated = response
            .message
            .tool_calls
            .iter()
            .filter(|c| repeat_of(&self.state.messages, c, specs).is_some())
            .count();
        AnswerShape {
            tolerated: examined.tolerated,
            record,
            repeated_writes: u32::try_from(repeated).unwrap_or(u32::MAX),
            verdict: Verdict::of(
                examined.malformed,
                self.state.answer_repairs,
                self.def.answer_repair_turns,
            ),
        }
    }

    /// Counts what the examination found, once the answer is journaled; the incident once no
    /// repair turn is left.
    pub(super) fn answer_shape_outcome(&self, shape: AnswerShape) -> Step {
        let agent = crate::metrics::labels::capped(&self.def.name);
        let metrics = &self.scope.rt.metrics;
        for t in &shape.tolerated {
            metrics.count_tolerated_answer(&agent, t.as_str());
        }
        match shape.verdict {
            Verdict::Accepted => Ok(()),
            Verdict::Repair(m) => {
                tracing::info!(agent = %self.def.name, reason = m.reason.as_str(), detail = %m.detail, "the model's answer is malformed; the model gets a repair turn");
                metrics.count_answer_repair(&agent, m.reason.as_str(), true);
                Ok(())
            }
            Verdict::Exhausted(m) => {
                metrics.count_answer_repair(&agent, m.reason.as_str(), false);
                Err(incident(
                    "the agent's answer is malformed",
                    m.incident_details(&self.def.name, self.def.answer_repair_turns),
                ))
            }
        }
    }

    /// A pending write identical to one that already succeeded in this run ([`repeat_of`]) is
    /// answered with a tool result saying so, quoting the earlier result, and not performed.
    /// `true` when it was answered here. A call already started (its key journaled) or already
    /// put to a person was checked before and goes on as it is.
    pub(super) async fn answer_repeated_call(&mut self, next: &PendingCall) -> Step<bool> {
        if next.started_key.is_some() || self.state.approval.is_some() {
            return Ok(false);
        }
        let specs = self.tool_specs().await?;
        let history = before_last_answer(&self.state.messages);
        let Some(result) =
            repeat_of(history, &next.call, &specs).map(|r| repeated_result(&next.call, r, &specs))
        else {
            return Ok(false);
        };
        tracing::info!(call_id = %next.call.call_id, tool = %next.call.tool, "the model repeated a write that already succeeded; it is not performed again");
        let span = spans::execute_tool(&spans::ToolSpan {
            server: &next.call.server,
            tool: &next.call.tool,
            call_id: &next.call.call_id,
        });
        self.count_tool(&span, &next.call, "repeated_call");
        let finished = self
            .finish_tool(&span, &next.call, None, result)
            .instrument(span.clone())
            .await;
        spans::record_tool_end(&span, self.tools.last_outcome, finished.is_err());
        finished.map(|()| true)
    }
}
