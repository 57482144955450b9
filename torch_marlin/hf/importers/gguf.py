"""GGUF files (llama.cpp, Ollama, LM Studio): block types and dequantization from the `gguf` package.

The model's config, tokenizer and tensor names come from transformers' own GGUF support
(the config and tokenizer it builds with `gguf_file=`, `get_gguf_hf_weights_map`, and its
per-architecture tensor processor, which undoes the row permutation llama.cpp applies to
Llama's q/k projections). A GGUF tensor is `ne = [K, N]`: N rows of K values, each row a
run of blocks. The processor's permutation moves whole rows, so it is applied to the
blocks before decoding (the same as transformers permuting the dequantized rows).

Blocks (ggml-common.h), along K; `d`, `m`, `dmin` fp16:
- Q4_0 (32 values, 18 bytes): d, qs[16]; qs[j] low nibble is value j, high nibble j + 16;
  w = d * (q - 8) -> int4 g32, scale d: exact.
- Q4_1 (32, 20 bytes): d, m, qs[16] (as Q4_0); w = d * q + m -> affine g32: exact.
- MXFP4 (32, 17 bytes): E8M0 e, qs[16] (as Q4_0) E2M1 codes; w = e2m1(q) * 2^(e - 127)
  -> fp4 g32, exact while 2^(e - 127) is an fp16 value (else an error, or 0 with a note).
- Q4_K (256, 144 bytes): d, dmin, scales[12] (6-bit sc and m of 8 sub-blocks of 32),
  qs[128]; qs[32i + l] low nibble is value l of sub-block 2i, high nibble of 2i + 1;
  w = (d * sc) * q - dmin * m -> affine g32 with scale d * sc and bias -dmin * m each
  rounded once to fp16: |w' - w| <= 2^-11 * (15 |d * sc| + |dmin * m|) per weight (fp16
  subnormals: 2^-25 absolute per rounding).
- Everything else (Q5_*, Q6_K, Q8_0, IQ4_NL, whose 16 values are not one of our tables,
  F16, BF16, F32): kept in float, as gguf's dequantize gives it (float32), or, for
  linear layers and with ImportOptions.requantize, re-quantized.
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import shutil
import struct
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Dict, NamedTuple, Optional

import numpy as np
import torch

from ...layouts import QuantizedWeight
from ..errors import CheckpointError, MissingDependency, UnsupportedQuantization, import_transformers
from .base import ConvertedLayer, LayerPlan
from .fp4 import e8m0_scales
from .reencode import ReencodingImporter, TensorView

_INSTALL = "pip install gguf"
# ggml types imported as a torch_marlin format: (block values, block bytes, format).
FOUR_BIT = {"Q4_0": (32, 18, "int4"), "Q4_1": (32, 20, "affine"), "MXFP4": (32, 17, "fp4"),
            "Q4_K": (256, 144, "affine")}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_DEQUANTIZE_ELEMENTS = 1 << 20


def import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise MissingDependency(f"reading GGUF files needs the gguf package, which is not installed: {_INSTALL}") from e
    return gguf


def gguf_path(src: str, gguf_file: Optional[str]) -> Optional[str]:
    """The GGUF file to convert: `src` itself when it is a .gguf file, `src/gguf_file` when
    gguf_file is given (src being a directory, e.g. a Hub snapshot), else None."""
    if gguf_file is not None:
        if not isinstance(gguf_file, str) or not gguf_file or os.path.isabs(gguf_file) or ".." in gguf_file.split("/"):
            raise ValueError(f"gguf_file must be a file name inside the source directory, got {gguf_file!r}")
        if not os.path.isdir(src):
            raise CheckpointError(f"gguf_file={gguf_file!r} names a file inside a directory, but {src} is not one")
        path = os.path.join(src, gguf_file)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} not found (gguf_file={gguf_file!r})")
        return path
    return src if os.path.isfile(src) and src.endswith(".gguf") else None


class GGUFTensorInfo(NamedTuple):
    """A tensor of a GGUF file, as the file's tensor table describes it (the attribute names of
    the gguf package's ReaderTensor)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ne: [K, N] (fastest-moving first)
    data_offset: int  # absolute, in the file
    n_bytes: int


