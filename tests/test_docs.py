"""The docs state what the code does: lists of formats, group sizes and options
are checked against the package, and every file path they name exists."""

import re
from pathlib import Path

import pytest

from torch_marlin import formats
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
    assert re.search(r"--format (\S+)", text).group(1) == "FORMAT"
    choices = next(a.choices for a in _convert_parser()._actions if a.dest == "weight_format")
    assert tuple(choices) == formats.WEIGHT_FORMATS
    assert tuple(int(g) for g in re.search(r"--group-size (\S+)", text).group(1).split("|")) == formats.GROUP_SIZES
    assert tuple(re.search(r"--quantizer (\w+(?:\|\w+)*)", text).group(1).split("|")) == quantizer_names()


def _convert_parser():
    import argparse

    from torch_marlin import cli

    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["convert"]


def test_readme_group_sizes():
    line = next(l for l in _text("README.md").splitlines() if "group size `g` in" in l)
    assert _ints(line) == formats.GROUP_SIZES


_PATH = re.compile(r"`((?:csrc|metal|torch_marlin|tests|docs|benchmarks|examples|scripts)/[^`\s]*)`")


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
