"""`torch-marlin convert` with a Hugging Face Hub repo id as SRC, resolved with huggingface_hub.

Never the network: the Hub cache is a directory the tests fill in huggingface_hub's
layout (models--org--name/snapshots/<commit>/..., refs/<branch> holding the commit),
used with HF_HUB_OFFLINE=1; the online path runs with snapshot_download replaced.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
from safetensors.torch import load_file

from hf_helpers import leftovers
from torch_marlin.convert import convert
from torch_marlin.hf.errors import CheckpointError

REPO = "tiny-org/tiny-llama"
MAIN, V1 = "a" * 40, "b" * 40
ARGS = dict(weight_format="int4", group_size=32, quantizer="absmax")
CLI_ARGS = ["--format", "int4", "--group-size", "32", "--quantizer", "absmax", "--no-progress"]


def _cache_snapshot(cache: str, model_dir: str, commit: str = MAIN, ref: str = "main", repo: str = REPO,
                    files=None) -> str:
    """Put `files` (default all) of `model_dir` in the Hub cache as the snapshot `ref` points to."""
    storage = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(storage, "snapshots", commit)
    os.makedirs(snapshot, exist_ok=True)
    for name in files or os.listdir(model_dir):
        shutil.copy(os.path.join(model_dir, name), snapshot)
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    with open(os.path.join(storage, "refs", ref), "w") as f:
        f.write(commit)
    return snapshot


def _same_checkpoint(a: str, b: str) -> None:
    ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hub cache for this process, offline (as HF_HUB_CACHE=... HF_HUB_OFFLINE=1 would set)."""
    cache = str(tmp_path / "hub-cache")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def local_reference(tiny_model_dir, tmp_path_factory):
    """The float model and its conversion from the local directory."""
    src = tiny_model_dir("llama")
    dst = str(tmp_path_factory.mktemp("local") / "q")
    convert(src, dst, progress=False, **ARGS)
    return src, dst


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_cli_converts_a_cached_repo_offline(local_reference, tmp_path, variable):
    """What a user runs: the cache named by the environment, HF_HUB_OFFLINE=1, the CLI."""
    src, reference = local_reference
    home = str(tmp_path / "hf-home")
    cache = os.path.join(home, "hub") if variable == "HF_HOME" else str(tmp_path / "cache")
    _cache_snapshot(cache, src)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update({variable: home if variable == "HF_HOME" else cache, "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    dst = str(tmp_path / "q")
    run = subprocess.run([sys.executable, "-m", "torch_marlin.convert", REPO, dst, *CLI_ARGS],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    _same_checkpoint(dst, reference)
    assert sorted(os.listdir(dst)) == sorted(os.listdir(reference))


def test_revision_selects_the_snapshot(local_reference, offline_cache, tmp_path):
    src, reference = local_reference
    _cache_snapshot(offline_cache, src, commit=MAIN, files=["config.json"])  # main: no weights cached
    _cache_snapshot(offline_cache, src, commit=V1, ref="v1")
    dst = str(tmp_path / "q")
    convert(REPO, dst, progress=False, revision="v1", **ARGS)
    _same_checkpoint(dst, reference)
    with pytest.raises(CheckpointError, match=r"holds no \.safetensors weights.*hf download tiny-org/tiny-llama"):
        convert(REPO, str(tmp_path / "q-main"), progress=False, **ARGS)
    assert not os.path.exists(tmp_path / "q-main")


def test_repo_in_neither_hub_nor_cache_names_both_options(offline_cache, tmp_path, capsys):
    from torch_marlin.cli import main

    dst = tmp_path / "q"
    with pytest.raises(CheckpointError) as info:
        convert("tiny-org/absent", str(dst), progress=False, revision="v2")
    message = str(info.value)
    for part in ("is not a local directory", "HF_HUB_OFFLINE=1 is set", offline_cache, "at revision 'v2'",
                 "run online", "hf download tiny-org/absent --revision v2", "run with HF_HUB_OFFLINE=1",
                 "pass a local model directory"):
        assert part in message
    assert not dst.exists() and leftovers(str(tmp_path), "q") == []
    assert main(["convert", "tiny-org/absent", str(dst), "--no-progress"]) == 1
    assert "hf download tiny-org/absent" in capsys.readouterr().err


def test_local_directory_wins_and_paths_are_never_repo_ids(local_reference, offline_cache, tmp_path, monkeypatch):
    src, reference = local_reference

    def no_hub(*args, **kwargs):
        raise AssertionError("snapshot_download must not be called")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(src, REPO)  # ./tiny-org/tiny-llama shadows the repo id
    convert(REPO, "q", progress=False, **ARGS)
    _same_checkpoint("q", reference)
    for path in ("./tiny-org/absent", str(tmp_path / "absent"), "a/b/c", "~/absent-model"):
        with pytest.raises(CheckpointError, match="source model directory not found"):
            convert(path, "q2", progress=False)
    with pytest.raises(ValueError, match="revision='v1' applies to Hub repo ids"):
        convert(REPO, "q3", progress=False, revision="v1")


def _http_error(cls, status):
    request = httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}")
    return cls(f"{status} Client Error", response=httpx2.Response(status, request=request))


@pytest.fixture
def online(monkeypatch, tmp_path):
    """Online mode with snapshot_download replaced: records its calls, returns or raises `outcome`."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    state = {"calls": [], "outcome": None}

    def snapshot_download(**kwargs):
        state["calls"].append(kwargs)
        if isinstance(state["outcome"], Exception):
            raise state["outcome"]
        return state["outcome"]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return state


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_online_downloads_what_the_converter_reads(local_reference, online, tmp_path, allow_pickle):
    src, reference = local_reference
    online["outcome"] = _cache_snapshot(str(tmp_path / "downloaded"), src)
    dst = str(tmp_path / "q")
    convert(REPO, dst, progress=False, revision="v1", allow_pickle=allow_pickle, **ARGS)
    _same_checkpoint(dst, reference)
    (call,) = online["calls"]
    assert call["repo_id"] == REPO and call["revision"] == "v1"
    patterns = call["allow_patterns"]
    assert {"*.json", "*.safetensors", "*.model", "*.txt"} <= set(patterns) and "*.py" not in patterns
    assert ("*.bin" in patterns) == allow_pickle


@pytest.mark.parametrize("error,reason", [
    (lambda: _http_error(RepositoryNotFoundError, 404), "the Hub has no repo 'tiny-org/tiny-llama'"),
    (lambda: LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub"),
     "could not be downloaded, nor found in the Hub cache"),
])
def test_online_failures_name_both_options(online, tmp_path, error, reason):
    online["outcome"] = error()
    with pytest.raises(CheckpointError) as info:
        convert(REPO, str(tmp_path / "q"), progress=False)
    message = str(info.value)
    assert reason in message and "run online" in message and "run with HF_HUB_OFFLINE=1" in message
    assert isinstance(info.value.__cause__, type(online["outcome"]))
    assert not (tmp_path / "q").exists()
