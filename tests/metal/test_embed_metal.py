"""csrc/mps/embed_metal.py: the metallib is built for the declared macOS floor
with safe math; no Metal toolchain falls back to the sources with a note; a
toolchain that rejects a kernel fails the build with its diagnostics. Tested
with a fake xcrun (no Xcode here); the exact command lines are asserted."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import torch_marlin.ops  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
EMBED = ROOT / "csrc" / "mps" / "embed_metal.py"

spec = importlib.util.spec_from_file_location("embed_metal", EMBED)
embed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(embed)

SOURCES = sorted((ROOT / "metal").glob("*.metal"))


def test_compile_command_is_safe_math_for_the_floor(tmp_path):
    cmd = embed.metal_compile_command(ROOT / "metal" / "gemv.metal", tmp_path / "gemv.air")
    assert cmd == ["xcrun", "-sdk", "macosx", "metal", "-std=metal3.1", "-mmacosx-version-min=14.0",
                   "-fno-fast-math", "-I", str(ROOT / "metal"), "-c", str(ROOT / "metal" / "gemv.metal"),
                   "-o", str(tmp_path / "gemv.air")]
    assert "-ffast-math" not in cmd
    link = embed.metallib_link_command([tmp_path / "a.air", tmp_path / "b.air"], tmp_path / "x.metallib")
    assert link == ["xcrun", "-sdk", "macosx", "metallib", str(tmp_path / "a.air"), str(tmp_path / "b.air"),
                    "-o", str(tmp_path / "x.metallib")]
    assert embed.toolchain_env()["MACOSX_DEPLOYMENT_TARGET"] == embed.MACOS_FLOOR


def test_macos_floor_is_the_bridge_floor():
    # the metallib's deployment target, setup.py's and the syntax check's
    # floor is the one the bridge checks at first use (csrc/core/metal_plan.cpp)
    major, minor = (int(v) for v in embed.MACOS_FLOOR.split("."))
    problem = torch.ops.marlin._metal_support_problem
    assert problem(major, minor, True) == ""
    assert f"macOS {embed.MACOS_FLOOR} or newer" in problem(major - 1, 9, True)
    readme = (ROOT / "README.md").read_text()
    assert f"macOS {embed.MACOS_FLOOR}" in readme and "Metal 3.1" in readme
    low = re.search(r'"torch>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"torch {low}" in readme


class FakeToolchain:
    """subprocess.run stand-in: records commands; `fail` names a step that fails."""

    def __init__(self, fail=None):
        self.fail, self.calls = fail, []

    def __call__(self, cmd, capture_output, text, env):
        self.calls.append((cmd, env))
        if cmd == embed.toolchain_probe_command():
            if self.fail == "probe":
                return SimpleNamespace(returncode=1, stdout="",
                                       stderr="error: cannot execute tool 'metal' due to missing Metal Toolchain")
            return SimpleNamespace(returncode=0, stdout="Apple metal version 32023.35", stderr="")
        step = "link" if "metallib" in cmd else Path(cmd[cmd.index("-c") + 1]).name
        if step == self.fail:
            return SimpleNamespace(returncode=1, stdout="", stderr=f"{step}:12:3: error: use of undeclared identifier")
        Path(cmd[-1]).write_bytes(b"MTLB" + step.encode())
        return SimpleNamespace(returncode=0, stdout="", stderr="warning: an Apple-only warning" if step == "gemv.metal"
                               else "")


def test_builds_every_kernel_file_then_links(tmp_path, capsys):
    run = FakeToolchain()
    lib = embed.build_metallib(SOURCES, tmp_path, run=run, which=lambda _: "/usr/bin/xcrun")
    assert lib == b"MTLBlink"
    cmds = [c for c, _ in run.calls]
    assert cmds[0] == embed.toolchain_probe_command()
    assert cmds[1:-1] == [embed.metal_compile_command(s, tmp_path / (s.stem + ".air")) for s in SOURCES]
    assert cmds[-1] == embed.metallib_link_command([tmp_path / (s.stem + ".air") for s in SOURCES],
                                                   tmp_path / "torch_marlin.metallib")
    assert all(env["MACOSX_DEPLOYMENT_TARGET"] == "14.0" for _, env in run.calls)
    assert "an Apple-only warning" in capsys.readouterr().err  # the compiler's output is shown


def test_no_xcode_falls_back_to_sources(tmp_path, capsys):
    run = FakeToolchain()
    assert embed.build_metallib(SOURCES, tmp_path, run=run, which=lambda _: None) is None
    assert run.calls == [] and "no xcrun" in capsys.readouterr().err
    run = FakeToolchain(fail="probe")
    assert embed.build_metallib(SOURCES, tmp_path, run=run, which=lambda _: "/usr/bin/xcrun") is None
    assert len(run.calls) == 1 and "missing Metal Toolchain" in capsys.readouterr().err


@pytest.mark.parametrize("fail", ["gemm_tiled.metal", "link"])
def test_rejected_kernel_fails_with_the_diagnostics(tmp_path, fail):
    with pytest.raises(embed.MetalCompileError, match="use of undeclared identifier") as e:
        embed.build_metallib(SOURCES, tmp_path, run=FakeToolchain(fail), which=lambda _: "/usr/bin/xcrun")
    assert (f"metal/{fail}" if fail != "link" else "the metallib") in str(e.value)


def _fake_xcrun(tmp_path, script):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    xcrun = bin_dir / "xcrun"
    xcrun.write_text("#!/bin/sh\n" + script)
    xcrun.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_build_fails_when_the_compiler_rejects_a_kernel(tmp_path):
    env = _fake_xcrun(tmp_path, 'case "$*" in *--version*) exit 0;; esac\n'
                                'echo "gemv.metal:80:5: error: no matching function" >&2; exit 1\n')
    r = subprocess.run([sys.executable, str(EMBED), str(tmp_path / "out"), "--metallib"], capture_output=True,
                       text=True, env=env)
    assert r.returncode != 0 and "no matching function" in r.stderr and "rejected metal/" in r.stderr, r.stderr


def test_build_without_metal_toolchain_embeds_sources_only(tmp_path):
    env = _fake_xcrun(tmp_path, 'echo "xcrun: error: unable to find utility \\"metal\\"" >&2; exit 72\n')
    r = subprocess.run([sys.executable, str(EMBED), str(tmp_path / "out"), "--metallib"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0 and "unable to find utility" in r.stderr, r.stderr
    header = (tmp_path / "out" / "torch_marlin_metal_sources.h").read_text()
    assert "kMarlinMetallibSize = 0;" in header and all(f'{{"{s.stem}",' in header for s in SOURCES)
