"""kvpush's router: disaggregated prefill (P) / decode (D) requests over pools of instances.

One routing core, on asyncio and aiohttp, behind ``kvpush proxy`` (:mod:`~kvpush.router.http`,
the HTTP front), the benchmark client and the end-to-end harness (:func:`complete`):

* :mod:`~kvpush.router.instances`: P and D addresses, P's coordinates (configured or learned),
  each instance's outstanding legs and health;
* :mod:`~kvpush.router.bodies`: the legs' bodies, push contract and pull contract;
* :mod:`~kvpush.router.balance`: least outstanding legs among the healthy, ties round-robin;
* :mod:`~kvpush.router.health`: per-instance ``/health`` checks;
* :mod:`~kvpush.router.exchange`: one request's legs and what ends it;
* :mod:`~kvpush.router.core`: :class:`Router`, the pools, the session, the requests in flight;
* :mod:`~kvpush.router.client`: one completion in-process, with per-leg timings;
* :mod:`~kvpush.router.loop`: a background event loop for synchronous callers;
* :mod:`~kvpush.router.http`: the OpenAI-compatible HTTP front and ``kvpush proxy``'s options
  (:class:`~kvpush.router.http.ProxyServer` is imported from there: it brings aiohttp's server).
"""

from kvpush.router.balance import NoHealthyInstanceError
from kvpush.router.bodies import (
    PULL_PREFILL_PARAMS,
    decode_body,
    prefill_body,
    pull_decode_body,
    pull_prefill_body,
)
from kvpush.router.client import Completion, RouterThread, complete, complete_once
from kvpush.router.core import Router
from kvpush.router.exchange import Leg, LegFailedError, Mode, RouterStoppingError, Timeouts
from kvpush.router.instances import PrefillCoordinates, PrefillInstance, parse_prefill

__all__ = [
    "PULL_PREFILL_PARAMS",
    "Completion",
    "Leg",
    "LegFailedError",
    "Mode",
    "NoHealthyInstanceError",
    "PrefillCoordinates",
    "PrefillInstance",
    "Router",
    "RouterStoppingError",
    "RouterThread",
    "Timeouts",
    "complete",
    "complete_once",
    "decode_body",
    "parse_prefill",
    "prefill_body",
    "pull_decode_body",
    "pull_prefill_body",
]
