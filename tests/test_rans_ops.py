"""torch.ops.marlin.rans_decode / rans_gemm on CPU (the entropy-coded layout,
docs/FORMAT.md): against a stream encoder and a per-element decoder written
here from the spec (apart from torch_marlin's codec on purpose), float64
dequantize-then-matmul, and the dense op on the same codes (lossless: equal,
bit for bit). Every kernel build this CPU runs is checked by rerunning the
tests below in a child process with TORCH_MARLIN_CPU_KERNELS set."""

import json
import threading

import numpy as np
import pytest
import torch

import torch_marlin as tm  # noqa: F401  (loads the ops)
from reference import weight_one_by_one
from torch_marlin import formats

LANES = 32
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23}


# --- the stream format, from the spec --------------------------------------------------

def make_freqs(codes, symbols, prob_bits):
    """Frequencies summing to 2^prob_bits, at least 1 for every symbol used."""
    counts = np.bincount(codes.reshape(-1), minlength=symbols).astype(np.float64)
    m = 1 << prob_bits
    freqs = np.where(counts > 0, np.maximum(1, np.floor(counts * m / counts.sum())), 0).astype(np.int64)
    freqs[np.argmax(freqs)] += m - freqs.sum()
    assert freqs.min() >= 0 and freqs.sum() == m and np.all(freqs[counts > 0] >= 1)
    return freqs


