"""The Mac kit (scripts/mac_report.py, docs/MAC.md, .github/workflows/macos.yml): what can be checked
without a Mac. It refuses to run here; it reads the tools' output and assembles the report from fake
inputs as it will from real ones; the workflow is valid and does what docs/MAC.md says."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import mac_report  # noqa: E402


def test_refuses_off_a_mac():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "mac_report.py")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and not (ROOT / "mac_report.json").exists()
    assert "runs on a Mac" in run.stderr and "This machine runs Linux" in run.stderr
    with pytest.raises(SystemExit, match="runs on a Mac"):
        mac_report.require_mac("Windows")
    mac_report.require_mac("Darwin")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.metal.test_metal_mps" name="test_gemm[1]" time="0.5"/>
<testcase classname="tests.metal.test_metal_mps" name="test_gemm[4]" time="0.7"><failure message="assert 0.1 &lt; 1e-3">trace</failure></testcase>
<testcase classname="tests.metal.test_metal_mps" name="test_dequant" time="0.1"><skipped message="no MPS"/></testcase>
<testcase classname="tests.metal.test_embed_metal" name="test_embed" time="0.2"><error message="boom"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit():
    results = mac_report.parse_junit(JUNIT)
    assert [(r["name"].split("::")[1], r["outcome"]) for r in results] == [
        ("test_gemm[1]", "passed"), ("test_gemm[4]", "failed"), ("test_dequant", "skipped"), ("test_embed", "error")]
    assert results[1]["message"] == "assert 0.1 < 1e-3" and results[1]["seconds"] == 0.7


def _mps_line(name, m, t_m, gbs, share, t_f, t_i):
    # the row format of benchmarks/bench_mps.py's bench_device
    return (f"{name:24} {m:5d} {t_m:8.3f} {gbs:7.1f} {share:>6} {t_f:8.3f} {t_f / t_m:6.2f} "
            f"{t_i:9.3f} {t_i / t_m:6.2f}")


def test_parse_bench_mps_names_kernels_and_share_of_peak():
    text = "\n".join(["# MPS timings on M2 Max (38-core GPU), DRAM peak 400 GB/s, format=fp4, group_size=128",
                      "shape                        M   marlin    GB/s  %peak  fp16 mm      x  int4pack      x",
                      _mps_line("qkv/o_proj 4096x4096", 1, 0.030, 300.0, "75%", 0.090, 0.060),
                      _mps_line("gate/up 11008x4096", 16, 0.200, 120.5, "30%", 0.180, float("nan"))])
    rows = mac_report.parse_bench_mps(text, "fp4", 128, 400.0)
    assert [(r["shape"], r["m"], r["kernels"]) for r in rows] == [
        ("qkv/o_proj 4096x4096", 1, "marlin_gemv_fp4_f16_m1"),
        ("gate/up 11008x4096", 16, "marlin_gemm_fused_fp4_f16_tm32")]
    assert rows[0]["gb_per_s"] == 300.0 and rows[0]["percent_of_peak"] == 75.0 and rows[0]["n"] == 4096
    assert rows[1]["int4pack_ms"] != rows[1]["int4pack_ms"]  # nan: no int4 kernel for that group size
    assert mac_report.parse_bench_mps(text, "fp4", 128, None)[0]["percent_of_peak"] is None


def test_parse_bench_sparse():
    text = "shape                        M    dense      2:4      x\n" + \
           f"{'down 4096x11008':24} {1:5d} {0.080:8.3f} {0.060:8.3f} {0.080 / 0.060:6.2f}"
    (row,) = mac_report.parse_bench_sparse(text, "int4", 128)
    assert row["kernels"] == "marlin_sparse24_gemv_int4_f16_m1" and row["sparse24_ms"] == 0.06


def test_assemble_summary():
    step = dict(cmd=["x"], returncode=0, seconds=1.0, stdout="", stderr="")
    kernels = dict(macos_floor="14.0", metal_std="metal3.1", metallib=dict(ok=False, diagnostics="link error"),
                   files=[dict(source="gemv.metal", ok=True, seconds=2.0, diagnostics=""),
                          dict(source="moe.metal", ok=False, seconds=1.0, diagnostics="moe.metal:3: error: x")])
    tests = dict(step=step, results=mac_report.parse_junit(JUNIT))
    bench = dict(bench_mps=dict(step=step, rows=[dict(m=1, percent_of_peak=75.0), dict(m=4, percent_of_peak=80.0)]))
    report = mac_report.assemble(dict(chip="Apple M2 Max"), [step, dict(step, returncode=1)], kernels, tests, bench)
    assert report["summary"] == dict(
        build_ok=False, kernels_compiled=1, kernels_total=2, kernels_with_diagnostics=["moe.metal"], metallib_ok=False,
        tests={"passed": 1, "failed": 1, "skipped": 1, "error": 1},
        failed_tests=["tests.metal.test_metal_mps::test_gemm[4]", "tests.metal.test_embed_metal::test_embed"],
        gemv_m1_percent_of_peak=[75.0], best_percent_of_peak=80.0)
    assert json.loads(json.dumps(report)) == report  # attachable as it is
    assert list(report) == ["report_version", "summary", "machine", "build", "kernels", "tests", "benchmarks"]


def test_macos_workflow():
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "macos.yml").read_text())
    assert {"push", "pull_request"} <= set(flow[True])  # YAML 1.1 reads the key `on` as True
    (job,) = flow["jobs"].values()
    matrix = job["strategy"]["matrix"]["include"]
    assert {m["xcode"].split(".")[0] for m in matrix} == {"15", "16"}
    assert all(re.fullmatch(r"macos-1[45]", m["runner"]) for m in matrix)
    assert job["runs-on"] == "${{ matrix.runner }}"
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert 'xcode-select -s "/Applications/Xcode_${{ matrix.xcode }}.app"' in runs
    assert "scripts/mac_report.py --kernels-only" in runs and "tests/metal/test_metal_mps.py" in runs
    for step in job["steps"]:
        assert set(step) <= {"name", "uses", "with", "run"} and ("uses" in step) != ("run" in step)


def test_documented_and_reachable():
    assert re.search(r"^mac-report: .*\n\t\$\(PY\) scripts/mac_report\.py", (ROOT / "Makefile").read_text(), re.M)
    readme = (ROOT / "README.md").read_text()
    assert "docs/MAC.md" in readme
    two = re.search(r"## Two commands.*?```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split()[:2] for line in two.splitlines()] == [["make", "example"], ["make", "test"]]
