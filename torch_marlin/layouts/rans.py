"""The entropy-coded layout ("rans", docs/FORMAT.md): codes of a 4-bit format
(lossless) or of a fine uniform grid ("grid", or "tcq": the grid read through a
4-state trellis) coded with interleaved rANS
(torch_marlin/rans.py), decoded inside the ops `torch.ops.marlin.rans_gemm` /
`rans_decode` (C++ and Metal). This module has the layout class, its
float64 reference dequantization, and the fake kernels and autograd of its
ops. Where the ops are not built yet, linear() and weight() fall back to the
reference decoder (correct, slow).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch

from .. import formats, rans
from .. import ops  # noqa: F401  (loads torch.ops.marlin)
from .base import QuantizedLayout, fake_gemm_output, register_layout

GRID = "grid"  # weight_format of the uniform-grid value kind (this layout only)
TCQ = "tcq"  # the trellis-coded grid (this layout only): rans.tcq_levels
GRID_KINDS = rans.GRID_KINDS
GRID_FORMAT_NUMBERS = {GRID: 64, TCQ: 65}  # their numbers in the state_dict descriptor
WEIGHT_FORMATS = formats.WEIGHT_FORMATS + GRID_KINDS


def has_ops() -> bool:
    """Whether this build registers the layout's C++ ops."""
    return hasattr(torch.ops.marlin, "rans_gemm") and hasattr(torch.ops.marlin, "rans_decode")


def check_weight_format(weight_format, group_size) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    formats.check_group_size(group_size)
    if weight_format in GRID_KINDS and group_size != -1:
        raise ValueError(f"group_size must be -1 for weight_format={weight_format!r} (one step per output "
                         f"column), got {group_size}")


