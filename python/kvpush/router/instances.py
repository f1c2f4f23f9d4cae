"""The P and D servers a router sends legs to: their addresses, P's coordinates, and the
per-instance state balancing and health checks read (outstanding legs, healthy or not).

P's coordinates are what D's connector needs to reach P: engine id, side-channel host and
port, TP and PP size. They are either configured (``--prefill URL,engine_id=..,side_channel=..``)
or learned from P's first answer, whose ``kv_transfer_params`` carry them (kvpush's P returns its
identity with every finished prefill, as llm-d's sidecar expects).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "Instance",
    "PrefillCoordinates",
    "PrefillInstance",
    "Role",
    "Upstream",
    "parse_prefill",
]

Role = Literal["prefill", "decode"]

#: The kv_transfer_params of P's answer that name P, and the coordinate each one fills.
IDENTITY_FIELDS = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size")


@dataclass(frozen=True)
class Upstream:
    """One P or D server's HTTP address, parsed once."""

    url: str
    scheme: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected an http:// or https:// URL with a host")
        try:
            port = parts.port
        except ValueError as error:
            raise ValueError(f"{url!r}: {error}") from None
        default = 443 if parts.scheme == "https" else 80
        return cls(url, parts.scheme, parts.hostname, port or default, parts.path.rstrip("/"))

    def join(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.base_path}{path}"


@dataclass(frozen=True)
class PrefillCoordinates:
    """Where D's connector finds one P: its engine id, side channel, TP and PP sizes."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id is empty")
        if not self.side_channel_host:
            raise ValueError("side channel host is empty")
        if not 0 < self.side_channel_port < 65536:
            raise ValueError(f"side channel port {self.side_channel_port}")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp={self.tp} pp={self.pp} must be >= 1")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PrefillCoordinates:
        """P's identity from its answer's ``kv_transfer_params``; ValueError naming what is
        missing or wrong (a P that is not kvpush's, or is an older one, answers without it)."""
        missing = [name for name in IDENTITY_FIELDS[:3] if params.get(name) in (None, "")]
        if missing:
            raise ValueError(f"P's kv_transfer_params lack {', '.join(missing)}")
        mode = params.get("transfer_mode", "push")
        if mode != "push":
            raise ValueError(f"P's transfer_mode is {mode!r}, not 'push'")
        try:
            return cls(
                str(params["remote_engine_id"]),
                str(params["remote_host"]),
                int(params["remote_port"]),
                tp=int(params.get("tp_size") or 1),
                pp=int(params.get("pp_size") or 1),
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"P's kv_transfer_params: {error}") from None


@dataclass(frozen=True)
class PrefillInstance:
    """One P server and, when known up front, the coordinates D's connector needs to reach it.

    ``engine_id`` is the ``engine_id`` in P's ``--kv-transfer-config``; ``side_channel_host``
    and ``side_channel_port`` are P's ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``; ``tp`` and
    ``pp`` are P's tensor- and pipeline-parallel sizes (D waits for ``pp`` stages' writes).
    With no ``engine_id`` and side channel, the router learns them from P's first answer.
    """

    url: str
    engine_id: str | None = None
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    tp: int = 1
    pp: int = 1
    upstream: Upstream = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "upstream", Upstream.parse(self.url))
        try:
            self.configured()
        except ValueError as error:
            raise ValueError(f"prefill {self.url}: {error}") from None

    def configured(self) -> PrefillCoordinates | None:
        """The coordinates given up front, or None when the router is to learn them."""
        given = (self.engine_id, self.side_channel_host, self.side_channel_port)
        if all(value is None for value in given):
            return None
        return PrefillCoordinates(
            self.engine_id or "",
            self.side_channel_host or "",
            self.side_channel_port or 0,
            tp=self.tp,
            pp=self.pp,
        )


def parse_prefill(spec: str) -> PrefillInstance:
    """``URL[,engine_id=ID,side_channel=HOST:PORT][,tp=N][,pp=N]`` (the ``--prefill`` syntax).

    A bare URL (tp= and pp= at most) means: learn P's coordinates from its first answer.
    """
    url, *options = (part.strip() for part in spec.split(","))
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("engine_id", "side_channel", "tp", "pp"):
            raise ValueError(
                f"--prefill {spec!r}: unknown option {option!r} "
                "(expected engine_id=, side_channel=, tp=, pp=)"
            )
        values[key] = value
    try:
        tp, pp = int(values.get("tp", "1")), int(values.get("pp", "1"))
    except ValueError:
        raise ValueError(f"--prefill {spec!r}: tp and pp must be integers") from None
    if "engine_id" not in values and "side_channel" not in values:
        if tp < 1 or pp < 1:
            raise ValueError(f"--prefill {spec!r}: tp={tp} pp={pp} must be >= 1")
        return PrefillInstance(url, tp=tp, pp=pp)
    for required in ("engine_id", "side_channel"):
        if required not in values:
            raise ValueError(
                f"--prefill {spec!r}: {required}= is required with "
                f"{'side_channel' if required == 'engine_id' else 'engine_id'}= "
                "(or give neither, and the router learns them from P's first answer)"
            )
    host, sep, port = values["side_channel"].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--prefill {spec!r}: side_channel must be HOST:PORT")
    return PrefillInstance(url, values["engine_id"], host.strip("[]"), int(port), tp=tp, pp=pp)


class Instance:
    """One P or D server as the router sees it now: healthy or not, how many legs it holds,
    and (for P) its coordinates once known. Touched only from the router's event loop."""

    def __init__(self, role: Role, url: str, prefill: PrefillInstance | None = None) -> None:
        self.role = role
        self.upstream = prefill.upstream if prefill is not None else Upstream.parse(url)
        self.url = url
        self.healthy = True
        self.outstanding = 0
        self.coordinates = prefill.configured() if prefill is not None else None
        self.learns = prefill is not None and self.coordinates is None
        # Set while a first, serial request learns this P's coordinates: others wait for it.
        self.learning: asyncio.Future[None] | None = None

    def taken_out(self) -> None:
        """Failed a health check: coordinates learned from its answers are forgotten (a P
        that comes back may be a new engine, on another side-channel port)."""
        self.healthy = False
        if self.learns:
            self.coordinates = None

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else "unhealthy"
        return f"Instance({self.role} {self.url}, {state}, {self.outstanding} outstanding)"
