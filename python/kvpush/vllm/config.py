"""The connector's configuration: what it reads from vLLM's ``kv_transfer_config`` (its
``kv_connector_extra_config`` options), from the environment, and the defaults; in plain Python
(vLLM's config is only read, never imported).

Options (``kv_connector_extra_config``): ``side_channel_host``/``side_channel_port`` (default:
``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, as vLLM's NIXL connectors; worker ``r`` listens on
port + r), ``secret_file`` (or env ``KVPUSH_SECRET_FILE``: the path of a file holding the shared
secret; or the secret itself in env ``KVPUSH_SECRET``. It HMAC-signs every control message and
is proven both ways before any NIXL metadata moves; required to listen beyond loopback unless
``insecure`` is true or ``KVPUSH_INSECURE=1``. A ``secret`` option is refused at startup: vLLM
logs this config at every start, and a command line is readable by every user of the host),
``kv_lease_duration`` (s P keeps finished KV for D, default 30), ``receive_timeout`` (s D waits
for KV, default 120), ``write_timeout`` / ``peer_timeout`` / ``heartbeat_interval`` (s, defaults
10 / 5 / 1: the write horizon, see docs/operations.md), ``max_connections`` /
``max_connections_per_host`` / ``max_handshakes`` (the side channel's caps, defaults 256 / 32 /
16: a P holds one connection per D rank it serves; a D turned away for want of a slot tries
again while its receives wait), ``idle_wait_ms`` (how long a worker's report in a step that
computes nothing may wait for a transfer event, ended by the first one: ``"auto"``, the default,
or milliseconds from 0 to 50; see :func:`idle_wait`), ``layerwise`` (``"off"``, the default,
``"on"`` or ``"auto"``: P writes each layer's KV as soon as the layer ran, while prefill goes
on; see :func:`layerwise`), ``transport`` (``nixl``, or ``loopback`` for in-process tests).

Environment only: ``KVPUSH_THREAD_CPUS`` (where the endpoint's native threads run,
:func:`native_thread_cpus`) and ``KVPUSH_TIMELINE_DIR`` (per-transfer timelines,
:func:`timeline_dir`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpush.exceptions import ConfigError, KvPushError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "LAYERWISE_AUTO_MIN_TOKENS",
    "LAYERWISE_MODES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "THREAD_CPUS_ENV",
    "TIMELINE_DIR_ENV",
    "WorkerConfig",
    "cpu_list",
    "identity",
    "layerwise",
    "load_secret",
    "native_thread_cpus",
    "timeline_dir",
    "worker_config",
]

logger = logging.getLogger("vllm.kvpush")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker's endpoint needs that is not in the KV tensors."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int
    #: The shared secret (:func:`load_secret`); never in a repr, so never in a log line.
    secret: bytes | None = field(repr=False)
    #: Listen beyond loopback without a secret (``insecure`` / ``KVPUSH_INSECURE=1``).
    insecure: bool
    ttl: float
    receive_timeout: float
    transport: str
    model_fingerprint: str
    #: The endpoint's timeouts (s): see docs/operations.md, "The fence".
    write_timeout: float = 10.0
    peer_timeout: float = 5.0
    heartbeat_interval: float = 1.0
    #: The side channel's caps: connections, connections from one host, handshakes at once.
    max_connections: int = 256
    max_connections_per_host: int = 32
    max_handshakes: int = 16
    #: How long (s) a worker's report in a step that computes nothing may wait for a transfer
    #: event, the first event ending it (``idle_wait_ms``; :func:`idle_wait` picks it on
    #: ``"auto"``). A request that arrives meanwhile waits behind it.
    idle_wait: float = 0.0
    #: Layer-wise push (``layerwise``): ``"off"``, ``"on"`` or ``"auto"``; see :func:`layerwise`.
    layerwise: str = "off"


#: The shared secret itself, or the path of a file that holds it.
SECRET_ENV = "KVPUSH_SECRET"
SECRET_FILE_ENV = "KVPUSH_SECRET_FILE"


def load_secret(extra: Mapping[str, object], environ: Mapping[str, str]) -> bytes | None:
    """The shared secret, from the environment (``KVPUSH_SECRET``) or a file (option
    ``secret_file`` or ``KVPUSH_SECRET_FILE``; surrounding whitespace, such as the newline
    ``openssl rand -hex 32 >FILE`` ends it with, is not part of it); None when neither is set.

    Never from ``kv_connector_extra_config`` itself: vLLM logs that config at every start, and a
    command line is readable by every user of the host (``/proc/*/cmdline``). Refused at
    startup, with what to do instead; no message carries the secret.
    """
    if "secret" in extra:
        raise ConfigError(
            "kv_connector_extra_config.secret is refused: vLLM logs kv_transfer_config at every "
            "start and the command line is readable by every user of the host "
            f"(/proc/*/cmdline). Remove it and give the secret in the environment ({SECRET_ENV}) "
            f"or in a file readable by the server's user only (option secret_file, or "
            f"{SECRET_FILE_ENV}: the file's path)"
        )
    path = extra.get("secret_file") or environ.get(SECRET_FILE_ENV)
    from_env = environ.get(SECRET_ENV)
    if path and from_env:
        raise ConfigError(
            f"both {SECRET_ENV} and a secret file ({path}) are set: give the secret one way"
        )
    if not path:
        return from_env.encode() if from_env else None
    if not isinstance(path, str):
        raise ConfigError(f"secret_file must be a path, not a {type(path).__name__}")
    try:
        with open(path, "rb") as file:
            secret = file.read().strip()
            mode = os.fstat(file.fileno()).st_mode
    except OSError as error:
        raise ConfigError(f"secret file {path}: {error.strerror or error}") from None
    if not secret:
        raise ConfigError(f"secret file {path} is empty")
    if mode & 0o077:
        logger.warning(
            "kvpush: secret file %s can be read by other users (mode %o); chmod 600 it",
            path,
            mode & 0o777,
        )
    return secret


