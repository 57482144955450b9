"""Shared fixtures for the Hugging Face tests: tiny models built from configs, offline."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

import torch_marlin  # noqa: E402
import torch_marlin.hf  # noqa: E402

# `import torch_marlin` is meant to do this (see test_transformers_integration); done here
# too so the other tests do not depend on it.
torch_marlin.hf.enable_transformers_integration()

from hf_helpers import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch, max_shard_size=None) -> directory of a saved float model (cached)."""
    cache = {}

    def make(arch: str, max_shard_size=None) -> str:
        key = (arch, max_shard_size)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"float-{arch}")
            model = build_tiny_model(arch)
            kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            model.save_pretrained(path, **kwargs)
            cache[key] = str(path)
        return cache[key]

    return make