def default_chunk_k(k: int, group_size: int) -> int:
    """rans.DEFAULT_CHUNK_K, at most K rounded up to 32, a multiple of the group size."""
    chunk = min(rans.DEFAULT_CHUNK_K, -(-k // rans.LANES) * rans.LANES)
    if group_size > 0:
        chunk = -(-chunk // group_size) * group_size
    return chunk


def num_groups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-k // group_size)


def stored_rows(in_features: int, group_size: int) -> int:
    """K of the stream: in_features, rounded up to whole groups (as the dense layout pads; the
    ops take whole groups) for lossless formats with groups."""
    return in_features if group_size == -1 else num_groups(in_features, group_size) * group_size


def dense_from_symbols(symbols: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                       weight_format: str, group_size: int, dtype=torch.float64,
                       chunk_k: Optional[int] = None) -> torch.Tensor:
    """B [K, N] from decoded symbols [K, N] (from the stream's first row) and scales (zeros),
    computed in `dtype`; "tcq" needs the stream's chunk_k (its trellis restarts per chunk)."""
    k = symbols.shape[0]
    if weight_format == GRID:
        return (symbols.to(dtype) - rans.GRID_OFFSET) * scales.to(dtype)
    if weight_format == TCQ:
        if chunk_k is None:
            raise ValueError("chunk_k is required for weight_format='tcq'")
        return rans.tcq_levels(symbols, chunk_k).to(dtype) * scales.to(dtype)
    rows = k if group_size == -1 else group_size
    per_row = lambda t: None if t is None else t.to(dtype).repeat_interleave(rows, dim=0)[:k]
    # A table made here, not the descriptor's cached tensor: rans_gemm's backward runs this
    # under fake tensors when traced (opcheck, torch.compile), where a real tensor cannot be indexed.
    table = torch.tensor(formats.value_format(weight_format).values.tolist(), device=symbols.device)
    values = table[symbols.long()].to(dtype)
    return formats.value_format(weight_format).weights(values, per_row(scales), per_row(zeros))


@register_layout
@dataclass
class RansQuantizedWeight(QuantizedLayout):
    """An entropy-coded weight (docs/FORMAT.md, "Entropy-coded layout")."""

    LAYOUT = "rans"
    LAYOUT_CODE = 4  # persisted in state_dicts: never reuse
    TENSORS = ("words", "word_offsets", "states", "freqs", "scales", "zeros")
    VARIABLE_TENSORS = ("words",)  # sized by the content: a state_dict's length is taken on load

    words: torch.Tensor  # int16 [W]
    word_offsets: torch.Tensor  # int32 [n_chunks + 1]
    states: torch.Tensor  # int32 [n_chunks, 32]
    freqs: torch.Tensor  # int16 [S]
    scales: torch.Tensor  # fp16 [G, N] ([1, N] steps for grid)
    zeros: Optional[torch.Tensor]  # fp16 [G, N] for uint4 / affine
    weight_format: str
    group_size: int
    in_features: int  # K the caller sees; the stream has stored_rows(in_features, group_size) rows
    out_features: int  # N
    chunk_k: int = rans.DEFAULT_CHUNK_K
    prob_bits: int = rans.DEFAULT_PROB_BITS
    relative_error: float = float("nan")

    # --- construction ----------------------------------------------------------------

    @classmethod
    def check_arguments(cls, weight_format, group_size) -> None:
        check_weight_format(weight_format, group_size)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                   weight_format: str, group_size: int, chunk_k: Optional[int] = None,
                   prob_bits: int = rans.DEFAULT_PROB_BITS, in_features: Optional[int] = None
                   ) -> "RansQuantizedWeight":
        """Code symbols [K, N] (4-bit codes, or grid / tcq symbols q + 128) with their scales (zeros);
        K = stored_rows(in_features, group_size) (in_features defaults to K)."""
        check_weight_format(weight_format, group_size)
        if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
            raise ValueError(f"codes must be a 2-D tensor [K, N], got {formats._describe(codes)}")
        k, n = codes.shape
        in_features = k if in_features is None else int(in_features)
        if stored_rows(in_features, group_size) != k:
            raise ValueError(f"codes must have {stored_rows(in_features, group_size)} rows (in_features="
                             f"{in_features} in whole groups of {group_size}), got {k}")
        chunk_k = default_chunk_k(k, group_size) if chunk_k is None else chunk_k
        stream = rans.encode_codes(codes, weight_format, chunk_k, prob_bits, group_size)
        device = scales.device if isinstance(scales, torch.Tensor) else codes.device
        q = cls(*(t.to(device) for t in stream.tensors().values()), scales, zeros, weight_format, group_size,
                in_features, n, chunk_k, prob_bits)
        q.check_shapes()
        return q

    @classmethod
    def from_dense(cls, qweight, chunk_k: Optional[int] = None,
                   prob_bits: int = rans.DEFAULT_PROB_BITS) -> "RansQuantizedWeight":
        """Lossless: the codes of a dense QuantizedWeight entropy-coded; same scales and zeros,
        the same weight and op results."""
        from .dense import QuantizedWeight

        if not isinstance(qweight, QuantizedWeight):
            raise TypeError(f"qweight must be a dense QuantizedWeight, got {type(qweight).__name__}")
        rows = stored_rows(qweight.in_features, qweight.group_size)
        codes = formats.unpack_codes(qweight.packed.cpu())[:rows]
        q = cls.from_codes(codes, qweight.scales, qweight.zeros, qweight.weight_format, qweight.group_size,
                           chunk_k, prob_bits, qweight.in_features)
        q.relative_error = qweight.relative_error
        return q

    @classmethod
    def empty(cls, in_features, out_features, weight_format, group_size, device=None, chunk_k=None,
              prob_bits=rans.DEFAULT_PROB_BITS, num_words=0) -> "RansQuantizedWeight":
        check_weight_format(weight_format, group_size)
        k = stored_rows(in_features, group_size)
        chunk_k = default_chunk_k(k, group_size) if chunk_k is None else rans.check_chunk_k(chunk_k)
        prob_bits = rans.check_prob_bits(prob_bits)
        n_chunks = rans.num_blocks(out_features) * rans.num_kchunks(k, chunk_k)
        groups = num_groups(k, group_size)
        scales = torch.zeros(groups, out_features, dtype=torch.float16, device=device)
        zeros = torch.zeros_like(scales) if weight_format not in GRID_KINDS and formats.has_zeros(weight_format) \
            else None
        freqs = torch.zeros(rans.alphabet_size(weight_format), dtype=torch.int16, device=device)
        return cls(torch.zeros(num_words, dtype=torch.int16, device=device),
                   torch.zeros(n_chunks + 1, dtype=torch.int32, device=device),
                   torch.zeros(n_chunks, rans.LANES, dtype=torch.int32, device=device), freqs, scales, zeros,
                   weight_format, group_size, in_features, out_features, chunk_k, prob_bits)

    @classmethod
    def from_float(cls, weight, weight_format, group_size, method="mse") -> "RansQuantizedWeight":
        """Lossless coding of the dense quantization (`method`) of a 4-bit format; the
        rate-controlled grid takes a bit budget instead (torch_marlin.rans_quantize)."""
        if weight_format in GRID_KINDS:
            raise ValueError(f"weight_format={weight_format!r} is made by the rate-controlled quantizer: "
                             "MarlinLinear.from_linear(linear, bits=...) or quantize_model(model, bits=...)")
        from .dense import quantize_weight

        return cls.from_dense(quantize_weight(weight, weight_format, group_size, method))

    def options(self) -> dict:
        return {"chunk_k": self.chunk_k, "prob_bits": self.prob_bits}

    @property
    def stored_k(self) -> int:
        return stored_rows(self.in_features, self.group_size)

    def shape_options(self) -> dict:
        return {**self.options(), "num_words": self.words.shape[0]}

    # --- checks -------------------------------------------------------------------

    def check_shapes(self) -> None:
        """Shapes and dtypes (no content): the fake kernels' checks."""
        check_scales(self.scales, self.zeros, self.weight_format, self.group_size, self.stored_k,
                     self.out_features)
        if self.freqs.shape != (rans.alphabet_size(self.weight_format),):
            raise ValueError(f"freqs must have shape [{rans.alphabet_size(self.weight_format)}] for "
                             f"weight_format={self.weight_format!r}, got {list(self.freqs.shape)}")

    def check_contents(self) -> None:
        self.check_shapes()
        rans.check_chunk_compatible(self.chunk_k, self.group_size, self.stored_k, self.weight_format)
        rans.check_stream(self.words, self.word_offsets, self.states, self.freqs, self.stored_k,
                          self.out_features, self.chunk_k, self.prob_bits, rans.alphabet_size(self.weight_format))

    # --- decoding -------------------------------------------------------------------

    def symbols(self) -> torch.Tensor:
        """uint8 symbols [in_features, N] (the op when built, else the reference decoder)."""
        if has_ops():
            sym = torch.ops.marlin.rans_decode(self.words, self.word_offsets, self.states, self.freqs,
                                               self.stored_k, self.out_features, self.chunk_k, self.prob_bits)
        else:
            sym = rans.decode(self.words, self.word_offsets, self.states, self.freqs, self.stored_k,
                              self.out_features, self.chunk_k, self.prob_bits).to(self.words.device)
        return sym[: self.in_features]

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """W [N, K] from the reference decoder, float64 inside."""
        sym = rans.decode(self.words, self.word_offsets, self.states, self.freqs, self.stored_k,
                          self.out_features, self.chunk_k, self.prob_bits)[: self.in_features]
        b = dense_from_symbols(sym, self.scales.cpu(), None if self.zeros is None else self.zeros.cpu(),
                               self.weight_format, self.group_size, chunk_k=self.chunk_k)
        return b.t().to(device=self.scales.device, dtype=dtype)

    def weight(self, dtype=torch.float32) -> torch.Tensor:
        b = dense_from_symbols(self.symbols(), self.scales, self.zeros, self.weight_format, self.group_size,
                               torch.float32, self.chunk_k)
        return b.t().to(dtype)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if has_ops():
            pad = self.stored_k - self.in_features
            if pad:
                x = torch.nn.functional.pad(x, (0, pad))
            return torch.ops.marlin.rans_gemm(x, self.words, self.word_offsets, self.states, self.freqs,
                                              self.scales, self.zeros, bias, self.weight_format, self.stored_k,
                                              self.chunk_k, self.prob_bits, self.group_size)
        y = x @ self.weight(x.dtype).t()
        return y if bias is None else y + bias

    # --- descriptor -----------------------------------------------------------------

    def descriptor(self) -> List[int]:
        number = GRID_FORMAT_NUMBERS[self.weight_format] if self.weight_format in GRID_KINDS \
            else formats.WEIGHT_FORMATS.index(self.weight_format)
        return [self.LAYOUT_CODE, number, self.group_size, self.in_features, self.chunk_k, self.prob_bits]

    @classmethod
    def knows_format_number(cls, number: int) -> bool:
        return number in GRID_FORMAT_NUMBERS.values() or super().knows_format_number(number)

    @classmethod
    def describe_extra(cls, text: str, extra: List[int]) -> str:
        for kind, number in GRID_FORMAT_NUMBERS.items():
            text = text.replace(f"#{number}", repr(kind))
        if len(extra) == 2:
            text += f", chunk_k={extra[0]}, prob_bits={extra[1]}"
        return text

    def replace(self, **tensors) -> "RansQuantizedWeight":
        return dataclasses.replace(self, **tensors)


def check_scales(scales, zeros, weight_format: str, group_size: int, k: int, n: int) -> None:
    groups = num_groups(k, group_size)
    formats._check_group_tensor(scales, "scales", groups, n, scales.device if isinstance(scales, torch.Tensor)
                                else None)
    if weight_format not in GRID_KINDS and formats.has_zeros(weight_format):
        if zeros is None:
            raise ValueError(f"zeros is required for weight_format={weight_format!r}")
        formats._check_group_tensor(zeros, "zeros", groups, n, scales.device)
    elif zeros is not None:
        raise ValueError(f"zeros must be None for weight_format={weight_format!r}")


# --- fake kernels and autograd of the rans ops (registered once the C++ ops exist) ------

def _register_op_python_parts() -> None:
    @torch.library.register_fake("marlin::rans_decode")
    def _decode_fake(words, word_offsets, states, freqs, K, N, chunk_k, prob_bits):
        torch._check(words.dtype == torch.int16, lambda: f"words must be int16, got {words.dtype}")
        return words.new_empty((K, N), dtype=torch.uint8)

    @torch.library.register_fake("marlin::rans_gemm")
    def _gemm_fake(x, words, word_offsets, states, freqs, scales, zeros, bias, weight_format, K, chunk_k,
                   prob_bits, group_size):
        n = scales.shape[1]
        check_weight_format(weight_format, group_size)
        check_scales(scales, zeros, weight_format, group_size, K, n)
        return fake_gemm_output(x, words, "words", K, n, bias)

    def setup_context(ctx, inputs, output):
        x, words, word_offsets, states, freqs, scales, zeros, bias, weight_format, k, chunk_k, prob_bits, gs = inputs
        ctx.save_for_backward(words, word_offsets, states, freqs, scales, zeros)
        ctx.args = (weight_format, k, chunk_k, prob_bits, gs)
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None

    def backward(ctx, grad):
        words, word_offsets, states, freqs, scales, zeros = ctx.saved_tensors
        weight_format, k, chunk_k, prob_bits, gs = ctx.args
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            sym = torch.ops.marlin.rans_decode(words, word_offsets, states, freqs, k, scales.shape[1], chunk_k,
                                               prob_bits)
            b = dense_from_symbols(sym, scales, zeros, weight_format, gs, torch.float32, chunk_k).to(ctx.x_dtype)
            grad_x = grad @ b.t()
        if ctx.has_bias and ctx.needs_input_grad[7]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return (grad_x,) + (None,) * 6 + (grad_bias,) + (None,) * 5

    torch.library.register_autograd("marlin::rans_gemm", backward, setup_context=setup_context)


if has_ops():
    _register_op_python_parts()
