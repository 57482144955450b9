"""mslsim is a package of its own (mslsim/): it imports nothing of torch_marlin, its wheel carries
its shim headers and runtime, torch_marlin's wheel does not carry it, and run_metal names the
install command when it is missing."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mslsim

ROOT = Path(__file__).resolve().parents[2]


def test_imports_nothing_of_torch_marlin():
    code = ("import sys, mslsim; lib = mslsim.compile('kernel void k(device float* y [[buffer(0)]]) { y[0] = 1; }');"
            "print(sorted(m for m in sys.modules if m.startswith('torch_marlin')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_wheel_carries_headers_and_runtime(tmp_path):
    # built from a copy: an in-tree build would leave build/ and egg-info in the checkout
    src = tmp_path / "mslsim"
    shutil.copytree(ROOT / "mslsim", src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", str(src),
                          "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    names = set(zipfile.ZipFile(next((tmp_path / "dist").glob("mslsim-*.whl"))).namelist())
    packaged = {n for n in names if n.startswith("mslsim/")}
    expected = {"mslsim/" + str(p.relative_to(ROOT / "mslsim")) for p in (ROOT / "mslsim").rglob("*")
                if p.is_file() and p.parts[len(ROOT.parts) + 1] in ("include", "runtime")
                or p.parent == ROOT / "mslsim" and p.suffix == ".py"}
    assert packaged == expected


def test_not_in_torch_marlins_wheel(tmp_path):
    run = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    info = next(tmp_path.glob("*.egg-info"))
    assert (info / "top_level.txt").read_text().split() == ["torch_marlin"]
    assert not [f for f in (info / "SOURCES.txt").read_text().split() if f.startswith("mslsim/")]


def test_run_metal_names_the_install_command(monkeypatch):
    from torch_marlin.testing import metal

    monkeypatch.setitem(sys.modules, "mslsim", None)  # import mslsim raises ImportError
    monkeypatch.setattr(metal, "_libs", {})
    with pytest.raises(ImportError, match=r"needs the MSL emulator package mslsim: pip install --no-build-isolation "
                                          r"\./mslsim"):
        metal.library("dequant")


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI installs mslsim (make test); elsewhere the checkout's copy")
def test_installed_under_ci():
    from importlib.metadata import distribution

    assert distribution("mslsim").version
