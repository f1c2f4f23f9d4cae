"""vLLM OpenAI servers as subprocesses: start, watch, query, stop, clean up.

Owns what it takes to run vLLM servers beside kvpush on one machine (``docs/vllm-cpu.md``),
with the standard library and prometheus_client (kvpush does not depend on vLLM; the servers
run in the interpreter that has it, by default this one):

* :class:`VllmServer`: one ``python -m vllm.entrypoints.openai.api_server`` with the CPU
  settings that work (fp32, eager, a 1 GiB KV cache, OpenMP pinned to one core, its own NIXL
  side-channel port), its output in a log file whose first lines are the command and the
  environment it was given, in its own process group;
* :func:`wait_healthy`: waits for several servers at once, reporting each one's start-up phase
  (read from its log) to a callback, and fails with the log's tail when one dies or hangs;
* :meth:`VllmServer.stop`: SIGTERM to the group, SIGKILL after a grace period, and
  :func:`clean_shm`: ``/dev/shm`` entries the servers left behind that nothing uses any more;
* :func:`parse_metrics` / :func:`metric_value`: Prometheus counters from ``/metrics``
  (prometheus_client's parser).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
SHM = Path("/dev/shm")

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def cpu_list(text: str) -> set[int]:
    """CPUs written as Linux (and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``) lists them: ``0``,
    ``2,3``, ``4-7``, ``0,2-3``."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


#: Shown instead of a secret in logs.
REDACTED = "<redacted>"


def redact_value(name: str, value: str) -> str:
    """``value``, unless the variable ``name`` holds a secret (KVPUSH_SECRET, *_TOKEN, ...)."""
    upper = name.upper()
    return REDACTED if any(word in upper for word in ("SECRET", "TOKEN", "PASSWORD")) else value


