"""The rANS codec of the entropy-coded layout (torch_marlin/rans.py) against a
per-element decoder written here from docs/FORMAT.md ("Entropy-coded layout")."""

import numpy as np
import pytest
import torch

from reference import tcq_levels_one_by_one
from torch_marlin import rans


def decode_per_element(words, word_offsets, states, freqs, k, n, chunk_k, prob_bits):
    """One chunk, one step, one lane at a time, plain Python ints (docs/FORMAT.md)."""
    words = [w & 0xFFFF for w in words.tolist()]
    offsets = word_offsets.tolist()
    states = [[s & 0xFFFFFFFF for s in row] for row in states.tolist()]
    freqs = [f & 0xFFFF for f in freqs.tolist()]
    m = 1 << prob_bits
    assert sum(freqs) == m
    cum = [sum(freqs[:s]) for s in range(len(freqs))]
    nk = (k + chunk_k - 1) // chunk_k
    nb = (n + 31) // 32
    out = [[None] * n for _ in range(k)]
    for b in range(nb):
        for c in range(nk):
            i = b * nk + c
            x = list(states[i])
            ptr, end = offsets[i], offsets[i + 1]
            for t in range(min(chunk_k, k - c * chunk_k)):
                need = []
                for lane in range(32):
                    slot = x[lane] % m
                    s = next(s for s in range(len(freqs)) if cum[s] <= slot < cum[s] + freqs[s])
                    col = 32 * b + lane
                    if col < n:
                        out[c * chunk_k + t][col] = s
                    x[lane] = freqs[s] * (x[lane] // m) + slot - cum[s]
                    need.append(x[lane] < 65536)
                for lane in range(32):
                    if need[lane]:
                        if ptr >= end:
                            raise ValueError("read past the chunk")
                        x[lane] = x[lane] * 65536 + words[ptr]
                        ptr += 1
            if ptr != end or any(v != 65536 for v in x):
                raise ValueError("chunk does not end clean")
    return torch.tensor(out, dtype=torch.uint8)


def _symbols(rng, k, n, alphabet, kind):
    if kind == "normal":
        return np.clip(np.round(rng.normal(alphabet / 2, alphabet / 12, (k, n))), 0, alphabet - 1).astype(np.int64)
    if kind == "uniform":
        return rng.integers(0, alphabet, (k, n))
    if kind == "single":
        return np.full((k, n), 3)
    if kind == "skewed":  # one symbol ~ always, a few rare ones including the extremes
        sym = np.full((k, n), alphabet // 2)
        rare = rng.random((k, n)) < 0.01
        sym[rare] = rng.choice([0, 1, alphabet - 1], rare.sum())
        return sym
    if kind == "two":
        return rng.integers(0, 2, (k, n)) * (alphabet - 1)
    raise ValueError(kind)


@pytest.mark.parametrize("alphabet", [16, 256])
@pytest.mark.parametrize("kind", ["normal", "uniform", "single", "skewed", "two"])
@pytest.mark.parametrize("k,n,chunk_k,prob_bits", [(70, 45, 32, 12), (64, 32, 64, 10), (33, 7, 32, 15)])
def test_round_trip_matches_per_element_decoder(alphabet, kind, k, n, chunk_k, prob_bits):
    rng = np.random.default_rng(k * n + alphabet)
    sym = _symbols(rng, k, n, alphabet, kind)
    stream = rans.encode(sym, alphabet, chunk_k, prob_bits)
    assert stream.words.dtype == torch.int16 and stream.states.dtype == torch.int32
    assert stream.word_offsets.dtype == torch.int32 and stream.freqs.dtype == torch.int16
    nchunks = ((n + 31) // 32) * ((k + chunk_k - 1) // chunk_k)
    assert stream.states.shape == (nchunks, 32) and stream.word_offsets.shape == (nchunks + 1,)
    expected = torch.from_numpy(sym.astype(np.uint8))
    args = (stream.words, stream.word_offsets, stream.states, stream.freqs, k, n, chunk_k, prob_bits)
    assert torch.equal(decode_per_element(*args), expected)
    assert torch.equal(rans.decode(*args), expected)


def test_large_weight_is_close_to_entropy():
    rng = np.random.default_rng(0)
    sym = np.clip(np.round(rng.laplace(128, 6, (2048, 512))), 0, 255).astype(np.int64)
    stream = rans.encode(sym, 256, 1024, 12)
    decoded = rans.decode(stream.words, stream.word_offsets, stream.states, stream.freqs, 2048, 512, 1024, 12)
    assert torch.equal(decoded, torch.from_numpy(sym.astype(np.uint8)))
    coded_bits = stream.words.numel() * 16 / sym.size
    assert coded_bits <= rans.entropy_bits(sym, 256) * 1.01


def test_normalize_freqs():
    f = rans.normalize_freqs([1000000, 1, 0, 3], 10)
    assert f.dtype == np.uint16 and int(f.sum()) == 1024
    assert f[1] >= 1 and f[3] >= 1 and f[2] == 0
    f = rans.normalize_freqs(np.ones(256), 10)  # every symbol used, 4 units each
    assert (f == 4).all()
    assert rans.normalize_freqs([0, 5], 15).tolist() == [0, 32768]
    with pytest.raises(ValueError, match="prob_bits"):
        rans.normalize_freqs([1, 2], 16)
    with pytest.raises(ValueError, match="counts"):
        rans.normalize_freqs([0, 0], 12)


def _stream(k=96, n=40, chunk_k=32, p=12, alphabet=16):
    sym = _symbols(np.random.default_rng(1), k, n, alphabet, "normal")
    return rans.encode(sym, alphabet, chunk_k, p), (k, n, chunk_k, p)


def _decode(s, shape):
    return rans.decode(s.words, s.word_offsets, s.states, s.freqs, *shape)


def test_truncated_stream_is_refused():
    s, shape = _stream()
    with pytest.raises(rans.RansStreamError, match="word_offsets"):
        _decode(rans.RansStream(s.words[:-1], s.word_offsets, s.states, s.freqs), shape)
    # Shortened consistently: the last chunk's reads run past its end.
    offsets = s.word_offsets.clone()
    offsets[-1] -= 1
    with pytest.raises(rans.RansStreamError, match="chunk"):
        _decode(rans.RansStream(s.words[:-1], offsets, s.states, s.freqs), shape)


@pytest.mark.parametrize("what", ["words", "states", "freqs"])
def test_bit_flips_are_detected(what):
    s, shape = _stream()
    detected = 0
    rng = np.random.default_rng(2)
    for trial in range(20):
        t = {"words": s.words, "states": s.states, "freqs": s.freqs}[what].clone()
        flat = t.view(-1)
        i = int(rng.integers(flat.numel()))
        bits = 15 if t.dtype == torch.int16 else 31
        flat[i] = flat[i] ^ (1 << int(rng.integers(bits)))
        parts = {"words": s.words, "word_offsets": s.word_offsets, "states": s.states, "freqs": s.freqs, what: t}
        try:
            out = _decode(rans.RansStream(**parts), shape)
        except rans.RansStreamError:
            detected += 1
        else:  # a flip the integrity checks cannot see must at least not be silent garbage everywhere
            assert out.shape == (shape[0], shape[1])
    # freqs flips break the sum, state and word flips almost always the final-state check.
    assert detected >= 18


def test_bad_tables_and_offsets_are_refused():
    s, shape = _stream()
    freqs = s.freqs.clone()
    freqs[0] += 1
    with pytest.raises(rans.RansStreamError, match="freqs must sum"):
        _decode(rans.RansStream(s.words, s.word_offsets, s.states, freqs), shape)
    offsets = s.word_offsets.clone()
    offsets[1], offsets[2] = offsets[2], offsets[1]
    if offsets[1] != offsets[2]:
        with pytest.raises(rans.RansStreamError, match="word_offsets"):
            _decode(rans.RansStream(s.words, offsets, s.states, s.freqs), shape)
    states = s.states.clone()
    states[0, 0] = 5
    with pytest.raises(rans.RansStreamError, match="states must be in"):
        _decode(rans.RansStream(s.words, s.word_offsets, states, s.freqs), shape)
    with pytest.raises(rans.RansStreamError, match="states must have shape"):
        _decode(rans.RansStream(s.words, s.word_offsets, s.states[1:], s.freqs), shape)
    with pytest.raises(rans.RansStreamError, match="words must be a torch.int16"):
        _decode(rans.RansStream(s.words.int(), s.word_offsets, s.states, s.freqs), shape)


def test_bad_arguments():
    with pytest.raises(ValueError, match="chunk_k must be a positive multiple of 32"):
        rans.encode(np.zeros((4, 4), np.int64), 16, 48)
    with pytest.raises(ValueError, match="prob_bits"):
        rans.encode(np.zeros((4, 4), np.int64), 16, 32, 9)
    with pytest.raises(ValueError, match=r"symbols must be in \[0, 16\)"):
        rans.encode(np.full((4, 4), 16), 16, 32)
    with pytest.raises(ValueError, match="symbols must be a non-empty 2-D"):
        rans.encode(np.zeros((4,), np.int64), 16, 32)
    with pytest.raises(ValueError, match="chunk_k must be a multiple of group_size"):
        rans.encode_codes(torch.zeros(256, 8, dtype=torch.uint8), "int4", chunk_k=96, group_size=64)


# --- value kind "tcq": symbols through the 4-state trellis ---------------------------------

def test_tcq_levels_by_hand():
    # state 0: k=1 -> 2 (state 2); k=1 -> 1 (state 3); k=-1 -> -1 (state 1); k=2 -> 4 (state 2);
    # k=0 -> 0 (state 1); then the next chunk starts again in state 0: k=1 -> 2.
    column = [129, 129, 127, 130, 128] + [128] * 27 + [129]
    symbols = torch.tensor(column, dtype=torch.uint8).unsqueeze(1)
    levels = rans.tcq_levels(symbols, 32)[:, 0].tolist()
    assert levels[:5] == [2, 1, -1, 4, 0] and levels[32] == 2
    # One chunk of 64: k=0 moves state 1 to 2 and 2 to 1, so row 32 is read in state 2: k=1 -> 1.
    assert rans.tcq_levels(symbols, 64)[32, 0] == 1


@pytest.mark.parametrize("k,n,chunk_k", [(70, 45, 32), (64, 33, 64), (200, 7, 96)])
def test_tcq_levels_match_the_per_element_decoder(k, n, chunk_k):
    rng = np.random.default_rng(k + n)
    sym = np.clip(np.round(rng.normal(128, 20, (k, n))), 0, 255).astype(np.int64)
    sym[0, 0], sym[1, 0], sym[-1, -1] = 0, 255, 1  # the extremes decode too
    stream = rans.encode(sym, 256, chunk_k, 12)
    decoded = rans.decode(stream.words, stream.word_offsets, stream.states, stream.freqs, k, n, chunk_k, 12)
    expected = torch.tensor(tcq_levels_one_by_one(sym.tolist(), chunk_k))
    levels = rans.tcq_levels(decoded, chunk_k)
    assert levels.dtype == torch.int64 and torch.equal(levels, expected)
    assert torch.equal(rans.tcq_levels(torch.from_numpy(sym), chunk_k), expected)  # any integer dtype
    assert int(levels.min()) >= -256 and int(levels.max()) <= 254


def test_tcq_levels_bad_input():
    with pytest.raises(ValueError, match="symbols must be a 2-D integer tensor"):
        rans.tcq_levels(torch.zeros(4, 4), 32)
    with pytest.raises(ValueError, match="symbols must be a 2-D integer tensor"):
        rans.tcq_levels(torch.zeros(4, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match=r"symbols must be in \[0, 256\)"):
        rans.tcq_levels(torch.full((4, 4), 256), 32)
    with pytest.raises(ValueError, match="chunk_k must be a positive multiple of 32"):
        rans.tcq_levels(torch.zeros(4, 4, dtype=torch.uint8), 48)
