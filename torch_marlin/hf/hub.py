"""A conversion source that is not a local directory: a Hugging Face Hub repo id.

As in transformers and mlx-lm, SRC is a local model when a directory of that
name exists; otherwise a name that is a valid repo id ("org/name" or "name")
is resolved with huggingface_hub's snapshot_download, which downloads the
model files into the Hub cache (HF_HUB_CACHE, default $HF_HOME/hub) when
online, and with HF_HUB_OFFLINE=1 returns the cached snapshot without any
network access. When neither works the error names both options.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Optional

from .errors import CheckpointError

# What the converter reads or copies: configs (also sentence-transformers module
# folders), safetensors weights and index, tokenizer and chat-template files.
# Not *.py (remote code is never run) nor other frameworks' weights.
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_PICKLE_PATTERNS = ["*.bin"]


def resolve_source(src: str, revision: Optional[str] = None, allow_pickle: bool = False,
                   progress: bool = True, gguf_file: Optional[str] = None) -> str:
    """The local directory of conversion source `src`: `src` itself when it is a directory
    (or a .gguf file), else the snapshot of Hub repo `src` at `revision` (default: the main
    branch); with `gguf_file`, that file of the repo rather than its safetensors weights."""
    if os.path.isdir(src) or (os.path.isfile(src) and src.endswith(".gguf") and gguf_file is None):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repo ids, but {src} is a local path")
        return src
    if os.path.exists(src):
        raise CheckpointError(f"source {src} is a file; expected a model directory, a .gguf file or a Hugging Face "
                              f"Hub repo id")
    try:
        import huggingface_hub
    except ImportError as e:
        raise CheckpointError(f"source model directory not found: {src} (to read it as a Hugging Face Hub "
                              f"repo id, install huggingface_hub: pip install 'torch_marlin[hf]')") from e
    if not _is_repo_id(src):
        raise CheckpointError(f"source model directory not found: {src}")
    patterns = _ALLOW_PATTERNS + (_PICKLE_PATTERNS if allow_pickle else [])
    if gguf_file is not None:  # the one GGUF file and the repo's small files; not its other weights
        patterns = [gguf_file] + [p for p in _ALLOW_PATTERNS if p != "*.safetensors"]
    try:
        with _progress_bars(progress):
            path = huggingface_hub.snapshot_download(repo_id=src, revision=revision, allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001  (huggingface_hub and its HTTP client raise many types)
        raise CheckpointError(_not_resolved(src, revision, _reason(src, revision, e))) from e
    weights = (".safetensors", ".bin") if allow_pickle else (".safetensors",)
    if gguf_file is not None:
        if not os.path.isfile(os.path.join(path, gguf_file)):
            raise CheckpointError(_not_resolved(src, revision, f"its snapshot {path} has no file {gguf_file!r}"))
    elif not any(name.endswith(weights) for name in os.listdir(path)):  # e.g. only a tokenizer was cached
        have = f"its snapshot {path} holds no {' or '.join(weights)} weights"
        raise CheckpointError(_not_resolved(src, revision, have))
    return path


def _is_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hub repo id, "org/name" or "name"; an explicit path
    ("./x", "/x", "~/x") never does."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")) or (os.sep != "/" and os.sep in name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _reason(src: str, revision: Optional[str], error: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    at = f" at revision {revision!r}" if revision else ""
    name = type(error).__name__
    if constants.HF_HUB_OFFLINE:
        return (f"HF_HUB_OFFLINE=1 is set and the Hub cache {constants.HF_HUB_CACHE} has no complete snapshot "
                f"of it{at} ({name})")
    if isinstance(error, RepositoryNotFoundError):  # also gated repos
        return f"the Hub has no repo {src!r} that this machine may read ({name}; private and gated repos need a login)"
    if isinstance(error, RevisionNotFoundError):
        return f"the Hub repo {src!r} has no revision {revision!r}"
    return (f"it could not be downloaded, nor found in the Hub cache {constants.HF_HUB_CACHE}{at} "
            f"({name}: {_first_line(error)})")


def _not_resolved(src: str, revision: Optional[str], reason: str) -> str:
    download = f"hf download {src}" + (f" --revision {revision}" if revision else "")
    return (f"source {src!r} is not a local directory and was read as a Hugging Face Hub repo id, but {reason}. "
            f"Either download it: run online (without HF_HUB_OFFLINE=1), with `hf auth login` for private or gated "
            f"repos; or use a cached copy: fill the cache on a connected machine (`{download}`; the cache is "
            f"HF_HUB_CACHE, default $HF_HOME/hub) and run with HF_HUB_OFFLINE=1; or pass a local model directory.")


def _first_line(error: Exception) -> str:
    lines: List[str] = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else "no details"


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    """huggingface_hub's download bars follow the converter's `progress` flag."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