def _flag(value: object) -> bool:
    """A boolean option given as JSON (true/false) or as an environment string (1/true/yes)."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


#: The longest ``idle_wait_ms`` accepted: a step that computes nothing waits at most this long.
MAX_IDLE_WAIT_MS = 50.0
#: ``idle_wait_ms: "auto"`` in an engine of several workers (s).
SEVERAL_WORKERS_IDLE_WAIT = 0.002


def idle_wait(value: object, several_workers: bool) -> float:
    """``idle_wait_ms`` in seconds. ``"auto"``: 2 ms where the engine has several workers (tensor
    or pipeline parallel), none otherwise. vLLM's engine loop sleeps 1 ms after a step that
    computes nothing (``EngineCore._process_engine_step``, vLLM 0.32), and a wait here holds a
    request that arrives meanwhile (``kvpush bench engine``; on real one-worker CPU servers,
    which vLLM runs in a process of their own, waiting cost D 2.1 ms per idle step and bought
    nothing in TTFT or handover, ``kvpush bench engine --servers``); several workers in their
    own processes spin on ``sched_yield`` in vLLM's shared-memory queue and collectives between
    steps, and there the wait kept a P of two ranks from starving its writer threads for
    seconds on a small host (tests/e2e/test_kvpush_tp.py). Anything but ``"auto"`` or a number of
    milliseconds in [0, 50] is refused, naming the key."""
    if value == "auto":
        return SEVERAL_WORKERS_IDLE_WAIT if several_workers else 0.0
    try:
        milliseconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        milliseconds = math.nan
    if isinstance(value, bool) or not 0.0 <= milliseconds <= MAX_IDLE_WAIT_MS:
        raise ConfigError(
            f'kv_connector_extra_config.idle_wait_ms must be "auto" or a number of milliseconds '
            f"from 0 to {MAX_IDLE_WAIT_MS:g}, not {value!r}"
        )
    return milliseconds / 1000.0


#: What ``layerwise`` may be.
LAYERWISE_MODES = ("off", "on", "auto")
#: ``layerwise: "auto"`` streams a request whose prompt has at least this many tokens: below
#: it, one WRITE per layer costs more than the overlap saves (SGLang measured layer-pipelined
#: transfer slower at 256 tokens, faster from 1k on; sglang#23515).
LAYERWISE_AUTO_MIN_TOKENS = 512


def layerwise(value: object) -> str:
    """``layerwise``: ``"off"`` (P writes a request's KV once its prefill is done), ``"on"``
    (P writes each layer's KV as soon as the layer ran in the step that ends the prefill, where
    D registered already; the request's last WRITE then carries the layers left and the DONE)
    or ``"auto"`` (``"on"`` for prompts of at least :data:`LAYERWISE_AUTO_MIN_TOKENS` tokens).
    Anything else is refused at startup, naming the key and its values."""
    if isinstance(value, str) and value in LAYERWISE_MODES:
        return value
    raise ConfigError(
        f"kv_connector_extra_config.layerwise must be one of "
        f"{', '.join(repr(mode) for mode in LAYERWISE_MODES)}, not {value!r}"
    )


def _several_workers(vllm_config: VllmConfig) -> bool:
    """Whether the engine runs several workers (tensor or pipeline parallel)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return int(getattr(parallel, "world_size", 1) or 1) > 1


def worker_config(vllm_config: VllmConfig) -> WorkerConfig:
    """A worker's configuration: vLLM's ``kv_transfer_config`` and its extra options, the
    environment, and the defaults."""
    transfer = vllm_config.kv_transfer_config
    extra = transfer.kv_connector_extra_config or {}
    model = vllm_config.model_config
    return WorkerConfig(
        engine_id=str(transfer.engine_id),
        side_channel_host=str(
            extra.get("side_channel_host")
            or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
        ),
        side_channel_port=int(
            extra.get("side_channel_port") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 5600
        ),
        secret=load_secret(extra, os.environ),
        insecure=_flag(extra.get("insecure", os.environ.get("KVPUSH_INSECURE", ""))),
        ttl=float(extra.get("kv_lease_duration", 30.0)),
        write_timeout=float(extra.get("write_timeout", 10.0)),
        peer_timeout=float(extra.get("peer_timeout", 5.0)),
        heartbeat_interval=float(extra.get("heartbeat_interval", 1.0)),
        max_connections=int(extra.get("max_connections", 256)),
        max_connections_per_host=int(extra.get("max_connections_per_host", 32)),
        max_handshakes=int(extra.get("max_handshakes", 16)),
        receive_timeout=float(extra.get("receive_timeout", 120.0)),
        idle_wait=idle_wait(extra.get("idle_wait_ms", "auto"), _several_workers(vllm_config)),
        layerwise=layerwise(extra.get("layerwise", "off")),
        transport=str(extra.get("transport", "nixl")),
        model_fingerprint=f"{model.model}|{model.dtype}|{vllm_config.cache_config.cache_dtype}",
    )


def identity(vllm_config: VllmConfig) -> dict[str, Any]:
    """What a router needs to send D to this engine as P: the fields of vLLM's push contract."""
    worker = worker_config(vllm_config)
    parallel = vllm_config.parallel_config
    return {
        "remote_engine_id": worker.engine_id,
        "remote_host": worker.side_channel_host,
        "remote_port": worker.side_channel_port,
        "tp_size": parallel.tensor_parallel_size,
        "pp_size": parallel.pipeline_parallel_size,
    }


#: When set, each worker appends one JSON line per finished transfer to
#: ``$KVPUSH_TIMELINE_DIR/<engine>-tp<rank>.jsonl`` (``kvpush demo`` reads them).
TIMELINE_DIR_ENV = "KVPUSH_TIMELINE_DIR"


def timeline_dir() -> Path | None:
    """Where the worker writes its timelines (``KVPUSH_TIMELINE_DIR``), or None."""
    value = os.environ.get(TIMELINE_DIR_ENV)
    return Path(value) if value else None


#: CPUs for the endpoint's native threads (writer, side channel, NIXL's): ``inherit`` keeps the
#: creating thread's affinity, a list such as ``2,3`` or ``4-7`` names them. Unset: the CPUs the
#: engine process was allowed (see :func:`native_thread_cpus`).
THREAD_CPUS_ENV = "KVPUSH_THREAD_CPUS"


def cpu_list(text: str) -> set[int]:
    """CPUs written as Linux lists them: ``0``, ``2,3``, ``4-7``, ``0,2-3``."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def native_thread_cpus() -> set[int] | None:
    """Where the endpoint's threads should run, or None to leave them where they are born.

    vLLM's CPU worker pins the thread that runs the forward pass to one core (each OpenMP thread
    to its own); threads it starts inherit that, so a writer born there would wait for the
    forward pass to yield the core before it could post a WRITE. The native threads get the CPUs
    the engine process (the worker's parent, or the process itself with vLLM's in-process
    executor) was allowed instead: the operator's own pinning (``taskset``, cgroups) still holds.
    """
    configured = os.environ.get(THREAD_CPUS_ENV, "").strip()
    if configured == "inherit":
        return None
    if configured:
        try:
            return cpu_list(configured)
        except ValueError:
            raise KvPushError(
                f"{THREAD_CPUS_ENV}={configured!r}: expected 'inherit' or CPUs like '2,3' or '4-7'"
            ) from None
    current = os.sched_getaffinity(0)
    parent = os.getppid()
    if parent <= 1:
        return None  # orphaned (or a container's first process): no engine to take CPUs from
    try:
        engine = os.sched_getaffinity(parent) | os.sched_getaffinity(os.getpid())
    except OSError:
        return None
    return engine if not engine <= current else None
