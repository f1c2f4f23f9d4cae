"""The vLLM connector's logic without vLLM: layouts from vLLM's tensor shapes, the scheduler's
bookkeeping, and two workers moving real bytes through their endpoints (loopback transport)."""

from __future__ import annotations

import ctypes
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvpush
from kvpush._native import LayerStreams, lab
from kvpush.exceptions import ConfigError, KvPushError, LayoutError
from kvpush.vllm import _stats, config
from kvpush.vllm._layers import Event
from kvpush.vllm._layout import (
    CacheGroups,
    Model,
    TensorView,
    WindowFree,
    layout_from_caches,
    views_by_group,
)
from kvpush.vllm._scheduler import PushScheduler
from kvpush.vllm._worker import PushWorker
from kvpush.vllm.config import THREAD_CPUS_ENV, WorkerConfig, load_secret
from kvpush.vllm.metadata import SendRequest
from kvpush_lab.bench.engine import worker_connector
from tests.support.layers import Events

HEADS, HEAD = 2, 4  # KV heads per rank, head size (float32)


def cpu_caches(layers: int, blocks: int, block_size: int, seed: int | None) -> list[np.ndarray]:
    """vLLM CPU attention's per-layer caches: [blocks, kv_heads, block_size, 2 * head_size]."""
    shape = (blocks, HEADS, block_size, 2 * HEAD)
    if seed is None:
        return [np.zeros(shape, np.float32) for _ in range(layers)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(layers)]


def view(a: np.ndarray) -> TensorView:
    return TensorView(a.ctypes.data, a.shape, tuple(s // a.itemsize for s in a.strides), a.itemsize)


def test_cpu_blocks_are_opaque_and_move_whole() -> None:
    caches = cpu_caches(3, 8, 32, seed=None)
    cache = layout_from_caches([view(c) for c in caches], Model(HEADS, HEAD, 32))
    layout = cache.layout
    assert cache.whole_blocks
    assert [r.base for r in layout.regions] == [c.ctypes.data for c in caches]
    assert layout.regions[0].block_stride == HEADS * 32 * 2 * HEAD * 4
    assert layout.block_tokens * layout.heads * layout.head_bytes == layout.regions[0].block_stride
    assert [cache.tokens_to_write(n) for n in (1, 32, 33, 90)] == [32, 32, 64, 96]


def test_cpu_plan_copies_every_listed_block_whole_and_nothing_else() -> None:
    p = cpu_caches(2, 16, 32, seed=1)
    d = cpu_caches(2, 16, 32, seed=None)
    model = Model(HEADS, HEAD, 32)
    src, dst = (layout_from_caches([view(c) for c in cs], model) for cs in (p, d))
    p_blocks, d_blocks = [9, 2, 14], [5, 1, 11]
    tokens = src.tokens_to_write(70)  # a partial last block still moves whole
    plan = lab.Planner(src.layout, dst.layout).plan("req", tokens, [p_blocks], [d_blocks])
    for s_addr, d_addr, n in plan.runs():
        ctypes.memmove(d_addr, s_addr, n)  # the plan's addresses are the arrays' own
    for layer in range(2):
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert np.array_equal(p[layer][pb], d[layer][db])
        untouched = [b for b in range(16) if b not in d_blocks]
        assert not d[layer][untouched].any()


def test_flash_layouts_and_unknown_shapes() -> None:
    nhd = np.zeros((2, 8, 16, HEADS, HEAD), np.float16)
    cache = layout_from_caches([view(nhd)], Model(HEADS, HEAD, 16))
    layout = cache.layout
    assert not cache.whole_blocks
    assert (layout.token_order, len(layout.regions)) == ("NHD", 2)
    assert layout.regions[1].base == nhd.ctypes.data + nhd[0].nbytes
    hnd = np.zeros((2, 8, HEADS, 16, HEAD), np.float16).transpose(0, 1, 3, 2, 4)
    assert layout_from_caches([view(hnd)], Model(HEADS, HEAD, 16)).layout.token_order == "HND"
    with pytest.raises(LayoutError, match="unsupported KV cache tensor"):
        layout_from_caches([view(np.zeros((8, 16, 3), np.float16))], Model(HEADS, HEAD, 16))


D_PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "transfer_id": "xfer-1",
}


def test_scheduler_registers_d_blocks_once_and_cancels_aborted_waits() -> None:
    sched = PushScheduler()
    params = dict(D_PARAMS)
    assert sched.external_tokens("d-1", params, prompt_tokens=100, num_computed=32) == (68, True)
    assert sched.external_tokens("d-0", {}, 100, 0) == (0, False)
    sched.allocated("d-1", params, [[4, 7]], num_computed=32, prompt_tokens=100, num_external=68)
    assert params["do_remote_prefill"] is False, "a re-entry must not register twice"
    meta = sched.take_metadata()
    (recv,) = meta.recvs
    assert (recv.first_token, recv.num_tokens, recv.blocks) == (32, 100, ((4, 7),))
    assert recv.transfer_id == "xfer-1"
    assert not sched.take_metadata(), "metadata is per step"
    assert sched.finished("d-1", params, False, [[4, 7]], 100) == (False, None)
    assert sched.take_metadata().cancels == ["d-1"]


def test_params_changed_between_hooks_are_read_again_never_answered_from_the_first_read() -> None:
    # The scheduler reads a request's params once while they stay as read; changed in place
    # between two hooks (a field now wrong), the next hook reads what they are now.
    sched = PushScheduler()
    params = dict(D_PARAMS)
    assert sched.external_tokens("d-1", params, prompt_tokens=100, num_computed=0) == (100, True)
    params["remote_port"] = 70_000
    sched.allocated("d-1", params, [[4, 7]], num_computed=0, prompt_tokens=100, num_external=100)
    (refused,) = sched.take_metadata().refused
    assert "remote_port" in refused.reason
    # And a P's params that turn valid after a first read offer the KV.
    p_params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": 5}
    assert sched.external_tokens("p-1", p_params, prompt_tokens=16, num_computed=0) == (0, False)
    p_params["transfer_id"] = "xfer-p"
    delay, answer = sched.finished("p-1", p_params, True, [[1]], 16)
    assert delay
    assert answer is not None
    assert answer["transfer_id"] == "xfer-p"


@pytest.mark.parametrize(
    ("params", "complaint"),
    [
        ({"do_remote_prefill": True, "remote_port": 5600}, "remote_host"),
        ({"do_remote_prefill": True, "remote_host": "h"}, "remote_port"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": "x"}, "must be an integer"),
        ({"do_remote_prefill": True, "remote_host": "h", "remote_port": 70_000}, "TCP port"),
        ({"do_remote_prefill": True, "remote_host": ["h"], "remote_port": 1}, "host name"),
        (
            {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "tp_size": 0},
            "tp_size",
        ),
        (
            {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "pp_size": 2},
            "pp_size 2",
        ),
        (
            {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1, "pp_size": "x"},
            "must be an integer",
        ),
    ],
)
def test_bad_params_fall_back_to_a_local_prefill_of_that_request_alone(
    params: dict[str, Any], complaint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An llm-d-style first request forwards P's answer as is; a bad one must not raise inside
    the engine's step (that kills EngineCore and every request on it)."""
    sched = PushScheduler()
    with caplog.at_level("WARNING", logger="vllm.kvpush"):
        assert sched.external_tokens("d-bad", params, 10, 0) == (0, False)
    assert complaint in caplog.text
    assert "d-bad" in caplog.text
    assert params["do_remote_prefill"] is False
    # vLLM then allocates no external tokens: nothing is registered, nothing raised.
    sched.allocated("d-bad", params, [[1]], 0, 10, 0)
    assert not sched.take_metadata()


def test_a_remote_prefill_is_settled_once_even_where_its_params_cannot_be_marked() -> None:
    """vLLM asks again for a request it re-admits (preempted, or recomputed after a failed
    load): P's KV does not come twice, so it matches nothing, whether or not its params could
    be marked (a mapping kvpush cannot write to keeps ``do_remote_prefill``)."""
    sched = PushScheduler()
    params = MappingProxyType(dict(D_PARAMS))
    assert sched.external_tokens("d-1", params, 100, 0) == (100, True)
    sched.allocated("d-1", params, [[1, 2]], 0, 100, 100)
    assert len(sched.take_metadata().recvs) == 1
    assert sched.external_tokens("d-1", params, 100, 0) == (0, False)
    sched.allocated("d-1", params, [[3]], 0, 100, 0)
    assert not sched.take_metadata()
    sched.transfers_finished(set(), {"d-1"})
    assert sched.finished("d-1", params, True, [[3]], 100) == (False, None)
    # Finished: a later request reusing the id is asked afresh.
    assert sched.external_tokens("d-1", params, 100, 0) == (100, True)


def test_scheduler_keeps_p_blocks_until_the_send_is_reported() -> None:
    sched = PushScheduler()
    params = {"do_remote_decode": True, "transfer_id": "xfer-2"}
    delay, out = sched.finished("p-1", params, True, [[1, 2, 3]], 40)
    assert delay is True
    assert out is not None
    assert sched.has_pending_work()
    (send,) = sched.take_metadata().sends
    assert (send.request_id, send.blocks, send.num_tokens) == ("p-1", ((1, 2, 3),), 40)
    sched.transfers_finished({"p-1"}, set())
    assert not sched.has_pending_work()
    assert sched.finished("p-2", dict(params), False, [[4]], 10) == (False, None)
    assert sched.take_metadata().aborts == [("p-2", "xfer-2")]


class FullAttentionSpec:
    """Stand-ins named as vLLM's spec classes (``vllm/v1/kv_cache_interface.py``): the groups
    are read by class name and attributes, without importing vLLM."""

    sliding_window: int | None = None

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size


class AttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    sliding_window = 40


class MambaSpec:
    block_size = 4096


def groups_config(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=[f"layers.{i}"], kv_cache_spec=spec)
            for i, spec in enumerate(specs)
        ]
    )


def test_p_and_d_list_a_sliding_window_group_from_its_window_on() -> None:
    groups = CacheGroups.from_vllm(groups_config(SlidingWindowSpec(32), AttentionSpec(32)))
    assert groups.windowed == (True, False)
    assert groups.frees == ((WindowFree(sliding_window=40),), ())
    # P: 150 tokens, blocks 0-2 of the window group freed (vLLM's null block 0 in their place).
    p_sched = PushScheduler(groups=groups)
    p_sched.finished("p", {"do_remote_decode": True}, True, [[0, 0, 0, 7, 8], [1, 2, 3, 4, 5]], 150)
    (send,) = p_sched.take_metadata().sends
    assert send.blocks == ((7, 8), (1, 2, 3, 4, 5))
    assert send.first_tokens == (96, 0)
    # D: no null blocks in its lists; the window group's blocks are the prompt's last two.
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9}
    d_sched = PushScheduler(groups=groups)
    d_sched.allocated("d", dict(params), [[11, 12], [13, 14, 15, 16, 17]], 0, 150, 150)
    (recv,) = d_sched.take_metadata().recvs
    assert recv.blocks == ((11, 12), (13, 14, 15, 16, 17))
    assert recv.first_tokens == (96, 0)
    # D's prefix hit of one block: both groups start after it while it is in the window.
    d_sched.allocated("d2", dict(params), [[21, 22, 23], [24, 25, 26]], 32, 100, 68)
    assert d_sched.take_metadata().recvs[0].first_tokens == (32, 32)


