//! The attempt protocol checked exhaustively at its bounds (src/lib.rs): the runner's rule holds
//! every property in every interleaving, and the checker finds the counterexample when the rule,
//! or another guard the properties rest on, is taken out of the model.

use std::time::Instant;

use abada_proofs::*;
use stateright::{Checker, Model};

/// Every fault the model has, `budget` of them in one run, the engine's clock in step with the
/// workers' (the safety margin's premise).
fn faults(budget: u8) -> Faults {
    Faults {
        budget,
        crashes: true,
        pauses: true,
        lost_answers: true,
        clock_jumps: false,
    }
}

/// Runs the checker over the whole space and prints what it covered.
fn check(model: Protocol) -> impl Checker<Protocol> {
    let name = model.to_string();
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    eprintln!(
        "{name}: {} states ({} unique), depth {}, {:.1} s",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
    checker
}

/// The counterexample to `property`, as the actions that reach it, one a line.
fn counterexample(checker: &impl Checker<Protocol>, property: &'static str) -> String {
    let path = checker.discovery(property).unwrap_or_else(|| {
        panic!("the checker found no counterexample to \"{property}\"");
    });
    let actions: Vec<String> = path
        .into_actions()
        .iter()
        .map(|a| format!("{a:?}"))
        .collect();
    actions.join("\n  ")
}

fn holds(model: Protocol) {
    let checker = check(model);
    checker.assert_properties();
}

#[test]
fn one_task_on_the_engine_journal_holds_every_property_under_three_faults() {
    holds(Protocol::new(
        1,
        Journaling::Engine,
        SameTaskRule::OneAtATime,
        faults(3),
    ));
}

#[test]
fn one_task_in_the_run_store_holds_every_property_under_three_faults() {
    holds(Protocol::new(
        1,
        Journaling::Store,
        SameTaskRule::OneAtATime,
        faults(3),
    ));
}

/// Two tasks, two workers of one slot each: fetches that pick between tasks, a task offered
/// again to either worker after a failure; one crash at any step (the run store's journal with
/// one retry each, its state space being the larger).
#[test]
fn two_tasks_hold_every_property_under_a_crash() {
    let crash = Faults {
        budget: 1,
        crashes: true,
        pauses: false,
        lost_answers: false,
        clock_jumps: false,
    };
    holds(Protocol::new(
        2,
        Journaling::Engine,
        SameTaskRule::OneAtATime,
        crash,
    ));
    let mut store = Protocol::new(2, Journaling::Store, SameTaskRule::OneAtATime, crash);
    store.retries = 1;
    let checker = check(store);
    for property in [
        ONE_COMPLETION,
        SILENT_AFTER_LOSS,
        NO_STALE_ACCEPTED,
        ONE_ATTEMPT_AT_A_TIME,
        ACCEPTED_REPORT_KEPT,
        WRITE_ONCE,
        EVERY_TASK_ENDS,
    ] {
        checker.assert_no_discovery(property);
    }
}

/// The runner before the rule (every older attempt superseded, the newer started at once): the
/// supersession race. A failure is accepted, the task is offered again to the same worker while
/// the answer is on its way, and the older attempt is ended `lease_lost`.
#[test]
fn without_the_rule_an_accepted_report_is_disowned_by_the_newer_attempt() {
    for journaling in [Journaling::Engine, Journaling::Store] {
        let checker = check(Protocol::new(
            1,
            journaling,
            SameTaskRule::SupersedeAtOnce,
            faults(0),
        ));
        let path = counterexample(&checker, ACCEPTED_REPORT_KEPT);
        eprintln!("{journaling:?}, the rule off, {ACCEPTED_REPORT_KEPT}:\n  {path}");
        assert!(path.contains(", Failure)"), "{path}");
        counterexample(&checker, ONE_ATTEMPT_AT_A_TIME);
    }
}

/// No rule at all: the newer attempt works while the older one reports.
#[test]
fn without_any_rule_two_attempts_of_a_task_run_at_once() {
    let checker = check(Protocol::new(
        1,
        Journaling::Engine,
        SameTaskRule::Unguarded,
        faults(0),
    ));
    let path = counterexample(&checker, ONE_ATTEMPT_AT_A_TIME);
    eprintln!("the rule removed, {ONE_ATTEMPT_AT_A_TIME}:\n  {path}");
}

/// What holds when the engine's clock runs ahead of the workers' by more than the safety margin
/// (one jump, beside a crash): the engine hands a task to another worker while its
/// holder still believes its lease.
const BEYOND_THE_MARGIN: [&str; 5] = [
    SILENT_AFTER_LOSS,
    ONE_ATTEMPT_AT_A_TIME,
    ACCEPTED_REPORT_KEPT,
    WRITE_ONCE,
    EVERY_TASK_ENDS,
];

fn clock_jump() -> Faults {
    Faults {
        budget: 2,
        crashes: true,
        pauses: false,
        lost_answers: false,
        clock_jumps: true,
    }
}

/// Beyond the margin, the run store's claim fences a stale holder (a task without `attempt`):
/// it goes silent on the store's refusal. With that refusal not taken as a loss (the stale
/// holder of the simulator's blind spot), it reports a failure for a task it no longer holds.
#[test]
fn beyond_the_margin_a_holder_fenced_by_the_store_goes_silent_and_the_flaw_that_does_not_is_caught()
{
    let model = Protocol::new(1, Journaling::Store, SameTaskRule::OneAtATime, clock_jump());
    let checker = check(model.clone());
    checker.assert_any_discovery(HOLDER_REFUSED);
    for property in BEYOND_THE_MARGIN {
        checker.assert_no_discovery(property);
    }
    let flawed = check(
        Protocol::new(
            1,
            Journaling::Store,
            SameTaskRule::OneAtATime,
            Faults {
                budget: 1,
                ..clock_jump()
            },
        )
        .with_flaw(Flaw::StoreRefusalIgnored),
    );
    let path = counterexample(&flawed, SILENT_AFTER_LOSS);
    eprintln!("the store's refusal ignored, {SILENT_AFTER_LOSS}:\n  {path}");
}

/// Beyond the margin on the engine's journal, the attempt fences every append, credential and
/// report of a stale holder. One thing it cannot fence: a complete on a task another attempt has
/// completed is answered 200 and does nothing (protocol.md A.2, the real engine's rule), so a
/// stale holder whose complete comes second records `completed` although the engine applied
/// only the other. The engine's state is right; the stale worker's end is not. Within the margin
/// (every test above) it cannot happen: the holder's lease has expired locally before the
/// engine hands the task out again.
#[test]
fn beyond_the_margin_the_attempt_fences_a_stale_holder_but_a_second_complete_is_a_no_op() {
    let checker = check(Protocol::new(
        1,
        Journaling::Engine,
        SameTaskRule::OneAtATime,
        clock_jump(),
    ));
    for property in BEYOND_THE_MARGIN {
        checker.assert_no_discovery(property);
    }
    let path = counterexample(&checker, ONE_COMPLETION);
    eprintln!("beyond the margin, {ONE_COMPLETION}:\n  {path}");
}

/// A write key that changes with the attempt: a resumed attempt's write is applied again.
#[test]
fn a_write_key_per_attempt_is_applied_twice() {
    let checker = check(
        Protocol::new(1, Journaling::Engine, SameTaskRule::OneAtATime, faults(1))
            .with_flaw(Flaw::WriteKeyPerAttempt),
    );
    counterexample(&checker, WRITE_ONCE);
}

/// Calls checked against the lease's latch only, not its local expiry: a worker frozen past its
/// lease wakes and sends what it was about to send.
#[test]
fn without_the_local_expiry_a_frozen_holder_calls_after_its_lease() {
    let checker = check(
        Protocol::new(1, Journaling::Engine, SameTaskRule::OneAtATime, faults(1))
            .with_flaw(Flaw::NoLocalExpiry),
    );
    counterexample(&checker, SILENT_AFTER_LOSS);
}

/// The model as it stands reaches every state it is meant to: a state from which nothing can
/// happen is one where every task has ended (`every task ends` also holds above).
#[test]
fn the_model_is_finite_and_every_run_stops() {
    let model = Protocol::new(1, Journaling::Engine, SameTaskRule::OneAtATime, faults(0));
    let checker = check(model);
    assert!(checker.unique_state_count() > 10, "a trivial model");
    checker.assert_no_discovery(EVERY_TASK_ENDS);
}
