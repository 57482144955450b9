"""Builds torch_marlin._C: CPU kernels everywhere, the Metal bridge on macOS."""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
GENERATED = os.path.join(ROOT, "build", "generated")


EMBED_METAL = os.path.join(ROOT, "csrc", "mps", "embed_metal.py")


def embed_metal_sources():
    """macOS: metal/ sources (and a metallib when Xcode's `metal` works) become a
    header that the bridge compiles in, so the installed extension needs no files."""
    subprocess.run([sys.executable, EMBED_METAL, GENERATED, "--metallib"], check=True)


def macos_floor():
    """The oldest macOS the package supports (embed_metal.MACOS_FLOOR)."""
    return subprocess.run([sys.executable, EMBED_METAL, "--macos-floor"], check=True, capture_output=True,
                          text=True).stdout.strip()


class BuildPyWithMetal(build_py):
    """Ships metal/ inside the wheel as torch_marlin/metal, where
    torch_marlin.testing.run_metal looks when the repository is not around."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "torch_marlin", "metal")
        os.makedirs(dst, exist_ok=True)
        for name in sorted(os.listdir(os.path.join(ROOT, "metal"))):
            shutil.copy2(os.path.join(ROOT, "metal", name), dst)


def sources():
    # csrc/mps/*.cpp (the MPS ops' plan runner) builds everywhere; only the
    # Objective-C++ encoder (*.mm) needs macOS.
    files = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/core/*.cpp") + glob.glob("csrc/cpu/*.cpp")
                   + glob.glob("csrc/mps/*.cpp"))
    if sys.platform == "darwin":
        files += sorted(glob.glob("csrc/mps/*.mm"))
    return files


def extension():
    # -g0: Python's CFLAGS carry -g; debug info for the torch headers took 40%
    # of the compile time and 33 of the 35 MB of the .so, and does not change
    # the generated code. The two defines make <ATen/ATen.h> and
    # <ATen/Functions.h> (every op: seconds per file) a compile error: include
    # <ATen/ops/NAME.h> for the few free functions a file calls.
    # scripts/check_mm_syntax.sh uses the same defines.
    cxx = ["-O3", "-g0", "-std=c++20", "-fvisibility=hidden", "-DAT_PER_OPERATOR_HEADERS",
           "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS"]
    # metal/ holds marlin_common.h, the constants shared by host code and kernels.
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "metal")]
    if sys.platform == "darwin":
        embed_metal_sources()
        include_dirs.append(GENERATED)
        # Built for the declared macOS floor, not the build machine's: APIs
        # newer than the floor need @available (as the Linux syntax check enforces).
        floor = [f"-mmacosx-version-min={macos_floor()}"]
        cxx += ["-fobjc-arc"] + floor  # .mm files compile as Objective-C++ by their extension
        link = ["-framework", "Metal", "-framework", "Foundation"] + floor
    else:
        link = []
    # at::parallel_for inlines OpenMP pragmas on Linux torch builds. macOS
    # wheels are not built or tested here; there it compiles without OpenMP.
    omp = [] if sys.platform == "darwin" else ["-fopenmp"]
    # The portable CPU kernels use 32-byte vectors without AVX; GCC notes an
    # ABI change for them that cannot matter (they are internal and inlined).
    quiet = [] if sys.platform == "darwin" else ["-Wno-psabi"]
    return CppExtension(
        "torch_marlin._C",
        sources(),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + omp + quiet},
        extra_link_args=link + omp,
    )


setup(
    # The MSL emulator (mslsim/) is a package of its own, installed by the test set-up, not shipped here.
    packages=find_packages(include=["torch_marlin", "torch_marlin.*"]),
    # Packages live at the top of the checkout: an editable install is then a plain
    # path entry, without setuptools' notice about folders that could shadow them.
    package_dir={"": "."},
    package_data={
        "torch_marlin.testing": ["calibration_en.txt"],
    },
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithMetal},
)
