"""The reference codec of the entropy-coded ("rans") layout (docs/FORMAT.md, "rans").

Codes c[k, n] (K-major, like the dense layout) are split into blocks of 32 output
columns (the 32 lanes) and chunks of `chunk_k` rows; each (block, chunk) is one
interleaved rANS stream: 32 lanes with their own 32-bit state sharing one stream of
16-bit words, refills handed out in lane order. Everything is vectorised with numpy
over lanes and chunks; the loop runs over the chunk_k steps only, so a 4096 x 4096
weight encodes and decodes in about a second. The C++ and Metal kernels are tested
against `decode`, and `decode` against the per-element decoder in tests/test_rans.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch

LANES = 32  # lanes of an interleaved stream: 32 consecutive output columns
STATE_LOW = 1 << 16  # a state x lives in [2^16, 2^32)
WORD_BITS = 16
MIN_PROB_BITS, MAX_PROB_BITS = 10, 15
DEFAULT_PROB_BITS = 12  # measured: docs/ENTROPY.md
DEFAULT_CHUNK_K = 1024  # measured: docs/ENTROPY.md
GRID_OFFSET = 128  # grid symbol s stands for the integer s - 128
ALPHABET_LOSSLESS = 16
ALPHABET_GRID = 256
GRID_KINDS = ("grid", "tcq")  # value kinds of 256 symbols, one step per output column
# "tcq": the 4-state trellis of docs/FORMAT.md; TCQ_NEXT[state][k & 1] is the next state.
TCQ_NEXT = ((0, 2), (2, 0), (1, 3), (3, 1))
TCQ_STATES = 4


class RansStreamError(ValueError):
    """A stream, table, offset or state that breaks the format (docs/FORMAT.md)."""


def alphabet_size(weight_format: str) -> int:
    """Symbols of a value kind: 256 for the grid and tcq, 16 for the 4-bit formats (lossless)."""
    return ALPHABET_GRID if weight_format in GRID_KINDS else ALPHABET_LOSSLESS


def check_prob_bits(prob_bits, name: str = "prob_bits") -> int:
    if isinstance(prob_bits, bool) or not isinstance(prob_bits, (int, np.integer)) \
            or not MIN_PROB_BITS <= prob_bits <= MAX_PROB_BITS:
        raise ValueError(f"{name} must be an integer in [{MIN_PROB_BITS}, {MAX_PROB_BITS}], got {prob_bits!r}")
    return int(prob_bits)


def check_chunk_k(chunk_k, name: str = "chunk_k") -> int:
    if isinstance(chunk_k, bool) or not isinstance(chunk_k, (int, np.integer)) or chunk_k <= 0 or chunk_k % LANES:
        raise ValueError(f"{name} must be a positive multiple of {LANES}, got {chunk_k!r}")
    return int(chunk_k)


def num_kchunks(k: int, chunk_k: int) -> int:
    return -(-k // chunk_k)


def num_blocks(n: int) -> int:
    return -(-n // LANES)


# --- frequency tables ---------------------------------------------------------------

def normalize_freqs(counts, prob_bits: int) -> np.ndarray:
    """uint16 freqs [S] summing to 2^prob_bits, every symbol with a count >= 1 getting
    freq >= 1, close to the counts' distribution: start from the rounded scaled counts,
    then move the remaining units one at a time where they cost the fewest coded bits
    (sum of count * log2(1 / freq) is what the stream costs)."""
    prob_bits = check_prob_bits(prob_bits)
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0 or (counts < 0).any() or not np.isfinite(counts).all():
        raise ValueError(f"counts must be a non-empty 1-D array of non-negative counts, got {counts!r}")
    total_freq = 1 << prob_bits
    used = counts > 0
    if not used.any():
        raise ValueError("counts must have at least one symbol with a count > 0")
    if used.sum() > total_freq:
        raise ValueError(f"{int(used.sum())} used symbols do not fit prob_bits={prob_bits}")
    freqs = np.where(used, np.maximum(1, np.round(counts * total_freq / counts.sum())), 0).astype(np.int64)
    diff = total_freq - int(freqs.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        while diff > 0:  # add a unit where it saves the most bits: count * log2((f + 1) / f)
            s = int(np.argmax(np.where(used, counts * np.log2((freqs + 1) / np.maximum(freqs, 1)), -np.inf)))
            freqs[s] += 1
            diff -= 1
        while diff < 0:  # take a unit where it costs the fewest bits: count * log2(f / (f - 1))
            s = int(np.argmin(np.where(freqs > 1, counts * np.log2(freqs / np.maximum(freqs - 1, 1)), np.inf)))
            freqs[s] -= 1
            diff += 1
    return freqs.astype(np.uint16)


def cumulative(freqs: np.ndarray) -> np.ndarray:
    """cum[s] = sum of freqs[< s] (int64, one entry per symbol)."""
    f = freqs.astype(np.int64)
    return np.concatenate([[0], np.cumsum(f)[:-1]])


# --- stream -------------------------------------------------------------------------

@dataclass
class RansStream:
    """The persisted tensors of one coded weight (dtypes of docs/FORMAT.md)."""

    words: torch.Tensor  # int16 [W] (uint16 bit patterns)
    word_offsets: torch.Tensor  # int32 [n_chunks + 1]
    states: torch.Tensor  # int32 [n_chunks, 32] (uint32 bit patterns)
    freqs: torch.Tensor  # int16 [S] (uint16 bit patterns)

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {"words": self.words, "word_offsets": self.word_offsets, "states": self.states, "freqs": self.freqs}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def _as_numpy_symbols(symbols, alphabet: int) -> np.ndarray:
    if isinstance(symbols, torch.Tensor):
        if symbols.dtype.is_floating_point or symbols.dtype == torch.bool:
            raise ValueError(f"symbols must be an integer tensor, got {symbols.dtype}")
        symbols = symbols.detach().cpu().numpy()
    symbols = np.asarray(symbols)
    if symbols.ndim != 2 or symbols.shape[0] == 0 or symbols.shape[1] == 0:
        raise ValueError(f"symbols must be a non-empty 2-D array [K, N], got shape {list(symbols.shape)}")
    if not np.issubdtype(symbols.dtype, np.integer):
        raise ValueError(f"symbols must be integers, got {symbols.dtype}")
    if symbols.min() < 0 or symbols.max() >= alphabet:
        raise ValueError(f"symbols must be in [0, {alphabet}), got values in [{symbols.min()}, {symbols.max()}]")
    return symbols.astype(np.int64)


def _lane_steps(symbols: np.ndarray, chunk_k: int, fill: int) -> np.ndarray:
    """symbols [K, N] -> [n_chunks, chunk_k, 32] in chunk order b * n_kchunks + c,
    N padded with `fill`, the last chunk's missing steps with `fill` (never coded)."""
    k, n = symbols.shape
    nk, nb = num_kchunks(k, chunk_k), num_blocks(n)
    padded = np.full((nk * chunk_k, nb * LANES), fill, dtype=np.int64)
    padded[:k, :n] = symbols
    # [nk, chunk_k, nb, 32] -> [nb, nk, chunk_k, 32]
    return padded.reshape(nk, chunk_k, nb, LANES).transpose(2, 0, 1, 3).reshape(nb * nk, chunk_k, LANES)