def encode(codes, chunk_k, prob_bits, symbols, freqs=None):
    """codes int [K, N] -> the op's tensors (words, word_offsets, states, freqs).
    The spec's reference encoder: per chunk, lanes start at 2^16; for t = len-1..0,
    l = 31..0: emit the low 16 bits while x >= freq << (32 - p), then
    x = (x // freq << p) + x % freq + cum; the chunk's words are the emitted ones reversed."""
    codes = np.asarray(codes, dtype=np.int64)
    k, n = codes.shape
    if freqs is None:
        freqs = make_freqs(codes, symbols, prob_bits)
    freqs = np.asarray(freqs, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(freqs)[:-1]])
    blocks = -(-n // LANES)
    padded = np.full((k, blocks * LANES), int(np.argmax(freqs)), dtype=np.int64)  # pad columns: the most frequent
    padded[:, :n] = codes
    words, offsets, states = [], [0], []
    for b in range(blocks):
        for k0 in range(0, k, chunk_k):
            sym = padded[k0:min(k, k0 + chunk_k), b * LANES:(b + 1) * LANES]
            x = np.full(LANES, 1 << 16, dtype=np.uint64)
            emitted = []
            for t in range(sym.shape[0] - 1, -1, -1):
                f, c = freqs[sym[t]].astype(np.uint64), cum[sym[t]].astype(np.uint64)
                need = x >= (f << np.uint64(32 - prob_bits))
                emitted.extend((x[need] & np.uint64(0xFFFF))[::-1].tolist())  # lanes 31..0
                x = np.where(need, x >> np.uint64(16), x)
                x = ((x // f) << np.uint64(prob_bits)) + x % f + c
            words.extend(emitted[::-1])
            offsets.append(len(words))
            states.append(x)
    return (torch.from_numpy(np.array(words, dtype=np.uint16).view(np.int16)),
            torch.tensor(offsets, dtype=torch.int32),
            torch.from_numpy(np.array(states, dtype=np.uint64).astype(np.uint32).view(np.int32).reshape(-1, LANES)),
            torch.from_numpy(freqs.astype(np.uint16).view(np.int16)))


def decode_one_by_one(words, word_offsets, states, freqs, k, n, chunk_k, prob_bits):
    """Symbols [K][N] (Python lists), one lane and one step at a time, per the spec."""
    words = [w & 0xFFFF for w in words.tolist()]
    offsets = word_offsets.tolist()
    states = [[s & 0xFFFFFFFF for s in row] for row in states.tolist()]
    freqs = [f & 0xFFFF for f in freqs.tolist()]
    cum = [sum(freqs[:s]) for s in range(len(freqs))]
    mask = (1 << prob_bits) - 1
    kchunks = -(-k // chunk_k)
    out = [[None] * n for _ in range(k)]
    for chunk in range(len(offsets) - 1):
        b, c = divmod(chunk, kchunks)
        x, ptr, end = list(states[chunk]), offsets[chunk], offsets[chunk + 1]
        for row in range(c * chunk_k, min(k, (c + 1) * chunk_k)):
            for lane in range(LANES):
                slot = x[lane] & mask
                s = next(s for s in range(len(freqs)) if cum[s] <= slot < cum[s] + freqs[s])
                x[lane] = freqs[s] * (x[lane] >> prob_bits) + slot - cum[s]
                if x[lane] < 1 << 16:
                    assert ptr < end
                    x[lane] = (x[lane] << 16) | words[ptr]
                    ptr += 1
                if b * LANES + lane < n:
                    out[row][b * LANES + lane] = s
        assert ptr == end and all(v == 1 << 16 for v in x)
    return out


def skewed_codes(k, n, symbols, generator=None):
    """Codes with a peaked distribution (what quantized weights look like), every symbol possible."""
    if symbols == 16:
        p = torch.tensor([1, 2, 4, 8, 14, 20, 26, 30, 30, 26, 20, 14, 8, 4, 2, 1], dtype=torch.float64)
    else:
        p = torch.exp(-0.5 * ((torch.arange(256) - 128.0) / 9.0) ** 2) + 1e-4
    return torch.multinomial(p / p.sum(), k * n, replacement=True, generator=generator).view(k, n)


def random_groups(k, n, weight_format, group_size):
    groups = 1 if group_size == -1 else -(-k // group_size)  # a short last group is allowed
    scales = (torch.rand(groups, n) * 0.02 + 0.001).half()
    zeros = (torch.rand(groups, n) * 15).half() if formats.has_zeros(weight_format) else None
    return scales, zeros


# tcq's trellis (docs/FORMAT.md): from state 0 at each chunk's first row, j = 2k - (sigma >> 1) sign(k),
# k = s - 128, then sigma = NEXT[sigma][k & 1].
NEXT = [[0, 2], [2, 0], [1, 3], [3, 1]]


def tcq_levels(symbols, chunk_k):
    """Symbols [K, N] ints 0..255 -> trellis levels j [K, N], one column and one row at a time."""
    k, n = symbols.shape
    j = [[0] * n for _ in range(k)]
    for col in range(n):
        sigma = 0
        for row in range(k):
            if row % chunk_k == 0:
                sigma = 0
            q = int(symbols[row, col]) - 128
            j[row][col] = 2 * q - (sigma >> 1) * ((q > 0) - (q < 0))
            sigma = NEXT[sigma][q & 1]
    return torch.tensor(j, dtype=torch.int64)


def dequantize_codes(codes, scales, zeros, weight_format, group_size, chunk_k=None):
    """float64 B [K, N] per element (tests/reference.py), the grid's (s - 128) * step,
    or tcq's trellis level j * step."""
    k, n = codes.shape
    if weight_format == "grid":
        return (codes.double() - 128) * scales.double()
    if weight_format == "tcq":
        return tcq_levels(codes, chunk_k).double() * scales.double()
    rows = k if group_size == -1 else group_size
    c, s = codes.tolist(), scales.double().tolist()
    z = None if zeros is None else zeros.double().tolist()
    return torch.tensor([[weight_one_by_one(c[r][j], s[r // rows][j], None if z is None else z[r // rows][j],
                                            weight_format) for j in range(n)] for r in range(k)], dtype=torch.float64)


def assert_close_to_reference(y, x, b64, bias=None):
    """One rounding to y's dtype plus fp32 accumulation error, per element."""
    ref = x.double() @ b64 + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ b64.abs() + (0 if bias is None else bias.double().abs())
    bound = 0.5 * EPS[y.dtype] * ref.abs() + 1e-6 * magnitude + 1e-30
    err = (y.double() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert torch.all(err <= bound), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


# --- decode ---------------------------------------------------------------------------

@pytest.mark.parametrize("symbols, prob_bits", [(16, 10), (16, 12), (256, 12), (256, 13), (16, 15), (256, 15)])
def test_encoder_and_decoder_of_the_spec_agree(symbols, prob_bits):
    k, n, chunk_k = 70, 45, 32  # K not a multiple of chunk_k, N not of 32
    codes = skewed_codes(k, n, symbols)
    t = encode(codes.numpy(), chunk_k, prob_bits, symbols)
    assert decode_one_by_one(*t, k, n, chunk_k, prob_bits) == codes.tolist()
    assert torch.equal(torch.ops.marlin.rans_decode(*t, k, n, chunk_k, prob_bits), codes.to(torch.uint8))


@pytest.mark.parametrize("symbols, prob_bits", [(16, 12), (256, 12), (256, 15)])
@pytest.mark.parametrize("k, n, chunk_k", [(1, 1, 32), (33, 31, 32), (300, 100, 128), (1024, 64, 1024), (96, 33, 64)])
def test_decode_op_gives_the_codes(symbols, prob_bits, k, n, chunk_k):
    codes = skewed_codes(k, n, symbols)
    t = encode(codes.numpy(), chunk_k, prob_bits, symbols)
    assert torch.equal(torch.ops.marlin.rans_decode(*t, k, n, chunk_k, prob_bits), codes.to(torch.uint8))


def test_decode_single_symbol_stream_has_no_words():
    codes = torch.full((64, 40), 5)
    t = encode(codes.numpy(), 32, 12, 16)
    assert t[0].numel() == 0
    assert torch.equal(torch.ops.marlin.rans_decode(*t, 64, 40, 32, 12), codes.to(torch.uint8))


# --- gemm -----------------------------------------------------------------------------

ROWS = [1, 3, 32, 128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_format", formats.WEIGHT_FORMATS)
def test_lossless_gemm_equals_the_dense_op(weight_format, dtype):
    """The same codes, scales and zeros through the dense op: the same result, bit for bit,
    whatever the thread count (lossless formats never split K over threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # more threads than the column blocks of N = 33, 45, 70
    try:
        # K = 100: a short last group (G = ceil(K / group_size)), which the dense layout pads with zero rows
        for k, n, group_size, chunk_k in [(320, 70, 64, 128), (256, 33, -1, 96), (512, 96, 128, 256), (100, 45, 32, 64),
                                          (100, 45, -1, 64), (128, 224, 64, 64)]:
            codes = skewed_codes(k, n, 16)
            k_dense = formats.padded_in_features(k, group_size)
            scales, zeros = random_groups(k_dense, n, weight_format, group_size)
            t = encode(codes.numpy(), chunk_k, 12, 16)
            packed = tm.pack_codes(torch.cat([codes, torch.zeros(k_dense - k, n, dtype=codes.dtype)]))
            for m in ROWS:
                x = torch.randn(m, k).to(dtype)
                bias = torch.randn(n).to(dtype) if m % 2 else None
                x_dense = torch.cat([x, torch.zeros(m, k_dense - k, dtype=dtype)], 1)
                dense = torch.ops.marlin.gemm(x_dense, packed, scales, zeros, bias, weight_format, group_size)
                y = torch.ops.marlin.rans_gemm(x, *t, scales, zeros, bias, weight_format, k, chunk_k, 12, group_size)
                assert y.dtype == dtype and torch.equal(y, dense), (k, n, m, (y.float() - dense.float()).abs().max())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_format", [*formats.WEIGHT_FORMATS, "grid", "tcq"])
def test_gemm_matches_float64_reference(weight_format, dtype):
    grid = weight_format in ("grid", "tcq")
    symbols = 256 if grid else 16
    for m, k, n, group_size, chunk_k, prob_bits in [(1, 100, 45, -1, 64, 12), (3, 96, 70, 32, 32, 14),
                                                     (32, 200, 33, -1, 96, 12), (128, 160, 64, 32, 64, 15),
                                                     (2, 100, 40, 32, 64, 12), (17, 100, 40, 64, 64, 13)]:
        if grid:
            group_size = k
        codes = skewed_codes(k, n, symbols)
        if grid:
            scales, zeros = (torch.rand(1, n) * 0.002 + 0.0001).half(), None
        else:
            scales, zeros = random_groups(k, n, weight_format, group_size)
        t = encode(codes.numpy(), chunk_k, prob_bits, symbols)
        b64 = dequantize_codes(codes, scales, zeros, weight_format, group_size, chunk_k)
        x = torch.randn(2, m, k).to(dtype)  # batch dimensions: [..., K]
        bias = torch.randn(n).to(dtype) if m % 2 else None
        y = torch.ops.marlin.rans_gemm(x, *t, scales, zeros, bias, weight_format, k, chunk_k, prob_bits, group_size)
        assert y.shape == (2, m, n)
        assert_close_to_reference(y.view(-1, n), x.view(-1, k), b64, bias)


@pytest.mark.parametrize("weight_format", ["fp4", "grid", "tcq"])
def test_gemm_column_tails(weight_format):
    """The tile GEMM's work items of 128 columns (4 column blocks decoded in lockstep on
    AVX-512): N = 64 j + r with an odd number of 32-column blocks and a part block in the last
    item, against the float64 reference, the same bits whatever the thread count."""
    grid = weight_format in ("grid", "tcq")
    k, chunk_k = 192, 64
    for n in (160, 200, 224, 330):
        codes = skewed_codes(k, n, 256 if grid else 16)
        if grid:
            scales, zeros, group_size = (torch.rand(1, n) * 0.002 + 0.0001).half(), None, k
        else:
            group_size = 64
            scales, zeros = random_groups(k, n, weight_format, group_size)
        t = encode(codes.numpy(), chunk_k, 12, 256 if grid else 16)
        b64 = dequantize_codes(codes, scales, zeros, weight_format, group_size, chunk_k)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(32, k).to(dtype)
            ys = []
            for threads in (1, 3):
                saved = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    ys.append(torch.ops.marlin.rans_gemm(x, *t, scales, zeros, None, weight_format, k, chunk_k, 12,
                                                         group_size))
                finally:
                    torch.set_num_threads(saved)
            assert torch.equal(ys[0], ys[1]), (n, dtype)
            assert_close_to_reference(ys[0], x, b64)


def tail_freqs(core, tail, prob_bits, tail_freq=1):
    """Grid freqs: `core` Gaussian symbols with `tail` symbols of frequency tail_freq on each side."""
    f = np.zeros(256, np.int64)
    c0 = (256 - core) // 2
    f[c0 - tail:c0] = f[c0 + core:c0 + core + tail] = tail_freq
    w = np.exp(-0.5 * ((np.arange(core) - (core - 1) / 2) / (core / 5)) ** 2)
    f[c0:c0 + core] = np.maximum(1, np.floor(w / w.sum() * ((1 << prob_bits) - 2 * tail * tail_freq)))
    f[c0 + core // 2] += (1 << prob_bits) - f.sum()
    return f


def one_tail_freqs():
    f = np.zeros(256, np.int64)
    f[100:104] = 2048
    f[104:144] = 1
    f[101] -= 40
    return f


# Tables that take each variant of the AVX-512 builds' lookup in registers and
# of the AVX2 builds' byte tables (rans_kernel_args.h;
# tests/cpu_kernels/check_rans_kernels.cpp checks the variants of many more):
# (prob_bits, freqs, what it takes).
LOOKUP_TABLES = [
    (12, tail_freqs(24, 20, 12), "64 symbols (the most), 2 halvings, split buckets of 16"),
    (12, tail_freqs(30, 18, 12), "66 symbols: the slot table"),
    (13, tail_freqs(30, 12, 13), "2 halvings, split buckets of 32"),
    (10, tail_freqs(12, 2, 10), "the fewest prob_bits: 1 halving, split buckets of 16"),
    (15, tail_freqs(20, 3, 15), "the most prob_bits: 2 halvings, split buckets of 16"),
    (13, one_tail_freqs(), "1 halving, one split bucket of 64"),
    (12, np.array([0] * 100 + [1024] * 4 + [0] * 152), "no search: one symbol per bucket"),
    (12, tail_freqs(12, 2, 12), "AVX2 byte tables of 16 entries, 3 compares by table"),
    (11, tail_freqs(10, 3, 11), "AVX2 byte tables of 16 entries, 2 split buckets of a run of 3"),
    (12, tail_freqs(24, 4, 12), "AVX2 byte tables of 32 entries, 2 split buckets of a run of 4 and 2 more compares"),
    (12, tail_freqs(24, 2, 12, tail_freq=2), "AVX2 byte tables of 32 entries, 2 split buckets of 4 more compares (the most)"),
    (12, tail_freqs(24, 3, 12, tail_freq=2), "AVX2: the slot table (a split bucket of 5 more compares, no run)"),
]


@pytest.mark.parametrize("prob_bits, freqs, what", LOOKUP_TABLES, ids=[t[2] for t in LOOKUP_TABLES])
def test_every_symbol_lookup_decodes(prob_bits, freqs, what):
    """Symbols drawn evenly among those of the table (rare ones as often as the rest),
    through decode, the fused GEMV (M = 1, 5) and the tile GEMM (M = 32), grid and tcq."""
    k, n, chunk_k = 256, 70, 128
    used = np.flatnonzero(freqs)
    codes = torch.from_numpy(used[np.random.default_rng(0).integers(0, len(used), (k, n))])
    t = encode(codes.numpy(), chunk_k, prob_bits, 256, freqs)
    assert torch.equal(torch.ops.marlin.rans_decode(*t, k, n, chunk_k, prob_bits), codes.to(torch.uint8))
    scales = (torch.rand(1, n) * 0.002 + 0.0001).half()
    for weight_format in ("grid", "tcq"):
        b64 = dequantize_codes(codes, scales, None, weight_format, k, chunk_k)
        for m in (1, 5, 32):
            x = torch.randn(m, k).to(torch.bfloat16)
            y = torch.ops.marlin.rans_gemm(x, *t, scales, None, None, weight_format, k, chunk_k, prob_bits, k)
            assert_close_to_reference(y, x, b64)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("weight_format", ["grid", "tcq", "uint4"])
def test_gemv_split_over_k_is_deterministic(weight_format, threads):
    """Few column blocks: the grid's (and tcq's) GEMV splits K over threads and adds the parts
    in order; tcq's trellis restarts at each K chunk, so the parts decode alone."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k, n, chunk_k = 1024, 40, 128
        grid = weight_format in ("grid", "tcq")
        symbols, group_size = (256, k) if grid else (16, 128)
        codes = skewed_codes(k, n, symbols)
        scales, zeros = ((torch.rand(1, n) * 0.002).half(), None) if grid else \
            random_groups(k, n, weight_format, group_size)
        t = encode(codes.numpy(), chunk_k, 12, symbols)
        x = torch.randn(2, k)
        y = torch.ops.marlin.rans_gemm(x, *t, scales, zeros, None, weight_format, k, chunk_k, 12, group_size)
        assert torch.equal(y, torch.ops.marlin.rans_gemm(x, *t, scales, zeros, None, weight_format, k, chunk_k, 12,
                                                         group_size))
        assert_close_to_reference(y, x, dequantize_codes(codes, scales, zeros, weight_format, group_size, chunk_k))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tcq_gemm_of_random_symbols_matches_float64_reference(dtype):
    """Any symbols are a tcq stream: uniform ones over all 256 reach the extreme levels -256 and 254.
    Every M class (GEMV 1-8, tiles above), N not a multiple of 32, several K chunks (the trellis
    restarts in each) and a short last one (12 rows; 1 row), tiles of 256 K rows that end inside a
    chunk (the M > 8 fill carries the states over), odd K (no bf16 pairs) too."""
    generator = torch.Generator().manual_seed(5)
    for k, n, chunk_k in [(300, 45, 96), (257, 70, 64), (600, 40, 512)]:
        codes = torch.randint(0, 256, (k, n), generator=generator)
        scales = (torch.rand(1, n, generator=generator) * 0.002 + 0.0001).half()
        t = encode(codes.numpy(), chunk_k, 12, 256)
        b64 = dequantize_codes(codes, scales, None, "tcq", k, chunk_k)
        assert b64.abs().max() > 200 * scales.double().min()  # the wide levels are exercised
        for m in [1, 4, 8, 9, 32, 64, 130]:
            x = torch.randn(m, k, generator=generator).to(dtype)
            bias = torch.randn(n, generator=generator).to(dtype) if m % 2 else None
            y = torch.ops.marlin.rans_gemm(x, *t, scales, None, bias, "tcq", k, chunk_k, 12, -1)
            assert_close_to_reference(y, x, b64, bias)


def test_tcq_is_not_the_grid():
    """The same stream as "grid" and as "tcq": the trellis doubles the even states' levels and
    shifts the odd states' by one toward zero, so the results differ (a kernel that ignored
    the kind would pass the reference tests of neither)."""
    k, n, chunk_k = 128, 40, 64
    codes = skewed_codes(k, n, 256)
    t = encode(codes.numpy(), chunk_k, 12, 256)
    scales = torch.full((1, n), 0.01).half()
    x = torch.randn(3, k)
    grid = torch.ops.marlin.rans_gemm(x, *t, scales, None, None, "grid", k, chunk_k, 12, -1)
    tcq = torch.ops.marlin.rans_gemm(x, *t, scales, None, None, "tcq", k, chunk_k, 12, -1)
    assert_close_to_reference(tcq, x, dequantize_codes(codes, scales, None, "tcq", k, chunk_k))
    assert (tcq - grid).abs().max() > 0.1


def test_gemm_empty_batch():
    codes = skewed_codes(64, 8, 16)
    t = encode(codes.numpy(), 32, 12, 16)
    y = torch.ops.marlin.rans_gemm(torch.randn(0, 64), *t, torch.ones(1, 8).half(), None, None, "fp4", 64, 32, 12, -1)
    assert y.shape == (0, 8)


# --- bad input ------------------------------------------------------------------------

def grid_case(k=200, n=70, chunk_k=64, prob_bits=12):
    """The same case at every call (the bad-argument cases are built from one)."""
    generator = torch.Generator().manual_seed(23)
    codes = skewed_codes(k, n, 256, generator)
    words, offsets, states, freqs = encode(codes.numpy(), chunk_k, prob_bits, 256)
    return dict(x=torch.randn(3, k, generator=generator), words=words, word_offsets=offsets, states=states, freqs=freqs,
                scales=torch.full((1, n), 0.01).half(), zeros=None, bias=None, weight_format="grid", K=k,
                chunk_k=chunk_k, prob_bits=prob_bits, group_size=k)


def run_gemm(a):
    return torch.ops.marlin.rans_gemm(a["x"], a["words"], a["word_offsets"], a["states"], a["freqs"], a["scales"],
                                      a["zeros"], a["bias"], a["weight_format"], a["K"], a["chunk_k"],
                                      a["prob_bits"], a["group_size"])


def run_decode(a):
    return torch.ops.marlin.rans_decode(a["words"], a["word_offsets"], a["states"], a["freqs"], a["K"],
                                        a["scales"].shape[1], a["chunk_k"], a["prob_bits"])


def flipped(words, index, bit):
    w = words.clone()
    w[index] ^= 1 << bit
    return w


CORRUPT = 'corrupted rans stream: chunk'


def tcq_case(k=200, n=70, chunk_k=64, prob_bits=12):
    return dict(grid_case(k, n, chunk_k, prob_bits), weight_format="tcq")


def lossless_case(k=200, n=70, chunk_k=64, prob_bits=12):
    """fp4 codes of 16 symbols: the AVX-512 builds look their slots up in registers, not in the slot table."""
    generator = torch.Generator().manual_seed(23)
    codes = skewed_codes(k, n, 16, generator)
    words, offsets, states, freqs = encode(codes.numpy(), chunk_k, prob_bits, 16)
    return dict(grid_case(k, n, chunk_k, prob_bits), words=words, word_offsets=offsets, states=states, freqs=freqs,
                weight_format="fp4", group_size=-1)


@pytest.mark.parametrize("case", [grid_case, tcq_case, lossless_case])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_corrupted_streams_are_clear_errors(rows, case):
    a = case()
    a["x"] = torch.randn(rows, a["K"])
    w, o = a["words"], a["word_offsets"]
    cases = [
        # truncated: the last chunk's words cut short, offsets kept consistent
        (dict(words=w[:-5], word_offsets=torch.cat([o[:-1], o[-1:] - 5])), CORRUPT),
        # a bit flipped in the middle of each of a few chunks' words
        *[(dict(words=flipped(w, int(o[c] + (o[c + 1] - o[c]) // 2), bit)), CORRUPT) for c, bit in [(0, 0), (4, 7), (8, 15)]],
        # words moved between two chunks (offsets still monotone and complete)
        (dict(word_offsets=torch.cat([o[:3], o[3:4] + 2, o[4:]])), CORRUPT),
        # a final state of a chunk changed
        (dict(states=a["states"] + torch.tensor([[0] * 31 + [1]] + [[0] * 32] * (a["states"].shape[0] - 1),
                                                dtype=torch.int32)), CORRUPT),
    ]
    for over, message in cases:
        b = dict(a, **over)
        with pytest.raises(ValueError, match=message):
            run_gemm(b)
        with pytest.raises(ValueError, match=message):
            run_decode(b)


def test_swapped_freqs_are_a_clear_error():
    a = grid_case()
    f = a["freqs"].clone()
    f[[127, 128]] = f[[128, 127]]  # still sums to 2^prob_bits: only the decode can tell
    for run in (run_gemm, run_decode):
        with pytest.raises(ValueError, match=CORRUPT):
            run(dict(a, freqs=f))


# --- the lookup tables the op keeps per distinct freqs (rans_ops.cpp) --------------------

def test_freqs_rewritten_in_place_decode_by_their_new_contents():
    """The same freqs tensor (same object and address) rewritten between calls: stale tables would decode wrongly."""
    generator = torch.Generator().manual_seed(5)
    k, n, chunk_k = 96, 40, 32
    codes = [skewed_codes(k, n, 256, generator) for _ in range(2)]
    streams = [encode(c.numpy(), chunk_k, 12, 256) for c in codes]
    assert not torch.equal(streams[0][3], streams[1][3])
    freqs = streams[0][3].clone()
    x = torch.randn(3, k, generator=generator)
    scales = torch.full((1, n), 0.01).half()
    for i in (0, 1, 0):
        freqs.copy_(streams[i][3])
        y = torch.ops.marlin.rans_gemm(x, *streams[i][:3], freqs, scales, None, None, "grid", k, chunk_k, 12, -1)
        assert_close_to_reference(y, x, dequantize_codes(codes[i], scales, None, "grid", -1))
        decoded = torch.ops.marlin.rans_decode(*streams[i][:3], freqs, k, n, chunk_k, 12)
        assert torch.equal(decoded, codes[i].to(torch.uint8))


def distinct_tables(count, k=32, n=32, prob_bits=15):
    """count weights of distinct freqs: prob_bits 15's 256 KB slot tables, so that 80 overflow the 16 MB kept."""
    generator = torch.Generator().manual_seed(11)
    weights = []
    for _ in range(count):
        codes = skewed_codes(k, n, 256, generator)
        weights.append((codes, encode(codes.numpy(), k, prob_bits, 256)))
    assert len({bytes(w[1][3].numpy()) for w in weights}) == count
    return weights


def test_more_tables_than_are_kept_still_decode():
    weights = distinct_tables(80)
    for _ in range(2):  # the second pass finds the first tables dropped
        for codes, streams in weights:
            assert torch.equal(torch.ops.marlin.rans_decode(*streams, 32, 32, 32, 15), codes.to(torch.uint8))


def test_tables_shared_by_threads():
    weights = distinct_tables(12)
    x = torch.randn(2, 32)
    scales = torch.full((1, 32), 0.01).half()
    expected = [x.double() @ dequantize_codes(codes, scales, None, "grid", -1) for codes, _ in weights]
    failures = []

    def work(t):
        for j in range(60):
            i = (t * 5 + j) % len(weights)
            y = torch.ops.marlin.rans_gemm(x, *weights[i][1], scales, None, None, "grid", 32, 32, 15, -1)
            if not torch.allclose(y.double(), expected[i], rtol=1e-5, atol=1e-5):
                failures.append((t, j))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def _bad_args():
    a = grid_case()
    o, s, f, w = a["word_offsets"], a["states"], a["freqs"], a["words"]
    bump = f.clone()
    bump[0] += 1
    low = s.clone()
    low[2, 5] = 65535
    return [
        (dict(freqs=bump), r"freqs must sum to 2\^prob_bits = 4096, got 4097"),
        (dict(freqs=f[:16]), r"freqs must have shape \[256\] for weight_format='grid'"),
        (dict(freqs=f.int()), "freqs must be int16"),
        (dict(word_offsets=o.flip(0)), r"word_offsets\[0\] must be 0"),
        (dict(word_offsets=torch.cat([o[:2], o[1:2] - 1, o[3:]])), "word_offsets must not decrease"),
        (dict(word_offsets=o[:-1]), r"word_offsets must have shape \[chunks \+ 1\] = \[13\]"),
        (dict(words=w[:-1]), r"word_offsets\[-1\] must be <= words.numel\(\) = \d+, got \d+ \(truncated words\?\)"),
        (dict(words=w.int()), "words must be int16"),
        (dict(states=low), r"states must be in \[2\^16, 2\^32\) as uint32, got 65535 at \[2, 5\]"),
        (dict(states=s[:, :16].contiguous()), r"states must have shape \[chunks, 32\] = \[12, 32\]"),
        (dict(chunk_k=48), r"chunk_k must be a multiple of 32 in \[32, K rounded up to 32 = 224\], got 48"),
        (dict(chunk_k=256), r"chunk_k must be a multiple of 32"),
        (dict(prob_bits=16), r"prob_bits must be in \[10, 15\], got 16"),
        (dict(prob_bits=9), r"prob_bits must be in \[10, 15\], got 9"),
        (dict(weight_format="fp8"), r"weight_format must be 'grid', 'tcq' or a value format \('fp4', .*\), got 'fp8'"),
        (dict(group_size=64), "group_size must be K = 200 \\(or -1\\) for weight_format='grid'"),
        (dict(zeros=torch.ones(1, 70).half()), "zeros must be None for weight_format='grid'"),
        (dict(scales=torch.ones(2, 70).half()), r"scales must have shape \[K/group_size, N\] = \[1, 70\]"),
        (dict(scales=torch.ones(1, 70)), "scales must be float16"),
        (dict(x=torch.randn(3, 199)), "x.size\\(-1\\) must equal K = the argument K = 200"),
        (dict(x=torch.randn(3, 200).double()), "x must be float16, bfloat16 or float32"),
        (dict(bias=torch.randn(71)), r"bias must have shape \[N\] = \[70\]"),
        (dict(K=0), "K must be >= 1"),
    ]


@pytest.mark.parametrize("over, message", _bad_args())
def test_bad_arguments_are_clear_errors(over, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        run_gemm(dict(grid_case(), **over))


def test_lossless_argument_rules():
    k, n = 256, 40
    codes = skewed_codes(k, n, 16)
    t = encode(codes.numpy(), 96, 12, 16)
    scales, zeros = random_groups(k, n, "uint4", 64)
    with pytest.raises(ValueError, match="chunk_k = 96 must be a multiple of group_size = 64"):
        torch.ops.marlin.rans_gemm(torch.randn(1, k), *t, scales, zeros, None, "uint4", k, 96, 12, 64)
    with pytest.raises(ValueError, match="zeros is required for weight_format='uint4'"):
        torch.ops.marlin.rans_gemm(torch.randn(1, k), *t, scales, None, None, "uint4", k, 96, 12, 64)
    grid = encode(codes.numpy(), 96, 12, 256)
    with pytest.raises(ValueError, match=r"freqs must have shape \[16\] for weight_format='fp4'"):
        torch.ops.marlin.rans_gemm(torch.randn(1, k), *grid, scales, None, None, "fp4", k, 96, 12, 64)


# --- the same tests under every kernel build --------------------------------------------

REFERENCE_TESTS = ["test_encoder_and_decoder_of_the_spec_agree", "test_decode_op_gives_the_codes",
                   "test_lossless_gemm_equals_the_dense_op", "test_gemm_matches_float64_reference",
                   "test_gemv_split_over_k_is_deterministic", "test_tcq_gemm_of_random_symbols_matches_float64_reference",
                   "test_tcq_is_not_the_grid", "test_corrupted_streams_are_clear_errors",
                   "test_swapped_freqs_are_a_clear_error", "test_decode_single_symbol_stream_has_no_words",
                   "test_every_symbol_lookup_decodes"]


def cpu_kernels():
    return json.loads(torch.ops.marlin._cpu_kernels())


@pytest.mark.parametrize("build", list(cpu_kernels()["builds"]))
def test_kernel_build_matches_reference(build, rerun_under_build):
    """Each build this CPU runs, forced by environment variable; the aarch64 builds run
    under qemu in test_cpu_kernels_aarch64.py."""
    rerun_under_build(build, "test_rans_ops.py", [__file__, "-k", " or ".join(REFERENCE_TESTS)])


# --- fake kernels, autograd, torch.compile (registered by torch_marlin/layouts/rans.py) ----

@pytest.mark.parametrize("weight_format", ["uint4", "grid", "tcq"])
def test_opcheck(weight_format):
    k, n, chunk_k = 96, 40, 32
    grid = weight_format in ("grid", "tcq")
    symbols, group_size = (256, -1) if grid else (16, 32)
    codes = skewed_codes(k, n, symbols)
    t = encode(codes.numpy(), chunk_k, 12, symbols)
    scales, zeros = ((torch.rand(1, n) * 0.01).half(), None) if grid else \
        random_groups(k, n, weight_format, group_size)
    for x in (torch.randn(3, k, requires_grad=True), torch.randn(2, 1, k).bfloat16()):
        bias = torch.randn(n).to(x.dtype)
        torch.library.opcheck(torch.ops.marlin.rans_gemm.default,
                              (x, *t, scales, zeros, bias, weight_format, k, chunk_k, 12, group_size))
    torch.library.opcheck(torch.ops.marlin.rans_decode.default, (*t, k, n, chunk_k, 12))


@pytest.mark.parametrize("weight_format", ["grid", "tcq"])
def test_torch_compile_fullgraph(weight_format):
    k, n, chunk_k = 128, 70, 64
    codes = skewed_codes(k, n, 256)
    t = encode(codes.numpy(), chunk_k, 12, 256)
    scales = (torch.rand(1, n) * 0.01).half()

    def f(x):
        return torch.nn.functional.gelu(torch.ops.marlin.rans_gemm(x, *t, scales, None, None, weight_format, k, chunk_k, 12,
                                                                   -1)) * 2

    for rows in (1, 16):
        x = torch.randn(rows, k)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            torch.testing.assert_close(torch.compile(f, fullgraph=True, backend=backend)(x), f(x))
