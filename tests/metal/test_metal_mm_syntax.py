"""CI syntax check of the macOS build on Linux (scripts/check_mm_syntax.sh),
for the package's macOS floor (Apple's availability attributes enforced) and
against stub headers of two SDK generations (macOS 14 SDK: Xcode 15; macOS 15
SDK: Xcode 16): the Objective-C++ MPS bridge against the installed torch's
headers, and the bridge with every C++ source setup.py builds on macOS
against the headers of the macOS arm64 torch wheels at the floor and at the
newest version pyproject.toml admits."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_mm_syntax.sh"
BRIDGE = ROOT / "csrc" / "mps" / "metal_encode.mm"
STUBS = ROOT / "csrc" / "mps" / "stubs"
SDKS = ("14", "15")
CLANG = shutil.which("clang++-16") or shutil.which("clang++")
CROSS_HEADERS = Path("/usr/aarch64-linux-gnu/include/stdlib.h").is_file() and any(
    Path("/usr/aarch64-linux-gnu/include/c++").glob("*/string"))
CI = bool(os.environ.get("CI"))


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


headers = _load(ROOT / "scripts" / "macos_torch_headers.py", "macos_torch_headers")

# CI (.ci/run installs clang-16 and the aarch64 headers, and fetches the
# macOS torch headers) must run these checks; elsewhere they are optional.
_missing = [what for what, ok in (("clang++ (apt-get install clang-16)", CLANG),
                                  ("the aarch64 C/C++ headers (apt-get install libc6-dev-arm64-cross "
                                   "libstdc++-12-dev-arm64-cross)", CROSS_HEADERS)) if not ok]
if _missing and CI:
    raise RuntimeError("CI requires for the Objective-C++ syntax check: " + "; ".join(_missing))
pytestmark = pytest.mark.skipif(bool(_missing), reason="; ".join(_missing) + " not installed")


def _run(*files, torch_include=None, sdk=None):
    args = ["--torch-include", str(torch_include)] if torch_include else []
    args += ["--sdk", sdk] if sdk else []
    return subprocess.run(["bash", str(SCRIPT), *args, *map(str, files)], capture_output=True, text=True,
                          env={**os.environ, "CLANG": CLANG or "", "PYTHON": sys.executable}, timeout=600)


def _macos_headers(version):
    try:
        return headers.include_dir(version)
    except Exception as e:  # no network, PyPI down
        if CI:
            raise
        pytest.skip(f"macOS torch {version} headers unavailable: {e}")


def _variant(tmp_path, name, old, new):
    src = BRIDGE.read_text()
    bad = src.replace(old, new) if isinstance(old, str) else old.sub(new, src)
    assert bad != src, name
    f = tmp_path / f"{name}.mm"
    f.write_text(bad)
    return f


def _checked_against_every_sdk(stdout):
    return all(f"metal_encode.mm (macOS {sdk} SDK)" in stdout for sdk in SDKS)


def test_stub_sdks_are_the_floor_and_the_next():
    # The oldest SDK that builds for the floor is the floor's own.
    floor = _load(ROOT / "csrc" / "mps" / "embed_metal.py", "embed_metal").MACOS_FLOOR
    assert sorted(p.name for p in STUBS.glob("MacOSX*.sdk")) == [f"MacOSX{sdk}.sdk" for sdk in SDKS]
    assert SDKS[0] == floor.split(".")[0]


def test_bridge_passes_installed_torch():
    # the C++ sources were just built for real against this torch
    r = _run(BRIDGE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _checked_against_every_sdk(r.stdout), r.stdout


@pytest.mark.parametrize("version", headers.VERSIONS)
def test_macos_build_passes_macos_torch(version):
    r = _run(torch_include=_macos_headers(version))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _checked_against_every_sdk(r.stdout) and "C++ files" in r.stdout


def test_header_versions_are_the_declared_range():
    text = (ROOT / "pyproject.toml").read_text()
    ranges = set(re.findall(r'"torch>=([\d.]+),<([\d.]+)"', text))
    assert len(ranges) == 1, ranges  # build requirement and dependency agree
    ((low, high),) = ranges
    floor, newest = headers.VERSIONS[0], headers.VERSIONS[-1]
    assert floor.split(".")[:2] == low.split(".")[:2]
    major, minor = (int(v) for v in high.split(".")[:2])
    assert [int(v) for v in newest.split(".")[:2]] == [major, minor - 1]


def test_torch_2_6_has_no_dispatch_sync_with_rethrow(tmp_path):
    # The bug this check exists for: torch's own helper is only in torch >= 2.10.
    f = _variant(tmp_path, "torch_rethrow", "  dispatch_sync_with_rethrow(stream->queue(), ^() {",
                 "  at::mps::dispatch_sync_with_rethrow(stream->queue(), ^() {")
    r = _run(f, torch_include=_macos_headers(headers.VERSIONS[0]))
    assert r.returncode != 0 and "dispatch_sync_with_rethrow" in r.stderr, r.stderr


def test_wrong_selector_fails(tmp_path):
    f = _variant(tmp_path, "wrong_selector", re.compile(r"setThreadgroupMemoryLength:(.*) atIndex:0"),
                 r"setThreadgroupMemoryLength:\1 index:0")
    r = _run(f)
    assert r.returncode != 0 and "setThreadgroupMemoryLength:index:" in r.stderr, r.stderr


def test_api_above_the_macos_floor_needs_available(tmp_path):
    # mathMode is macOS 15 API; the floor is 14: unguarded it is a compile error.
    f = _variant(tmp_path, "unguarded", re.compile(r"if \(@available\(macOS 15\.0, \*\)\) \{(.*?)\}", re.S), r"\1")
    r = _run(f, sdk="15")
    assert r.returncode != 0 and "'setMathMode:' is only available on macOS 15.0" in r.stderr, r.stderr


_SDK_GUARD = re.compile(r"#if defined\(__MAC_15_0\) && __MAC_OS_X_VERSION_MAX_ALLOWED >= __MAC_15_0\n((?:.*\n)*?)#endif\n")


def test_api_of_a_newer_sdk_needs_a_compile_time_guard(tmp_path):
    # mathMode exists only in the macOS 15 SDK: @available alone compiles there
    # and fails with Xcode 15 / the macOS 14 Command Line Tools.
    f = _variant(tmp_path, "runtime_check_only", _SDK_GUARD, r"\1")
    assert "@available(macOS 15.0, *)" in f.read_text()
    assert _run(f, sdk="15").returncode == 0
    r = _run(f, sdk="14")
    assert r.returncode != 0 and "property 'mathMode' not found on object of type 'MTLCompileOptions *'" in r.stderr, \
        r.stderr


def test_sdk_guard_must_test_that_the_version_is_defined(tmp_path):
    # An SDK that does not know macOS 15 leaves __MAC_15_0 undefined, which #if
    # reads as 0: `MAX_ALLOWED >= __MAC_15_0` alone is true on the 14 SDK.
    f = _variant(tmp_path, "undefined_is_zero", "#if defined(__MAC_15_0) && ", "#if ")
    r = _run(f, sdk="14")
    assert r.returncode != 0 and "property 'mathMode' not found" in r.stderr, r.stderr


def test_runtime_compile_uses_safe_math():
    # Metal compiles with fast math unless told otherwise; the syntax check
    # above proves these selectors exist with Apple's types and availability.
    src = BRIDGE.read_text()
    body = re.search(r"MTLCompileOptions\* compile_options\(\) \{(.*?)\n\}", src, re.S).group(1)
    assert re.search(r"#if defined\(__MAC_15_0\) && __MAC_OS_X_VERSION_MAX_ALLOWED >= __MAC_15_0\s*"
                     r"if \(@available\(macOS 15\.0, \*\)\) \{\s*options\.mathMode = MTLMathModeSafe;\s*"
                     r"return options;\s*\}\s*#endif\s*options\.fastMathEnabled = NO;\s*return options;\s*$", body), body
    assert "options.languageVersion = MTLLanguageVersion3_1;" in body
    # every runtime compile goes through it
    assert src.count("newLibraryWithSource:") == 1 and "options:compile_options()" in src
