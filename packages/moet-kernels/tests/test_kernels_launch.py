"""The op's kernel launches against the cubins' own parameter lists.

`ops._gpu` runs here with its launches recorded instead of made (a CUDA launch cannot happen on
this machine): every launch must pass as many arguments as the kernel declares, each of the
declared size (`param_sizes` in sass/<cubin>.json, which the SASS audit reads from the cubin's
ELF and keeps in step with the source), in the order the op promises: route, w13 per tier,
requant, w2 per tier, combine, with each tier's GEMMs over its own job range (FP4, device, host
rows read in place); prefill batches
(16 pairs per expert on average) take the GEMMs' `_t16` variants and jobs of 16 pairs, unless a
tier has none (NVFP4).
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch

from moet_kernels import ops
from moet_kernels.layout import NativeRowLayout

SASS = Path(__file__).resolve().parents[3] / "sass"
H, INTER, E, K = 256, 64, 16, 4
DECODE, PREFILL = 3, 64  # tokens: 12 pairs, and 256 = 16 per expert


class Recorder:
    """Stands in for loader.Module: the grid arithmetic of a 132-SM GPU, launches recorded."""

    sms = 132

    def __init__(self):
        self.launches: list[tuple[str, int, int, list]] = []

    def slots(self, name: str, block: int) -> int:
        return 3 * self.sms

    def persistent_grid(self, name: str, block: int, work: int) -> int:
        return max(1, min(work, self.slots(name, block)))

    def launch(self, name: str, grid: int, block: int, args: list) -> None:
        self.launches.append((name, grid, block, list(args)))


def declared() -> dict[str, list[list[int]]]:
    """Kernel -> its parameter sizes in every committed cubin manifest."""
    out: dict[str, list[list[int]]] = {}
    for manifest in sorted(SASS.glob("*.json")):
        for name, f in json.loads(manifest.read_text())["functions"].items():
            out.setdefault(name, []).append(f["param_sizes"])
    return out


def record(monkeypatch, dtype, fp4: str | None, n_tok: int, host: bool = False):
    rec = Recorder()
    monkeypatch.setattr(ops, "load", lambda dev: rec)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "_workspaces", {})
    lay, lay4 = NativeRowLayout(H, INTER), NativeRowLayout(H, INTER, fp4 or "fp4r")
    pool = torch.zeros(5, lay.row_bytes, dtype=torch.uint8)
    pool4 = torch.zeros(5, lay4.row_bytes, dtype=torch.uint8)
    table, table4 = torch.zeros(E, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)
    host_pool, host_table = torch.zeros(7, lay.row_bytes, dtype=torch.uint8), table.clone()
    tiers = {"fp4": (pool4, table4, lay4)} if fp4 else {}
    tiers["device"] = (pool, table, lay)
    if host:
        tiers["host"] = (host_pool, host_table, lay)
    args = (
        torch.zeros(n_tok, H, dtype=dtype),
        torch.zeros(n_tok, K, dtype=torch.int32),
        torch.zeros(n_tok, K),
        tiers,
        torch.tensor([n_tok], dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(E, dtype=torch.uint8),
    )
    ops._gpu(*args)
    (ws,) = ops._workspaces.values()
    return rec.launches, ws, table4, host_pool, host_table


@pytest.mark.parametrize("host", [False, True], ids=["device", "host-rows"])
@pytest.mark.parametrize("n_tok", [DECODE, PREFILL])
@pytest.mark.parametrize("fp4", [None, "fp4r", "fp4x-nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_launch_matches_the_kernels_parameters(monkeypatch, dtype, fp4, n_tok, host) -> None:
    launches, ws, table4, host_pool, host_table = record(monkeypatch, dtype, fp4, n_tok, host)
    out = ops.OUT_KERNELS[dtype]
    # prefill jobs where every tier has the kernels for them (not NVFP4: ops.PREFILL_TIERS)
    prefill_jobs = n_tok == PREFILL and fp4 != "fp4x-nvfp4"
    prefill = "_t16" if prefill_jobs else ""
    gemm = ([ops.GEMM_KERNELS[fp4] + prefill] if fp4 else []) + [prefill]  # host rows: W2's
    want = [f"moet_route_{out}", *(f"moet_w13{g}" for g in gemm), "moet_requant",
            *(f"moet_w2{g}" for g in gemm), f"moet_combine_{out}"]  # fmt: skip
    assert [name for name, *_ in launches] == want
    sizes = declared()
    for name, grid, block, args in launches:
        assert sizes[name], f"{name} is in no committed manifest"
        for declared_sizes in sizes[name]:  # every arch's cubin
            assert [ctypes.sizeof(a) for a in args] == declared_sizes, name
        assert 1 <= grid <= 8 * Recorder.sms and block in (128, 256)
    # the FP4 and host tables go to the route kernel; the GEMMs read their job ranges from
    # route's n_jobs = {0, FP4 jobs, + device jobs, + host jobs}: the FP4 tier's from n_jobs[0],
    # the W2 launch's from n_jobs[1], its jobs past the device pool's rows of the host pool
    route_args = launches[0][3]
    assert route_args[7].value == (table4.data_ptr() if fp4 else None)
    assert route_args[8].value == (host_table.data_ptr() if host else None)
    assert route_args[15].value == (4 if prefill_jobs else 3)  # log2 of the job size
    assert tuple(ws.job_pairs.shape) == (ws.max_jobs, 16 if prefill_jobs else 8)
    n_jobs = ws.n_jobs.data_ptr()
    w13 = [args for name, _, _, args in launches if name.startswith("moet_w13")]
    w2 = [args for name, _, _, args in launches if name.startswith("moet_w2")]
    assert [a[12].value for a in w13] + [a[11].value for a in w2] == (
        ([n_jobs] if fp4 else []) + [n_jobs + 4]
    ) * 2
    host_rows = host_pool.data_ptr() if host else None  # the second pool: the W2 launch's
    assert [a[2].value for a in w13 + w2] == (([None] if fp4 else []) + [host_rows]) * 2


def test_the_manifests_name_every_parameter_list() -> None:
    sizes = declared()
    assert {"moet_route_bf16", "moet_w13", "moet_w2_fp4", "moet_w13_nvfp4", "moet_requant"} <= set(
        sizes
    )
    for name, lists in sizes.items():
        assert lists and all(s == lists[0] and s for s in lists), name  # same on every arch


def test_prefill_jobs_from_16_pairs_per_expert_where_every_tier_has_them() -> None:
    assert ops.job_size(16 * E - 1, E) == ops.TOK == 8
    assert ops.job_size(16 * E, E) == ops.PREFILL_JOB == 16
    assert ops.job_size(16 * E, E, ["fp4r", "w2"]) == 16
    assert ops.job_size(16 * E, E, ["fp4x-mxfp4"]) == 16
    assert ops.job_size(16 * E, E, ["fp4x-nvfp4", "w2"]) == 8  # NVFP4 has no _t16 kernels
    assert ops.job_size(10**6, E, ["fp4x-nvfp4"]) == 8


def test_workspaces_share_one_arena_that_grows_to_the_largest_batch(monkeypatch) -> None:
    """Memory stays bounded whatever mix of batch sizes arrives: every batch size of a layer
    shape views one arena, sized for the largest batch so far; outside a capture it grows (the
    old views go), inside one a larger batch is refused instead of moving a buffer."""
    monkeypatch.setattr(ops, "_arenas", {})
    monkeypatch.setattr(ops, "_retired", [])
    record(monkeypatch, torch.bfloat16, None, PREFILL)
    (arena,) = ops._arenas.values()
    assert arena.tokens == PREFILL
    for n_tok in (1, 2, DECODE, 17, PREFILL):  # smaller batches: views of the same arena
        ops._gpu(*_args(n_tok))
    assert list(ops._arenas.values()) == [arena]
    for ws in ops._workspaces.values():
        assert ws.y.data_ptr() == arena.y.data_ptr() and ws.xq.data_ptr() == arena.xq.data_ptr()
        assert ws.y.shape[0] == ws.pair_ok.shape[0] <= PREFILL * K
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    ops._gpu(*_args(DECODE))  # a captured batch marks its arena
    assert arena.captured
    with pytest.raises(RuntimeError, match="before capturing a CUDA graph"):
        ops._gpu(*_args(2 * PREFILL))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ops._gpu(*_args(2 * PREFILL))  # grows; the captured arena is kept for its graph
    (bigger,) = ops._arenas.values()
    assert bigger.tokens == 2 * PREFILL and ops._retired == [arena]
    assert all(ws.y.data_ptr() == bigger.y.data_ptr() for ws in ops._workspaces.values())


def _args(n_tok: int):
    lay = NativeRowLayout(H, INTER)
    pool = torch.zeros(5, lay.row_bytes, dtype=torch.uint8)
    return (
        torch.zeros(n_tok, H, dtype=torch.bfloat16),
        torch.zeros(n_tok, K, dtype=torch.int32),
        torch.zeros(n_tok, K),
        {"device": (pool, torch.zeros(E, dtype=torch.int32), lay)},
        torch.tensor([n_tok], dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(E, dtype=torch.uint8),
    )