def _redact_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: REDACTED if str(k).lower() in {"secret", "token", "password"} else _redact_json(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    return value


def redact_command(args: list[str]) -> list[str]:
    """``args`` as they may be logged: secrets inside JSON-valued flags (a connector's extra
    config holding a ``secret``, ``token`` or ``password``; kvpush's refuses one and takes it
    from the environment) replaced by :data:`REDACTED`."""
    shown = []
    for arg in args:
        try:
            parsed = json.loads(arg) if arg.startswith("{") else None
        except ValueError:
            parsed = None
        shown.append(arg if parsed is None else json.dumps(_redact_json(parsed)))
    return shown


#: Start-up milestones in a vLLM 0.32 server's log, latest first: the phase a server is in is
#: the first of these its log contains (before any: the interpreter is importing vLLM).
PHASES: tuple[tuple[str, str], ...] = (
    ("Starting vLLM server on", "API server up"),
    ("init engine (profile, create kv cache, warmup model) took", "engine ready"),
    ("Creating v1 connector", "KV cache + connector"),
    ("Loading weights took", "weights loaded"),
    ("Starting to load model", "loading model"),
    ("Initializing a V1 LLM engine", "starting engine"),
)
IMPORTING = "importing vLLM"
# A traceback's last line (vLLM prefixes its own lines with "(EngineCore pid=N) ERROR ...").
_EXCEPTION_LINE = re.compile(r"(?:^|\] )\s*(?P<exception>[\w.]+(?:Error|Exception): .*)$")


class ServerError(RuntimeError):
    """A server that exited, did not become healthy in time, or answered with an error."""


#: Ports a server's workers listen on above its side-channel port (``port + tp_rank``).
PORT_SPAN = 8


def free_port(span: int = PORT_SPAN) -> int:
    """A port that, with the ``span - 1`` above it, nothing listens on right now.

    Chosen below the kernel's ephemeral range (``ip_local_port_range``): vLLM, ZeroMQ and UCX
    take their own ports with ``bind(0)`` from that range while the servers start, and one of
    them could take a port picked here from the same range before its server binds it (the
    server then dies with "address already in use"). Falls back to the kernel's choice when the
    range leaves no room below it.
    """
    low = _ephemeral_low()
    candidates = list(range(max(1024, low - 16384), low - span))
    random.shuffle(candidates)
    for port in candidates[:256]:
        if all(_bindable(p) for p in range(port, port + span)):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


@dataclass
class VllmServer:
    """One vLLM OpenAI-compatible server process.

    ``cpu`` is the core its OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's
    ``auto`` puts every server on core 0). With ``confined`` (the default) the whole server, API
    server, engine core and worker, may run on ``cpu`` only, as if each server had a host of its
    own: otherwise a decode server's engine loop, which steps without pause while a request
    waits for its KV, takes CPU from the prefill server's forward pass on a small machine.
    ``kv_transfer_config`` goes to ``--kv-transfer-config`` as JSON; ``side_channel_port`` is
    ``VLLM_NIXL_SIDE_CHANNEL_PORT``, where a push connector's worker listens. ``python`` must be
    an interpreter with vLLM.
    """

    name: str
    model: Path
    log_dir: Path
    cpu: str = "0"
    port: int = field(default_factory=free_port)
    side_channel_port: int = field(default_factory=free_port)
    kv_transfer_config: Mapping[str, Any] | None = None
    max_model_len: int = 4096
    block_size: int | None = None
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable
    confined: bool = True

    process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    started_at: float = field(default=0.0, init=False, repr=False)
    ready_after_s: float | None = field(default=None, init=False)
    _shm_before: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--disable-uvicorn-access-log",
        ]
        if self.block_size is not None:
            args += ["--block-size", str(self.block_size)]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(dict(self.kv_transfer_config))]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """This process's environment plus what the server needs; ``extra_env`` wins."""
        env = dict(os.environ)
        env.update(self.server_environment())
        return env

    def server_environment(self) -> dict[str, str]:
        """Only the variables this class sets (logged at the top of the log file)."""
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": self.cpu,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "VLLM_HOST_IP": HOST,
            "UCX_NET_DEVICES": "lo",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Launch the server in its own process group; its output goes to :attr:`log_path`.

        Call from the thread that will outlive the server (the main thread): on Linux the
        server gets SIGTERM when that thread's process dies, so a killed caller leaves nothing.
        """
        if self.process is not None:
            raise ServerError(f"{self.name}: already started (pid {self.process.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._shm_before = shm_entries()
        settings = " ".join(
            f"{k}={redact_value(k, v)}" for k, v in sorted(self.server_environment().items())
        )
        with self.log_path.open("wb") as log:
            confined = f"\n# confined to CPUs {self.cpu}" if self.confined else ""
            shown = " ".join(redact_command(self.command()))
            log.write(f"# {shown}\n# {settings}{confined}\n".encode())
            log.flush()
            self.started_at = time.monotonic()
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=functools.partial(
                    _prepare_child, self.cpus() if self.confined else None
                ),
            )

    def cpus(self) -> set[int]:
        """Every CPU of :attr:`cpu`, whose tensor parallel ranks vLLM separates with ``|``."""
        return set().union(*(cpu_list(rank) for rank in self.cpu.split("|")))

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def exit_code(self) -> int | None:
        """The server's exit status, or None while it runs (or before it started)."""
        return None if self.process is None else self.process.poll()

    def is_healthy(self) -> bool:
        """One ``GET /health`` (2 s timeout); records :attr:`ready_after_s` the first time."""
        try:
            status, _ = self.request("GET", "/health", timeout_s=2.0)
        except (OSError, http.client.HTTPException):
            return False
        if status == 200 and self.ready_after_s is None:
            self.ready_after_s = time.monotonic() - self.started_at
        return status == 200

    def phase(self) -> str:
        """Where start-up is, read from the log (:data:`PHASES`)."""
        text = self.log_text()
        for marker, phase in PHASES:
            if marker in text:
                return phase
        return IMPORTING

    def stop(self, grace_s: float = 20.0, *, clean: bool = True) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; returns the exit status.

        ``clean`` then removes this server's ``/dev/shm`` leftovers. A caller stopping several
        servers passes ``clean=False`` and calls :func:`clean_shm` once after the last: one
        server's files are still in use while another of the same family runs.
        """
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                signal_group(process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(10.0)
        # The engine core and worker children share the group; make sure none outlived it.
        signal_group(process.pid, signal.SIGKILL)
        if clean:
            clean_shm(self._shm_before)
        return process.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def first_error(self) -> str | None:
        """The log's first exception line (``SomethingError: ...``): vLLM's last lines only
        say "see root cause above"."""
        for line in self.log_text().splitlines():
            match = _EXCEPTION_LINE.search(line)
            if match:
                return match.group("exception").strip()
        return None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self) -> Metrics:
        status, payload = self.request("GET", "/metrics")
        if status != 200:
            raise ServerError(f"{self.name}: GET /metrics -> {status}")
        return parse_metrics(payload.decode())

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> tuple[int, bytes]:
        """One HTTP request to the server; returns the status and the whole body."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout_s)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(
                method,
                path,
                body=data,
                headers={"Content-Type": "application/json", **(headers or {})},
            )
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()


