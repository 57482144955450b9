"""A Hugging Face model directory as a source of tensors, validated up front."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch

from .errors import CheckpointError
from .safetensors_io import SAFETENSORS_INDEX, TensorInfo, read_header, read_tensor

PICKLE_INDEX = "pytorch_model.bin.index.json"


def read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{what} not found: {path}") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{what} {path} must hold a JSON object")
    return value


class SourceCheckpoint:
    """Tensors of a model directory: names, dtypes and shapes without loading data.

    Safetensors are preferred (single file or sharded with an index). Pickle
    `.bin` files are refused unless `allow_pickle`, and then loaded with
    `weights_only=True` (no arbitrary code) and mmap.
    """

    def __init__(self, directory: str, allow_pickle: bool = False) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a path, got {type(directory).__name__}")
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise CheckpointError(f"source model directory not found: {directory}")
        self.directory = directory
        self.config = read_json(os.path.join(directory, "config.json"), "config.json")
        self._expected: Optional[Dict[str, str]] = None  # weight_map of a safetensors index
        self._infos: Dict[str, TensorInfo] = {}
        self._pickle: Dict[str, Tuple[str, torch.dtype, Tuple[int, ...]]] = {}
        self._pickle_cache: Tuple[Optional[str], Optional[dict]] = (None, None)
        files = self._safetensors_files()
        if files:
            self._index_safetensors(files)
        else:
            self._index_pickle(allow_pickle)

    # --- discovery ---------------------------------------------------------------

    def _safetensors_files(self) -> List[str]:
        index = os.path.join(self.directory, SAFETENSORS_INDEX)
        if os.path.exists(index):
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no 'weight_map'")
            self._expected = weight_map
            return sorted(set(weight_map.values()))
        single = os.path.join(self.directory, "model.safetensors")
        if os.path.exists(single):
            return ["model.safetensors"]
        return sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))

    def _index_safetensors(self, files: List[str]) -> None:
        for name in files:
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise CheckpointError(f"weight file {name} listed in {SAFETENSORS_INDEX} is missing")
            tensors, _ = read_header(path)
            for key, info in tensors.items():
                if key in self._infos:
                    raise CheckpointError(f"tensor {key!r} appears in two files")
                self._infos[key] = info
        if self._expected is not None:
            for key, file in self._expected.items():
                info = self._infos.get(key)
                if info is None or os.path.basename(info.file) != file:
                    raise CheckpointError(f"{SAFETENSORS_INDEX} lists {key!r} in {file}, but that file "
                                          f"does not contain it")

    def _index_pickle(self, allow_pickle: bool) -> None:
        index = os.path.join(self.directory, PICKLE_INDEX)
        if os.path.exists(index):
            files = sorted(set(read_json(index, "pickle index").get("weight_map", {}).values()))
        else:
            files = sorted(f for f in os.listdir(self.directory) if f.endswith(".bin"))
        if not files:
            raise CheckpointError(f"no weights in {self.directory}: expected model.safetensors, "
                                  f"{SAFETENSORS_INDEX} or pytorch_model.bin")
        if not allow_pickle:
            raise CheckpointError(f"{self.directory} holds pickle weights ({', '.join(files)}); pickle can run "
                                  f"arbitrary code. Convert them to safetensors, or pass --allow-pickle "
                                  f"(allow_pickle=True) to load them with torch.load(weights_only=True)")
        for name in files:
            state = self._load_pickle(name)
            for key, tensor in state.items():
                if not isinstance(tensor, torch.Tensor):
                    raise CheckpointError(f"{name}: entry {key!r} is not a tensor")
                self._pickle[key] = (name, tensor.dtype, tuple(tensor.shape))

    def _load_pickle(self, name: str) -> dict:
        if self._pickle_cache[0] == name:
            return self._pickle_cache[1]
        path = os.path.join(self.directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"weight file {name} is missing")
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) format cannot be mmapped
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (torch raises many types for corrupt files)
            raise CheckpointError(f"cannot load {path} with weights_only=True: {e}") from e
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} does not hold a state dict")
        self._pickle_cache = (name, state)
        return state

    # --- access -------------------------------------------------------------------

    def keys(self) -> List[str]:
        if self._infos:
            return [k for k, _ in sorted(self._infos.items(), key=lambda kv: (kv[1].file, kv[1].begin))]
        return sorted(self._pickle, key=lambda k: self._pickle[k][0])

    def __contains__(self, key: str) -> bool:
        return key in self._infos or key in self._pickle

    def dtype(self, key: str) -> torch.dtype:
        return self._infos[key].dtype if key in self._infos else self._pickle[key][1]

    def shape(self, key: str) -> Tuple[int, ...]:
        return self._infos[key].shape if key in self._infos else self._pickle[key][2]

    def nbytes(self, key: str) -> int:
        shape = self.shape(key)
        count = 1
        for s in shape:
            count *= s
        return count * torch.empty((), dtype=self.dtype(key)).element_size()

    def load(self, key: str) -> torch.Tensor:
        if key in self._infos:
            return read_tensor(self._infos[key])
        if key in self._pickle:
            return self._load_pickle(self._pickle[key][0])[key]
        raise CheckpointError(f"tensor {key!r} not found in {self.directory}")

    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self.keys())