# Metadata value types (GGUF spec): fixed sizes, 8 = string, 9 = array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_tensor_table(path: str):
    """(scalar metadata, tensors) of a GGUF file, reading only its header. The gguf package's
    GGUFReader builds an object per element of every metadata array, ~9 s of CPU for Llama 3's
    128k-token vocabulary and merges; this skips those arrays (~0.1 s)."""
    size = os.path.getsize(path)
    if size < 24:
        raise CheckpointError(f"{path}: not a GGUF file ({size} bytes)")
    # Mapped, so that only the header's pages are read, and unmapped once parsed.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        try:
            return _parse_header(path, mapped, size)
        except struct.error as e:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF header ({e})") from e


def _parse_header(path: str, view, size: int):
    gguf = import_gguf()
    magic, version, tensor_count, kv_count = struct.unpack_from("<4sIQQ", view, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise CheckpointError(f"{path}: not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
    pos, metadata = 24, {}

    def string(pos):
        (n,) = struct.unpack_from("<Q", view, pos)
        if pos + 8 + n > size:
            raise struct.error(f"a string of {n} bytes at {pos} runs past the end of the file")
        return bytes(view[pos + 8:pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

    def skip(value_type, pos, count=1):
        if value_type in _SCALAR:
            return pos + count * struct.calcsize(_SCALAR[value_type])
        if value_type == 8:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", view, pos)[0]
            return pos
        if value_type == 9:
            for _ in range(count):
                item_type, n = struct.unpack_from("<IQ", view, pos)
                pos = skip(item_type, pos + 12, n)
            return pos
        raise CheckpointError(f"{path}: unknown metadata value type {value_type}")

    for _ in range(kv_count):
        key, pos = string(pos)
        (value_type,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if value_type in _SCALAR:
            metadata[key] = struct.unpack_from(_SCALAR[value_type], view, pos)[0]
        elif value_type == 8:
            metadata[key] = string(pos)[0]
        pos = skip(value_type, pos)
    entries = []
    for _ in range(tensor_count):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", view, pos)
        shape = struct.unpack_from(f"<{dims}Q", view, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", view, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        entries.append((name, shape, type_id, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in entries:
        try:
            kind = gguf.GGMLQuantizationType(type_id)
        except ValueError as e:
            raise UnsupportedQuantization(f"{path}: tensor {name} has ggml type {type_id}, unknown to the gguf "
                                          f"package") from e
        values, nbytes = gguf.GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape)) if shape else 1
        tensors.append(GGUFTensorInfo(name, kind, np.array(shape, dtype=np.int64), data_start + offset,
                                      count // values * nbytes))
    for t in tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes}, beyond the "
                                  f"file's {size}: truncated")
    return metadata, tensors


class GGUFCheckpoint:
    """A GGUF file seen as a model directory: `directory` is a temporary one holding the
    config.json and tokenizer transformers builds from the file (removed when this object
    is); tensors have the model's names and shapes ([N, K]); a quantized tensor loads as its
    raw blocks, uint8 [N, bytes per row], rows in the model's order."""

    def __init__(self, path: str) -> None:
        transformers = import_transformers("converting a GGUF file")
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        from ..model_layers import build_meta_model

        self.path = path
        self.metadata, tensors = read_tensor_table(path)
        self.directory = tempfile.mkdtemp(prefix=".torch-marlin-gguf-")
        weakref.finalize(self, shutil.rmtree, self.directory, True)  # removed with this object
        folder, name = os.path.split(os.path.abspath(path))
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
            except (ValueError, KeyError, NotImplementedError) as e:
                raise UnsupportedQuantization(f"{path}: transformers cannot read this GGUF model ({e})") from e
        parsed = {"config": config.to_dict(), "tensors": {}}  # what transformers' tensor processors read
        causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if causal is not None and not getattr(config, "architectures", None):
            config.architectures = [causal]
        config.save_pretrained(self.directory)
        self.tokenizer_note = self._save_tokenizer(transformers, folder, name, config)
        with open(os.path.join(self.directory, "config.json"), encoding="utf-8") as f:
            self.config = json.load(f)
        self.config["gguf"] = {"file": name}
        with open(os.path.join(self.directory, "config.json"), "w", encoding="utf-8") as f:
            json.dump(self.config, f, indent=2)

        gguf_arch = self.metadata.get("general.architecture") or config.model_type
        processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=parsed["config"])
        mapping = get_gguf_hf_weights_map(build_meta_model(self.directory), processor)
        self._tensors: Dict[str, tuple] = {}  # model name -> (GGUFTensorInfo, type name, row order or None)
        for tensor in tensors:
            hf_name, order = self._name_and_order(tensor, processor, mapping, parsed)
            if hf_name is None:
                continue  # not a parameter of the model (e.g. rope_freqs), as transformers skips it
            self._tensors[hf_name] = (tensor, tensor.tensor_type.name, order)

    def _save_tokenizer(self, transformers, folder: str, name: str, config) -> Optional[str]:
        try:  # the config is passed so that AutoTokenizer does not read the file's config again
            with contextlib.redirect_stdout(io.StringIO()):
                tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, config=config,
                                                                       local_files_only=True)
            tokenizer.save_pretrained(self.directory)
        except Exception as e:  # noqa: BLE001  (tokenizer conversion raises many types)
            return (f"no tokenizer written: transformers could not build one from the GGUF file "
                    f"({type(e).__name__}: {e})")
        return None

    @staticmethod
    def _name_and_order(tensor, processor, mapping, parsed):
        """The model name of a GGUF tensor and the row order transformers' processor gives it
        (None for the identity), found by processing the row numbers instead of the weights."""
        shape = [int(s) for s in reversed(tensor.shape.tolist())]  # [N, K] or [N]
        rows = np.arange(shape[0], dtype=np.float64).reshape(shape[0], *([1] * (len(shape) - 1)))
        result = processor.process(weights=rows, name=tensor.name, tensor_key_mapping=mapping, parsed_parameters=parsed)
        if result.name not in mapping:
            return None, None
        weights = result.weights
        if weights is None or tuple(weights.shape) != tuple(rows.shape) or \
                not np.array_equal(np.sort(weights.reshape(-1)), rows.reshape(-1)):
            raise UnsupportedQuantization(f"{tensor.name}: transformers' GGUF processor for this architecture does "
                                          f"more than reorder its rows; torch_marlin cannot import it")
        order = weights.reshape(-1).astype(np.int64)
        return mapping[result.name], None if np.array_equal(order, rows.reshape(-1)) else torch.from_numpy(order)

    # --- SourceCheckpoint's interface ----------------------------------------------------

    def keys(self):
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def ggml_type(self, key: str) -> str:
        return self._tensors[key][1]

    def shape(self, key: str):
        return tuple(int(s) for s in reversed(self._tensors[key][0].shape.tolist()))

    def dtype(self, key: str) -> torch.dtype:
        return _FLOAT_TYPES.get(self.ggml_type(key), torch.uint8)

    def nbytes(self, key: str) -> int:
        return int(self._tensors[key][0].n_bytes)

    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self._tensors)

    def _bytes(self, key: str) -> np.ndarray:
        """The tensor's bytes, read from the file (not through the reader's memory map, whose
        pages would stay resident: memory stays one tensor, whatever the file's size)."""
        if key not in self._tensors:
            raise CheckpointError(f"tensor {key!r} not found in {self.path}")
        tensor = self._tensors[key][0]
        with open(self.path, "rb") as f:
            f.seek(int(tensor.data_offset))
            data = np.fromfile(f, dtype=np.uint8, count=int(tensor.n_bytes))
        if data.size != int(tensor.n_bytes):
            raise CheckpointError(f"{self.path}: tensor {tensor.name} is truncated ({data.size} of {tensor.n_bytes} "
                                  f"bytes)")
        return data

    def load(self, key: str) -> torch.Tensor:
        """A float tensor as stored, or a quantized one's blocks uint8 [N, bytes per row]."""
        data = torch.from_numpy(self._bytes(key))
        _, kind, order = self._tensors[key]
        shape = self.shape(key)
        t = data.view(_FLOAT_TYPES[kind]).reshape(shape) if kind in _FLOAT_TYPES else data.reshape(shape[0], -1)
        return t if order is None else t[order].contiguous()

    def dequantize(self, key: str) -> torch.Tensor:
        """float32 [N, K] (or [N]) exactly as gguf's dequantize gives it, rows in the model's order.
        Row blocks at a time: gguf's numpy temporaries stay a few MiB beside the result."""
        gguf = import_gguf()
        tensor, kind, order = self._tensors[key]
        shape = self.shape(key)
        data = self._bytes(key).reshape(shape[0], -1)
        out = torch.empty(shape, dtype=torch.float32)
        rows = max(1, _DEQUANTIZE_ELEMENTS // max(1, shape[-1])) if len(shape) == 2 else shape[0]
        try:
            for r0 in range(0, shape[0], rows):
                values = gguf.dequantize(data[r0:r0 + rows], tensor.tensor_type)
                out[r0:r0 + rows] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(
                    out[r0:r0 + rows].shape)
        except NotImplementedError as e:
            raise UnsupportedQuantization(f"{key} ({tensor.name}): the gguf package cannot dequantize {kind} ({e}); "
                                          f"torch_marlin cannot convert it") from e
        return out if order is None else out[order].contiguous()


def _blocks(raw: torch.Tensor, kind: str, key: str, k: int) -> torch.Tensor:
    values, nbytes, _ = FOUR_BIT[kind]
    if k % values or raw.shape[1] != k // values * nbytes:
        raise CheckpointError(f"{key}: {raw.shape[1]} bytes per row do not hold K={k} values of {kind}")
    return raw.reshape(raw.shape[0], k // values, nbytes)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes per value, little endian -> float16."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _halves(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., 16] -> codes [..., 32]: low nibbles are values 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def q4k_scales_mins(scales: torch.Tensor):
    """The 6-bit sub-block scales and mins of Q4_K's 12 bytes [..., 12] -> two [..., 8]
    (ggml-common.h get_scale_min_k4)."""
    s = scales.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 6) << 4)), dim=-1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 6) << 4)), dim=-1)
    return sc, mn


