"""The connector's scheduler-side bookkeeping, in plain Python (no vLLM import).

The scheduler decides, per request, what the workers must do; the workers' native endpoints do
it. What crosses from the scheduler to the workers each step is a
:class:`~kvpush.vllm.metadata.PushMetadata` (:mod:`kvpush.vllm.metadata` says what each of its
lists asks).

kv_transfer_params are vLLM's push-proxy contract (``do_remote_prefill``, ``do_remote_decode``,
``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``, ``pp_size``,
``remote_request_id``, ``transfer_id``), so an unchanged push router drives kvpush; every hook
reads them through :func:`kvpush.vllm._params.parse_params`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvpush.vllm._layout import NULL_BLOCK, CacheGroups, window_start
from kvpush.vllm._params import Refused, RemoteDecode, TransferParams, parse_params
from kvpush.vllm.config import LAYERWISE_AUTO_MIN_TOKENS
from kvpush.vllm.metadata import PushMetadata, RecvRefused, RecvRequest, SendRequest

logger = logging.getLogger("vllm.kvpush")

#: Requests whose read kv_transfer_params are kept at most (each entry goes when its request
#: finishes; past this many, all go, and are read again).
MAX_READ_PARAMS = 65_536


class PushScheduler:
    """Per-request decisions of the scheduler role (P and D alike: a ``kv_both`` engine is
    both).

    Nothing here raises into vLLM's scheduler for one request's sake: kv_transfer_params are
    read by :func:`parse_params` (a bad request is refused with the reason), and each hook's
    failure, whatever its cause, has a handler here (``*_failed``) that the connector calls, so
    that the request alone prefills locally or fails. State changes come last in every method,
    after everything that could raise.
    """

    def __init__(
        self,
        identity: Mapping[str, Any] | None = None,
        groups: CacheGroups | None = None,
        layerwise: str = "off",
    ) -> None:
        #: The KV cache groups vLLM hands block lists for (None: one group, all of the cache).
        self._groups = groups
        #: Layer-wise push (``config.layerwise``): which prefills' layers stream.
        self._layerwise = layerwise
        #: P, layer-wise push: prompts computed over several steps, with their blocks so far
        #: (per group) and their length, until the step of their last chunk.
        self._chunked: dict[str, tuple[list[list[int]], int]] = {}
        #: P, layer-wise push: per streamed request of a model with a window that frees blocks
        #: as the prompt's chunks go (sliding window, local attention chunks), each group's first
        #: token of the blocks vLLM keeps until the request finishes (``CacheGroups.kept_from``).
        #: Its streams and its send list each group's blocks from there, never a freed one.
        self._kept: dict[str, tuple[int, ...]] = {}
        #: P, layer-wise push: requests a step's streams named (their layers may have gone to D
        #: with WRITEs still in flight), until they finish.
        self._streamed: set[str] = set()
        #: P's identity, returned with every finished prefill's kv_transfer_params (engine id,
        #: side-channel host and base port, TP and PP sizes): a router that learns P from its
        #: answer (llm-d's push dispatch) forwards them to D, which needs nothing else.
        self._identity = dict(identity or {})
        self._pending = PushMetadata()
        self._sending: set[str] = set()
        self._receiving: set[str] = set()
        #: D: requests whose remote prefill is settled (registered once, refused, failed, or
        #: not needed after all): asked again (vLLM retries a request it could not schedule,
        #: re-admits a preempted or recomputed one), they match nothing and log nothing, even
        #: where their params cannot be marked (``do_remote_prefill`` cleared). Until the
        #: request finishes.
        self._settled: set[str] = set()
        #: Each request's kv_transfer_params as last read, and what they read as: vLLM hands
        #: them to four or five hooks per request, unchanged unless kvpush changed them.
        self._read: dict[str, tuple[dict[Any, Any], TransferParams]] = {}

    def _params(self, request_id: str, params: object) -> TransferParams:
        """:func:`parse_params` of ``params``, read once while they stay as they were: a JSON
        object's values are immutable, so an equal copy means the same answer."""
        seen = self._read.get(request_id)
        if seen is not None and type(params) is dict and seen[0] == params:
            return seen[1]
        parsed = parse_params(params)
        if type(params) is dict:
            if len(self._read) >= MAX_READ_PARAMS:
                self._read.clear()  # never reached by requests that finish; a bound regardless
            self._read[request_id] = (dict(params), parsed)
        return parsed

    # ---- every request ----------------------------------------------------------------------

    def admit(self, request_id: str, params: object) -> bool:
        """A new request: False when its kv_transfer_params are no object at all, which vLLM's
        own scheduler reads as a dict right after this (``.get``): the request then goes on
        without them, as a plain one, and the refusal is logged once."""
        if params is None or isinstance(params, Mapping):
            return True
        refused = self._params(request_id, params).remote_prefill
        reason = refused.reason if isinstance(refused, Refused) else "not an object"
        logger.warning(
            "kvpush: request %s: %s; serving it as a request without them", request_id, reason
        )
        return False

    def admit_failed(self, request_id: str, error: Exception) -> None:
        """``on_new_request`` failed for this request: it goes on, its params as they are."""
        logger.error("kvpush: request %s: %s", request_id, _unexpected(error), exc_info=error)

    # ---- D --------------------------------------------------------------------------------

    def external_tokens(
        self,
        request_id: str,
        params: object,
        prompt_tokens: int,
        num_computed: int,
    ) -> tuple[int, bool]:
        """How many prompt tokens P will write (loaded asynchronously), after D's local hit.

        A remote prefill whose kv_transfer_params kvpush refuses (:func:`parse_params`) falls
        back to a local prefill (0 tokens from P), logged once with the request and the reason:
        vLLM's contract lets a connector match nothing, and one bad request must not stop the
        others.
        """
        if request_id in self._settled:
            return 0, False
        asked = self._params(request_id, params).remote_prefill
        if asked is None:
            return 0, False
        if isinstance(asked, Refused):
            self._prefill_locally(request_id, params, asked.reason)
            return 0, False
        count = prompt_tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def match_failed(self, request_id: str, params: object, error: Exception) -> tuple[int, bool]:
        """``get_num_new_matched_tokens`` failed for this request: it prefills locally."""
        self._prefill_locally(request_id, params, _unexpected(error), error)
        return 0, False

    def allocated(
        self,
        request_id: str,
        params: object,
        uncached_blocks: Sequence[Sequence[int]],
        num_computed: int,
        prompt_tokens: int,
        num_external: int,
    ) -> None:
        """D's blocks for a remote prefill are allocated: register them with P this step.

        ``params["do_remote_prefill"]`` is cleared so a re-entry (preemption) never registers
        twice with the same epoch. vLLM waits for the KV of every request it allocated external
        tokens for: one that cannot be registered is refused to the workers
        (:class:`RecvRefused`), which report it failed.
        """
        asked = self._params(request_id, params).remote_prefill
        if asked is None or request_id in self._settled:
            return
        if num_external <= 0:
            # Nothing to load after all (a local hit covered it, or vLLM trimmed the match):
            # the request computes its prompt here, now and after any preemption.
            self._settle(request_id, params)
            return
        if isinstance(asked, Refused):
            self._refuse_recv(request_id, params, uncached_blocks, asked.reason)
            return
        blocks = self._moved(uncached_blocks)
        recv = RecvRequest(
            request_id=request_id,
            transfer_id=asked.transfer_id,
            remote_host=asked.host,
            remote_port=asked.port,
            remote_tp_size=asked.tp_size,
            blocks=blocks,
            first_token=num_computed,
            num_tokens=prompt_tokens,
            first_tokens=self._uncached_starts(blocks, num_computed, prompt_tokens),
        )
        self._settle(request_id, params)
        self._receiving.add(request_id)
        self._pending.recvs.append(recv)

    def alloc_failed(
        self,
        request_id: str,
        params: object,
        num_external: int,
        error: Exception,
        uncached_blocks: Sequence[Sequence[int]] = (),
    ) -> None:
        """``update_state_after_alloc`` failed for this request: if vLLM waits for its KV, the
        workers report the receive failed; otherwise it prefills locally."""
        if request_id in self._receiving:
            logger.error(
                "kvpush: request %s: %s after its registration was queued; it stands",
                request_id,
                _unexpected(error),
                exc_info=error,
            )
            return
        if num_external > 0:
            self._refuse_recv(request_id, params, uncached_blocks, _unexpected(error), error)
        else:
            self._prefill_locally(request_id, params, _unexpected(error), error)

    def _prefill_locally(
        self, request_id: str, params: object, reason: str, error: Exception | None = None
    ) -> None:
        if request_id not in self._settled:
            logger.warning(
                "kvpush: request %s: %s; prefilling it locally instead",
                request_id,
                reason,
                exc_info=error,
            )
        self._settle(request_id, params)

    def _refuse_recv(
        self,
        request_id: str,
        params: object,
        uncached_blocks: Sequence[Sequence[int]],
        reason: str,
        error: Exception | None = None,
    ) -> None:
        try:
            blocks = tuple(int(b) for group in uncached_blocks for b in group)
        except Exception:  # vLLM's lists; the failure is reported without them
            blocks = ()
        logger.warning(
            "kvpush: request %s: %s; its KV load fails, and vLLM's kv_load_failure_policy "
            "decides (recompute: prefilled locally; fail: an error for this request)",
            request_id,
            reason,
            exc_info=error,
        )
        self._settle(request_id, params)
        self._pending.refused.append(RecvRefused(request_id, blocks, reason))

    def _settle(self, request_id: str, params: object) -> None:
        """The request's remote prefill is over: it computes what it lacks here from now on."""
        self._settled.add(request_id)
        _clear_remote_prefill(params)

    def _moved(self, block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        if self._groups is None:
            return tuple(tuple(group) for group in block_ids)
        return self._groups.select(block_ids)

    def _uncached_starts(
        self, blocks: tuple[tuple[int, ...], ...], num_computed: int, prompt_tokens: int
    ) -> tuple[int, ...]:
        """D: the first token of each group's uncached blocks. vLLM lists a group's blocks for
        ``[num_computed, prompt)``, except that a sliding-window group lacks those before its
        window (null blocks, left out of the list): its blocks are the prompt's last ones."""
        groups = self._groups
        if groups is None:
            return (num_computed,) * len(blocks)
        size = groups.block_size
        starts = []
        for windowed, group in zip(groups.windowed, blocks, strict=True):
            whole = -(-(prompt_tokens - num_computed) // size)
            if windowed and len(group) < whole:
                # A count that fits neither case is left to the planner, which refuses it.
                starts.append((-(-prompt_tokens // size) - len(group)) * size)
            else:
                starts.append(num_computed)
        return tuple(starts)

    # ---- P, and D's aborts ----------------------------------------------------------------

    def finished(
        self,
        request_id: str,
        params: object,
        finished_normally: bool,
        blocks: Sequence[Sequence[int]],
        prompt_tokens: int,
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished; returns vLLM's ``(delay_free_blocks, kv_transfer_params)``.

        P offers the KV of a prefill that finished normally to D, keeping its blocks until the
        workers report the send over; a prefill that ended otherwise is aborted (D is told).
        """
        refused_before = request_id in self._settled
        streamed = request_id in self._streamed
        kept = self._kept.pop(request_id, None)
        self._settled.discard(request_id)
        self._chunked.pop(request_id, None)
        self._streamed.discard(request_id)
        read = self._read.pop(request_id, None)
        if request_id in self._receiving:
            # D: aborted while waiting for its KV. vLLM keeps the blocks until the workers
            # report the receive finished, which they do once P confirmed the cancel.
            self._pending.cancels.append(request_id)
            return False, None
        fresh = read is not None and type(params) is dict and read[0] == params
        parsed = read[1] if read is not None and fresh else parse_params(params)
        asked = parsed.remote_decode
        if asked is None:
            return False, None
        if isinstance(asked, Refused):
            # Params that are no object at all were refused, and logged, as a remote prefill.
            if not (refused_before and parsed.remote_prefill == asked):
                logger.warning(
                    "kvpush: request %s: %s; its KV is not offered to D", request_id, asked.reason
                )
            return False, None
        transfer_id = asked.transfer_id
        if streamed and any(blocks) and not finished_normally:
            # Aborted mid-stream: a layer's WRITE may still read its blocks, so vLLM keeps
            # them until the workers report the abort settled (as a send finished).
            self._pending.stream_aborts.append((request_id, transfer_id))
            self._sending.add(request_id)
            return True, None
        if not finished_normally or not any(blocks):
            self._pending.aborts.append((request_id, transfer_id))
            return False, None
        send = self._send(request_id, transfer_id, blocks, prompt_tokens, kept)
        answer = {
            **self._identity,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_mode": "push",
            **({"transfer_id": transfer_id} if transfer_id else {}),
        }
        self._sending.add(request_id)
        self._pending.sends.append(send)
        return True, answer

    def _send(
        self,
        request_id: str,
        transfer_id: str | None,
        blocks: Sequence[Sequence[int]],
        prompt_tokens: int,
        kept: Sequence[int] | None = None,
    ) -> SendRequest:
        """P's KV of a prompt in ``blocks`` (vLLM's lists, every group), as sent to D: each
        group's blocks from its first token ``kept`` on, where given."""
        moved = self._moved(blocks)
        if self._groups is None:
            first_tokens: tuple[int, ...] = ()
        else:
            # vLLM's null block stands for the blocks a sliding window dropped: never sent (any
            # group: a null block is never KV), the group's list starts after them.
            size = self._groups.block_size
            starts = [window_start(group, size) for group in moved]
            if kept is not None:
                starts = [
                    (first, ids) if first >= keep else (keep, ids[(keep - first) // size :])
                    for (first, ids), keep in zip(starts, kept, strict=True)
                ]
            first_tokens = tuple(start for start, _ in starts)
            moved = tuple(ids for _, ids in starts)
        return SendRequest(
            request_id=request_id,
            transfer_id=transfer_id,
            blocks=moved,
            num_tokens=prompt_tokens,
            first_tokens=first_tokens,
        )

    @property
    def streams_layers(self) -> bool:
        """Whether any prefill may stream by layer (``layerwise`` is not off)."""
        return self._layerwise != "off"

    def prefill_ends(
        self,
        request_id: str,
        blocks: Sequence[Sequence[int]],
        prompt_tokens: int,
        num_computed: int,
        num_scheduled: int,
        max_tokens: int | None = None,
    ) -> None:
        """P, layer-wise push: a request scheduled in this step for the first time, with its
        blocks. When the step computes the rest of its prompt, its KV goes in this step's
        ``streams`` (as :meth:`finished` will send it), so that the workers stream each layer as
        it runs. A prompt chunked over several steps streams chunk by chunk (here and in
        :meth:`prefill_continues`): each step's stream is the prompt's KV so far, its tokens
        before the chunk's end in the blocks that hold them (only the last chunk, with the whole
        prompt's KV, where the block size is not known).

        A sliding window (or local attention chunks) frees a group's blocks before the window as
        the request computes, possibly while a WRITE of an earlier step still reads them. So the
        streams and the send list such a group's blocks only from the first one vLLM keeps until
        the request ends, computing ``max_tokens`` tokens at most (the tokens D's window needs
        start there or later). Where that is not known (no ``max_tokens``, a window kvpush does
        not know), a chunked prompt goes whole."""
        asked = self._streamed_decode(request_id, prompt_tokens)
        if asked is None or not any(blocks):
            return
        windowed = self._groups is not None and self._groups.any_windowed
        kept = None
        if self._groups is not None and windowed and max_tokens is not None:
            # The most tokens computed before any step that frees blocks: the prompt but its
            # last token and the output but its last.
            kept = self._groups.kept_from(prompt_tokens + max(max_tokens, 1) - 2)
        if kept is not None:
            self._kept[request_id] = kept
        # At or past the prompt's end (a resumed request recomputes its output tokens too):
        # every prompt token's KV of a layer is final once this step ran the layer.
        end = num_computed + num_scheduled
        if end >= prompt_tokens:
            self._stream(self._send(request_id, asked.transfer_id, blocks, prompt_tokens, kept))
        elif not windowed or kept is not None:
            self._chunked[request_id] = ([list(group) for group in blocks], prompt_tokens)
            self._stream_chunk(request_id, asked, blocks, end)

    def prefill_continues(
        self,
        request_id: str,
        new_blocks: Sequence[Sequence[int]] | None,
        resumed: bool,
        num_computed: int,
        num_scheduled: int,
    ) -> None:
        """P, layer-wise push: a request scheduled again (vLLM's cached request data: the blocks
        added for this step, or all of them when it resumed after a preemption). A chunked
        prompt goes in the step's ``streams``: its KV so far, or all of it in the step of its
        last chunk."""
        chunked = self._chunked.get(request_id)
        if chunked is None:
            return
        blocks, prompt_tokens = chunked
        if resumed:
            blocks = [list(group) for group in new_blocks or ()]
        elif new_blocks is not None:
            for group, added in zip(blocks, new_blocks, strict=True):
                group.extend(added)
        end = num_computed + num_scheduled
        if end < prompt_tokens:
            self._chunked[request_id] = (blocks, prompt_tokens)
            asked = self._streamed_decode(request_id, prompt_tokens)
            if asked is not None and num_scheduled > 0:
                self._stream_chunk(request_id, asked, blocks, end)
            return
        del self._chunked[request_id]
        asked = self._streamed_decode(request_id, prompt_tokens)
        if asked is not None and any(blocks):
            kept = self._kept.get(request_id)
            self._stream(self._send(request_id, asked.transfer_id, blocks, prompt_tokens, kept))

    def _stream_chunk(
        self,
        request_id: str,
        asked: RemoteDecode,
        blocks: Sequence[Sequence[int]],
        end: int,
    ) -> None:
        """A chunk of a prompt computed over several steps ends at token ``end`` in this step:
        the KV of the tokens before it, in the blocks that hold them, streams (each layer's once
        the step ran it). Not where the block size is unknown."""
        if self._groups is None or end <= 0:
            return
        count = -(-end // self._groups.block_size)
        chunk = [list(group[:count]) for group in blocks]
        send = self._send(request_id, asked.transfer_id, chunk, end, self._kept.get(request_id))
        # The connector's copy of a group's blocks does not see vLLM free them: a null block
        # past the kept ones would mean it freed one anyway, and the chunk waits for the rest.
        if any(send.blocks) and all(NULL_BLOCK not in group for group in send.blocks):
            self._stream(send)

    def _stream(self, send: SendRequest) -> None:
        self._pending.streams.append(send)
        self._streamed.add(send.request_id)

    def _streamed_decode(self, request_id: str, prompt_tokens: int) -> RemoteDecode | None:
        """The remote decode a prompt of ``prompt_tokens`` streams for, if ``layerwise`` says
        it streams."""
        mode = self._layerwise
        if mode == "off" or (mode == "auto" and prompt_tokens < LAYERWISE_AUTO_MIN_TOKENS):
            return None
        read = self._read.get(request_id)
        asked = None if read is None else read[1].remote_decode
        return asked if isinstance(asked, RemoteDecode) else None

    def finish_failed(
        self, request_id: str, params: object, error: Exception
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` failed for this request: nothing is sent, its blocks are freed
        (P; D is told when the transfer id is known), or kept until the cancel is confirmed
        (D, waiting for its KV)."""
        self._settled.discard(request_id)
        self._chunked.pop(request_id, None)
        self._kept.pop(request_id, None)
        self._streamed.discard(request_id)
        self._read.pop(request_id, None)
        if request_id in self._receiving:
            self._pending.cancels.append(request_id)
            return False, None
        asked = parse_params(params).remote_decode
        told = ""
        if isinstance(asked, RemoteDecode):
            self._pending.aborts.append((request_id, asked.transfer_id))
            told = "; D is told"
        logger.error(
            "kvpush: request %s: %s; its KV is not sent%s",
            request_id,
            _unexpected(error),
            told,
            exc_info=error,
        )
        return False, None

    # ---- every step -----------------------------------------------------------------------

    def take_metadata(self, idle: bool = False) -> PushMetadata:
        """This step's instructions (``idle``: the step computes nothing); the next step starts
        empty."""
        metadata, self._pending = self._pending, PushMetadata()
        metadata.idle = idle
        return metadata

    def transfers_finished(self, sending: set[str], recving: set[str]) -> None:
        """The workers reported these sends and receives over."""
        self._sending -= sending
        self._receiving -= recving

    def has_pending_work(self) -> bool:
        """True while sends are unfinished: the engine must keep stepping to report them."""
        return bool(self._sending or self._pending)


def _clear_remote_prefill(params: object) -> None:
    """Marks a request's remote prefill as handled, as vLLM's NIXL connectors do (a router
    reading the request back sees it was not a pending remote prefill)."""
    if isinstance(params, dict) and params.get("do_remote_prefill", False) is not False:
        params["do_remote_prefill"] = False


def _unexpected(error: BaseException) -> str:
    """A hook's unexpected failure, for the request's log line (the traceback follows it)."""
    detail = str(error)
    if len(detail) > 300:
        detail = detail[:297] + "..."
    return f"kvpush failed on it ({type(error).__name__}: {detail}); please report this"
