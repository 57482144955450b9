"""moe_gemm's Metal kernels (metal/moe.metal) on the emulator against the CPU op.

Every case runs the exact launches of the dispatch plan (run_metal: per-pair
GEMV for few pairs, routing + grouped GEMM over expert-sorted rows for many,
then the combining epilogue) under two random emulator schedules.
Tolerance: max |metal - cpu| / max |cpu| <= GEMM_TOL[dtype] (metal_helpers.py).
"""

import shutil

import pytest
import torch

import torch_marlin.ops  # noqa: F401
import mslsim
from torch_marlin.testing.metal import library, metal_dir, metal_plan, run_metal_with_stats

from metal_helpers import has_zeros, DTYPES, FORMATS, GEMM_TOL, GROUP_SIZES, K_FOR_GROUP, SEEDS, make_weight, rel_err

GEMV_MAX_PAIRS = 64  # csrc/core/metal_plan_experts.cpp kMoeGemvMaxPairs


def make_stack(fmt, experts, k, n, group_size, gen):
    parts = [make_weight(fmt, k, n, group_size, gen=gen) for _ in range(experts)]
    packed, scales = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    zeros = torch.stack([p[2] for p in parts]) if has_zeros(fmt) else None
    return packed, scales, zeros


def check(fmt, dtype, ids, k, n, group_size, seed, weighted=True, shared=True, bias=True, experts=None,
          id_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    experts = experts or int(ids.max()) + 1
    packed, scales, zeros = make_stack(fmt, experts, k, n, group_size, gen)
    tokens, top_k = ids.shape
    x = torch.randn(*((tokens,) if shared else (tokens, top_k)), k, generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(dtype) if weighted else None
    b = torch.randn(experts, n, generator=gen).to(dtype) if bias else None
    ids = ids.to(id_dtype)
    args = (x, ids, w, packed, scales, zeros, b, fmt, group_size)
    ref = torch.ops.marlin.moe_gemm(*args)
    for schedule_seed in SEEDS:
        out, plan, stats = run_metal_with_stats("moe_gemm", *args, seed=schedule_seed)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        kernels = [launch["kernel"] for launch in plan["launches"]]
        dt = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
        matmul = (["marlin_moe_route", f"marlin_moe_gemm_{fmt}_{dt}"] if ids.numel() > GEMV_MAX_PAIRS
                  else [f"marlin_moe_gemv_{fmt}_{dt}"])
        assert kernels == matmul + [f"marlin_moe_combine_{dt}"], kernels
        for launch, st in zip(plan["launches"], stats):
            assert st.threadgroup_memory <= 32768
        err = rel_err(out, ref) if ref.numel() else 0.0
        assert err <= GEMM_TOL[dtype], (fmt, dtype, tuple(ids.shape), group_size, schedule_seed, err)
    return plan


def routed(tokens, top_k, experts, gen):
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_dtype_and_group_size(fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    for i, group_size in enumerate(GROUP_SIZES):
        k = K_FOR_GROUP[group_size]
        # decode: T = 3, top-2 of 5 (GEMV per pair); prefill: T = 40, top-2 (grouped GEMM)
        for tokens in (3, 40):
            check(fmt, dtype, routed(tokens, 2, 5, gen), k, 83, group_size, seed=10 * i + tokens,
                  weighted=(i + tokens) % 2 == 0, shared=i % 3 != 2, bias=i % 2 == 0,
                  id_dtype=(torch.int32, torch.int64)[i % 2])


@pytest.mark.parametrize("path_tokens", [5, 70], ids=["gemv", "grouped"])
def test_routing_edge_cases(path_tokens):
    gen = torch.Generator().manual_seed(1)
    e = 7  # not a power of two
    t = path_tokens
    cases = {
        "experts without tokens": torch.tensor([[0, 3], [3, 0]]).repeat(t // 2 + 1, 1)[:t],
        "all tokens on one expert": torch.full((t, 1), 4),  # 70 rows: three tiles of one expert
        "top_k = 1": torch.randint(0, e, (t, 1), generator=gen),
        "top_k = E": torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]),
    }
    for i, (name, ids) in enumerate(cases.items()):
        check("fp4" if i % 2 else "int4", torch.float32, ids, 96, 40, 32, seed=i, experts=e)
    check("uint4", torch.float16, torch.tensor([[6, 2]]), 96, 40, 32, seed=9, experts=e)  # T = 1


def test_routing_needs_its_device_memory_barriers(tmp_path, monkeypatch):
    """The routing kernel hands its per-expert counts from thread to thread through device memory: with its
    barriers weakened to mem_threadgroup (which orders threadgroup memory only) the emulator reports the race
    (docs/MSLSIM.md, "Race detection"); as written, the grouped path passes (test above)."""
    src = (metal_dir() / "moe.metal").read_text()
    if "mem_flags::mem_device" not in src:
        pytest.skip("moe.metal orders no device memory between its threads")
    shutil.copytree(metal_dir(), tmp_path / "metal")
    (tmp_path / "metal" / "moe.metal").write_text(src.replace("mem_flags::mem_device", "mem_flags::mem_threadgroup"))
    monkeypatch.setenv("TORCH_MARLIN_METAL_DIR", str(tmp_path / "metal"))
    gen = torch.Generator().manual_seed(2)
    packed, scales, zeros = make_stack("int4", 5, 64, 40, 32, gen)
    ids = routed(40, 2, 5, gen)  # 80 pairs: routing + grouped GEMM
    with pytest.raises(mslsim.MSLSimError, match=r"kernel 'marlin_moe_route': device memory race .* of buffer\(\d+\)"
                                                 r".*not ordered by a threadgroup_barrier with mem_flags::mem_device"):
        run_metal_with_stats("moe_gemm", torch.randn(40, 64, generator=gen), ids, None, packed, scales, zeros,
                             None, "int4", 32)


def test_empty_input_launches_nothing():
    gen = torch.Generator().manual_seed(0)
    packed, scales, zeros = make_stack("fp4", 3, 64, 8, 32, gen)
    ids = torch.zeros(0, 2, dtype=torch.long)
    out, plan, stats = run_metal_with_stats("moe_gemm", torch.randn(0, 64), ids, torch.rand(0, 2), packed, scales,
                                            zeros, None, "fp4", 32)
    assert plan["launches"] == [] and out.shape == (0, 8)


@pytest.mark.parametrize("tokens", [3, 40], ids=["gemv", "grouped"])
def test_invalid_expert_ids_give_nan_rows_not_a_crash(tokens):
    """On the device the ids cannot be checked without a sync: a pair with an id
    outside [0, E) is never dereferenced, its row (and its token's sum) is NaN."""
    gen = torch.Generator().manual_seed(3)
    packed, scales, zeros = make_stack("int4", 4, 64, 40, 32, gen)
    ids = routed(tokens, 2, 4, gen)
    ids[1, 1], ids[2, 0] = 4, -1
    x = torch.randn(tokens, 64, generator=gen)
    w = torch.rand(tokens, 2, generator=gen)
    for weights in (w, None):
        out = run_metal_with_stats("moe_gemm", x, ids, weights, packed, scales, zeros, None, "int4", 32)[0]
        bad = torch.zeros(out.shape[:2], dtype=torch.bool)
        if weights is None:
            bad[1, 1] = bad[2, 0] = True
        else:
            bad[1] = bad[2] = True
        assert out[bad].isnan().all() and not out[~bad].isnan().any()
        good = ids.clone()
        good[1, 1] = good[2, 0] = 0
        ref = torch.ops.marlin.moe_gemm(x, good, weights, packed, scales, zeros, None, "int4", 32)
        assert torch.allclose(out[~bad], ref[~bad], rtol=1e-5, atol=1e-5)


def test_plan_threshold_grid_and_every_kernel_reachable():
    meta = dict(device="meta")
    packed = torch.empty(6, 128 // 8, 72, dtype=torch.int32, **meta)
    scales = torch.empty(6, 4, 72, dtype=torch.float16, **meta)
    seen = set()
    for dtype in DTYPES:
        for fmt in FORMATS:
            zeros = scales if has_zeros(fmt) else None
            for tokens, top_k in ((1, 8), (8, 8), (9, 8), (512, 8)):
                x = torch.empty(tokens, 128, dtype=dtype, **meta)
                ids = torch.empty(tokens, top_k, dtype=torch.long, **meta)
                plan = metal_plan("moe_gemm", x, ids, None, packed, scales, zeros, None, fmt, 32)
                seen |= {launch["kernel"] for launch in plan["launches"]}
                pairs = tokens * top_k
                assert plan["path"] == ("gemv" if pairs <= GEMV_MAX_PAIRS else "grouped")
                if plan["path"] == "grouped":
                    route, gemm, combine = plan["launches"]
                    max_tiles = -(-pairs // 32) + min(6, pairs)
                    assert route["grid"] == [1, 1, 1] and gemm["grid"] == [2, max_tiles, 1]
                    size = torch.empty(0, dtype=dtype).element_size()
                    assert gemm["threadgroup_memory"] == 2 * 32 * (16 + 16 // size) * size  # padded x tiles
                else:
                    assert plan["launches"][0]["grid"] == [3, pairs, 1]
                for launch in plan["launches"]:
                    assert launch["threadgroup_memory"] <= 32768
    assert set(library("moe").kernels()) <= seen, sorted(set(library("moe").kernels()) - seen)


@pytest.mark.parametrize("case", [
    dict(expert_ids=torch.zeros(3, 2)),  # float ids
    dict(topk_weights=torch.rand(3, 3)),
    dict(x=torch.randn(3, 60)),
    dict(bias=torch.randn(5, 8)),
    dict(scales=torch.ones(3, 2, 8).half()),  # E differs from packed's
])
def test_same_errors_as_cpu(case):
    gen = torch.Generator().manual_seed(0)
    packed, scales, zeros = make_stack("fp4", 4, 64, 8, 32, gen)
    args = dict(x=torch.randn(3, 64), expert_ids=torch.zeros(3, 2, dtype=torch.long), topk_weights=torch.rand(3, 2),
                packed=packed, scales=scales, zeros=zeros, bias=None, weight_format="fp4", group_size=32)
    args.update(case)
    with pytest.raises(Exception) as cpu:
        torch.ops.marlin.moe_gemm(**args)
    with pytest.raises(type(cpu.value)) as planned:
        metal_plan("moe_gemm", **args)
    assert str(planned.value).split("\n")[0] == str(cpu.value).split("\n")[0]
