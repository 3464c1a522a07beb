//! What the engine offers beyond protocol v1, learned from its answers and held for the life of
//! the process: a fact the worker consults before calling, so an engine without a journal is not
//! asked for one on every task (protocol.md Part B and D).
//!
//! Today it holds one fact, whether the engine keeps a journal (B.2). It is learned once: the
//! first journal read the engine answers with 404 `RESOURCE_NOT_FOUND`, or the first task without
//! `attempt` (a plain v1 engine, Part D), makes it absent, and a journal read that succeeds makes
//! it present. Absent is final: an engine upgraded to agent/1 is used once the worker restarts.

use std::sync::atomic::{AtomicU8, Ordering};

/// Whether the engine keeps a journal (protocol.md B.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JournalSupport {
    /// Not learned yet: ask, and learn from the answer.
    Unknown,
    /// A journal read succeeded.
    Present,
    /// The engine has no journal: never ask it again.
    Absent,
}

/// How the worker learned that the engine keeps no journal (for the one log line that says so).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NoJournalEvidence {
    /// A journal read was answered 404: the endpoint does not exist.
    NotFound,
    /// A task came without `attempt`: the engine speaks plain protocol v1, without agent/1.
    PlainTask,
}

/// The engine's capabilities as learned so far; shared by every task of the process.
#[derive(Debug, Default)]
pub(crate) struct EngineCapabilities {
    journal: AtomicU8,
}

const UNKNOWN: u8 = 0;
const PRESENT: u8 = 1;
const ABSENT: u8 = 2;

impl EngineCapabilities {
    pub fn journal(&self) -> JournalSupport {
        match self.journal.load(Ordering::Relaxed) {
            UNKNOWN => JournalSupport::Unknown,
            PRESENT => JournalSupport::Present,
            _ => JournalSupport::Absent,
        }
    }

    /// A journal read succeeded. Never undoes an absence learned meanwhile by another task.
    pub(crate) fn journal_answered(&self) {
        let _ =
            self.journal
                .compare_exchange(UNKNOWN, PRESENT, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The engine showed it keeps no journal. A plain v1 task says nothing about an engine
    /// whose journal already answered (that task alone has none). Logs once, at warn, for the
    /// call that learned it; returns whether this call did.
    pub(crate) fn journal_missing(&self, evidence: NoJournalEvidence) -> bool {
        let learned = match evidence {
            NoJournalEvidence::NotFound => self.journal.swap(ABSENT, Ordering::Relaxed) != ABSENT,
            NoJournalEvidence::PlainTask => self
                .journal
                .compare_exchange(UNKNOWN, ABSENT, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok(),
        };
        if learned {
            match evidence {
                NoJournalEvidence::NotFound => tracing::warn!(
                    "the engine has no journal endpoint (404): agents run without durability; a task interrupted mid-run starts over on its next attempt"
                ),
                NoJournalEvidence::PlainTask => tracing::warn!(
                    "the engine sends tasks without attempt (protocol v1 without agent/1), so it keeps no journal: agents run without durability; a task interrupted mid-run starts over on its next attempt"
                ),
            }
        }
        learned
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_until_the_engine_answers() {
        let c = EngineCapabilities::default();
        assert_eq!(c.journal(), JournalSupport::Unknown);
        c.journal_answered();
        assert_eq!(c.journal(), JournalSupport::Present);
    }

    #[test]
    fn a_404_is_learned_once_and_held() {
        let c = EngineCapabilities::default();
        assert!(c.journal_missing(NoJournalEvidence::NotFound));
        assert!(!c.journal_missing(NoJournalEvidence::NotFound), "said once");
        assert!(
            !c.journal_missing(NoJournalEvidence::PlainTask),
            "said once"
        );
        c.journal_answered();
        assert_eq!(c.journal(), JournalSupport::Absent, "absent is final");
    }

    #[test]
    fn a_plain_task_makes_an_unknown_journal_absent() {
        let c = EngineCapabilities::default();
        assert!(c.journal_missing(NoJournalEvidence::PlainTask));
        assert_eq!(c.journal(), JournalSupport::Absent);
    }

    #[test]
    fn a_plain_task_does_not_undo_a_journal_that_answered() {
        let c = EngineCapabilities::default();
        c.journal_answered();
        assert!(!c.journal_missing(NoJournalEvidence::PlainTask));
        assert_eq!(c.journal(), JournalSupport::Present);
        // A 404 from an engine whose journal once answered is believed.
        assert!(c.journal_missing(NoJournalEvidence::NotFound));
        assert_eq!(c.journal(), JournalSupport::Absent);
    }
}
