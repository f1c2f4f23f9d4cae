"""Two third-party push routers, re-implemented from their documented behaviour, so that the
e2e tests drive kvpush the way those routers would, unchanged (issue 11, item 3).

Both are written here on aiohttp's client, not on kvpush's router: the point is that kvpush
needs nothing of its own in front of it.

* :class:`VllmPushDemoProxy`: vLLM's ``disagg_proxy_pushconnector_demo.py``
  (``shared/reference/vllm-push-connector.md`` §2.2). P's coordinates are configured up front
  (engine id, side-channel host and port, TP and PP size); both legs go out at once with one
  ``X-Request-Id: <uuid4>``; P's leg (``max_tokens=1``, ``do_remote_decode``) is drained and
  ignored; D's answer is the client's.
* :class:`LlmdPushDispatch`: llm-d's routing sidecar's push dispatch
  (``pkg/sidecar/proxy/nixl_push_identity.go``). Nothing about P is configured: a request to a P
  whose push identity is not cached goes serially (P's leg, then D with P's answer's
  kv_transfer_params as they are), the identity fields of that answer are cached, and later
  requests send both legs at once with the cached identity. Every request carries
  ``transfer_id = xfer-<uuid4>``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

JSON = dict[str, Any]

#: P's leg's kv_transfer_params in both routers: "prefill, keep the KV for a remote decode".
PREFILL_PARAMS: JSON = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: What llm-d caches of a prefill answer as P's push identity (it also reads ``dcp_size``,
#: which vLLM's push connector leaves out below decode context parallelism, as kvpush does).
IDENTITY_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size")


class LegError(RuntimeError):
    """One leg answered with an HTTP error."""

    def __init__(self, url: str, status: int, text: str) -> None:
        super().__init__(f"{url} answered {status}: {text[:2000]}")
        self.url, self.status, self.text = url, status, text


@dataclass(frozen=True)
class Routed:
    """One request through a router: D's answer (the client's), and what the test may check."""

    request_id: str
    transfer_id: str
    #: ``parallel`` (both legs at once) or ``serial`` (P first, its answer forwarded to D).
    mode: str
    prefill: JSON
    decode: JSON


async def post_completion(
    session: aiohttp.ClientSession, url: str, body: JSON, request_id: str | None = None
) -> JSON:
    """``POST url/v1/completions`` (non-streaming); the decoded answer, or :class:`LegError`."""
    headers = {} if request_id is None else {"X-Request-Id": request_id}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        text = await response.text()
        if response.status != 200:
            raise LegError(url, response.status, text)
        answer: JSON = json.loads(text)
        return answer


def prefill_leg(body: JSON, transfer_id: str) -> JSON:
    """The client's body as P's leg: one token, no stream, the KV kept for D."""
    leg = {**body, "max_tokens": 1, "stream": False}
    leg.pop("stream_options", None)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["kv_transfer_params"] = {**PREFILL_PARAMS, "transfer_id": transfer_id}
    return leg


def decode_leg(body: JSON, params: JSON) -> JSON:
    return {**body, "stream": False, "kv_transfer_params": params}


@dataclass
class VllmPushDemoProxy:
    """vLLM's push demo proxy: one P whose coordinates are given on its command line."""

    prefill_url: str
    decode_url: str
    prefill_engine_id: str
    prefill_kv_host: str
    prefill_side_channel_port: int
    prefill_tp_size: int = 1
    prefill_pp_size: int = 1

    async def complete(self, session: aiohttp.ClientSession, body: JSON) -> Routed:
        request_id = str(uuid.uuid4())
        transfer_id = str(uuid.uuid4())
        d_params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.prefill_engine_id,
            "remote_host": self.prefill_kv_host,
            "remote_port": self.prefill_side_channel_port,
            "tp_size": self.prefill_tp_size,
            "pp_size": self.prefill_pp_size,
            "remote_request_id": request_id,
            "transfer_id": transfer_id,
        }
        prefill, decode = await asyncio.gather(
            post_completion(session, self.prefill_url, prefill_leg(body, transfer_id), request_id),
            post_completion(session, self.decode_url, decode_leg(body, d_params), request_id),
        )
        return Routed(request_id, transfer_id, "parallel", prefill, decode)


@dataclass
class LlmdPushDispatch:
    """llm-d's push dispatch: P's identity learned from its first answer, then parallel legs."""

    prefill_url: str
    decode_url: str
    #: P's push identity per P (its URL), learned from a prefill answer.
    identities: dict[str, JSON] = field(default_factory=dict)
    #: Requests by dispatch mode (llm-d counts ``nixl_push_dispatches_total{mode}``).
    dispatches: Counter[str] = field(default_factory=Counter)

    async def complete(self, session: aiohttp.ClientSession, body: JSON) -> Routed:
        request_id = str(uuid.uuid4())
        transfer_id = f"xfer-{uuid.uuid4()}"
        p_body = prefill_leg(body, transfer_id)
        identity = self.identities.get(self.prefill_url)
        if identity is None:
            self.dispatches["serial"] += 1
            prefill = await post_completion(session, self.prefill_url, p_body, request_id)
            params = prefill.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise RuntimeError(f"P's answer carries no kv_transfer_params: {prefill}")
            self._learn(params)
            d_params = {**params, "transfer_id": transfer_id}
            decode = await post_completion(
                session, self.decode_url, decode_leg(body, d_params), request_id
            )
            return Routed(request_id, transfer_id, "serial", prefill, decode)
        self.dispatches["parallel"] += 1
        d_params = {
            **identity,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
        }
        prefill, decode = await asyncio.gather(
            post_completion(session, self.prefill_url, p_body, request_id),
            post_completion(session, self.decode_url, decode_leg(body, d_params), request_id),
        )
        return Routed(request_id, transfer_id, "parallel", prefill, decode)

    def _learn(self, params: JSON) -> None:
        """Caches P's identity when its answer names a push P completely; otherwise the next
        request to it goes serially again (a cache miss)."""
        if params.get("transfer_mode") != "push":
            return
        if any(params.get(name) is None for name in IDENTITY_FIELDS):
            return
        self.identities[self.prefill_url] = {
            **{name: params[name] for name in IDENTITY_FIELDS},
            "transfer_mode": "push",
        }
