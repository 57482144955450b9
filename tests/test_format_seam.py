"""The value-format seam: a format added to MARLIN_FOR_EACH_FORMAT without its
decode does not compile (no kernel silently decodes it as another format), and
docs/ARCHITECTURE.md's "a value format" list names every file that has a case per format."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from torch_marlin.formats import WEIGHT_FORMATS
import mslsim

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++")
ENUMERATOR = re.compile(r"\bk(Fp4|Uint4|Int4|Nf4|Affine)\b")


def _copy(tmp_path: Path, add_format: bool) -> Path:
    """csrc/ and metal/ in tmp_path, with one more format `probe` (the next number) if add_format."""
    for d in ("csrc", "metal"):
        shutil.copytree(ROOT / d, tmp_path / d)
    if add_format:
        header = tmp_path / "metal" / "marlin_common.h"
        text = header.read_text()
        n, last = len(WEIGHT_FORMATS), WEIGHT_FORMATS[-1]
        enumerator = f"k{last.capitalize()}"
        for old, new in [(f"{enumerator} = {n - 1} }};", f"{enumerator} = {n - 1}, kProbe = {n} }};"),
                         (f"  X({last}, {enumerator}, __VA_ARGS__)\n",
                          f"  X({last}, {enumerator}, __VA_ARGS__) \\\n  X(probe, kProbe, __VA_ARGS__)\n"),
                         (f"kNumWeightFormats = {n};", f"kNumWeightFormats = {n + 1};")]:
            assert old in text, old
            text = text.replace(old, new)
        header.write_text(text)
    return tmp_path


def _syntax_check(root: Path, source: str) -> subprocess.CompletedProcess:
    return subprocess.run([CXX, "-std=c++20", "-fsyntax-only", "-I", str(root / "csrc"), "-I", str(root / "metal"),
                           str(root / source)], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("add_format", [False, True], ids=["as_is", "with_one_more_format"])
def test_cpu_kernels_need_a_decode_per_format(tmp_path, add_format):
    root = _copy(tmp_path, add_format)
    for source, missing in [("csrc/cpu/kernels_generic.cpp", f"FormatDecode<{len(WEIGHT_FORMATS)}>"),
                            ("csrc/cpu/quantize_generic.cpp", f"QuantFormat<{len(WEIGHT_FORMATS)}>")]:
        r = _syntax_check(root, source)
        if add_format:
            assert r.returncode != 0 and f"incomplete type" in r.stderr and missing in r.stderr, r.stderr[-3000:]
        else:
            assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("add_format", [False, True], ids=["as_is", "with_one_more_format"])
def test_metal_kernels_need_a_decode_per_format(tmp_path, add_format):
    root = _copy(tmp_path, add_format)
    source = root / "metal" / "dequant.metal"  # instantiates the shared decode for every format
    if not add_format:
        mslsim.compile(str(source), include_dirs=(str(root / "metal"),), strict=False)
        return
    with pytest.raises(mslsim.MSLSimError, match=r"incomplete type .MarlinFormat<marlin::kProbe>"):
        mslsim.compile(str(source), include_dirs=(str(root / "metal"),), strict=False)


# Files that name one format on purpose, not a case per format.
_NAMES_ONE_FORMAT = {
    "csrc/core/formats.cpp",  # pins the persisted numbers of the first three formats
    "csrc/core/formats.h",  # an example in a comment
    "tests/metal/kernels/fused_b_variants.metal",  # fp4 variants of the fused GEMM's B loads
    "tests/test_shared_constants.py",  # probes has_zeros(kUint4)
    "tests/test_format_seam.py",  # adds a format to a copy
    "metal/rans.metal",  # rans_decode_s16 decodes symbols only: any 16-code format's instance serves
    "metal/rans_decode.h",  # the grid takes int4's group params (scale as is, no zeros)
    "benchmarks/rans_fill.cpp",  # times fp4 as the 16-code stream: any 16-code format's fill decodes alike
}


def _value_format_list() -> set:
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = doc.split("### a value format", 1)[1].split("\n### ", 1)[0]
    return set(re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M))


def test_architecture_lists_every_file_with_a_case_per_format():
    listed = _value_format_list()
    assert len(listed) <= 8
    for path in listed:
        assert (ROOT / path).is_file(), path
    naming = {str(p.relative_to(ROOT)) for d in ("csrc", "metal", "tests", "benchmarks", "torch_marlin")
              for p in (ROOT / d).rglob("*") if p.suffix in (".h", ".cpp", ".mm", ".metal", ".py")
              and ENUMERATOR.search(p.read_text(errors="ignore"))}
    assert naming - _NAMES_ONE_FORMAT <= listed, naming - _NAMES_ONE_FORMAT - listed


@pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
def test_table_decode_in_every_build(tmp_path):
    """The general 16-entry decode a table format takes (TableDecode), forced for every
    format in every build this CPU runs, against the kernel harness's float64 reference."""
    sources = sorted((ROOT / "csrc" / "cpu").glob("kernel*.cpp")) + [ROOT / "tests" / "cpu_kernels" / "check_kernels.cpp"]
    flags = ["-O1", "-std=c++20", "-Wno-psabi", "-DMARLIN_KERNEL_TABLE_DECODE=1", "-I", str(ROOT / "csrc"),
             "-I", str(ROOT / "metal")]

    def compile_one(src):
        obj = tmp_path / (src.stem + ".o")
        r = subprocess.run([CXX, *flags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{src.name}:\n{r.stderr[-3000:]}"
        return str(obj)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        objects = list(pool.map(compile_one, sources))
    exe = tmp_path / "check_kernels"
    subprocess.run([CXX, *objects, "-o", str(exe)], check=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), r.stdout[-3000:]
    assert "PASS generic " in r.stdout, r.stdout
