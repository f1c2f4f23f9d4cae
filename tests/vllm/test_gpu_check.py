"""The GPU check's CPU-side pieces (``scripts/gpu-check``, ``scripts/gpu-wheels``).

The check itself runs on a GPU machine; here its ``--device cpu`` mode runs the same sections on
host tensors registered as DRAM, small, in real processes over NIXL; its caches are compared
with vLLM's own allocation (where vLLM is installed); its reference is shown to catch a transfer
that never happened; and the carry is prepared from the installed NIXL wheel, trimmed, and run
from. Needs torch (``.venv-vllm``); the budget arithmetic runs everywhere.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.support.nixl import nixl_or_skip

ROOT = Path(__file__).resolve().parents[2]
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)


def script(name: str) -> ModuleType:
    """``scripts/<name>`` (a Python file without a suffix) as a module."""
    module_name = name.replace("-", "_")
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader = importlib.machinery.SourceFileLoader(module_name, str(ROOT / "scripts" / name))
    spec = importlib.util.spec_from_loader(module_name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while defined
    loader.exec_module(module)
    return module


def run_check(
    *args: str, env: dict[str, str | None] | None = None
) -> tuple[int, dict[str, Any], str]:
    """Runs the check in its own process (``env``: None removes a variable); returns its
    status, JSON report and output."""
    report = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu-check-{os.getpid()}-{id(args)}.json"
    changes = {"UCX_NET_DEVICES": "lo", **(env or {})}
    merged = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check"), *args, "--json", str(report)],
        env=merged,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    data = json.loads(report.read_text()) if report.exists() else {"header": {}, "rows": []}
    report.unlink(missing_ok=True)
    return done.returncode, data, output


def python_path() -> str:
    """This checkout's package first, as the tests' own interpreter sees it."""
    return os.pathsep.join([str(ROOT / "python"), str(ROOT), *sys.path[1:]])


# ---- the carry's budget ----------------------------------------------------------------------


def test_the_budget_counts_the_carry_and_the_tree_and_refuses_beyond_it() -> None:
    wheels = script("gpu-wheels")
    mib = 2**20
    fits = wheels.Budget({"kvpush.whl": 1 * mib, "nixl.tar.xz": 8 * mib}, tree=2 * mib)
    assert fits.total == 11 * mib
    assert fits.fits
    assert fits.lines()[-1].endswith("of 64 MiB: fits")
    over = wheels.Budget({"nixl-cu13.whl": 56 * mib, "kvpush.whl": 6 * mib}, tree=3 * mib)
    assert not over.fits
    assert "OVER BUDGET" in over.lines()[-1]
    assert wheels.Budget({"a": 10}, tree=0, limit=10).fits
    assert not wheels.Budget({"a": 10}, tree=1, limit=10).fits


def installed_nixl() -> tuple[str, Path]:
    """The NIXL wheel module installed here and its site-packages folder."""
    for module in ("nixl_cu13", "nixl_cu12"):
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin is not None:
            return module, Path(spec.origin).parent.parent
    if os.environ.get("KVPUSH_REQUIRE_NIXL"):
        pytest.fail("no NIXL wheel installed, and KVPUSH_REQUIRE_NIXL requires one")
    pytest.skip("no NIXL wheel installed")


def test_the_carry_keeps_only_what_kvpush_loads_and_refuses_a_small_budget(
    tmp_path: Path,
) -> None:
    module, site = installed_nixl()
    wheels = script("gpu-wheels")
    members, system = wheels.select(site, module, python_api=True)
    assert f".{module}.mesonpy.libs/libnixl_capi.so" in members
    assert f".{module}.mesonpy.libs/plugins/libplugin_UCX.so" in members
    assert any("libucp" in m for m in members), "UCX itself comes along (the plugin needs it)"
    # Storage backends and the wheel's other plugins stay behind.
    assert not any("AZURE" in m or "libaws" in m or "GDS" in m or "ib_mlx5" in m for m in members)
    assert "libc.so.6" in system
    out = tmp_path / "carry"
    status = wheels.main(
        [
            str(out),
            "--nixl-site",
            str(site),
            "--module",
            module,
            "--no-kvpush",
            "--xz-preset",
            "0",
            "--budget-mib",
            "1",
        ]
    )
    assert status == 1, "a carry over its budget is refused"


# ---- vLLM's layout, without vLLM --------------------------------------------------------------


@needs_torch
@needs_vllm
def test_the_caches_are_the_views_vllms_allocation_makes() -> None:
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    check = script("gpu-check")
    assert {m.name: m.value for m in KVCacheLayout} == check.KV_CACHE_LAYOUTS
    pairs = check.layout_cases(small=True)
    cases = [c for pair in pairs for c in pair] + [replace(pairs[0][0], tp_rank=1, tp_size=2)]
    for case in cases:
        if case.mla:
            spec: Any = MLAAttentionSpec(
                block_size=case.block,
                num_kv_heads=1,
                head_size=case.head_size,
                dtype=torch.float16,
            )
        else:
            spec = FullAttentionSpec(
                block_size=case.block,
                num_kv_heads=case.rank_heads,
                head_size=case.head_size,
                dtype=torch.float16,
            )
        layout = KVCacheLayout[case.layout]
        names = [f"model.layers.{i}.self_attn.attn" for i in range(case.layers)]
        # The attributes get_kv_cache_config_from_groups reads (as tests/vllm/test_vllm_layouts.py).
        vllm_config = SimpleNamespace(
            attention_config=SimpleNamespace(hisparse_config=None),
            cache_config=SimpleNamespace(
                get_resolved_kv_cache_layout=lambda layout=layout: layout,
                num_gpu_blocks_override=case.blocks,
                prefix_cache_retention_interval=None,
            ),
        )
        config = get_kv_cache_config_from_groups(
            vllm_config, [KVCacheGroupSpec(names, spec)], available_memory=1 << 30
        )
        theirs = allocate_kv_cache(config, torch.device("cpu"), layout, [case.block])
        ours = check.KvCache(torch, case, torch.device("cpu"))
        assert ours.raw.numel() == theirs[names[0]].untyped_storage().nbytes()
        for name, view in zip(names, ours.views, strict=True):
            theirs_view = theirs[name]
            assert (view.shape, view.stride(), view.storage_offset(), view.dtype) == (
                theirs_view.shape,
                theirs_view.stride(),
                theirs_view.storage_offset(),
                theirs_view.dtype,
            ), f"{case.name} {name}"


# ---- the reference and the CPU mode ------------------------------------------------------------


@needs_torch
def test_the_reference_tells_a_transfer_that_never_came() -> None:
    nixl_or_skip()
    check = script("gpu-check")
    p, d = check.layout_cases(small=True)[0]
    requests = check.scattered_requests(p, d, "never", seed=1)
    side = check.Side("cpu")
    try:
        side.open(asdict(d), seed=2)
        side.prepare_reference([asdict(r) for r in requests], [{"case": asdict(p), "seed": 1}])
        untouched = side.verify()
        assert untouched["wrong"] > 0, "the requests must change D's cache"
        # The reference is exactly D's bytes plus the requests' tokens: applying it fixes all.
        assert side.cache is not None
        side.cache.raw.copy_(side.expected)
        assert side.verify()["wrong"] == 0
        side.cache.raw.view(-1)[untouched["bytes"] - 1] += 1
        assert side.verify() == {
            "bytes": untouched["bytes"],
            "wrong": 1,
            "first_wrong": untouched["bytes"] - 1,
        }
    finally:
        side.close()


def rows_by_case(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["case"]: row for row in data["rows"]}


@needs_torch
def test_cpu_mode_moves_every_layout_byte_exact_and_prints_one_table() -> None:
    nixl_or_skip()
    status, data, output = run_check(
        "--device", "cpu", "--small", "--repeats", "1", env={"PYTHONPATH": python_path()}
    )
    assert status == 0, output
    rows = rows_by_case(data)
    for case in ("FLASH_ATTN-LBHNC", "FLASH_ATTN-LBNHC", "TRITON_MLA-latent576"):
        row = rows[case]
        assert (row["result"], row["wrong"]) == ("ok", 0), row
        assert row["bytes"] > 0
        assert row["direction"] == "dram:0 b16 -> dram:0 b32"
    for order in ("in order", "scattered"):
        row = rows[f"kvpush, {order}"]
        assert (row["result"], row["wrong"]) == ("ok", 0), row
        assert row["bytes"] == 32 * 2**20
        baseline = rows[f"plain NIXL, {order}"]
        assert baseline["result"] == "ok" or baseline["result"].startswith("skipped"), baseline
        if baseline["result"] == "ok":
            assert (baseline["bytes"], baseline["runs"]) == (row["bytes"], row["runs"])
    assert rows["kvpush, scattered"]["runs"] > rows["kvpush, in order"]["runs"]
    layerwise = rows["FLASH_ATTN-LBHNC layer-wise"]
    assert layerwise["wrong"] == 0, layerwise
    assert layerwise["result"].startswith("ok: "), layerwise
    tp2 = rows["FLASH_ATTN-LBHNC tp2->tp1"]
    assert tp2["result"] == "ok" or "takes one P address" in tp2["result"], tp2
    assert output.count("| wrong bytes |") == 1, "one table"


@needs_torch
def test_the_check_runs_from_a_prepared_carry_and_finds_nixl_there(tmp_path: Path) -> None:
    nixl_or_skip()
    module, site = installed_nixl()
    carry = tmp_path / "carry"
    wheels = script("gpu-wheels")
    args = [str(carry), "--nixl-site", str(site), "--module", module, "--no-kvpush"]
    assert wheels.main([*args, "--xz-preset", "0"]) == 0
    (archive,) = carry.glob("*.tar.xz")
    # kvpush comes from this checkout (no wheel carried); NIXL only from the carry.
    env: dict[str, str | None] = {
        "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)]),
        "TMPDIR": str(tmp_path),
        "KVPUSH_NIXL_CAPI": None,
    }
    status, data, output = run_check(
        "--device", "cpu", "--small", "--sections", "layouts", "--carry", str(carry), env=env
    )
    assert status == 0, output
    assert f"unpacked into {tmp_path}" in output
    assert data["header"]["NIXL"].endswith(f"/.{module}.mesonpy.libs/libnixl_capi.so)")
    assert str(tmp_path) in data["header"]["NIXL"], "kvpush's finder found the carried NIXL"
    assert all(row["result"] == "ok" for row in data["rows"]), data["rows"]
    assert archive.stat().st_size > 0
