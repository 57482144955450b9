"""The entropy-coded ("rans") Metal kernels (lockstep decode, fused decode + GEMV,
decode-once-per-tile GEMM with K split) on the emulator through the real dispatch
plan, against a float64 dequantize-then-matmul of the reference codec's symbols;
corrupted streams give NaN for the bad chunk's outputs and nothing else (GEMV,
GEMM) or the CPU op's error (decode, whose status output flags exactly the bad
chunks), and no access outside the buffers (the emulator checks every device
access). Race
detection and the strict compile check are on (the emulator's defaults).
Shapes are small: every decode step is two simdgroup rendezvous on the emulator.
"tcq" (the grid's symbols through a per-lane trellis) is checked against its own
float64 reference written here from the spec (tcq_levels)."""

import dataclasses

import pytest
import torch

import torch_marlin.ops  # noqa: F401
from torch_marlin import rans
from torch_marlin.layouts.rans import dense_from_symbols
from torch_marlin.testing.metal import metal_plan, run_metal_outputs, run_metal_with_stats

from metal_helpers import DTYPES, FORMATS, GEMM_TOL, SEEDS, has_zeros, rel_err

FORMATS_AND_GRID = (*FORMATS, "grid")
GRID_KINDS = ("grid", "tcq")  # 256 symbols, one step per column
KINDS = (*FORMATS, *GRID_KINDS)  # every kind with kernels of its own


def skewed_symbols(alphabet, k, n, gen):
    """Codes with a peaked distribution (what the layout compresses), every symbol
    present at least once (the table's edges: first, last, rare symbols)."""
    if alphabet == 16:
        probs = torch.softmax(-0.35 * (torch.arange(16.0) - 7.5).abs(), 0)
        sym = torch.multinomial(probs, k * n, replacement=True, generator=gen)
    else:  # grid: q = s - 128 roughly Laplace, clamped to the alphabet
        q = torch.distributions.Laplace(0.0, 6.0).sample((k * n,)).round().clamp(-128, 127)
        sym = (q + 128).long()
    sym = sym.view(k, n)
    sym.view(-1)[torch.randperm(k * n, generator=gen)[:alphabet]] = torch.arange(alphabet)
    return sym


TCQ_NEXT = ((0, 2), (2, 0), (1, 3), (3, 1))  # the trellis: sigma' = TCQ_NEXT[sigma][k & 1]


def tcq_levels(symbols, chunk_k, restart=True):
    """The spec's tcq levels j [K, N] (int64) of symbols [K, N]: per column a trellis state,
    0 at each chunk's first row (restart=False: never reset, as a decoder missing the reset)."""
    k = symbols.to(torch.int64) - 128
    j = torch.empty_like(k)
    sigma = torch.zeros(k.shape[1], dtype=torch.int64)
    next_state = torch.tensor(TCQ_NEXT)
    for row in range(k.shape[0]):
        if restart and row % chunk_k == 0:
            sigma.zero_()
        j[row] = 2 * k[row] - (sigma >> 1) * torch.sign(k[row])
        sigma = next_state[sigma, k[row] & 1]
    return j


def tcq_wrong_weights(sym, scales, chunk_k):
    """float64 weights of decoders a tcq test must fail: the grid's, a trellis never restarted."""
    return [(sym - 128).double() * scales.double(), tcq_levels(sym, chunk_k, restart=False).double() * scales.double()]


def make_coded(fmt, k, n, chunk_k, prob_bits, group_size, gen):
    """(stream, symbols, scales, zeros, float64 weight [K, N]) of a random coded weight."""
    torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))  # Laplace sampling
    grid_like = fmt in GRID_KINDS
    sym = skewed_symbols(256 if grid_like else rans.alphabet_size(fmt), k, n, gen)
    if grid_like:
        scales = (torch.rand(1, n, generator=gen) * 0.02 + 0.001).half()
        zeros = None
    else:
        groups = 1 if group_size == -1 else k // group_size
        scales = (torch.rand(groups, n, generator=gen) * 0.5 + 0.01).half()
        zeros = (torch.rand(groups, n, generator=gen) * 15).half() if has_zeros(fmt) else None
    if fmt == "tcq":  # the grid's stream; the weight from this file's reference
        stream = rans.encode(sym, 256, chunk_k, prob_bits)
        weight = tcq_levels(sym, chunk_k).double() * scales.double()
    else:
        stream = rans.encode_codes(sym, fmt, chunk_k, prob_bits, group_size)
        weight = dense_from_symbols(sym, scales, zeros, fmt, group_size, torch.float64)
    return stream, sym, scales, zeros, weight