def test_mamba_state_and_mixed_block_sizes_are_refused_with_the_reason() -> None:
    with pytest.raises(LayoutError, match=r"group 0 \(MambaSpec.*Mamba/SSM state layers"):
        CacheGroups.from_vllm(groups_config(MambaSpec(), AttentionSpec(128)))
    with pytest.raises(LayoutError, match="different block sizes"):
        CacheGroups.from_vllm(groups_config(SlidingWindowSpec(16), AttentionSpec(32)))
    with pytest.raises(LayoutError, match="hold no attention KV blocks"):
        CacheGroups.from_vllm(groups_config(object()))


class Tensor:
    """What the connector reads of a torch tensor (``TensorView.of``), over a numpy array."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape = array, array.shape

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return int(self.array.itemsize)


def test_each_layer_region_carries_its_group() -> None:
    groups = CacheGroups.from_vllm(groups_config(SlidingWindowSpec(32), AttentionSpec(32)))
    shared, own = (Tensor(a) for a in cpu_caches(2, 8, 32, seed=None))
    # vLLM's hybrid manager gives layer 0 (window) and layer 1 (full) one tensor.
    views, group_of, layers = views_by_group({"layers.0": shared, "layers.1": shared}, groups)
    assert group_of == [0, 1]
    assert layers == {"layers.0": 0, "layers.1": 1}
    model = Model(HEADS, HEAD, 32, groups=groups)
    cache = layout_from_caches(views, model, group_of)
    assert [(r.base, r.group) for r in cache.layout.regions] == [
        (shared.data_ptr(), 0),
        (shared.data_ptr(), 1),
    ]
    assert cache.windowed
    assert cache.layer_regions == ((0, 1), (1, 2)), "each layer's regions, for layer-wise push"
    # Aliases within one group count once; layers of no moved group are left out.
    one_group = CacheGroups.from_vllm(groups_config(AttentionSpec(32)))
    one_group = replace(one_group, layers={"layers.0": 0, "alias": 0})
    views, group_of, layers = views_by_group(
        {"layers.0": shared, "x": own, "alias": shared}, one_group
    )
    assert [v.data_ptr for v in views] == [shared.data_ptr()]
    assert group_of == [0]
    assert layers == {"layers.0": 0, "alias": 0}


def test_views_follow_the_forward_passs_layer_order_whatever_order_vllm_hands_them() -> None:
    groups = CacheGroups.from_vllm(groups_config(SlidingWindowSpec(32), AttentionSpec(32)))
    groups = replace(
        groups,
        layers={"model.layers.0.attn": 0, "model.layers.2.attn": 0, "model.layers.1.attn": 1},
    )
    a, b, c = (Tensor(x) for x in cpu_caches(3, 8, 32, seed=None))
    # Group by group, as vLLM's hybrid manager may list them: layer 0, layer 2, then layer 1.
    caches = {"model.layers.0.attn": a, "model.layers.2.attn": c, "model.layers.1.attn": b}
    views, group_of, layers = views_by_group(caches, groups)
    assert [v.data_ptr for v in views] == [a.data_ptr(), b.data_ptr(), c.data_ptr()]
    assert group_of == [0, 1, 0]
    assert layers == {"model.layers.0.attn": 0, "model.layers.1.attn": 1, "model.layers.2.attn": 2}


def worker(
    engine: str,
    caches: list[np.ndarray],
    block_size: int,
    port: int,
    idle_wait: float = 0.0,
    layerwise: str = "off",
    layer_events: Callable[[], Event] | None = None,
) -> PushWorker:
    views = [view(c) for c in caches]
    return worker_from_views(engine, views, block_size, port, idle_wait, layerwise, layer_events)


def worker_from_views(
    engine: str,
    views: list[TensorView],
    block_size: int,
    port: int,
    idle_wait: float = 0.0,
    layerwise: str = "off",
    layer_events: Callable[[], Event] | None = None,
) -> PushWorker:
    config = WorkerConfig(
        engine_id=engine,
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        secret=b"adapter-test-secret-0123",
        insecure=False,
        ttl=30.0,
        receive_timeout=30.0,
        transport="loopback",
        model_fingerprint="tiny",
        idle_wait=idle_wait,
        layerwise=layerwise,
    )
    w = PushWorker(config, Model(HEADS, HEAD, block_size), layer_events=layer_events)
    w.register(views, layers={f"layers.{i}": i for i in range(len(views))})
    return w


def test_two_workers_move_a_request_through_scheduler_metadata() -> None:
    p_caches, d_caches = cpu_caches(2, 16, 32, seed=3), cpu_caches(2, 16, 32, seed=None)
    p, d = worker("prefill", p_caches, 32, 0), worker("decode", d_caches, 32, 0)
    try:
        p_sched, d_sched = PushScheduler(), PushScheduler()
        p_port = int(p.endpoint.address.rsplit(":", 1)[1])
        params = {**D_PARAMS, "remote_port": p_port}
        d_sched.allocated("d-req", params, [[6, 3, 9, 0]], 0, 100, 100)
        d.apply(d_sched.take_metadata())
        p_sched.finished("p-req", {"do_remote_decode": True, "transfer_id": "xfer-1"},
                         True, [[3, 8, 1, 12]], 100)  # fmt: skip
        p.apply(p_sched.take_metadata())
        sent, received = wait_finished(p, d)
        assert (sent, received) == ({"p-req"}, {"d-req"})
        for layer in range(2):
            for pb, db in zip([3, 8, 1, 12], [6, 3, 9, 0], strict=True):
                assert np.array_equal(p_caches[layer][pb], d_caches[layer][db])
    finally:
        p.close()
        d.close()


P_PARAMS = {"do_remote_decode": True, "transfer_id": "xfer-lw"}


def layer_landed(
    p_caches: list[np.ndarray],
    d_caches: list[np.ndarray],
    layer: int,
    p_blocks: list[int],
    d_blocks: list[int],
) -> bool:
    """Whether D's blocks hold P's of ``layer``, block for block."""
    return all(
        np.array_equal(p_caches[layer][pb], d_caches[layer][db])
        for pb, db in zip(p_blocks, d_blocks, strict=True)
    )


def streamed_writes(p: PushWorker) -> int:
    """Layer WRITEs P's endpoint posted."""
    return p.endpoint.stats()["streamed_writes"]