@dataclass
class GGUFSource(ReencodingImporter):
    QUANT_METHODS = ("gguf",)
    LABEL = "GGUF"
    CONFIG_KEYS = ("gguf",)

    config: dict = field(default_factory=dict)
    method: str = "gguf"

    @classmethod
    def detect(cls, config: dict) -> Optional[dict]:
        return {"quant_method": "gguf", **config["gguf"]} if isinstance(config.get("gguf"), dict) else None

    def __post_init__(self):
        if not isinstance(self.source, GGUFCheckpoint):
            raise UnsupportedQuantization("config.json says 'gguf' but the source is not a GGUF file; pass the .gguf "
                                          "file (or --gguf-file NAME)")
        if self.source.tokenizer_note:
            self.note(self.source.tokenizer_note)
        self.view = TensorView(self.source)
        self.plans: Dict[str, LayerPlan] = {}
        kept: Dict[str, list] = {}  # ggml type -> linear layers kept in float
        for key in self.source.keys():
            kind = self.source.ggml_type(key)
            module = key[: -len(".weight")] if key.endswith(".weight") else None
            linear = module is not None and self.is_linear(module) and len(self.source.shape(key)) == 2
            bits = self._bits(key)
            bias = f"{module}.bias" if linear and f"{module}.bias" in self.source else None
            if linear and (kind in FOUR_BIT or self.options.requantize):
                self.plans[module] = LayerPlan([key], bias)
            elif kind in _FLOAT_TYPES:
                if linear:
                    self.tally.add("kept float", module, int(np.prod(self.source.shape(key))), bits, bits)
            else:
                if linear:
                    kept.setdefault(kind, []).append(module)
                self.keep_float(module or key, [key], key, torch.float32, self.source.shape(key),
                                lambda k=key: self.source.dequantize(k), bits)
        for kind, modules in kept.items():
            why = ("its 16 values (-127 .. 113) are no torch_marlin format's table" if kind == "IQ4_NL"
                   else "no 4-bit torch_marlin format holds it")
            self.note(f"{len(modules)} linear layers stored as GGUF {kind} kept in float ({why}; --requantize "
                      f"re-quantizes them with --format/--group-size): {', '.join(modules[:4])}"
                      + (" ..." if len(modules) > 4 else ""))

    def _bits(self, key: str) -> float:
        return 8 * self.source.nbytes(key) / max(1, int(np.prod(self.source.shape(key))))

    def plan(self) -> Dict[str, LayerPlan]:
        return dict(self.plans)

    def convert(self, module: str, plan: LayerPlan) -> ConvertedLayer:
        key = plan.keys[0]
        kind = self.source.ggml_type(key)
        bits = self._bits(key)
        if kind not in FOUR_BIT:
            weight = self.source.load(key) if kind in _FLOAT_TYPES else self.source.dequantize(key)
            return self.requantized(module, weight, bits)
        n, k = self.source.shape(key)
        blocks = _blocks(self.source.load(key), kind, key, k)
        exact = True
        if kind == "Q4_0":
            codes, scales, zeros = _halves(blocks[..., 2:]), _fp16(blocks[..., :2]), None
        elif kind == "Q4_1":
            codes, scales, zeros = _halves(blocks[..., 4:]), _fp16(blocks[..., :2]), _fp16(blocks[..., 2:4])
        elif kind == "MXFP4":
            codes, zeros = _halves(blocks[..., 1:]), None
            scales = self.to_fp16_scales(e8m0_scales(blocks[..., 0], f"{key} (GGUF MXFP4)"), module)
            exact = not (self.notes and self.notes[-1].startswith(f"{module}:"))
        else:  # Q4_K
            d, dmin = _fp16(blocks[..., 0:2]).float(), _fp16(blocks[..., 2:4]).float()
            sc, mn = q4k_scales_mins(blocks[..., 4:16])
            wide_scales = d.unsqueeze(-1) * sc  # float32, exact (11 bits times 6)
            wide_biases = -(dmin.unsqueeze(-1) * mn)
            scales, zeros = wide_scales.half(), wide_biases.half()
            for name, wide, half in (("scale d*sc", wide_scales, scales), ("bias dmin*m", wide_biases, zeros)):
                if not torch.isfinite(half).all():
                    raise UnsupportedQuantization(f"{key}: a Q4_K sub-block {name} exceeds the fp16 range; "
                                                  f"pass --requantize (requantize=True) to re-quantize the layer")
            exact = torch.equal(scales.float(), wide_scales) and torch.equal(zeros.float(), wide_biases)
            qs = blocks[..., 16:].reshape(n, k // 256, 4, 32)
            codes = torch.stack((qs & 0xF, qs >> 4), dim=3)  # [N, blocks, 4, 2, 32]: sub-block 2i + half
            scales, zeros = scales.reshape(n, -1), zeros.reshape(n, -1)
        codes = codes.reshape(n, k)
        fmt = FOUR_BIT[kind][2]
        q = QuantizedWeight.from_codes(codes.t().contiguous(), scales.reshape(n, -1).t().contiguous(),
                                       None if zeros is None else zeros.reshape(n, -1).t().contiguous(),
                                       fmt, 32, in_features=k, out_features=n)
        return self.imported(module, q, bits, exact)

    def description(self) -> dict:
        return {"method": "gguf", "file": self.config.get("file")}

