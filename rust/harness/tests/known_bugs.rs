//! Bugs in the core that the harness found, each reproduced by a short script, each fixed
//! since: a duplicate registration at the host quota failed while the first stood; fan-out
//! groups P's KV never came for were never forgotten; an abort racing a fan-out slot's end said
//! released and the slot's event followed; a WRITE that failed before it was posted dropped a
//! re-registration that came meanwhile.

use kvpush_harness::registration::{
    run, Action, Blocks, EpochSpec, Fanout, Fences, FirstToken, Groups, KeySpec, Metadata,
    PeerShape, PeerSpec, ReadyTtl, Script, Shift, Tokens, Ttl, WriteFate,
};
use kvpush_harness::{record_panics, Few, Report};

/// Two block lists that fit a one-block prompt, from blocks 1 and 5.
fn blocks() -> Groups {
    Groups { count: 2, first: FirstToken::Zero, blocks: Blocks::Run, starts: [1, 5, 9] }
}

/// D peer `peer` registers transfer `k{key}` (or its slot), as request `d{peer}-r{request}`.
fn register(peer: u8, key: KeySpec, request: u8, ttl: Ttl, fanout: Fanout) -> Action {
    Action::Register {
        peer,
        key,
        request,
        epoch: EpochSpec::Small(1),
        groups: blocks(),
        tokens: Tokens::Fit,
        ttl,
        fanout,
    }
}

fn key(base: u8, slot: Option<u8>) -> KeySpec {
    KeySpec { base, slot }
}

fn ready(key: u8) -> Action {
    Action::Ready { key, groups: blocks(), tokens: Tokens::Fit, ttl: ReadyTtl::Long }
}

fn script(peers: usize, actions: Vec<Action>) -> Script {
    let peer = PeerSpec { shape: PeerShape::Whole, metadata: Metadata::Own };
    Script {
        peers: Few(vec![peer; peers]),
        writes: WriteFate::Prompt,
        fences: Fences::Long,
        prompts: [0; 3],
        actions: Few(actions),
    }
}

fn assert_clean(report: &Report) {
    assert!(report.violations.is_empty() && report.known.is_empty(), "{report:#?}");
}

/// control.rs, `Control::register`: the host quota (and, for a slot key, the fan-out check) is
/// applied before the rendezvous table, which is what recognises a registration D sent again
/// (same key, request and epoch: a retransmission, or `expect` called twice) and lets the one
/// it holds stand without a reply. At the quota the copy is refused with a FAIL (`refused`)
/// naming that very epoch, so D ends its receive as failed and hands its blocks back, and P
/// then writes the registration that stands into them. Here: D peer 0 registers `k0`, fills
/// the quota (6) with five more, sends `k0` again, and P's KV for `k0` comes.
#[test]
fn a_registration_sent_again_at_the_quota_is_not_failed_while_the_first_stands() {
    record_panics();
    let mut actions = vec![register(0, key(0, None), 0, Ttl::Long, Fanout::One)];
    // Five more transfers: slot keys registered with a fan-out of 1 are plain keys.
    for n in 1..6 {
        actions.push(register(0, key(1 + n % 2, Some(n / 2)), n, Ttl::Long, Fanout::One));
    }
    actions.push(Action::Wait { ms: 10 });
    actions.push(register(0, key(0, None), 0, Ttl::Long, Fanout::One));
    actions.push(Action::Wait { ms: 10 });
    actions.push(ready(0));
    actions.push(Action::Wait { ms: 15 });
    assert_clean(&run(&script(1, actions)));
}

/// fanout.rs / control.rs, `Control::join_fanout`: a D rank's first slot registration creates
/// the transfer's fan-out group, which is removed only when the send is reported or P aborts
/// the transfer. When P's KV never comes (the registration expires or its D goes, and P never
/// calls `ready` or `abort` for that key: a misrouted request, a P restarted since), the group
/// stays in `Shared::fanouts` for good. Any D holding the secret can grow that map without
/// bound, one transfer key at a time, within its host quota. Here: D peer 0 registers slot 0
/// of `k0` (fan-out 2) with a TTL of 0 and leaves; P never hears of `k0`.
#[test]
fn a_fan_out_group_no_ready_comes_for_is_forgotten_with_its_registrations() {
    record_panics();
    let actions = vec![
        register(0, key(0, Some(0)), 0, Ttl::Zero, Fanout::Of(2)),
        Action::Wait { ms: 15 },
        Action::Leave { peer: 0 },
    ];
    assert_clean(&run(&script(1, actions)));
}

/// lib.rs `Endpoint::abort_slots` against send.rs `Writer::report_send`: a slot whose WRITE
/// has ended (the table fenced its key) but whose end the writer has not yet counted in the
/// group (`report_send` takes the groups' lock after `table.finish` and after sending D its
/// FAIL) is `NotFound` to the abort, which releases the other slots, answers `Released` ("no
/// write will happen; no event follows") and removes the group. `report_send` then finds no
/// group and reports the slot's send on its own, under the slot key: P's engine gets an event
/// for a request it already freed. A race: each attempt below has slot 0's WRITE fail at once
/// (D asks for more tokens than P computed) while P aborts right after `ready`; a few hundred
/// attempts hit it on a small machine.
#[test]
fn an_abort_that_releases_a_fan_out_transfer_is_its_only_end() {
    record_panics();
    for _ in 0..300 {
        let mut bad = register(0, key(0, Some(0)), 0, Ttl::Long, Fanout::Of(2));
        if let Action::Register { tokens, .. } = &mut bad {
            *tokens = Tokens::Max;
        }
        let actions = vec![bad, Action::Wait { ms: 5 }, ready(0), Action::Abort { key: 0 }];
        assert_clean(&run(&script(1, actions)));
    }
}

/// send.rs, `Writer::write`: when `post` fails (a refused plan, a lapsed lease, a transport
/// that refuses the WRITE), the error path calls `table.finish` and drops what it returns. If D
/// re-registered at a higher epoch while the post was under way, the table answers with that
/// re-registration's match (`Finished::rematch`, and any `cancel_acknowledged`) and keeps P's KV
/// matched for it; the writer reports the send failed and forgets the match. The new
/// registration is then never written and D is never told (it waits out its TTL), and P's KV
/// stays in the table until its own TTL, when the send is reported a second time (expired).
/// `Writer::finish` (a WRITE that was posted) handles both. Here: P's transport takes 15 ms to
/// refuse every post, and D peer 0 re-registers at the next epoch meanwhile.
#[test]
fn a_re_registration_during_a_failed_post_is_written_or_failed() {
    record_panics();
    let actions = vec![
        register(0, key(0, None), 0, Ttl::Long, Fanout::One),
        Action::Wait { ms: 5 },
        Action::Ready { key: 0, groups: blocks(), tokens: Tokens::Fit, ttl: ReadyTtl::Short(60) },
        Action::Wait { ms: 5 },
        Action::Again { peer: 0, nth: 0, epoch: Shift::Up },
        Action::Wait { ms: 15 },
    ];
    let mut script = script(1, actions);
    script.writes = WriteFate::Unposted;
    assert_clean(&run(&script));
}