def registered_with_p(
    p: PushWorker, d: PushWorker, d_blocks: list[int], p_sched: PushScheduler
) -> None:
    """D registers ``d-req`` (transfer ``xfer-lw``, 100 tokens) into ``d_blocks`` and its
    registration reaches P's table; P's scheduler reads ``p-req``'s params."""
    d_sched = PushScheduler()
    p_port = int(p.endpoint.address.rsplit(":", 1)[1])
    d_sched.allocated("d-req", {**D_PARAMS, "remote_port": p_port, "transfer_id": "xfer-lw"},
                      [d_blocks], 0, 100, 100)  # fmt: skip
    d.apply(d_sched.take_metadata())
    deadline = time.monotonic() + 10.0
    while p.endpoint.pending == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p_sched.external_tokens("p-req", P_PARAMS, 100, 0) == (0, False)


def test_layers_stream_as_the_forward_runs_them_and_the_last_write_carries_the_rest() -> None:
    p_caches, d_caches = cpu_caches(3, 16, 32, seed=5), cpu_caches(3, 16, 32, seed=None)
    p = worker("prefill-lw", p_caches, 32, 0, layerwise="on")
    d = worker("decode-lw", d_caches, 32, 0)
    p_blocks, d_blocks = [3, 8, 1, 12], [6, 3, 9, 0]

    def landed(layer: int) -> bool:
        return layer_landed(p_caches, d_caches, layer, p_blocks, d_blocks)

    try:
        p_sched = PushScheduler(layerwise="on")
        # D registers; vLLM reads P's params when it schedules the request, then its prefill is
        # computed whole in one step: the step's metadata names it, as its send will.
        registered_with_p(p, d, d_blocks, p_sched)
        p_sched.prefill_ends("p-req", [p_blocks], 100, 0, 100)
        p.apply(p_sched.take_metadata())
        p.save_layer("layers.0")
        deadline = time.monotonic() + 10.0
        while not landed(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert landed(0), "layer 0 is in D while P's forward is still running"
        assert not landed(1), "layer 1 has not run"
        assert not landed(2), "nor has layer 2"
        assert d.take_finished()[1] == set(), "D heard of nothing yet"
        p.save_layer("layers.1")
        p.end_forward()
        p.save_layer("layers.2")  # after the forward: nothing streams
        p_sched.finished("p-req", P_PARAMS, True, [p_blocks], 100)
        p.apply(p_sched.take_metadata())
        assert wait_finished(p, d) == ({"p-req"}, {"d-req"})
        assert all(landed(layer) for layer in range(3))
    finally:
        p.close()
        d.close()


class StreamSpy:
    """P's endpoint, recording the regions of each ``streams_ready`` and every other call."""

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint
        self.streamed: list[tuple[list[str], int, int]] = []
        self.calls: list[str] = []

    def streams_ready(self, streams: Any, start: int, end: int) -> None:
        self.streamed.append((streams.request_ids, start, end))
        self._endpoint.streams_ready(streams, start, end)

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self._endpoint, name)


def vllm_step(connector: Any, metadata: Any, layers: int) -> None:
    """One step of the worker's hooks in the order vLLM's model runner calls them
    (``KVConnectorModelRunnerMixin._get_kv_connector_output``, loads started after the
    forward)."""
    connector.bind_connector_metadata(metadata)
    for layer in range(layers):
        connector.wait_for_layer_load(f"layers.{layer}")
        connector.save_kv_layer(f"layers.{layer}", None, None)
    connector.start_load_kv(None)
    connector.wait_for_save()
    connector.get_transfer_results(set())
    connector.get_block_ids_with_load_errors()
    connector.get_kv_connector_stats()
    connector.clear_connector_metadata()


