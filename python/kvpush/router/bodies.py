"""The legs' request bodies, from the client's: the push contract (vLLM's push demo proxy,
which kvpush's connector reads) and the pull contract (vLLM's ``NixlConnector`` toy proxy).

Push: both legs go out at once with one ``X-Request-Id`` and one ``transfer_id``; P computes
one token and pushes the prompt's KV to whichever D registers for ``transfer_id``; D names P.
Pull: P first; D gets the ``kv_transfer_params`` P answered (where P holds the blocks).
"""

from __future__ import annotations

from typing import Any

from kvpush.router.instances import PrefillCoordinates, PrefillInstance

__all__ = [
    "PULL_PREFILL_PARAMS",
    "decode_body",
    "prefill_body",
    "pull_decode_body",
    "pull_prefill_body",
]

JSON = dict[str, Any]

#: The pull router's P leg (vLLM's ``disagg_proxy`` for ``NixlConnector``): P keeps the blocks
#: for D to read and answers where they are.
PULL_PREFILL_PARAMS: JSON = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _one_token(body: JSON) -> JSON:
    leg = dict(body)
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    # vLLM refuses stream_options without stream, and min_tokens above max_tokens.
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    return leg


def prefill_body(body: JSON, transfer_id: str) -> JSON:
    """P's push leg: one token, not streamed; P pushes the prompt's KV to whichever D
    registers for ``transfer_id``."""
    leg = _one_token(body)
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return leg


def decode_body(
    body: JSON,
    prefill: PrefillInstance | PrefillCoordinates,
    request_id: str,
    transfer_id: str,
) -> JSON:
    """D's push leg: the client's request, plus where P is and which transfer to wait for."""
    where = prefill.configured() if isinstance(prefill, PrefillInstance) else prefill
    if where is None:
        raise ValueError(f"{prefill!r}: P's coordinates are not configured (not known yet)")
    leg = dict(body)
    leg["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": where.engine_id,
        "remote_host": where.side_channel_host,
        "remote_port": where.side_channel_port,
        "tp_size": where.tp,
        "pp_size": where.pp,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }
    return leg


def pull_prefill_body(body: JSON) -> JSON:
    """P's pull leg: one token, not streamed; P keeps the blocks and answers where they are."""
    leg = _one_token(body)
    leg["kv_transfer_params"] = dict(PULL_PREFILL_PARAMS)
    return leg


def pull_decode_body(body: JSON, prefill_params: JSON) -> JSON:
    """D's pull leg: the client's request with the ``kv_transfer_params`` P answered."""
    return {**body, "kv_transfer_params": dict(prefill_params)}
