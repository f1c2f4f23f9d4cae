"""kvpush's lab: everything that measures, demonstrates or tests kvpush, apart from the product.

The ``kvpush`` package is what a serving host runs (the connector, the core API, the router, a
small CLI) and never imports this one; ``kvpush demo``, ``kvpush bench`` and ``kvpush model``
hand over to :mod:`kvpush_lab.cli` when it is installed.

* :mod:`kvpush_lab.demo`: the core's request lifecycle in one process (``kvpush demo --core``);
* :mod:`kvpush_lab.demo_vllm`: a vLLM prefill/decode pair behind kvpush's proxy (``kvpush demo``);
* :mod:`kvpush_lab.servers`: vLLM servers as subprocesses; :mod:`kvpush_lab.model`: tiny
  random-weight models;
* :mod:`kvpush_lab.peer`: a P or D worker in its own process, driven over a pipe (tests, benches,
  ``scripts/gpu-check``); :mod:`kvpush_lab.cache`: its paged KV cache; :mod:`kvpush_lab.plain_nixl`:
  NIXL driven from Python, the baseline of the data path;
* :mod:`kvpush_lab.bench`: the benchmarks against the baselines kvpush replaces.
"""