@dataclass(frozen=True)
class StartupState:
    """One server's state during :func:`wait_healthy`, for a progress display."""

    name: str
    phase: str
    healthy: bool
    after_s: float


def wait_healthy(
    servers: Sequence[VllmServer],
    timeout_s: float = 300.0,
    *,
    progress: Callable[[float, Sequence[StartupState]], None] | None = None,
    poll_s: float = 0.5,
) -> None:
    """Wait until every server answers ``/health`` with 200.

    ``progress(elapsed_s, states)`` is called after each poll round. Raises
    :class:`ServerError` with the log's tail as soon as one server exits, or when ``timeout_s``
    passes first.
    """
    started = time.monotonic()
    healthy: set[str] = set()
    while True:
        for server in servers:
            if server.name in healthy:
                continue
            code = server.exit_code()
            if code is not None or server.process is None:
                raise ServerError(
                    f"{server.name} exited with {code} before it was healthy; first error in "
                    f"its log: {server.first_error() or 'none found'}\n"
                    f"log {server.log_path}, last lines:\n{server.log_tail(15)}"
                )
            if server.is_healthy():
                healthy.add(server.name)
        elapsed = time.monotonic() - started
        if progress is not None:
            progress(
                elapsed,
                [
                    StartupState(
                        s.name,
                        "healthy" if s.name in healthy else s.phase(),
                        s.name in healthy,
                        s.ready_after_s if s.ready_after_s is not None else elapsed,
                    )
                    for s in servers
                ],
            )
        if len(healthy) == len(servers):
            return
        if elapsed > timeout_s:
            late = [s for s in servers if s.name not in healthy]
            raise ServerError(
                f"{', '.join(s.name for s in late)} not healthy within {timeout_s:.0f} s; "
                f"log {late[0].log_path}:\n{late[0].log_tail()}"
            )
        time.sleep(poll_s)


def stop_all(servers: Sequence[VllmServer], shm_before: set[str]) -> list[str]:
    """Stop every server (their groups together), then clean ``/dev/shm`` once."""
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            signal_group(server.process.pid, signal.SIGTERM)
    for server in servers:
        server.stop(clean=False)
    return clean_shm(shm_before)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Sends ``sig`` to process group ``pgid``; a group already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


_PR_SET_PDEATHSIG = 1


def _prepare_child(cpus: set[int] | None) -> None:
    """In the child before exec: SIGTERM when the parent dies, and confined to ``cpus`` (Linux;
    elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


# --- /dev/shm ----------------------------------------------------------------------------------


def shm_entries() -> set[str]:
    """The names under ``/dev/shm`` now (empty where there is no ``/dev/shm``)."""
    try:
        return {entry.name for entry in SHM.iterdir()}
    except OSError:
        return set()


def _shm_in_use() -> set[str]:
    """Names under /dev/shm that some live process has mapped or open."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                if " /dev/shm/" in line:
                    used.add(line.split(" /dev/shm/", 1)[1].split()[0])
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        used.add(target[len("/dev/shm/") :].split()[0])
    return used


def clean_shm(before: set[str]) -> list[str]:
    """Remove ``/dev/shm`` entries created since ``before`` that no live process uses.

    A killed server can leave its shared memory behind (vLLM's ``psm_*`` message queues).
    Entries still mapped or open are kept: they may belong to another server on this machine.
    Named semaphores (``sem.*``) are always kept: glibc maps one under a temporary name before
    linking it into place, so no process shows it as in use, and removing a live one kills the
    vLLM engine about to open it ("SemLock._rebuild: FileNotFoundError"); a leaked one is 32 B.
    """
    new = {name for name in shm_entries() - before if not name.startswith("sem.")}
    if not new:
        return []
    in_use = _shm_in_use()
    removed = []
    for name in sorted(new - in_use):
        with contextlib.suppress(OSError):
            (SHM / name).unlink()
            removed.append(name)
    return removed


# --- /metrics ----------------------------------------------------------------------------------


def parse_metrics(text: str) -> Metrics:
    """Prometheus text format to ``{(sample name, labels): value}`` (NaN samples skipped)."""
    samples: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.value == sample.value:  # not NaN
                samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return samples


def metric_value(
    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    wanted = set(labels.items())
    return sum(value for (n, ls), value in samples.items() if n == name and wanted <= ls)