def test_vllms_hook_order_hands_each_layer_over_once_and_a_plain_step_does_no_endpoint_work() -> (
    None
):
    # vLLM binds a step's metadata, runs the forward, then starts the loads with the same
    # metadata: the step's streams are read once, each layer goes once, and a later step
    # without instructions asks the endpoint for nothing but its events.
    pytest.importorskip("vllm")
    from kvpush.vllm.connector import KvPushMetadata

    p_caches, d_caches = cpu_caches(3, 16, 32, seed=6), cpu_caches(3, 16, 32, seed=None)
    p = worker("prefill-hooks", p_caches, 32, 0, layerwise="on")
    d = worker("decode-hooks", d_caches, 32, 0)
    p_blocks, d_blocks = [3, 8, 1, 12], [6, 3, 9, 0]
    try:
        p_sched = PushScheduler(layerwise="on")
        registered_with_p(p, d, d_blocks, p_sched)
        spy = StreamSpy(p.endpoint)
        p._endpoint = spy  # type: ignore[assignment]
        connector = worker_connector(SimpleNamespace(kv_transfer_config=object()), p)
        reads: list[int] = []
        read = p._layer_streams

        def counted(streams: Sequence[SendRequest]) -> LayerStreams:
            reads.append(len(streams))
            return read(streams)

        p._layer_streams = counted  # type: ignore[method-assign]
        p_sched.prefill_ends("p-req", [p_blocks], 100, 0, 100)
        vllm_step(connector, KvPushMetadata(p_sched.take_metadata()), layers=3)
        assert spy.streamed == [(["p-req"], 0, 1), (["p-req"], 1, 2), (["p-req"], 2, 3)]
        assert reads == [1], "the step's streams are read once"
        spy.calls.clear()
        for _ in range(3):
            vllm_step(connector, KvPushMetadata(p_sched.take_metadata()), layers=3)
        assert len(spy.streamed) == 3, "steps without streams stream nothing"
        assert reads == [1], "nor read any"
        assert set(spy.calls) == {"poll"}, spy.calls
        p_sched.finished("p-req", P_PARAMS, True, [p_blocks], 100)
        vllm_step(connector, KvPushMetadata(p_sched.take_metadata()), layers=3)
        assert wait_finished(p, d) == ({"p-req"}, {"d-req"})
        assert all(
            layer_landed(p_caches, d_caches, layer, p_blocks, d_blocks) for layer in range(3)
        )
    finally:
        p.close()
        d.close()


def test_a_chunked_prompt_streams_chunk_by_chunk_and_d_ends_with_the_final_kv() -> None:
    p_caches, d_caches = cpu_caches(2, 16, 32, seed=7), cpu_caches(2, 16, 32, seed=None)
    final = [c.copy() for c in p_caches]
    p = worker("prefill-ch", p_caches, 32, 0, layerwise="on")
    d = worker("decode-ch", d_caches, 32, 0)
    p_blocks, d_blocks = [3, 8, 1, 12], [6, 3, 9, 0]
    try:
        p_sched = PushScheduler(groups=CacheGroups(block_size=32), layerwise="on")
        registered_with_p(p, d, d_blocks, p_sched)

        def step(blocks_added: list[int], computed: int, scheduled: int) -> None:
            if computed == 0:
                p_sched.prefill_ends("p-req", [blocks_added], 100, 0, scheduled)
            else:
                p_sched.prefill_continues("p-req", (blocks_added,), False, computed, scheduled)
            p.apply(p_sched.take_metadata())
            for layer in range(2):
                p.save_layer(f"layers.{layer}")
            p.end_forward()

        # Chunk 1 computes tokens 0..40: block 8 holds 32..40 and, past them, scratch (blocks
        # move whole on CPU, so that scratch reaches D's block 3).
        for cache in p_caches:
            cache[8] = -1.0
        step([3, 8], 0, 40)
        deadline = time.monotonic() + 10.0
        while streamed_writes(p) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Chunk 2 computes 40..80: block 8 is whole now, and block 1 holds 64..80.
        for cache, done in zip(p_caches, final, strict=True):
            cache[8] = done[8]
        writes = streamed_writes(p)
        step([1], 40, 40)
        deadline = time.monotonic() + 10.0
        while streamed_writes(p) == writes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert d.take_finished()[1] == set(), "D heard of nothing yet"
        step([12], 80, 20)  # the last chunk
        p_sched.finished("p-req", P_PARAMS, True, [p_blocks], 100)
        p.apply(p_sched.take_metadata())
        assert wait_finished(p, d) == ({"p-req"}, {"d-req"})
        for layer in range(2):
            for pb, db in zip(p_blocks, d_blocks, strict=True):
                assert np.array_equal(final[layer][pb], d_caches[layer][db]), (layer, pb)
        assert streamed_writes(p) >= 2, "the first two chunks streamed (the last may go whole)"
    finally:
        p.close()
        d.close()


