"""Benchmarks of kvpush against the baselines it replaces. Benchmarks print tables and ratios;
they assert nothing about time.

* :mod:`kvpush_lab.bench.suite`: all of them in turn (``kvpush bench``);
* :mod:`kvpush_lab.bench.transfer`: the data path (``kvpush bench transfer``): one request's
  whole KV cache pushed by kvpush's native writer, against a plain NIXL WRITE of the same bytes
  driven from Python, in the same run; :mod:`kvpush_lab.bench.worker` is one side (P or D) of it,
  run in its own process by :class:`kvpush_lab.peer.RemoteWorker`;
* :mod:`kvpush_lab.bench.core`, :mod:`~kvpush_lab.bench.control`, :mod:`~kvpush_lab.bench.idle`:
  the Rust core's criterion benches, P's control path, an idle pair's CPU;
* :mod:`kvpush_lab.bench.serving`: real vLLM pairs (results :mod:`~kvpush_lab.bench.serving_result`,
  report :mod:`~kvpush_lab.bench.serving_report`).
"""
