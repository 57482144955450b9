"""Threadgroup-memory race detection: launch raises MSLSimError naming both threads and both source lines
for unordered conflicting accesses, whatever the schedule; race-free patterns pass."""
import os
import re

import pytest
import torch

from torch_marlin.testing import mslsim

KDIR = os.path.join(os.path.dirname(__file__), "kernels")
RACES = os.path.join(KDIR, "races.metal")
SCHEDULES = [("random", 0), ("random", 1), ("inorder", 0)]


@pytest.fixture(scope="module")
def lib():
    return mslsim.compile(RACES)


def _race_lines(kernel):
    with open(RACES) as f:
        return [i for i, ln in enumerate(f, 1) if ln.rstrip().endswith(f"// race: {kernel}")]


# kernel, conflict kinds, threads per threadgroup, both threads in one simdgroup (None: either)
RACES_CASES = {
    "write_write": ("write-write", 32, True),                  # two plain stores in one barrier interval
    "read_write": ("(?:read-write|write-read)", 256, None),    # a neighbour's value read without a barrier
    "simd_unsynced": ("(?:read-write|write-read)", 32, True),  # lanes of one simdgroup, no simdgroup sync
    "cross_simdgroup": ("(?:read-write|write-read)", 64, False),  # simdgroup_barrier across simdgroups
}


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
@pytest.mark.parametrize("kernel", sorted(RACES_CASES))
def test_race_is_reported(lib, kernel, schedule, seed):
    kind, n, same_simdgroup = RACES_CASES[kernel]
    args = {0: torch.randn(n), 1: torch.zeros(n)} if kernel == "read_write" else {0: torch.zeros(n)}
    with pytest.raises(mslsim.MSLSimError) as e:
        lib.launch(kernel, grid=(2,), threadgroup=(n,), args=args, schedule=schedule, seed=seed)
    msg = str(e.value)
    thread = r"thread (\d+) \(simdgroup (\d+) lane \d+\) of threadgroup \(\d,0,0\)"
    m = re.search(rf"threadgroup memory race \({kind}\) on byte \d+ of the threadgroup variable declared at "
                  rf".*races\.metal:\d+: {thread} (?:reads|writes) it at .*races\.metal:(\d+) and {thread} "
                  rf"(?:reads|writes) it at .*races\.metal:(\d+) in the same barrier interval", msg)
    assert m, msg
    t1, sg1, line1, t2, sg2, line2 = m.groups()
    assert t1 != t2
    if same_simdgroup is not None:
        assert (sg1 == sg2) == same_simdgroup, msg
    # the simdgroup hint only where a simdgroup sync would have ordered the two
    assert ("or, within the simdgroup, by a simdgroup_barrier or simd collective" in msg) == (sg1 == sg2), msg
    lines = _race_lines(kernel)
    assert {int(line1), int(line2)} <= set(lines), (lines, msg)
    if len(lines) > 1:
        assert line1 != line2, msg


def test_check_races_false_turns_it_off(lib):
    y = torch.zeros(32)
    lib.launch("write_write", grid=(1,), threadgroup=(32,), args={0: y}, check_races=False)
    assert all(int(v) // 2 == i // 2 for i, v in enumerate(y.tolist()))


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_race_free_patterns(lib, schedule, seed):
    n = 128
    y = torch.zeros(n)
    lib.launch("phases_ok", grid=(2,), threadgroup=(n,), args={0: y}, schedule=schedule, seed=seed)
    a = ((torch.arange(n) + 1) % n).float()  # buf[(tid + 1) % n] + buf[0]
    assert torch.equal(y, (a * 2 + 1)[(torch.arange(n) + 2) % n])

    out = torch.zeros(64, dtype=torch.int32)
    lib.launch("atomics_ok", grid=(2,), threadgroup=(64,), args={0: out}, schedule=schedule, seed=seed)
    assert torch.all(out == 64)

    y = torch.zeros(64)
    lib.launch("simd_ordered_ok", grid=(1,), threadgroup=(64,), args={0: y}, schedule=schedule, seed=seed)
    lane = torch.arange(32)
    a = (lane ^ 1).float()
    exp = (2 * a)[lane ^ 2] + a.sum()
    assert torch.equal(y, torch.cat([exp, exp]))

    x = torch.randn(4 * 64)
    y = torch.zeros(64)
    lib.launch("double_buffer_ok", grid=(1,), threadgroup=(64,), args={0: x, 1: y}, schedule=schedule, seed=seed)
    torch.testing.assert_close(y, x.view(4, 64).flip(1).sum(0))


def test_races_in_dynamic_threadgroup_memory_name_the_buffer():
    lib = mslsim.compile("""#include <metal_stdlib>
using namespace metal;
kernel void dyn(device float* y [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                uint tid [[thread_index_in_threadgroup]]) {
  t[0] = float(tid);
  y[tid] = t[0];
}
""")
    with pytest.raises(mslsim.MSLSimError, match=r"race \(write-write\) on byte 0 of the \[\[threadgroup\(0\)\]\] "
                                                 r"buffer.*<mslsim source>:5.*<mslsim source>:5"):
        lib.launch("dyn", grid=(1,), threadgroup=(8,), args={0: torch.zeros(8)}, threadgroup_memory={0: 64})
