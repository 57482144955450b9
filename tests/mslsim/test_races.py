"""Threadgroup-memory race detection: launch raises MSLSimError naming both threads and both source lines
for unordered conflicting accesses, whatever the schedule; race-free patterns pass."""
import os
import re

import pytest
import torch

import mslsim

KDIR = os.path.join(os.path.dirname(__file__), "kernels")
RACES = os.path.join(KDIR, "races.metal")
SCHEDULES = [("random", 0), ("random", 1), ("inorder", 0)]


@pytest.fixture(scope="module")
def lib():
    return mslsim.compile(RACES)


def _race_lines(kernel):
    with open(RACES) as f:
        return [i for i, ln in enumerate(f, 1) if ln.rstrip().endswith(f"// race: {kernel}")]


def check_report(msg, kernel, memory, place, kind, same_simdgroup):
    """The race report names both threads and both source lines (marked `// race: kernel` in races.metal),
    the conflict kind and the memory (place: how the byte is named); the simdgroup hint only where a
    simdgroup sync would have ordered the two."""
    thread = r"thread (\d+) \(simdgroup (\d+) lane \d+\) of threadgroup \(\d,0,0\)"
    flag = {"threadgroup": "mem_flags::mem_threadgroup", "device": "mem_flags::mem_device"}[memory]
    m = re.search(rf"{memory} memory race \({kind}\) on byte \d+ of {place}: {thread} (?:reads|writes) it at "
                  rf".*races\.metal:(\d+) and {thread} (?:reads|writes) it at .*races\.metal:(\d+) in the same "
                  rf"barrier interval; the accesses are not ordered by a threadgroup_barrier with {flag}", msg)
    assert m, msg
    t1, sg1, line1, t2, sg2, line2 = m.groups()
    assert t1 != t2
    if same_simdgroup is not None:
        assert (sg1 == sg2) == same_simdgroup, msg
    assert (f"or, within the simdgroup, by a simdgroup_barrier with {flag} or a simd collective" in msg) == (
        sg1 == sg2), msg
    lines = _race_lines(kernel)
    assert {int(line1), int(line2)} <= set(lines), (lines, msg)
    if len(lines) > 1:
        assert line1 != line2, msg


# kernel, conflict kinds, threads per threadgroup, both threads in one simdgroup (None: either)
RACES_CASES = {
    "write_write": ("write-write", 32, True),                  # two plain stores in one barrier interval
    "read_write": ("(?:read-write|write-read)", 256, None),    # a neighbour's value read without a barrier
    "simd_unsynced": ("(?:read-write|write-read)", 32, True),  # lanes of one simdgroup, no simdgroup sync
    "cross_simdgroup": ("(?:read-write|write-read)", 64, False),  # simdgroup_barrier across simdgroups
    "threadgroup_mem_none": ("(?:read-write|write-read)", 64, None),  # mem_none orders no memory
}


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
@pytest.mark.parametrize("kernel", sorted(RACES_CASES))
def test_race_is_reported(lib, kernel, schedule, seed):
    kind, n, same_simdgroup = RACES_CASES[kernel]
    args = {0: torch.randn(n), 1: torch.zeros(n)} if kernel == "read_write" else {0: torch.zeros(n)}
    with pytest.raises(mslsim.MSLSimError) as e:
        lib.launch(kernel, grid=(2,), threadgroup=(n,), args=args, schedule=schedule, seed=seed)
    check_report(str(e.value), kernel, "threadgroup", r"the threadgroup variable declared at .*races\.metal:\d+",
                 kind, same_simdgroup)


# Device memory within a threadgroup (each threadgroup uses its own part of buffer(0)): kernel, conflict
# kinds, threads per threadgroup, both threads in one simdgroup (None: either)
DEVICE_CASES = {
    "device_no_barrier": ("(?:read-write|write-read)", 64, None),
    "device_threadgroup_flag": ("(?:read-write|write-read)", 64, None),  # mem_threadgroup: not device memory
    "device_mem_none": ("(?:read-write|write-read)", 64, None),          # mem_none: no memory
    "device_write_after_read": ("read-write", 64, None),
    "device_own_read_back": ("write-write", 64, None),
    "device_simd_threadgroup_flag": ("(?:read-write|write-read)", 32, True),
}


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
@pytest.mark.parametrize("kernel", sorted(DEVICE_CASES))
def test_device_memory_race_is_reported(lib, kernel, schedule, seed):
    kind, n, same_simdgroup = DEVICE_CASES[kernel]
    with pytest.raises(mslsim.MSLSimError) as e:
        lib.launch(kernel, grid=(2,), threadgroup=(n,), args={0: torch.zeros(2 * 2 * n)}, schedule=schedule,
                   seed=seed)
    check_report(str(e.value), kernel, "device", r"buffer\(0\)", kind, same_simdgroup)


@pytest.mark.parametrize("schedule,seed", SCHEDULES)
def test_device_memory_ordered_by_mem_device(lib, schedule, seed):
    n = 64
    y = torch.zeros(2 * 2 * n)
    lib.launch("device_ordered_ok", grid=(2,), threadgroup=(n,), args={0: y}, schedule=schedule, seed=seed)
    tid = torch.arange(n)
    second = ((tid + 1) % n).float() + 1  # mine[n + tid] after the second phase (+ mine[n] == 0)
    for g in range(2):
        mine = y[g * 2 * n:(g + 1) * 2 * n]
        assert torch.equal(mine[n:], second)
        assert torch.equal(mine[:n], second[(tid // 32) * 32 + (tid % 32 ^ 1)])


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
