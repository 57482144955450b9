"""moe_gemm's Metal kernels (metal/moe.metal) on the emulator against the CPU op.

Every case runs the exact launches of the dispatch plan (run_metal: per-pair
GEMV for few pairs, routing + grouped GEMM over expert-sorted rows for many,
then the combining epilogue) under two random emulator schedules.
Tolerance: max |metal - cpu| / max |cpu| <= GEMM_TOL[dtype] (metal_helpers.py).
"""

import math
import shutil

import pytest
import torch

import torch_marlin.ops  # noqa: F401
import mslsim
from torch_marlin.testing.metal import library, metal_dir, metal_plan, run_metal_with_stats

from metal_helpers import has_zeros, DTYPES, FORMATS, GEMM_TOL, GROUP_SIZES, K_FOR_GROUP, SEEDS, make_weight, rel_err

ROUTING = ["marlin_moe_count", "marlin_moe_offsets", "marlin_moe_scatter"]


def gemv_path(pairs, experts):
    """csrc/core/metal_plan_experts.cpp moe_use_gemv: the GEMV unless the pairs outnumber 5x the expected
    grouped-GEMM tiles (the experts a uniform routing touches, times the 32-row tiles each needs)."""
    touched = experts * (1 - (1 - 1 / experts) ** pairs)
    return pairs == 0 or pairs <= 5 * touched * math.ceil(pairs / (touched * 32))


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
        matmul = ([f"marlin_moe_gemv_{fmt}_{dt}"] if gemv_path(ids.numel(), experts)
                  else ROUTING + [f"marlin_moe_gemm_{fmt}_{dt}"])
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
    """The routing's count kernel hands its per-expert counts from lane to lane through device memory: with its
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
    with pytest.raises(mslsim.MSLSimError, match=r"kernel 'marlin_moe_count': device memory race .* of buffer\(\d+\)"
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
            for tokens, top_k in ((1, 6), (1, 8), (8, 8), (9, 8), (512, 8)):
                x = torch.empty(tokens, 128, dtype=dtype, **meta)
                ids = torch.empty(tokens, top_k, dtype=torch.long, **meta)
                plan = metal_plan("moe_gemm", x, ids, None, packed, scales, zeros, None, fmt, 32)
                seen |= {launch["kernel"] for launch in plan["launches"]}
                pairs = tokens * top_k
                assert plan["path"] == ("gemv" if gemv_path(pairs, 6) else "grouped")
                assert plan["path"] == ("gemv" if pairs <= 8 else "grouped")  # 6 experts: 64 pairs are 11 per expert
                if plan["path"] == "grouped":
                    count, offsets, scatter, gemm, combine = plan["launches"]
                    max_tiles = -(-pairs // 32) + min(6, pairs)
                    chunks = -(-pairs // 256)
                    assert count["grid"] == [chunks, 1, 1] and count["threadgroup"] == [32, 1, 1]
                    assert offsets["grid"] == [1, 1, 1] and scatter["grid"] == [-(-pairs // 256), 1, 1]
                    assert gemm["grid"] == [2, max_tiles, 1]
                    size = torch.empty(0, dtype=dtype).element_size()
                    assert gemm["threadgroup_memory"] == 2 * 32 * (16 + 16 // size) * size  # padded x tiles
                else:
                    assert plan["launches"][0]["grid"] == [3, pairs, 1]
                for launch in plan["launches"]:
                    assert launch["threadgroup_memory"] <= 32768
    assert set(library("moe").kernels()) <= seen, sorted(set(library("moe").kernels()) - seen)


@pytest.mark.parametrize("experts, top_k, tokens, path", [
    (8, 2, 1, "gemv"), (8, 2, 4, "gemv"),
    (8, 2, 32, "grouped"),  # Mixtral: 64 pairs, ~8 per expert; the GEMV path would read each expert ~8 times
    (128, 8, 16, "gemv"),  # Qwen3-MoE: 128 pairs over ~81 experts
    (128, 8, 512, "grouped"),
])
def test_plan_path_follows_pairs_per_expert(experts, top_k, tokens, path):
    packed = torch.empty(experts, 4096 // 8, 64, dtype=torch.int32, device="meta")
    scales = torch.empty(experts, 32, 64, dtype=torch.float16, device="meta")
    x = torch.empty(tokens, 4096, dtype=torch.float16, device="meta")
    ids = torch.empty(tokens, top_k, dtype=torch.long, device="meta")
    assert metal_plan("moe_gemm", x, ids, None, packed, scales, None, None, "fp4", 128)["path"] == path


def test_gemv_k_split_for_narrow_experts():
    """Few (32-column, pair) threadgroups: the per-pair GEMV splits K as the dense GEMV does, and the
    combining epilogue sums the slices in order (no reduce launch)."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([[1, 3]])
    plan = check("int4", torch.float32, ids, 2048, 40, 128, seed=4, experts=4)
    gemv = plan["launches"][0]
    assert plan["splits"] == 2 and gemv["grid"] == [2, 2, 2] and len(plan["launches"]) == 2
    plan = check("fp4", torch.float16, routed(2, 2, 4, gen), 4096, 24, -1, seed=5, weighted=False, experts=4)
    assert plan["splits"] == 4  # at most K / 1024 slices