def test_a_layer_queued_on_a_gpu_stream_goes_once_its_event_completed_never_after_the_offer() -> (
    None
):
    events = Events()
    p_caches, d_caches = cpu_caches(3, 16, 32, seed=6), cpu_caches(3, 16, 32, seed=None)
    p = worker("prefill-ev", p_caches, 32, 0, layerwise="on", layer_events=events)
    d = worker("decode-ev", d_caches, 32, 0)
    p_blocks, d_blocks = [3, 8, 1, 12], [6, 3, 9, 0]

    def landed(layer: int) -> bool:
        return layer_landed(p_caches, d_caches, layer, p_blocks, d_blocks)

    try:
        p_sched = PushScheduler(layerwise="on")
        registered_with_p(p, d, d_blocks, p_sched)
        p_sched.prefill_ends("p-req", [p_blocks], 100, 0, 100)
        p.apply(p_sched.take_metadata())
        for layer in range(3):
            p.save_layer(f"layers.{layer}")  # returns at once: the kernels are only queued
        p.end_forward()
        time.sleep(0.1)
        assert not any(landed(layer) for layer in range(3)), "nothing goes before its event"
        events[0].done.set()
        deadline = time.monotonic() + 10.0
        while not landed(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert landed(0)
        assert streamed_writes(p) == 1
        # The request's whole KV is offered while layers 1 and 2 still wait: they are dropped
        # (the request's WRITE carries them), never handed over after the offer.
        p_sched.finished("p-req", P_PARAMS, True, [p_blocks], 100)
        p.apply(p_sched.take_metadata())
        events[1].done.set()
        events[2].done.set()
        assert wait_finished(p, d) == ({"p-req"}, {"d-req"})
        assert all(landed(layer) for layer in range(3))
        assert streamed_writes(p) == 1
    finally:
        p.close()
        d.close()


def test_the_scheduler_streams_a_remote_decode_whose_prompt_ends_in_the_step() -> None:
    blocks = [[3, 8, 1, 12]]
    for mode, prompt, computed, scheduled, params, streams in [
        ("on", 100, 0, 100, P_PARAMS, True),
        ("on", 100, 32, 68, P_PARAMS, True),  # after a prefix hit
        ("off", 100, 0, 100, P_PARAMS, False),
        ("on", 100, 0, 64, P_PARAMS, False),  # a first chunk, block size unknown: its last
        ("on", 100, 0, 100, None, False),  # not a remote decode
        ("on", 100, 0, 100, {"do_remote_decode": "yes"}, False),  # refused params
        ("auto", config.LAYERWISE_AUTO_MIN_TOKENS - 1, 0, 511, P_PARAMS, False),
        ("auto", config.LAYERWISE_AUTO_MIN_TOKENS, 0, 512, P_PARAMS, True),
    ]:
        sched = PushScheduler(layerwise=mode)
        sched.external_tokens("p-req", params, prompt, computed)
        sched.prefill_ends("p-req", blocks, prompt, computed, scheduled)
        got = sched.take_metadata().streams
        assert bool(got) == streams, (mode, prompt, computed, scheduled, params)
        if streams:
            sched.finished("p-req", params, True, blocks, prompt)
            assert got == [replace(sched.take_metadata().sends[0], decided_at=got[0].decided_at)]


def test_a_chunked_prompt_streams_in_the_step_of_its_last_chunk_with_all_its_blocks() -> None:
    sched = PushScheduler(layerwise="on")
    sched.external_tokens("p-req", P_PARAMS, 100, 0)
    sched.prefill_ends("p-req", [[3, 8]], 100, 0, 40)  # first chunk: 40 of 100 tokens
    assert sched.take_metadata().streams == []
    sched.prefill_continues("p-req", ([1],), False, 40, 40)  # second chunk
    assert sched.take_metadata().streams == []
    sched.prefill_continues("p-req", None, False, 80, 0)  # not scheduled this step
    sched.prefill_continues("p-req", ([12],), False, 80, 20)  # the last chunk
    (streamed,) = sched.take_metadata().streams
    assert streamed.blocks == ((3, 8, 1, 12),)
    sched.finished("p-req", P_PARAMS, True, [[3, 8, 1, 12]], 100)
    (sent,) = sched.take_metadata().sends
    assert streamed == replace(sent, decided_at=streamed.decided_at), "as the send names it"

    # Preempted between chunks: the resumed request's blocks are all new.
    sched.external_tokens("p-pre", P_PARAMS, 100, 0)
    sched.prefill_ends("p-pre", [[3, 8]], 100, 0, 40)
    sched.prefill_continues("p-pre", ([5, 6, 7, 9],), True, 0, 100)
    assert sched.take_metadata().streams[0].blocks == ((5, 6, 7, 9),)
    # A request that finished mid-prefill is forgotten.
    sched.external_tokens("p-gone", P_PARAMS, 100, 0)
    sched.prefill_ends("p-gone", [[3, 8]], 100, 0, 40)
    sched.finished("p-gone", P_PARAMS, False, [[3, 8]], 100)
    sched.prefill_continues("p-gone", ([1],), False, 40, 60)
    assert sched.take_metadata().streams == []


def test_a_chunked_prompt_streams_its_kv_so_far_chunk_by_chunk() -> None:
    sched = PushScheduler(groups=CacheGroups(block_size=16), layerwise="on")
    sched.external_tokens("p-req", P_PARAMS, 100, 0)
    # First chunk: 40 of 100 tokens; vLLM allocated a block ahead (12), not yet P's KV.
    sched.prefill_ends("p-req", [[3, 8, 1, 12]], 100, 0, 40)
    (first,) = sched.take_metadata().streams
    assert (first.blocks, first.num_tokens) == (((3, 8, 1),), 40)
    sched.prefill_continues("p-req", ([7],), False, 40, 40)  # second chunk: tokens 40..80
    (second,) = sched.take_metadata().streams
    assert (second.blocks, second.num_tokens) == (((3, 8, 1, 12, 7),), 80)
    sched.prefill_continues("p-req", None, False, 80, 0)  # not scheduled this step
    assert sched.take_metadata().streams == []
    sched.prefill_continues("p-req", ([9, 4],), False, 80, 20)  # the last chunk
    (last,) = sched.take_metadata().streams
    sched.finished("p-req", P_PARAMS, True, [[3, 8, 1, 12, 7, 9, 4]], 100)
    (sent,) = sched.take_metadata().sends
    assert last == replace(sent, decided_at=last.decided_at), "the last is the send"
    # A windowed group whose freeing is not known (or a request of unknown length): vLLM may
    # free its blocks between chunks, under a stream still reading them; the prompt goes whole.
    unknown = CacheGroups(block_size=16, windowed=(True,))
    windowed = PushScheduler(groups=unknown, layerwise="on")
    windowed.external_tokens("p-win", P_PARAMS, 100, 0)
    windowed.prefill_ends("p-win", [[3, 8, 1]], 100, 0, 40, max_tokens=1)
    windowed.prefill_continues("p-win", ([7, 9, 4],), False, 40, 60)
    assert windowed.take_metadata().streams == []
    known = replace(unknown, frees=((WindowFree(sliding_window=40),),))
    windowed = PushScheduler(groups=known, layerwise="on")
    windowed.external_tokens("p-win", P_PARAMS, 100, 0)
    windowed.prefill_ends("p-win", [[3, 8, 1]], 100, 0, 40, max_tokens=None)
    windowed.prefill_continues("p-win", ([7, 9, 4],), False, 40, 60)
    assert windowed.take_metadata().streams == []


def test_a_chunked_prompt_with_a_sliding_window_streams_only_blocks_vllm_keeps() -> None:
    # Group 0 full attention, group 1 a sliding window of 40 tokens; 16-token blocks; a prompt
    # of 100 tokens in chunks of 40, 40 and 20, and one output token (P's leg).
    groups = CacheGroups(
        transfer_ids=(0, 1),
        total=2,
        block_size=16,
        windowed=(False, True),
        frees=((), (WindowFree(sliding_window=40),)),
    )
    # Before the step of its last chunk, the request computed 80 tokens at most (99 for any
    # prompt of 100 with one output token): the window then skips 99 - 40 + 1 = 60 tokens, so
    # the blocks from 48 on are never freed.
    assert groups.kept_from(99) == (0, 48)
    sched = PushScheduler(groups=groups, layerwise="on")
    sched.external_tokens("p-win", P_PARAMS, 100, 0)
    sched.prefill_ends("p-win", [[3, 8, 1], [4, 9, 2]], 100, 0, 40, max_tokens=1)
    (first,) = sched.take_metadata().streams
    # The first chunk ends before the window's kept blocks: the window group lists none.
    assert (first.blocks, first.first_tokens, first.num_tokens) == (((3, 8, 1), ()), (0, 48), 40)
    sched.prefill_continues("p-win", ([7, 12], [5, 6]), False, 40, 40)
    (second,) = sched.take_metadata().streams
    assert (second.blocks, second.first_tokens) == (((3, 8, 1, 7, 12), (5, 6)), (0, 48))
    sched.prefill_continues("p-win", ([10, 11], [13, 14]), False, 80, 20)
    (last,) = sched.take_metadata().streams
    assert last.blocks == ((3, 8, 1, 7, 12, 10, 11), (5, 6, 13, 14))
    # vLLM freed blocks 4 and 9 meanwhile (null block 0 in their place); the send is the last
    # stream, so the request's WRITE goes on from it.
    sched.finished(
        "p-win", P_PARAMS, True, [[3, 8, 1, 7, 12, 10, 11], [0, 0, 2, 5, 6, 13, 14]], 100
    )
    (sent,) = sched.take_metadata().sends
    assert last == replace(sent, decided_at=last.decided_at)
    # A prompt computed in one step streams from the kept blocks too, and so is sent.
    sched.external_tokens("p-one", P_PARAMS, 100, 0)
    sched.prefill_ends("p-one", [[3, 8, 1, 7, 12, 10, 11], [4, 9, 2, 5, 6, 13, 14]], 100, 0, 100, 1)
    (whole,) = sched.take_metadata().streams
    assert (whole.blocks[1], whole.first_tokens) == ((5, 6, 13, 14), (0, 48))
    # More output tokens computed on P: the window moves on before the request ends.
    sched.external_tokens("p-more", P_PARAMS, 100, 0)
    sched.prefill_ends(
        "p-more", [[3, 8, 1, 7, 12, 10, 11], [4, 9, 2, 5, 6, 13, 14]], 100, 0, 100, 20
    )
    (more,) = sched.take_metadata().streams
    assert (more.blocks[1], more.first_tokens) == ((6, 13, 14), (0, 64))


def test_a_bad_layerwise_stops_the_start_naming_the_key_and_its_values() -> None:
    assert config_with({}).layerwise == "off"
    for mode in ("off", "on", "auto"):
        assert config_with({"layerwise": mode}).layerwise == mode
    for value in ("yes", "ON", True, 1, None, ["on"]):
        with pytest.raises(ConfigError, match=r"layerwise must be one of 'off', 'on', 'auto'"):
            config_with({"layerwise": value})


def wait_finished(p: PushWorker, d: PushWorker) -> tuple[set[str], set[str]]:
    """P's finished sends and D's finished receives, once both have one (bounded)."""
    sent: set[str] = set()
    received: set[str] = set()
    deadline = time.monotonic() + 10.0
    while (not sent or not received) and time.monotonic() < deadline:
        time.sleep(0.01)
        sent |= p.take_finished()[0]
        recv_done, failed = d.take_finished()[1:]
        assert not failed, f"receive failed: {failed}"
        received |= recv_done
    return sent, received


def test_opaque_blocks_of_different_sizes_are_refused_at_the_handshake(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = worker("prefill-64", cpu_caches(1, 8, 64, seed=3), 64, 0)
    d = worker("decode-32", cpu_caches(1, 8, 32, seed=None), 32, 0)
    try:
        sched = PushScheduler()
        port = int(p.endpoint.address.rsplit(":", 1)[1])
        sched.allocated("d-x", {**D_PARAMS, "remote_port": port}, [[1, 2]], 0, 50, 50)
        d.apply(sched.take_metadata())
        deadline = time.monotonic() + 10.0
        failed: set[str] = set()
        while not failed and time.monotonic() < deadline:
            time.sleep(0.01)
            failed = d.take_finished()[2]
        assert failed == {"d-x"}
        assert d.take_load_errors() == {1, 2}
        assert "the same block size where blocks move whole" in caplog.text
    finally:
        p.close()
        d.close()


def test_failed_receive_reports_the_blocks_as_load_errors() -> None:
    d = worker("decode-f", cpu_caches(1, 8, 32, seed=None), 32, 0)
    try:
        sched = PushScheduler()
        closed = {**D_PARAMS, "remote_port": 1}  # nothing listens on port 1
        sched.allocated("d-lost", closed, [[2, 5]], 0, 40, 40)
        d.apply(sched.take_metadata())
        deadline = time.monotonic() + 10.0
        finished: set[str] = set()
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
            _, finished, failed = d.take_finished()
        assert finished == failed == {"d-lost"}
        assert d.take_load_errors() == {2, 5}
    finally:
        d.close()


def test_timeline_lines_join_p_and_d_by_transfer_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPUSH_TIMELINE_DIR", str(tmp_path))
    p = worker("prefill-t", cpu_caches(1, 8, 32, seed=3), 32, 0)
    d = worker("decode-t", cpu_caches(1, 8, 32, seed=None), 32, 0)
    try:
        port = int(p.endpoint.address.rsplit(":", 1)[1])
        d_sched, p_sched = PushScheduler(), PushScheduler()
        d_sched.allocated("d-t", {**D_PARAMS, "remote_port": port}, [[1, 2]], 0, 50, 50)
        d.apply(d_sched.take_metadata())
        p_sched.finished("p-t", {"do_remote_decode": True, "transfer_id": "xfer-1"}, True,
                         [[4, 5]], 50)  # fmt: skip
        started = time.time()
        p.apply(p_sched.take_metadata())
        assert wait_finished(p, d) == ({"p-t"}, {"d-t"})
    finally:
        p.close()
        d.close()
    (sent,) = [json.loads(x) for x in (tmp_path / "prefill-t-tp0.jsonl").read_text().splitlines()]
    (got,) = [json.loads(x) for x in (tmp_path / "decode-t-tp0.jsonl").read_text().splitlines()]
    assert sent["key"] == got["key"] == "xfer-1"
    assert (sent["role"], got["role"], sent["outcome"], got["outcome"]) == (
        "send", "receive", "done", "done"
    )  # fmt: skip
    walls = sent["wall"]
    assert walls["scheduled"] <= walls["ready"] <= walls["matched"] <= walls["posted"]
    assert walls["posted"] <= walls["completed"]
    assert abs(walls["ready"] - started) < 5.0, "wall times are unix times"
    assert got["wall"]["scheduled"] <= got["wall"]["registered"] <= got["wall"]["completed"]


def test_stats_count_transfers_and_time_each_step() -> None:
    p = worker("prefill-s", cpu_caches(1, 8, 32, seed=3), 32, 0)
    d = worker("decode-s", cpu_caches(1, 8, 32, seed=None), 32, 0)
    try:
        port = int(p.endpoint.address.rsplit(":", 1)[1])
        d_sched, p_sched = PushScheduler(), PushScheduler()
        d_sched.allocated("d-s", {**D_PARAMS, "remote_port": port}, [[1, 2]], 0, 50, 50)
        d.apply(d_sched.take_metadata())
        p_sched.finished(
            "p-s", {"do_remote_decode": True, "transfer_id": "xfer-1"}, True, [[4, 5]], 50
        )
        p.apply(p_sched.take_metadata())
        assert wait_finished(p, d) == ({"p-s"}, {"d-s"})
        sent, received = p.take_stats(), d.take_stats()
    finally:
        p.close()
        d.close()
    assert sent is not None
    assert received is not None
    assert (sent["sent"], received["received"]) == (1, 1)
    block_bytes = HEADS * 32 * 2 * HEAD * 4
    assert sent["bytes"] == received["bytes"] == [2 * block_bytes]
    summary = _stats.reduce(_stats.aggregate(_stats.empty(), sent))
    assert summary["sent"] == 1
    assert summary["failed"] == 0
    assert {"post_ms_p50", "transfer_ms_p50", "step_wait_ms_p50"} <= summary.keys()
    assert p.take_stats() is None, "an interval's stats are taken once"


def _threads() -> dict[tuple[str, str], set[int]]:
    """This process's live threads: (thread id, start time) -> the CPUs it may run on. The start
    time tells a new thread from an ended one whose id the kernel gave out again. (Names would
    not do: a thread names itself once it first runs, which on a busy core can be later.)"""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                started = stat.read().rsplit(")", 1)[1].split()[19]
            threads[(tid, started)] = os.sched_getaffinity(int(tid))
        except OSError:
            continue  # ended while we looked
    return threads


@pytest.mark.parametrize("setting", ["unset", "inherit", "explicit"])
def test_endpoint_threads_leave_the_core_vllm_pinned_the_worker_to(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU worker pins its forward thread to one core; the endpoint's native threads
    must not be born there (they would wait for the forward pass to post a WRITE), unless the
    operator says so."""
    engine_cpus = os.sched_getaffinity(os.getppid()) | os.sched_getaffinity(0)
    if len(engine_cpus) < 2:
        pytest.skip("needs a process allowed on two CPUs or more")
    pinned = {min(engine_cpus)}
    expected = {"unset": engine_cpus, "inherit": pinned, "explicit": {max(engine_cpus)}}[setting]
    if setting == "inherit":
        monkeypatch.setenv(THREAD_CPUS_ENV, "inherit")
    elif setting == "explicit":
        monkeypatch.setenv(THREAD_CPUS_ENV, str(max(engine_cpus)))
    else:
        monkeypatch.delenv(THREAD_CPUS_ENV, raising=False)
    before = _threads()
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, pinned)
    try:
        w = worker(f"pinned-{setting}", cpu_caches(1, 4, 32, seed=None), 32, 0)
        try:
            assert os.sched_getaffinity(0) == pinned, "the worker thread's own pinning changed"
            born = {tid: cpus for tid, cpus in _threads().items() if tid not in before}
            assert born, "the endpoint started no threads"
            assert all(cpus == expected for cpus in born.values()), born
        finally:
            w.close()
    finally:
        os.sched_setaffinity(0, previous)


def test_thread_cpu_setting_is_checked() -> None:
    assert config.cpu_list("0,2-4") == {0, 2, 3, 4}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(THREAD_CPUS_ENV, "two")
        with pytest.raises(KvPushError, match="KVPUSH_THREAD_CPUS='two'"):
            config.native_thread_cpus()


class TensorStandIn:
    """A tensor on ``device_type:index`` as the connector sees one (``data_ptr``, shape, strides,
    element size, ``device``), backed by host memory: what a GPU KV cache hands kvpush, on a
    machine without a GPU."""

    def __init__(self, array: np.ndarray, index: int, device_type: str = "cuda") -> None:
        self.array = array
        self.device = type("Device", (), {"type": device_type, "index": index})()
        self.shape = array.shape

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return int(self.array.itemsize)


def test_a_worker_on_a_gpu_registers_its_cache_as_vram_of_that_device() -> None:
    caches = cpu_caches(2, 8, 32, seed=None)
    gpu_views = [TensorView.of(TensorStandIn(c, 3)) for c in caches]
    assert {v.cuda_device for v in gpu_views} == {3}
    assert TensorView.of(TensorStandIn(caches[0], 0, "cpu")).cuda_device is None
    w = worker_from_views("gpu-worker", gpu_views, 32, 16_400)
    try:
        assert w.endpoint.memory_space == ("vram", 3)
    finally:
        w.close()
    mixed = [gpu_views[0], TensorView.of(TensorStandIn(caches[1], 4))]
    with pytest.raises(LayoutError, match="several devices"):
        worker_from_views("mixed-worker", mixed, 32, 16_410)


def test_pipeline_stages_get_ports_of_their_own_and_are_refused_for_now() -> None:
    """Stage-major worker indexes (the side-channel port offset), so stages on one host never
    clash; an engine of several stages is refused at startup with the reason (a D would need to
    register with every stage: docs/operations.md, "Pipeline parallelism")."""
    indexes = {
        (pp, tp): Model(HEADS, HEAD, 32, tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2).worker_index
        for pp in range(2)
        for tp in range(2)
    }
    assert sorted(indexes.values()) == [0, 1, 2, 3]
    config = WorkerConfig(
        engine_id="staged",
        side_channel_host="127.0.0.1",
        side_channel_port=16_500,
        secret=None,
        insecure=False,
        ttl=30.0,
        receive_timeout=30.0,
        transport="loopback",
        model_fingerprint="tiny",
    )
    staged = PushWorker(config, Model(HEADS, HEAD, 32, pp_rank=1, pp_size=2))
    with pytest.raises(LayoutError, match="pipeline stages"):
        staged.register([view(c) for c in cpu_caches(2, 8, 32, seed=None)])


def test_ps_answer_names_p_so_that_a_router_can_forward_it_to_d_unchanged() -> None:
    """llm-d's push dispatch learns P's identity from a prefill's answer and forwards its
    kv_transfer_params to D: they must carry everything D's scheduler needs, and D must accept
    them as they are."""
    identity = {
        "remote_engine_id": "prefill-7",
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 2,
        "pp_size": 1,
    }
    p_sched = PushScheduler(identity)
    _, answer = p_sched.finished(
        "p-9", {"do_remote_decode": True, "transfer_id": "xfer-9"}, True, [[1, 2]], 20
    )
    assert answer is not None
    assert {k: answer[k] for k in identity} == identity
    assert answer["do_remote_prefill"] is True
    assert answer["transfer_mode"] == "push"
    assert answer["transfer_id"] == "xfer-9"
    d_sched = PushScheduler()
    forwarded = dict(answer)
    assert d_sched.external_tokens("d-9", forwarded, prompt_tokens=20, num_computed=0) == (20, True)
    d_sched.allocated("d-9", forwarded, [[5, 6]], 0, 20, 20)
    (recv,) = d_sched.take_metadata().recvs
    assert (recv.remote_host, recv.remote_port, recv.remote_tp_size) == ("10.0.0.7", 5600, 2)
    assert recv.transfer_id == "xfer-9"


class EndpointSpy:
    """The worker's endpoint, recording how each report collected its events."""

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint
        self.calls: list[tuple[str, float]] = []

    def poll(self) -> list[Any]:
        self.calls.append(("poll", 0.0))
        return list(self._endpoint.poll())

    def wait(self, timeout: float) -> list[Any]:
        self.calls.append(("wait", timeout))
        return list(self._endpoint.wait(timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._endpoint, name)


def idle_steps_until_received(idle_wait: float) -> tuple[list[tuple[str, float]], int]:
    """Moves one request between two workers (``idle_wait`` configured on D), stepping D with
    steps that compute nothing until it is received; returns D's endpoint calls from then on,
    and the number of those steps."""
    from kvpush.vllm.metadata import PushMetadata

    p_caches, d_caches = cpu_caches(2, 16, 32, seed=3), cpu_caches(2, 16, 32, seed=None)
    p = worker("prefill-idle", p_caches, 32, 0)
    d = worker("decode-idle", d_caches, 32, 0, idle_wait=idle_wait)
    spy = EndpointSpy(d.endpoint)
    d._endpoint = spy  # type: ignore[assignment]
    try:
        # Nothing outstanding: an idle step returns at once.
        d.apply(PushMetadata(idle=True))
        d.take_finished()
        assert spy.calls == [("poll", 0.0)]
        d_sched, p_sched = PushScheduler(), PushScheduler()
        p_port = int(p.endpoint.address.rsplit(":", 1)[1])
        d_sched.allocated("d-idle", {**D_PARAMS, "remote_port": p_port}, [[6, 3]], 0, 40, 40)
        d.apply(d_sched.take_metadata())  # a step that computes something: no wait
        d.take_finished()
        assert spy.calls[-1] == ("poll", 0.0)
        spy.calls.clear()
        p_sched.finished("p-idle", {"do_remote_decode": True, "transfer_id": "xfer-1"},
                         True, [[3, 8]], 40)  # fmt: skip
        p.apply(p_sched.take_metadata())
        received: set[str] = set()
        steps = 0
        deadline = time.monotonic() + 10.0
        while not received and time.monotonic() < deadline:
            steps += 1
            d.apply(PushMetadata(idle=True))
            received |= d.take_finished()[1]
            # The step's second report (vLLM asks for results, then stats) asks the endpoint for
            # nothing: the stats are of the events the results collected.
            d.take_stats()
            p.take_finished()
            time.sleep(0.001)  # vLLM's engine loop, after a step that computes nothing
        assert received == {"d-idle"}
        return list(spy.calls), steps
    finally:
        p.close()
        d.close()


def test_by_default_a_step_that_computes_nothing_never_waits_in_the_connector() -> None:
    # vLLM's engine loop sleeps after such a step itself; a wait in the connector would only
    # hold a request that arrives meanwhile.
    calls, steps = idle_steps_until_received(0.0)
    assert len(calls) == steps, "one poll per step"
    assert all(call == ("poll", 0.0) for call in calls)


def test_a_configured_idle_wait_waits_for_the_transfer_event_in_idle_steps_only() -> None:
    calls, steps = idle_steps_until_received(0.004)
    waits = [call for call in calls if call[0] == "wait"]
    assert waits, "idle steps with a receive outstanding wait for its event"
    assert all(timeout == 0.004 for _, timeout in waits)
    assert len(calls) == steps, "one endpoint call per step: a wait, or a poll once events wait"


def test_a_steps_instructions_are_handed_over_once_though_vllm_binds_then_starts_it() -> None:
    # vLLM hands the connector each step's metadata twice (bind_connector_metadata, then
    # start_load_kv, in the no-forward path too): the second hand-over gets nothing, so the
    # worker keeps what the first set (the step's idleness, its streams) and does no work twice.
    pytest.importorskip("vllm")
    from kvpush.vllm.connector import KvPushMetadata
    from kvpush.vllm.metadata import PushMetadata

    metadata = KvPushMetadata(PushMetadata(cancels=["d-req"], idle=True))
    first = metadata.take()
    assert first is not None
    assert first.cancels == ["d-req"]
    assert first.idle
    assert metadata.take() is None, "the instructions are handed over once"
    # Through the connector: the worker acts on them once, and the step stays idle (or the
    # worker's report would never wait).
    applied: list[PushMetadata] = []
    connector = worker_connector(
        SimpleNamespace(kv_transfer_config=object()), SimpleNamespace(apply=applied.append)
    )
    idle = KvPushMetadata(PushMetadata(cancels=["d-req"], idle=True))
    connector.bind_connector_metadata(idle)
    connector.start_load_kv(None)
    assert [(m.cancels, m.idle) for m in applied] == [(["d-req"], True)]


class BusyEndpoint:
    """The worker's endpoint while its writer is far behind: every abort, cancel and expect
    raises ``BusyError`` (nothing done) until ``catch_up``; calls are recorded."""

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint
        self.busy = True
        self.calls: list[tuple[str, str]] = []

    def _refuse(self, call: str, request_id: str) -> None:
        self.calls.append((call, request_id))
        if self.busy:
            raise kvpush.exceptions.BusyError("the writer is behind")

    def abort(self, request_id: str, transfer_id: str | None = None) -> str:
        self._refuse("abort", request_id)
        return "unknown"

    def cancel(self, request_id: str) -> None:
        self._refuse("cancel", request_id)

    def expect(self, request_id: str, *args: Any, **kwargs: Any) -> None:
        self._refuse("expect", request_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._endpoint, name)


def test_work_a_busy_endpoint_refused_fails_alone_or_is_retried_next_step() -> None:
    from kvpush.vllm.metadata import PushMetadata, RecvRequest

    caches = cpu_caches(2, 16, 32, seed=None)
    d = worker("decode-busy", caches, 32, 0)
    busy = BusyEndpoint(d.endpoint)
    d._endpoint = busy  # type: ignore[assignment]
    old = RecvRequest("d-old", "xfer-old", "127.0.0.1", 5600, 1, ((1, 2),), 0, 40)
    recv = RecvRequest("d-new", "xfer-new", "127.0.0.1", 5600, 1, ((4, 5),), 0, 40)
    try:
        busy.busy = False
        d.apply(PushMetadata(recvs=[old]))  # registered: the worker tracks its receive
        busy.busy = True
        d.apply(PushMetadata(aborts=[("p-gone", "xfer-gone")], recvs=[recv], cancels=["d-old"]))
        # The expectation was not registered: the request fails now, its blocks reported.
        _, received, failed = d.take_finished()
        assert (received, failed) == ({"d-new"}, {"d-new"})
        assert d.take_load_errors() == {4, 5}
        # The abort and the cancel are tried again with the next step's, once there is room.
        busy.busy = False
        busy.calls.clear()
        d.apply(PushMetadata())
        assert busy.calls == [("abort", "p-gone"), ("cancel", "d-old")]
        d.apply(PushMetadata())
        assert busy.calls[2:] == [], "each is retried until taken, then not again"
    finally:
        d.close()


SECRET = "0123456789abcdef0123456789abcdef"


def test_a_secret_in_the_connectors_config_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(ConfigError) as refused:
        load_secret({"secret": SECRET}, {})
    message = str(refused.value)
    assert SECRET not in message
    for advice in ("KVPUSH_SECRET", "secret_file", "KVPUSH_SECRET_FILE", "/proc/*/cmdline"):
        assert advice in message
    with pytest.raises(ConfigError):
        load_secret({"secret": None}, {"KVPUSH_SECRET": SECRET})  # the option, set or not


def test_the_secret_comes_from_the_environment_or_a_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert load_secret({}, {}) is None
    assert load_secret({"side_channel_port": 1}, {"KVPUSH_SECRET": SECRET}) == SECRET.encode()
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")  # as `openssl rand -hex 32 >FILE` writes it
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="vllm.kvpush"):
        assert load_secret({"secret_file": str(path)}, {}) == SECRET.encode()
        assert load_secret({}, {"KVPUSH_SECRET_FILE": str(path)}) == SECRET.encode()
    assert not caplog.text
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="vllm.kvpush"):
        assert load_secret({"secret_file": str(path)}, {}) == SECRET.encode()
    assert "can be read by other users (mode 644); chmod 600 it" in caplog.text
    assert SECRET not in caplog.text


@pytest.mark.parametrize(
    ("extra", "environ", "complaint"),
    [
        ({"secret_file": "FILE"}, {"KVPUSH_SECRET": SECRET}, "give the secret one way"),
        ({}, {"KVPUSH_SECRET_FILE": "MISSING"}, "No such file or directory"),
        ({"secret_file": "EMPTY"}, {}, "is empty"),
        ({"secret_file": ["FILE"]}, {}, "must be a path"),
    ],
)
def test_a_secret_that_cannot_be_read_stops_the_start_with_the_reason(
    tmp_path: Path, extra: dict[str, Any], environ: dict[str, str], complaint: str
) -> None:
    (tmp_path / "FILE").write_text(SECRET)
    (tmp_path / "EMPTY").write_text("\n")

    def placed(value: Any) -> Any:
        return str(tmp_path / value) if isinstance(value, str) and value.isupper() else value

    extra = {k: placed(v) for k, v in extra.items()}
    environ = {k: placed(v) if k.endswith("_FILE") else v for k, v in environ.items()}
    with pytest.raises(ConfigError, match=complaint) as refused:
        load_secret(extra, environ)
    assert SECRET not in str(refused.value)


def test_a_workers_config_never_shows_its_secret() -> None:
    config = WorkerConfig(
        engine_id="e",
        side_channel_host="127.0.0.1",
        side_channel_port=0,
        secret=SECRET.encode(),
        insecure=False,
        ttl=1.0,
        receive_timeout=1.0,
        transport="loopback",
        model_fingerprint="m",
    )
    assert SECRET not in repr(config)
    assert SECRET not in str(config)


def config_with(extra: dict[str, Any], world_size: int = 1) -> WorkerConfig:
    """The worker's config of an engine of ``world_size`` workers whose
    ``kv_connector_extra_config`` is ``extra``."""
    from types import SimpleNamespace

    from kvpush.vllm.config import worker_config

    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_connector_extra_config=extra),
        model_config=SimpleNamespace(model="tiny", dtype="float32"),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(world_size=world_size),
    )
    return worker_config(vllm_config)


def test_idle_wait_ms_auto_waits_only_in_an_engine_of_several_workers() -> None:
    # vLLM's loop sleeps after an idle step itself: no wait by default with one worker.
    assert config_with({}).idle_wait == 0.0
    assert config_with({"idle_wait_ms": "auto"}).idle_wait == 0.0
    assert config_with({}, 2).idle_wait == pytest.approx(0.002)
    assert config_with({"idle_wait_ms": 0}, 2).idle_wait == 0.0
    assert config_with({"idle_wait_ms": 2}).idle_wait == pytest.approx(0.002)
    assert config_with({"idle_wait_ms": "0.5"}).idle_wait == pytest.approx(0.0005)


@pytest.mark.parametrize("value", [-1, "soon", None, True, float("nan"), float("inf"), 51, [2]])
def test_a_bad_idle_wait_ms_stops_the_start_naming_the_key(value: Any) -> None:
    with pytest.raises(ConfigError, match='idle_wait_ms must be "auto" or a number of millisec'):
        config_with({"idle_wait_ms": value})
