"""``kvpush bench scale`` at a size a test can afford: real endpoints, a real side channel over
TCP, P restarted under its D peers. What is asserted is what does not depend on the machine's
speed: every receive of every round ends done (a D that P is too busy to answer tries again),
P runs one thread per connection on top of its own, and the section is written. The latencies
and CPU figures are reported, not checked."""

from __future__ import annotations

from collections.abc import Callable

from kvpush_lab.bench import scale
from kvpush_lab.bench.child import run_in_child


def _measure(peers: int, max_handshakes: int) -> scale.ScaleSample:
    """One size in its own process, as the bench runs it: a process's endpoints are its own."""
    sample = run_in_child(scale.measure, (peers, max_handshakes, 0.2), 300, "scale")
    assert isinstance(sample, scale.ScaleSample)
    return sample


def test_p_restarting_under_more_peers_than_handshake_slots_loses_no_receive() -> None:
    # 24 D peers against 2 handshake slots: most of each reconnect burst is turned away and
    # must come back, after the connect and again after P restarted.
    sample = _measure(24, max_handshakes=2)
    assert [r.name for r in sample.rounds] == list(scale.ROUNDS)
    for r in sample.rounds:
        assert (r.done, r.lost) == (24, {}), f"round {r.name}: {r.lost} {r.reasons}"
        assert r.match_p50 is not None
        assert r.match_p99 is not None
    assert sample.p_connection_threads == 24
    assert sample.p_threads > sample.p_connection_threads
    assert sample.p_fds >= 24
    assert sample.p_idle_percent >= 0


def test_the_section_has_both_tables_and_a_verdict_per_size(
    section_written: Callable[[str, str], str],
) -> None:
    lost = scale.Round("c", done=3, lost={"unreachable": 1}, reasons={"unreachable": "why"})
    samples = [
        scale.ScaleSample(4, 16, 6, 4, 5, 100.0, 0.5, 1.0, 1.0, [scale.Round("c", done=4)]),
        scale.ScaleSample(4, 16, 6, 4, 5, 100.0, 0.5, 1.0, 1.0, [scale.Round("a", 4), lost]),
    ]
    text = section_written(scale.SECTION, scale.markdown(samples, "kvpush bench scale"))
    assert f"## {scale.SECTION}" in text
    assert "| 4 | 6 (2 + 4) | 5 | 100 KiB | 0.50% | 1.00% | 0 ns |" in text
    assert "no receive lost: **met**." in text
    assert "no receive lost: **not met**: 1 receive(s) lost, most `unreachable` (why)." in text