def run_routing(ids, experts, seed=0):
    """The plan's routing launches alone: (expert_start, order, tiles, tile_count)."""
    packed = torch.zeros(experts, 4, 8, dtype=torch.int32)
    scales = torch.ones(experts, 1, 8, dtype=torch.float16)
    x = torch.zeros(ids.shape[0], 32)
    plan = metal_plan("moe_gemm", x, ids, None, packed, scales, None, None, "int4", -1)
    assert plan["path"] == "grouped"
    tensors = {"expert_ids": ids.contiguous()}
    tensors.update({w["name"]: torch.full(w["shape"], -1, dtype=getattr(torch, w["dtype"]))
                    for w in plan["workspaces"]})
    for launch in plan["launches"]:
        if launch["kernel"] not in ROUTING:
            continue
        bind = {i: value if role == "scalar" else tensors[role] for i, role, value in launch["bindings"]}
        library("moe").launch(launch["kernel"], grid=tuple(launch["grid"]), threadgroup=tuple(launch["threadgroup"]),
                              args=bind, seed=seed)
    return tensors["expert_start"], tensors["order"], tensors["tiles"], int(tensors["tile_count"][0]), plan


@pytest.mark.parametrize("experts, tokens, top_k", [(128, 256, 8), (256, 2048, 8), (256, 1500, 1), (7, 3000, 2)])
def test_routing_large_expert_counts(experts, tokens, top_k):
    """The counting sort (count per chunk, offsets, scatter) against a stable sort, with many experts and
    pairs over several chunks; an invalid id is left out of every expert."""
    gen = torch.Generator().manual_seed(experts + tokens)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    if experts == 7:  # skewed: most pairs on two experts, one expert empty, one invalid id
        ids = torch.where(ids < 5, ids % 2, ids)
        ids[5, 1] = experts
    flat = ids.flatten().long()
    valid = (flat >= 0) & (flat < experts)
    counts = torch.bincount(flat[valid], minlength=experts)
    start = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    order_ref = torch.nonzero(valid).flatten()[torch.sort(flat[valid], stable=True).indices]
    tiles_ref = [(e, int(start[e]) + r) for e in range(experts) for r in range(0, int(counts[e]), 32)]
    for seed in SEEDS:
        expert_start, order, tiles, tile_count, plan = run_routing(ids, experts, seed)
        assert torch.equal(expert_start.long(), start)
        assert torch.equal(order[:int(valid.sum())].long(), order_ref)
        assert tile_count == len(tiles_ref)
        assert tiles[:2 * tile_count].view(-1, 2).tolist() == [list(t) for t in tiles_ref]
    chunks = plan["launches"][0]["grid"][0]
    assert chunks == -(-flat.numel() // 256)


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


def test_grouped_path_with_many_experts():
    """128 experts, 800 pairs over several routing chunks: the whole plan against the CPU op."""
    gen = torch.Generator().manual_seed(6)
    plan = check("int4", torch.float32, routed(400, 2, 128, gen), 64, 8, 32, seed=6, experts=128)
    assert plan["path"] == "grouped" and plan["launches"][0]["grid"] == [4, 1, 1]
