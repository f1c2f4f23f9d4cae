"""Transfer statistics as vLLM's stats pipeline carries them: a dict of lists per interval,
summed across workers, reduced to a log line and observed into Prometheus metrics.

No vLLM import: :mod:`kvpush.vllm.connector` wraps this in vLLM's ``KVConnectorStats``.
"""

from __future__ import annotations

import statistics
from typing import Any

import kvpush

#: Per-transfer observations (lists, one value per finished transfer).
SERIES = (
    "bytes",  # bytes written (P) or announced by DONE (D)
    "descriptors",  # runs in the WRITE
    "post_seconds",  # P: match -> WRITE posted (planning + descriptor building + post)
    "transfer_seconds",  # P: WRITE posted -> done; D: registered -> last DONE
    "registration_wait_seconds",  # P: KV ready -> D's registration matched it (0 if D was first)
    "step_wait_seconds",  # scheduler decided -> worker acted (metadata delivery)
)


def empty() -> dict[str, Any]:
    data: dict[str, Any] = {name: [] for name in SERIES}
    data["sent"] = 0
    data["received"] = 0
    data["failures"] = {}  # reason code -> count
    return data


def _reason_code(event: kvpush.TransferEvent) -> str:
    """A failure's metric label: the role and the event's reason code (never its prose)."""
    code = event.code if event.code is not None else event.outcome
    return f"{event.role}_{code}"


def observe(
    data: dict[str, Any], event: kvpush.TransferEvent, scheduled: float | None, clock_offset: float
) -> None:
    """Adds one finished transfer to ``data``."""
    t = event.timeline
    if event.outcome != kvpush.Outcome.DONE:
        code = _reason_code(event)
        data["failures"][code] = data["failures"].get(code, 0) + 1
        return
    sent = event.role == kvpush.Role.SEND
    data["sent" if sent else "received"] += 1
    data["bytes"].append(event.bytes)
    data["descriptors"].append(event.runs)
    if sent:
        if t.matched is not None and t.posted is not None:
            data["post_seconds"].append(t.posted - t.matched)
        if t.posted is not None and t.completed is not None:
            data["transfer_seconds"].append(t.completed - t.posted)
        if t.ready is not None and t.matched is not None:
            data["registration_wait_seconds"].append(max(0.0, t.matched - t.ready))
        acted = t.ready
    else:
        if t.registered is not None and t.completed is not None:
            data["transfer_seconds"].append(t.completed - t.registered)
        acted = t.registered
    if scheduled is not None and acted is not None:
        data["step_wait_seconds"].append(max(0.0, acted + clock_offset - scheduled))


def aggregate(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Adds ``other``'s observations to ``into`` (another worker, or a later step)."""
    for name in SERIES:
        into.setdefault(name, []).extend(other.get(name, ()))
    for name in ("sent", "received"):
        into[name] = into.get(name, 0) + other.get(name, 0)
    failures = into.setdefault("failures", {})
    for code, count in other.get("failures", {}).items():
        failures[code] = failures.get(code, 0) + count
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not (data.get("sent") or data.get("received") or data.get("failures"))


def reduce(data: dict[str, Any]) -> dict[str, int | float]:
    """One interval's summary for vLLM's periodic log line."""
    out: dict[str, int | float] = {
        "sent": data.get("sent", 0),
        "received": data.get("received", 0),
        "failed": sum(data.get("failures", {}).values()),
        "MB": round(sum(data.get("bytes", ())) / 1e6, 3),
    }
    for name in (
        "post_seconds",
        "transfer_seconds",
        "registration_wait_seconds",
        "step_wait_seconds",
    ):
        values = data.get(name) or []
        if values:
            out[f"{name.removesuffix('_seconds')}_ms_p50"] = round(
                statistics.median(values) * 1e3, 3
            )
    return out
