//! The simulation in CI (a few hundred schedules, and replays), and a schedule for each fence
//! bug it found, which each fails without its fix.

use super::*;

#[test]
fn a_few_hundred_schedules_keep_the_fence_and_end_every_request() {
    let summary = run_schedules(Model::FULL, 0, Some(400), None);
    println!("{summary}");
    if let Some((failure, _)) = summary.failures.first() {
        panic!("{failure}");
    }
    assert_eq!(summary.schedules, 400);
}

#[test]
fn a_seed_replays_its_schedule_exactly() {
    for (seed, model) in [(7, Model::FULL), (1_001, Model::FULL), (90_210, Model::FULL)] {
        let (first, second) = (run(seed, model), run(seed, model));
        assert_eq!(first.digest, second.digest, "seed {seed}:\n{first}\n---\n{second}");
        assert_eq!(first.trace, second.trace);
        assert_eq!(first.rounds, second.rounds);
    }
}

#[test]
fn a_schedule_frees_everything_it_built() {
    let sim = Sim::new(Plan::generate(7, Model::FULL));
    let lab = Arc::downgrade(&sim.lab);
    let _report = sim.run();
    // The endpoints' links hold the lab that holds the endpoints: the cycle must be broken.
    assert!(lab.upgrade().is_none(), "a schedule's lab outlived it");
}

/// Asserts that `seed`'s schedule (as drawn before layer-wise push) keeps every property.
fn keeps_the_fence(seed: u64) {
    keeps_the_fence_in(seed, Model::WHOLE_REQUESTS);
}

/// Asserts that `seed`'s schedule under `model` keeps every property.
fn keeps_the_fence_in(seed: u64, model: Model) {
    let report = run(seed, model);
    assert!(report.passed(), "{report}");
}

/// Over TCP, a WRITE that fails may leave bytes on their way (UCX's own failure, on a TCP
/// connection that still carries them), and P's FAIL, on the side channel, may reach D before
/// them: D hands the blocks back only once P's delivery bound passed after P's word (this seed
/// lands bytes after D's final failure without that wait).
#[test]
fn seed_418181000885_a_failed_writes_last_bytes_land_before_d_hands_its_blocks_back() {
    keeps_the_fence(418_181_000_885);
}

/// A REGISTER held up on a connection D then lost reaches P's table after D asked again on a
/// new connection and P answered that it holds nothing for the transfer: P drops a
/// registration from a connection its D has since replaced (this seed writes into blocks D
/// handed back without that).
#[test]
fn seed_418344182972_a_register_on_a_replaced_connection_is_never_written() {
    keeps_the_fence(418_344_182_972);
}

/// The model's own bug, not the endpoint's: after a partition on which TCP gave up (every held
/// byte lost), the data path still waited out TCP's backoff, so a WRITE sent after the heal
/// landed 1.3 s after it left P, past the delivery bound the model promises (bytes arrive within
/// it or are lost), and so after D's final failure. New bytes after TCP gave up go on a new
/// connection, at once.
#[test]
fn seed_427180299053_bytes_sent_after_tcp_gave_up_wait_for_no_backoff() {
    keeps_the_fence(427_180_299_053);
}

/// Layer-wise push: D cancels while a layer's WRITE is stuck, and P's KV comes meanwhile. P's
/// KV was refused at once, so P's engine freed the blocks that WRITE still read; it is now held
/// until the stream's WRITEs are done, and its send ends cancelled.
#[test]
fn seed_89_a_kv_offered_during_a_cancelled_stream_keeps_its_blocks_until_the_stream_ends() {
    keeps_the_fence_in(89, Model::FULL);
}

/// Layer-wise push: P aborts a request while a layer's WRITE is stuck (answered `InFlight`).
/// Nothing followed: P's engine held the blocks for good waiting for the send's event, and D
/// waited for the KV until its TTL. Once the stream's WRITEs are done, P now reports the send
/// and D gets a FAIL.
#[test]
fn seed_285_a_prefill_aborted_mid_stream_ends_on_both_sides_once_the_stream_is_done() {
    keeps_the_fence_in(285, Model::FULL);
}

/// Layer-wise push: a layer's WRITE is stuck past the write timeout (a quarantine notice), then
/// so is the request's own WRITE: a second notice for the same request. Now one per request.
#[test]
fn seed_642443057927_a_stuck_stream_and_its_stuck_write_give_one_notice() {
    keeps_the_fence_in(642_443_057_927, Model::FULL);
}

/// Layer-wise push: D cancels, then P aborts, while a layer's WRITE is stuck. The stream's end
/// acknowledged D's cancel but, taking it for D's alone, ended nothing on P: the abort's
/// `InFlight` was never followed by the send's event. The table now records P's abort.
#[test]
fn seed_643421006194_p_s_abort_after_d_s_cancel_mid_stream_still_ends_p_s_send() {
    keeps_the_fence_in(643_421_006_194, Model::FULL);
}
