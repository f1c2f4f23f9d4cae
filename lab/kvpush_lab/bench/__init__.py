"""Benchmarks of kvpush against the baselines it replaces. Benchmarks print tables and ratios;
they assert nothing about time.

* :mod:`kvpush_lab.bench.transfer`: the data path (``kvpush bench transfer``): one request's whole
  KV cache pushed by kvpush's native writer, against a plain NIXL WRITE of the same bytes
  driven from Python, in the same run;
* :mod:`kvpush_lab.bench.worker`: one side (P or D) of that benchmark, in its own process.
"""