def gemm_args(x, stream, scales, zeros, bias, fmt, k, chunk_k, prob_bits, group_size):
    return (x, stream.words, stream.word_offsets, stream.states, stream.freqs, scales, zeros, bias, fmt, k, chunk_k,
            prob_bits, group_size)


def _check(fmt, dtype, m, n, k, chunk_k, group_size, seed_base, prob_bits=12, bias=True, x_shape=None, splits=None):
    gen = torch.Generator().manual_seed(seed_base)
    stream, sym, scales, zeros, weight = make_coded(fmt, k, n, chunk_k, prob_bits, group_size, gen)
    x = torch.randn(*(x_shape or (m,)), k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    ref = x.double() @ weight + (b.double() if bias else 0.0)
    args = gemm_args(x, stream, scales, zeros, b, fmt, k, chunk_k, prob_bits, group_size)
    # tcq: the case must tell tcq from the grid's kernel and from a trellis not restarted per chunk
    cpu = torch.ops.marlin.rans_gemm(*args)
    if fmt == "tcq":
        for wrong in tcq_wrong_weights(sym, scales, chunk_k):
            assert rel_err(x.double() @ wrong + (b.double() if bias else 0.0), ref) > 3 * GEMM_TOL[dtype]
    for seed in SEEDS:
        out, plan, stats = run_metal_with_stats("rans_gemm", *args, seed=seed)
        assert out.shape == ref.shape and out.dtype == dtype
        family = "rans_gemv_" if plan["M"] <= 8 else "rans_gemm_"
        assert plan["launches"][0]["kernel"] == f"{family}{fmt}_{plan['dtype']}"
        if splits is not None:
            assert (plan["splits"] > 1) == splits, plan
        for launch, st in zip(plan["launches"], stats):
            assert st.threadgroup_memory == launch["threadgroup_memory"] <= 32768
        err = rel_err(out, ref)
        assert err <= GEMM_TOL[dtype], (fmt, dtype, m, n, k, chunk_k, group_size, seed, err)
        assert rel_err(out, cpu) <= GEMM_TOL[dtype]  # the CPU op agrees
    return plan


# --- decode ---------------------------------------------------------------------------

@pytest.mark.parametrize("alphabet, k, n, chunk_k, prob_bits", [
    (16, 200, 70, 64, 12),   # K tail (200 = 3 * 64 + 8), N tail, 3 x 4 chunks
    (16, 96, 32, 96, 10),    # one chunk along K, one block
    (256, 150, 45, 64, 15),  # grid alphabet, prob_bits above the bucket bits: the bucket walk
    (256, 64, 100, 32, 11),
])
def test_decode_matches_reference_codec(alphabet, k, n, chunk_k, prob_bits):
    gen = torch.Generator().manual_seed(k + n)
    torch.manual_seed(k)
    sym = skewed_symbols(alphabet, k, n, gen)
    s = rans.encode(sym, alphabet, chunk_k, prob_bits)
    for seed in SEEDS:
        out, plan, _ = run_metal_with_stats("rans_decode", s.words, s.word_offsets, s.states, s.freqs, k, n, chunk_k,
                                            prob_bits, seed=seed)
        assert plan["launches"][0]["kernel"] == f"rans_decode_s{alphabet}"
        assert out.dtype == torch.uint8 and torch.equal(out.long(), sym)


# --- GEMV and GEMM ----------------------------------------------------------------------

@pytest.mark.parametrize("m", (1, 5, 40))  # fused GEMV at M = 1 and small M, the tile GEMM
@pytest.mark.parametrize("fmt", FORMATS_AND_GRID)
def test_rans_gemm_shapes(fmt, m):
    # K not a multiple of chunk_k, N not a multiple of 32, several chunks along K and N;
    # the dtype and the group size rotate with the format.
    i = FORMATS_AND_GRID.index(fmt)
    dtype = DTYPES[(i + m) % len(DTYPES)]
    if fmt == "grid":
        _check(fmt, dtype, m, 70, 203, 64, 203, seed_base=10 * m + i)
    else:
        group_size = (32, 64, -1)[(i + m) % 3]
        _check(fmt, dtype, m, 70, 192, 128, group_size, seed_base=10 * m + i, bias=m != 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_rans_gemm_dtypes_grid_and_int4(dtype):
    _check("grid", dtype, 1, 40, 100, 32, 100, seed_base=1, prob_bits=14)
    _check("int4", dtype, 33, 40, 128, 64, 16, seed_base=2, prob_bits=10)


def test_rans_gemm_k_split_and_batched_x():
    # Few output tiles and 16 K chunks: the GEMM splits K in 2 slices of 8 whole chunks (512 K).
    plan = _check("fp4", torch.float16, 20, 50, 16 * 64, 64, 32, seed_base=3, splits=True)
    assert plan["launches"][-1]["kernel"] == "marlin_reduce_f16" and plan["splits"] == 2
    # The GEMV's K chunks: one fp32 partial each, summed by marlin_reduce.
    plan = _check("uint4", torch.float32, 3, 33, 96, 32, 32, seed_base=4, x_shape=(3,))
    assert plan["splits"] == 3 and plan["launches"][-1]["kernel"] == "marlin_reduce_f32"
    # One K chunk: the GEMV writes y (bias, one rounding) itself.
    plan = _check("grid", torch.bfloat16, 4, 64, 64, 64, 64, seed_base=5, x_shape=(2, 2))
    assert plan["splits"] == 1 and len(plan["launches"]) == 1


@pytest.mark.parametrize("m, dtype", [(1, torch.float16), (4, torch.bfloat16), (8, torch.float32),  # GEMV
                                      (40, torch.float16), (40, torch.bfloat16), (40, torch.float32)],  # GEMM
                         ids=lambda v: str(v).split(".")[-1])
def test_rans_gemm_tcq(m, dtype):
    # K = 203: 4 chunks of 64 (each restarts the trellis; the GEMM carries it across its
    # 16-row stages), the last one 11 rows (a partial stage); N = 70: a partial column block.
    _check("tcq", dtype, m, 70, 203, 64, 203, seed_base=20 + m, x_shape=(2, m // 2) if m == 8 else None)


def test_rans_gemm_tcq_k_split():
    # 16 K chunks: the GEMM's K split in 2 slices of 8 whole chunks, each chunk restarting the trellis.
    plan = _check("tcq", torch.bfloat16, 20, 50, 16 * 64, 64, 16 * 64, seed_base=21, splits=True)
    assert plan["splits"] == 2 and plan["launches"][-1]["kernel"] == "marlin_reduce_bf16"


def test_rans_gemm_empty_x():
    gen = torch.Generator().manual_seed(0)
    stream, _, scales, zeros, _ = make_coded("fp4", 64, 16, 32, 12, 32, gen)
    out, plan, stats = run_metal_with_stats("rans_gemm", *gemm_args(torch.randn(0, 64).half(), stream, scales, zeros,
                                                                     None, "fp4", 64, 32, 12, 32))
    assert out.shape == (0, 16) and plan["launches"] == [] and stats == []


@pytest.mark.parametrize("fmt", ("affine", "tcq"))  # tcq: the trellis restarts in each chunk of a simdgroup
def test_gemv_runs_on_fewer_simdgroups(fmt):
    """A pipeline allowing fewer threads: the GEMV and the decode loop over their chunks."""
    gen = torch.Generator().manual_seed(6)
    group_size = 128 if fmt == "tcq" else 32
    stream, sym, scales, zeros, weight = make_coded(fmt, 128, 70, 32, 12, group_size, gen)
    x = torch.randn(2, 128, generator=gen)
    args = gemm_args(x, stream, scales, zeros, None, fmt, 128, 32, 12, group_size)
    out, plan, stats = run_metal_with_stats("rans_gemm", *args, max_threads_per_threadgroup=64)
    assert plan["launches"][0]["min_threads_x"] == 32 and stats[0].threads_per_threadgroup == 64
    assert rel_err(out, x.double() @ weight) <= GEMM_TOL[torch.float32]
    s = stream
    dec = run_metal_with_stats("rans_decode", s.words, s.word_offsets, s.states, s.freqs, 128, 70, 32, 12,
                               max_threads_per_threadgroup=32)[0]
    assert torch.equal(dec.long(), sym)


# --- corrupted streams ------------------------------------------------------------------

K_BAD, N_BAD, CHUNK_BAD = 96, 70, 32  # 3 column blocks x 3 K chunks; chunk = 3 * block + K chunk


def _bad_chunk_cases(stream):
    """(name, words, word_offsets, the chunks that must come out bad)."""
    w, o = stream.words, stream.word_offsets
    flipped = w.clone()
    flipped[int(o[4]) + 3] ^= 0x0100  # a bit of a word of chunk 4
    shifted = o.clone()
    shifted[5] += 3  # chunk 4 ends early, chunk 5 starts late
    negative = o.clone()
    negative[2] = -5  # chunk 1 ends before it starts, chunk 2 starts before the words
    beyond = o.clone()
    beyond[-1] = w.numel() + 100  # the last chunk ends past the words
    return [
        ("truncated", w[:-1].clone(), o, {8}),  # word_offsets[-1] > len(words): the last chunk
        ("bit-flipped", flipped, o, {4}),
        ("shifted offset", w, shifted, {4, 5}),
        ("negative offset", w, negative, {1, 2}),
        ("offset past the words", w, beyond, {8}),
    ]


def _chunk_mask(chunks, k, n, chunk_k, kchunks):
    """[K, N] True where a symbol belongs to one of `chunks`."""
    mask = torch.zeros(k, n, dtype=torch.bool)
    for c in chunks:
        b, kc = divmod(c, kchunks)
        mask[kc * chunk_k:(kc + 1) * chunk_k, 32 * b:32 * b + 32] = True
    return mask


@pytest.mark.parametrize("fmt", ("int4", "tcq"))
@pytest.mark.parametrize("m", (1, 12))
def test_corrupted_streams_give_nan_for_the_bad_chunk(m, fmt):
    gen = torch.Generator().manual_seed(7)
    group_size = K_BAD if fmt == "tcq" else 32
    stream, sym, scales, _, weight = make_coded(fmt, K_BAD, N_BAD, CHUNK_BAD, 12, group_size, gen)
    kchunks = K_BAD // CHUNK_BAD
    x = torch.randn(m, K_BAD, generator=gen).half()
    good = x.double() @ weight
    for name, words, offsets, bad in _bad_chunk_cases(stream):
        mask = _chunk_mask(bad, K_BAD, N_BAD, CHUNK_BAD, kchunks)
        corrupt = dataclasses.replace(stream, words=words, word_offsets=offsets)
        args = gemm_args(x, corrupt, scales, None, None, fmt, K_BAD, CHUNK_BAD, 12, group_size)
        out = run_metal_with_stats("rans_gemm", *args)[0]
        with pytest.raises(ValueError, match="corrupted rans stream|word_offsets"):  # the CPU op raises
            torch.ops.marlin.rans_gemm(*args)
        bad_columns = mask.any(0)
        assert torch.isnan(out[:, bad_columns]).all(), name
        assert not torch.isnan(out[:, ~bad_columns]).any(), name
        assert rel_err(out[:, ~bad_columns], good[:, ~bad_columns]) <= GEMM_TOL[torch.float16], name


def test_decode_status_flags_exactly_the_bad_chunks():
    gen = torch.Generator().manual_seed(7)
    stream, sym = make_coded("int4", K_BAD, N_BAD, CHUNK_BAD, 12, 32, gen)[:2]
    for name, words, offsets, bad in _bad_chunk_cases(stream):
        outputs, plan, _ = run_metal_outputs("rans_decode", words, offsets, stream.states, stream.freqs, K_BAD,
                                             N_BAD, CHUNK_BAD, 12)
        assert plan["status_output"] == "status", plan
        assert outputs["status"].tolist() == [int(c in bad) for c in range(9)], name
        mask = _chunk_mask(bad, K_BAD, N_BAD, CHUNK_BAD, K_BAD // CHUNK_BAD)
        assert torch.equal(outputs["out"][~mask].long(), sym[~mask]), name  # the good chunks are decoded


def _truncated_chunk(stream, chunk):
    """The stream without the last word of `chunk` (the later offsets follow): only that chunk is bad."""
    w, o = stream.words, stream.word_offsets
    cut = int(o[chunk + 1]) - 1
    offsets = o.clone()
    offsets[chunk + 1:] -= 1
    return torch.cat([w[:cut], w[cut + 1:]]), offsets


@pytest.mark.parametrize("fmt", ("grid", "fp4"))
def test_corrupted_stream_decode_raises_the_cpu_error(fmt):
    """A bad chunk never decodes to symbols on the Metal path: no uint8 value is
    outside every alphabet (0xFF is the grid's q = +127), so the op raises the
    CPU op's error, naming the chunk."""
    gen = torch.Generator().manual_seed(8)
    stream = make_coded(fmt, K_BAD, N_BAD, CHUNK_BAD, 12, K_BAD if fmt == "grid" else 32, gen)[0]
    cases = [(name, words, offsets, min(bad)) for name, words, offsets, bad in _bad_chunk_cases(stream)]
    cases.append(("chunk 5 truncated", *_truncated_chunk(stream, 5), 5))
    for name, words, offsets, first_bad in cases:
        args = (words, offsets, stream.states, stream.freqs, K_BAD, N_BAD, CHUNK_BAD, 12)
        with pytest.raises(ValueError) as cpu:
            torch.ops.marlin.rans_decode(*args)
        with pytest.raises(ValueError) as metal:
            run_metal_with_stats("rans_decode", *args)
        assert str(metal.value) == str(cpu.value), name
        if "corrupted rans stream" in str(cpu.value):  # else a word_offsets error, before any chunk is decoded
            assert f"chunk {first_bad} " in str(cpu.value), (name, str(cpu.value))
        else:
            assert "word_offsets" in str(cpu.value), (name, str(cpu.value))


def test_bit_flip_is_a_bad_chunk_for_the_reference_codec_too():
    gen = torch.Generator().manual_seed(7)
    stream = make_coded("int4", K_BAD, N_BAD, CHUNK_BAD, 12, 32, gen)[0]
    _, words, offsets, _ = _bad_chunk_cases(stream)[1]
    with pytest.raises(rans.RansStreamError, match="chunk 4"):
        rans.decode(words, offsets, stream.states, stream.freqs, K_BAD, N_BAD, CHUNK_BAD, 12)


# --- the planner ----------------------------------------------------------------------

def _meta(m, n, k, fmt, gs, chunk_k=1024, dtype=torch.float16):
    e = lambda *s, dt: torch.empty(*s, dtype=dt, device="meta")  # noqa: E731
    chunks = -(-n // 32) * -(-k // chunk_k)
    groups = 1 if gs in (-1, k) else k // gs
    grid_like = fmt in GRID_KINDS
    zeros = e(groups, n, dt=torch.float16) if not grid_like and has_zeros(fmt) else None
    return (e(m, k, dt=dtype), e(1000, dt=torch.int16), e(chunks + 1, dt=torch.int32), e(chunks, 32, dt=torch.int32),
            e(256 if grid_like else 16, dt=torch.int16), e(groups, n, dt=torch.float16), zeros, None, fmt, k,
            chunk_k, 12, gs)


@pytest.mark.parametrize("m, kernel", [(1, "gemv"), (8, "gemv"), (9, "gemm"), (4096, "gemm")])
def test_plan_kernel_choice(m, kernel):
    for fmt in KINDS:
        for dtype in DTYPES:
            gs = 4096 if fmt in GRID_KINDS else 128
            plan = metal_plan("rans_gemm", *_meta(m, 4096, 4096, fmt, gs, dtype=dtype))
            launch = plan["launches"][0]
            assert launch["kernel"] == f"rans_{kernel}_{fmt}_{plan['dtype']}" and launch["source"] == "rans"
            assert launch["threadgroup_memory"] <= 32768 and launch["threadgroup_memory"] % 16 == 0
            if kernel == "gemv":  # one chunk per simdgroup, the K chunks reduced in order
                assert launch["grid"] == [128 * 4 // 8, 1, 1] and plan["splits"] == 4
            else:  # 32 x 128 tiles
                assert launch["grid"][:2] == [32, -(-m // 32)]
                assert (plan["splits"] > 1) == (m <= 96), plan  # fewer than 128 tiles: K split
            assert (plan["launches"][-1]["kernel"] == f"marlin_reduce_{plan['dtype']}") == (plan["splits"] > 1)


def test_plan_errors_are_the_cpu_checks():
    args = list(_meta(4, 64, 96, "fp4", 32, chunk_k=32))
    args[4] = torch.empty(256, dtype=torch.int16, device="meta")
    with pytest.raises(ValueError, match=r"freqs must have shape \[16\] for weight_format='fp4'"):
        metal_plan("rans_gemm", *args)
    args = list(_meta(4, 64, 96, "fp4", 32, chunk_k=32))
    args[3] = torch.empty(5, 32, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"states must have shape \[chunks, 32\] = \[6, 32\]"):
        metal_plan("rans_gemm", *args)
    with pytest.raises(ValueError, match=r"prob_bits must be in \[10, 15\], got 16"):
        metal_plan("rans_decode", *_meta(1, 64, 96, "fp4", 32, chunk_k=32)[1:5], 96, 64, 32, 16)


def test_every_kernel_is_planned_and_exists():
    from torch_marlin.testing.metal import library

    kernels = set(library("rans").kernels())
    seen = set()
    for fmt in KINDS:
        for dtype in DTYPES:
            for m, n, k in ((1, 64, 8192), (8, 4096, 4096), (9, 83, 200), (1000, 4096, 4096)):
                gs = k if fmt in GRID_KINDS else (-1 if k == 200 else 128)
                for l in metal_plan("rans_gemm", *_meta(m, n, k, fmt, gs, chunk_k=1024 if k >= 1024 else 64, dtype=dtype))[
                        "launches"]:
                    threads = l["threadgroup"][0] * l["threadgroup"][1] * l["threadgroup"][2]
                    assert l["threadgroup_memory"] * 128 <= 16384 * threads, l  # two threadgroups per core
                    if l["source"] == "rans":
                        assert l["kernel"] in kernels, l["kernel"]
                        seen.add(l["kernel"])
    for symbols, fmt in ((16, "fp4"), (256, "grid")):
        (l,) = metal_plan("rans_decode", *_meta(1, 64, 96, fmt, 96, chunk_k=32)[1:5], 96, 64, 32, 12)["launches"]
        assert l["kernel"] == f"rans_decode_s{symbols}" and l["min_threads_x"] == 32
        seen.add(l["kernel"])
    assert kernels == seen, sorted(kernels ^ seen)


def test_bench_mps_rans_estimates_run_without_a_mac():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mps.py"
    r = subprocess.run([sys.executable, str(script), "--rans", "--plan-only", "--estimates"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "rans_gemv_fp4_f16" in r.stdout and "rans_gemm_fp4_f16" in r.stdout and "M4 Max 40c" in r.stdout