def _chunk_lengths(k: int, n: int, chunk_k: int) -> np.ndarray:
    nk = num_kchunks(k, chunk_k)
    lengths = np.full(nk, chunk_k, dtype=np.int64)
    lengths[-1] = k - (nk - 1) * chunk_k
    return np.tile(lengths, num_blocks(n))


def encode(symbols, alphabet: int, chunk_k: int = DEFAULT_CHUNK_K, prob_bits: int = DEFAULT_PROB_BITS,
           freqs: Optional[np.ndarray] = None) -> RansStream:
    """Encode symbols [K, N] (integers in [0, alphabet)) into a RansStream. `freqs`
    (uint16 [alphabet] summing to 2^prob_bits) defaults to the normalised counts of the
    symbols including the padding columns (which repeat the most frequent symbol)."""
    chunk_k, prob_bits = check_chunk_k(chunk_k), check_prob_bits(prob_bits)
    sym = _as_numpy_symbols(symbols, alphabet)
    k, n = sym.shape
    counts = np.bincount(sym.ravel(), minlength=alphabet)
    fill = int(np.argmax(counts))
    pad_columns = num_blocks(n) * LANES - n
    counts[fill] += pad_columns * k
    if freqs is None:
        freqs = normalize_freqs(counts, prob_bits)
    freqs = np.asarray(freqs)
    check_freqs(freqs, alphabet, prob_bits)
    if (freqs.astype(np.int64)[counts > 0] == 0).any():
        raise ValueError("freqs must give every symbol that occurs a frequency >= 1")
    f_table = freqs.astype(np.uint64)
    c_table = cumulative(freqs).astype(np.uint64)

    steps = _lane_steps(sym, chunk_k, fill)  # [C, T, 32]
    lengths = _chunk_lengths(k, n, chunk_k)
    n_chunks = steps.shape[0]
    x = np.full((n_chunks, LANES), STATE_LOW, dtype=np.uint64)
    emitted = np.zeros((n_chunks, chunk_k, LANES), dtype=np.uint16)
    emits = np.zeros((n_chunks, chunk_k, LANES), dtype=bool)
    shift = np.uint64(32 - prob_bits)
    p = np.uint64(prob_bits)
    w16 = np.uint64(WORD_BITS)
    full_chunks = bool((lengths == chunk_k).all())
    for t in range(chunk_k - 1, -1, -1):
        s = steps[:, t, :]
        f = f_table[s]
        need = x >= (f << shift)
        if not full_chunks:
            need &= (t < lengths)[:, None]
        emitted[:, t, :] = (x & np.uint64(0xFFFF)).astype(np.uint16)
        emits[:, t, :] = need
        x = np.where(need, x >> w16, x)
        coded = ((x // f) << p) + (x % f) + c_table[s]
        x = coded if full_chunks else np.where((t < lengths)[:, None], coded, x)
    # Emission order was (t descending, lane descending); the stream is its reverse,
    # which is (t ascending, lane ascending): the row-major order of the masked words.
    per_chunk = emits.reshape(n_chunks, -1).sum(1)
    offsets = np.concatenate([[0], np.cumsum(per_chunk)])
    if offsets[-1] >= 2 ** 31:
        raise ValueError(f"the stream has {offsets[-1]} words; word_offsets are int32 (< 2^31)")
    words = emitted[emits]
    return RansStream(
        words=torch.from_numpy(words.view(np.int16).copy()),
        word_offsets=torch.from_numpy(offsets.astype(np.int32)),
        states=torch.from_numpy(x.astype(np.uint32).view(np.int32).copy()),
        freqs=torch.from_numpy(freqs.astype(np.uint16).view(np.int16).copy()),
    )


# --- validation ---------------------------------------------------------------------

def _u16(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().view(np.uint16)


def _u32(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy().view(np.uint32)


def check_freqs(freqs: np.ndarray, alphabet: int, prob_bits: int, name: str = "freqs") -> None:
    if freqs.shape != (alphabet,):
        raise RansStreamError(f"{name} must have shape [{alphabet}], got {list(freqs.shape)}")
    total = int(freqs.astype(np.int64).sum())
    if total != 1 << prob_bits:
        raise RansStreamError(f"{name} must sum to 2^prob_bits = {1 << prob_bits}, got {total}")


def check_stream(words, word_offsets, states, freqs, k: int, n: int, chunk_k: int, prob_bits: int,
                 alphabet: Optional[int] = None) -> None:
    """The load-time checks of docs/FORMAT.md (dtypes, shapes, freqs sum, monotone offsets
    within words, states in [2^16, 2^32)); RansStreamError naming the argument."""
    chunk_k, prob_bits = check_chunk_k(chunk_k), check_prob_bits(prob_bits)
    if k <= 0 or n <= 0:
        raise RansStreamError(f"K and N must be positive, got K={k}, N={n}")
    expected = {"words": torch.int16, "word_offsets": torch.int32, "states": torch.int32, "freqs": torch.int16}
    for name, t in zip(expected, (words, word_offsets, states, freqs)):
        if not isinstance(t, torch.Tensor) or t.dtype != expected[name]:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise RansStreamError(f"{name} must be a {expected[name]} tensor, got {got}")
    n_chunks = num_blocks(n) * num_kchunks(k, chunk_k)
    if words.dim() != 1:
        raise RansStreamError(f"words must be 1-D, got shape {list(words.shape)}")
    if tuple(word_offsets.shape) != (n_chunks + 1,):
        raise RansStreamError(f"word_offsets must have shape [{n_chunks + 1}] (n_chunks + 1), "
                              f"got {list(word_offsets.shape)}")
    if tuple(states.shape) != (n_chunks, LANES):
        raise RansStreamError(f"states must have shape [{n_chunks}, {LANES}], got {list(states.shape)}")
    if alphabet is None:
        if freqs.shape[0] not in (ALPHABET_LOSSLESS, ALPHABET_GRID):
            raise RansStreamError(f"freqs must have 16 or 256 entries, got {list(freqs.shape)}")
        alphabet = freqs.shape[0]
    check_freqs(_u16(freqs), alphabet, prob_bits)
    offsets = word_offsets.detach().cpu().numpy().astype(np.int64)
    if offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] > words.shape[0]:
        raise RansStreamError(f"word_offsets must start at 0, not decrease and end at most at len(words) = "
                              f"{words.shape[0]}, got first {offsets[0]}, last {offsets[-1]}")
    if (_u32(states) < STATE_LOW).any():
        raise RansStreamError(f"states must be in [2^16, 2^32), got {int(_u32(states).min())}")


# --- decoder ------------------------------------------------------------------------

def decode(words, word_offsets, states, freqs, k: int, n: int, chunk_k: int, prob_bits: int) -> torch.Tensor:
    """uint8 symbols [K, N] of a stream (the reference of torch.ops.marlin.rans_decode).
    Raises RansStreamError if the stream is malformed: a read outside its chunk's words,
    a lane not ending at 2^16, or unread words left."""
    check_stream(words, word_offsets, states, freqs, k, n, chunk_k, prob_bits)
    if freqs.shape[0] > 256:
        raise RansStreamError("freqs must have at most 256 entries (symbols are uint8)")
    f_np = _u16(freqs).astype(np.int64)
    cum = cumulative(f_np)
    mask = (1 << prob_bits) - 1
    slot_symbol = np.repeat(np.arange(f_np.size), f_np)  # slot -> symbol, [2^p]
    w = _u16(words).astype(np.uint64)
    offsets = word_offsets.detach().cpu().numpy().astype(np.int64)
    x = _u32(states).astype(np.uint64)  # [C, 32]
    n_chunks = x.shape[0]
    lengths = _chunk_lengths(k, n, chunk_k)
    ptr = offsets[:-1].copy()
    end = offsets[1:]
    out = np.zeros((n_chunks, chunk_k, LANES), dtype=np.uint8)
    f_u = f_np.astype(np.uint64)
    cum_u = cum.astype(np.uint64)
    p = np.uint64(prob_bits)
    for t in range(chunk_k):
        active = t < lengths  # [C]
        if not active.any():
            break
        slot = x & np.uint64(mask)
        s = slot_symbol[slot.astype(np.int64)]
        out[:, t, :] = s
        nx = f_u[s] * (x >> p) + slot - cum_u[s]
        need = (nx < STATE_LOW) & active[:, None]
        rank = np.cumsum(need, axis=1) - need
        index = ptr[:, None] + rank
        bad = need & (index >= end[:, None])
        if bad.any():
            chunk = int(np.nonzero(bad.any(1))[0][0])
            raise RansStreamError(f"chunk {chunk} reads past its words (word_offsets[{chunk + 1}] = "
                                  f"{end[chunk]}) at step {t}: corrupt words, states or freqs")
        refill = w[np.where(need, index, 0)] if w.size else np.zeros_like(nx)
        nx = np.where(need, (nx << np.uint64(WORD_BITS)) | refill, nx)
        x = np.where(active[:, None], nx, x)
        ptr += need.sum(1)
    bad_state = (x != STATE_LOW).any(1)
    bad_end = ptr != end
    if bad_state.any() or bad_end.any():
        chunk = int(np.nonzero(bad_state | bad_end)[0][0])
        raise RansStreamError(f"chunk {chunk} is corrupt: after decoding, its lanes' states must all be 2^16 and "
                              f"it must have read words [{offsets[chunk]}, {end[chunk]}), read up to {ptr[chunk]}")
    nb, nk = num_blocks(n), num_kchunks(k, chunk_k)
    full = out.reshape(nb, nk, chunk_k, LANES).transpose(1, 2, 0, 3).reshape(nk * chunk_k, nb * LANES)
    return torch.from_numpy(np.ascontiguousarray(full[:k, :n]))


# --- codes <-> persisted tensors ----------------------------------------------------

def encode_codes(codes, weight_format: str, chunk_k: int = DEFAULT_CHUNK_K, prob_bits: int = DEFAULT_PROB_BITS,
                 group_size: Optional[int] = None) -> RansStream:
    """The stream of codes [K, N] of a value kind: a 4-bit format name (codes 0..15,
    lossless) or "grid" / "tcq" (symbols 0..255 = q + 128). For lossless formats with groups,
    chunk_k must be a multiple of group_size (or group_size == K) so a chunk never
    splits a group."""
    alphabet = alphabet_size(weight_format)
    if isinstance(codes, torch.Tensor):
        k = codes.shape[0] if codes.dim() == 2 else None
    else:
        k = np.shape(codes)[0] if np.ndim(codes) == 2 else None
    check_chunk_compatible(chunk_k, group_size, k, weight_format)
    return encode(codes, alphabet, chunk_k, prob_bits)


def check_chunk_compatible(chunk_k: int, group_size: Optional[int], k: Optional[int], weight_format: str) -> None:
    chunk_k = check_chunk_k(chunk_k)
    if weight_format in GRID_KINDS or group_size is None or k is None:
        return
    if group_size not in (-1, k) and chunk_k % group_size:
        raise ValueError(f"chunk_k must be a multiple of group_size = {group_size} (or group_size == K), "
                         f"got chunk_k={chunk_k}")


def decode_codes(stream: RansStream, k: int, n: int, chunk_k: int, prob_bits: int) -> torch.Tensor:
    """uint8 codes [K, N] of a stream (inverse of encode_codes)."""
    return decode(stream.words, stream.word_offsets, stream.states, stream.freqs, k, n, chunk_k, prob_bits)


def tcq_levels(symbols: torch.Tensor, chunk_k: int) -> torch.Tensor:
    """Integer levels j [K, N] (int64, in [-256, 254]) of "tcq" symbols [K, N] (docs/FORMAT.md):
    per column a trellis state, 0 at the first row of every chunk of chunk_k rows; symbol s
    (k = s - 128) is level 2k in states 0, 1 and 2k - sign(k) in states 2, 3, and moves the
    state to TCQ_NEXT[state][k & 1]. The value is j * step. The loop runs over the chunk's
    rows; all columns and chunks go at once."""
    chunk_k = check_chunk_k(chunk_k)
    if not isinstance(symbols, torch.Tensor) or symbols.dim() != 2 or symbols.dtype.is_floating_point \
            or symbols.dtype == torch.bool or symbols.dtype.is_complex:
        got = f"{symbols.dtype} {list(symbols.shape)}" if isinstance(symbols, torch.Tensor) else type(symbols).__name__
        raise ValueError(f"symbols must be a 2-D integer tensor [K, N], got {got}")
    if symbols.dtype != torch.uint8 and symbols.numel() and (symbols.min() < 0 or symbols.max() >= ALPHABET_GRID):
        raise ValueError(f"symbols must be in [0, {ALPHABET_GRID}), got values in "
                         f"[{int(symbols.min())}, {int(symbols.max())}]")
    k_rows, n = symbols.shape
    nk = num_kchunks(k_rows, chunk_k)
    k = torch.full((nk * chunk_k, n), 0, dtype=torch.int64, device=symbols.device)
    k[:k_rows] = symbols.to(torch.int64) - GRID_OFFSET
    k = k.view(nk, chunk_k, n)
    j = torch.empty_like(k)
    state = torch.zeros(nk, n, dtype=torch.int64, device=symbols.device)
    for t in range(chunk_k):
        kt = k[:, t]
        j[:, t] = 2 * kt - (state >> 1) * torch.sign(kt)
        state = (state >> 1) | (((state ^ kt) & 1) << 1)
    return j.view(nk * chunk_k, n)[:k_rows]


def entropy_bits(symbols, alphabet: int) -> float:
    """Empirical entropy of the symbols in bits per symbol (the lossless bound)."""
    sym = _as_numpy_symbols(symbols, alphabet)
    counts = np.bincount(sym.ravel(), minlength=alphabet).astype(np.float64)
    prob = counts[counts > 0] / counts.sum()
    return float(-(prob * np.log2(prob)).sum())
