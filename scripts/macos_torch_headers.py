"""C++ headers of PyTorch's macOS arm64 wheels, for the Objective-C++ syntax
check (scripts/check_mm_syntax.sh --torch-include DIR).

    python3 scripts/macos_torch_headers.py             # the floor and the newest admitted torch
    python3 scripts/macos_torch_headers.py 2.9.1 ...   # other versions

Prints one include directory per version. Each wheel is downloaded by pip
(`pip download --platform macosx_14_0_arm64 --only-binary=:all: --no-deps`,
nothing installed), only its torch/include/ is kept, under
~/.cache/torch_marlin/macos-torch-headers/<version>/include
($TORCH_MARLIN_CACHE overrides ~/.cache/torch_marlin); a cached version is
not downloaded again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

# The oldest torch pyproject.toml admits and the newest release below its
# upper bound (tests/metal/test_metal_mm_syntax.py checks both against it).
VERSIONS = ("2.6.0", "2.14.1")
PLATFORM = "macosx_14_0_arm64"  # also takes wheels tagged for older macOS (torch 2.6: macosx_11_0)
PYTHON_VERSION = "3.11"  # any CPython the wheels exist for: the headers are the same


def cache_root() -> Path:
    return Path(os.environ.get("TORCH_MARLIN_CACHE", Path.home() / ".cache" / "torch_marlin")) / "macos-torch-headers"


def include_dir(version: str) -> Path:
    """The cached include/ of torch==version for macOS arm64, downloading it if needed."""
    dest = cache_root() / version
    if (dest / "complete").is_file():
        return dest / "include"
    dest.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheels = Path(tmp) / "wheel"
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                            "--platform", PLATFORM, "--python-version", PYTHON_VERSION, "--dest", str(wheels),
                            f"torch=={version}"], capture_output=True, text=True)
        found = sorted(wheels.glob("torch-*.whl")) if wheels.is_dir() else []
        if r.returncode != 0 or not found:
            raise RuntimeError(f"pip download of torch=={version} for {PLATFORM} failed:\n{r.stdout}{r.stderr}")
        downloaded = time.monotonic()
        staged = Path(tmp) / "staged"
        with zipfile.ZipFile(found[0]) as z:
            members = [n for n in z.namelist() if n.startswith("torch/include/") and not n.endswith("/")]
            z.extractall(staged, members)
        (staged / "torch" / "include").rename(staged / "include")
        shutil.rmtree(staged / "torch")
        (staged / "complete").write_text(f"{found[0].name}\n")
        if dest.exists():
            shutil.rmtree(dest)
        staged.rename(dest)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"macos_torch_headers: torch {version}: {found[0].name}, download {downloaded - start:.0f} s, "
          f"extract {time.monotonic() - downloaded:.0f} s, {size / 2**20:.0f} MiB kept", file=sys.stderr)
    return dest / "include"


def main(argv):
    for version in argv[1:] or VERSIONS:
        print(include_dir(version))


if __name__ == "__main__":
    main(sys.argv)
