"""Streaming safetensors reading and writing, one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}} and the raw bytes. We
parse it ourselves so that (1) every header is validated against the file
size before anything is read, giving clear errors for truncated or corrupt
files, and (2) reading one tensor touches only that tensor's bytes, and
writing never holds more than one tensor (peak memory ~ the largest tensor).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .errors import CheckpointError

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 2 ** 20
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: str) -> Tuple[Dict[str, TensorInfo], Dict[str, str]]:
    """Validated header of one safetensors file: ({name: TensorInfo}, metadata)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path}: header length {header_len} does not fit the file "
                                      f"({size} bytes): truncated or not a safetensors file")
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}): corrupt safetensors file") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors: Dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: malformed header entry for {name!r}: {entry!r}") from e
        if dtype_name not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name!r}; "
                                  f"supported: {sorted(DTYPES)}")
        dtype = DTYPES[dtype_name]
        expected = math.prod(shape) * _element_size(dtype)
        if end - begin != expected or begin < 0:
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes but "
                                  f"{dtype_name}{list(shape)} needs {expected}")
        data_end = max(data_end, end)
        tensors[name] = TensorInfo(path, dtype, tuple(int(s) for s in shape), data_start + begin, data_start + end)
    if data_start + data_end > size:
        raise CheckpointError(f"{path}: file is truncated ({size} bytes, header promises "
                              f"{data_start + data_end})")
    return tensors, metadata


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Load exactly one tensor's bytes from disk."""
    buffer = bytearray(info.nbytes)
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        if f.readinto(buffer) != info.nbytes:
            raise CheckpointError(f"{info.file}: unexpected end of file while reading a tensor")
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(info.dtype).reshape(info.shape)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def index_single_file(directory: str) -> None:
    """Write model.safetensors.index.json for a directory holding one unindexed
    model.safetensors (what save_pretrained leaves for an unsharded model)."""
    if os.path.exists(os.path.join(directory, SAFETENSORS_INDEX)):
        return
    tensors, _ = read_header(os.path.join(directory, "model.safetensors"))
    _write_index(directory, {name: "model.safetensors" for name in tensors},
                 sum(info.nbytes for info in tensors.values()))


def _write_index(directory: str, weight_map: Dict[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(directory, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)


class ShardedWriter:
    """Writes tensors into safetensors shards as they come, plus an index.

    Each tensor's bytes go straight to the current shard's data file; when a
    shard is closed its header is written and the data appended by a chunked
    copy, so no more than one tensor is ever held in memory.
    """

    def __init__(self, directory: str, max_shard_bytes: int = 2 * 2 ** 30,
                 metadata: Optional[Dict[str, str]] = None) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._shards: List[Tuple[str, Dict[str, dict]]] = []  # (temp name, header)
        self._data = None
        self._header: Dict[str, dict] = {}
        self._offset = 0
        self.total_bytes = 0
        self._names = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"tensor {name!r} written twice")
        if tensor.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"cannot store tensor {name!r} of dtype {tensor.dtype}")
        self._names.add(name)
        data = tensor.detach().to("cpu").contiguous()
        nbytes = data.numel() * data.element_size()
        if self._data is not None and self._offset and self._offset + nbytes > self.max_shard_bytes:
            self._close_shard()
        if self._data is None:
            self._open_shard()
        if nbytes:
            self._data.write(memoryview(data.view(-1).view(torch.uint8).numpy()))
        self._header[name] = {"dtype": DTYPE_NAMES[data.dtype], "shape": list(data.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes
        self.total_bytes += nbytes

    def _open_shard(self) -> None:
        path = os.path.join(self.directory, f".shard-{len(self._shards):05d}.data")
        self._data = open(path, "wb")
        self._header, self._offset = {}, 0

    def _close_shard(self) -> None:
        self._data.close()
        self._shards.append((self._data.name, self._header))
        self._data = None

    def finish(self) -> List[str]:
        """Write the shard files and model.safetensors.index.json; returns shard names."""
        if self._data is not None:
            self._close_shard()
        if not self._shards:  # a model with no tensors still gets a valid file
            self._open_shard()
            self._close_shard()
        count = len(self._shards)
        names = (["model.safetensors"] if count == 1 else
                 [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        weight_map = {}
        for (data_path, header), name in zip(self._shards, names):
            header = {"__metadata__": self.metadata, **header}
            raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
            raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
            with open(os.path.join(self.directory, name), "wb") as out, open(data_path, "rb") as data:
                out.write(struct.pack("<Q", len(raw)))
                out.write(raw)
                shutil.copyfileobj(data, out, 2 ** 20)
            os.remove(data_path)
            weight_map.update({tensor: name for tensor in header if tensor != "__metadata__"})
        _write_index(self.directory, weight_map, self.total_bytes)
        return names

    def abort(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None
