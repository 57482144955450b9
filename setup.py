"""Builds torch_marlin._C: CPU kernels everywhere, the Metal bridge on macOS."""

import glob
import os
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources():
    files = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/core/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    if sys.platform == "darwin":
        files += sorted(glob.glob("csrc/mps/*.mm"))
    return files


def extension():
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden"]
    if sys.platform == "darwin":
        cxx += ["-fobjc-arc"]  # .mm files compile as Objective-C++ by their extension
        link = ["-framework", "Metal", "-framework", "Foundation"]
    else:
        link = []
    # at::parallel_for inlines OpenMP pragmas on Linux torch builds. macOS
    # wheels are not built or tested here; there it compiles without OpenMP.
    omp = [] if sys.platform == "darwin" else ["-fopenmp"]
    return CppExtension(
        "torch_marlin._C",
        sources(),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx + omp},
        extra_link_args=link + omp,
    )


setup(
    packages=find_packages(include=["torch_marlin", "torch_marlin.*"]),
    package_data={
        "torch_marlin.testing.mslsim": ["include/*", "include/**/*", "runtime/*", "runtime/**/*"],
        "torch_marlin": ["metal/*"],
    },
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
