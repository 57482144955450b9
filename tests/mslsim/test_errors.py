"""Deliberately broken kernels and bad launches must be caught with clear errors."""
import os

import pytest
import torch

import mslsim

KDIR = os.path.join(os.path.dirname(__file__), "kernels")
BROKEN = os.path.join(KDIR, "broken.metal")


@pytest.fixture(scope="module")
def lib():
    return mslsim.compile(BROKEN)


def test_api_surface():
    assert mslsim.MAX_THREADGROUP_MEMORY == 32768
    assert issubclass(mslsim.MSLSimError, RuntimeError)


@pytest.mark.parametrize("schedule,seed", [("random", 0), ("random", 1), ("inorder", 0)])
def test_missing_barrier_is_observable(lib, schedule, seed):
    n = 256
    x = torch.arange(2 * n, dtype=torch.float32)
    exp = x.view(2, n).roll(-1, 1).reshape(-1)
    y = torch.zeros(2 * n)
    lib.launch("exchange_ok", grid=(2,), threadgroup=(n,), args={0: x, 1: y}, schedule=schedule, seed=seed)
    assert torch.equal(y, exp)
    # the race detector reports it (tests/mslsim/test_races.py) ...
    with pytest.raises(mslsim.MSLSimError, match=r"missing_barrier.*threadgroup memory race.*broken\.metal:1[89]"):
        lib.launch("missing_barrier", grid=(2,), threadgroup=(n,), args={0: x, 1: y}, schedule=schedule, seed=seed)
    # ... and without it the results show it
    y = torch.zeros(2 * n)
    lib.launch("missing_barrier", grid=(2,), threadgroup=(n,), args={0: x, 1: y}, schedule=schedule, seed=seed,
               check_races=False)
    assert not torch.equal(y, exp)
    # unwritten threadgroup memory is poisoned: reads give NaN
    assert torch.isnan(y).any()


def test_missing_barrier_deterministic_per_seed(lib):
    n = 256
    x = torch.arange(n, dtype=torch.float32)
    ys = []
    for _ in range(2):
        y = torch.zeros(n)
        lib.launch("missing_barrier", grid=(1,), threadgroup=(n,), args={0: x, 1: y}, seed=7, check_races=False)
        ys.append(y)
    assert torch.equal(ys[0].nan_to_num(-1), ys[1].nan_to_num(-1))


def test_out_of_bounds_write(lib):
    y = torch.zeros(100)
    with pytest.raises(mslsim.MSLSimError, match=r"oob_write.*out-of-bounds write of buffer\(0\) at byte offset 400 "
                                                 r"\(buffer size 400 bytes\).*broken\.metal:24"):
        lib.launch("oob_write", grid=(2,), threadgroup=(64,), args={0: y, 1: 100}, schedule="inorder")


def test_out_of_bounds_read(lib):
    x = torch.zeros(64)
    y = torch.zeros(64)
    with pytest.raises(mslsim.MSLSimError, match=r"out-of-bounds read of buffer\(0\)"):
        lib.launch("oob_read", grid=(1,), threadgroup=(64,), args={0: x, 1: y})


def test_write_through_const_buffer_at_runtime(lib):
    x = torch.ones(32)
    with pytest.raises(mslsim.MSLSimError, match=r"read-only.*buffer\(0\)"):
        lib.launch("const_cast_write", grid=(1,), threadgroup=(32,), args={0: x})
    assert torch.all(x == 1)


def test_write_through_constant_is_a_compile_error():
    src = """
#include <metal_stdlib>
using namespace metal;
kernel void bad(constant float* p [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  p[i] = 1.0f;
}
"""
    with pytest.raises(mslsim.MSLSimError, match=r"(?s)compiling .* failed.*:5:.*read-only"):
        mslsim.compile(src)


def test_threadgroup_memory_over_budget_static(lib):
    y = torch.zeros(64)
    with pytest.raises(mslsim.MSLSimError, match=r"too_much_tg.*threadgroup memory over budget.*32768"):
        lib.launch("too_much_tg", grid=(1,), threadgroup=(64,), args={0: y})


def test_threadgroup_memory_over_budget_static_plus_dynamic(lib):
    y = torch.zeros(64)
    lib.launch("dyn_tg", grid=(1,), threadgroup=(64,), args={0: y}, threadgroup_memory={0: 16384})
    assert torch.all(y == 3)
    with pytest.raises(mslsim.MSLSimError, match=r"over budget.*dynamic.*16400"):
        lib.launch("dyn_tg", grid=(1,), threadgroup=(64,), args={0: y}, threadgroup_memory={0: 16400})
    with pytest.raises(mslsim.MSLSimError, match=r"over budget"):
        lib.launch("dyn_tg", grid=(1,), threadgroup=(64,), args={0: y}, threadgroup_memory={0: 40000})


def test_divergent_barrier(lib):
    y = torch.zeros(64)
    with pytest.raises(mslsim.MSLSimError, match=r"divergent_barrier.*barrier divergence.*broken\.metal:\d+"):
        lib.launch("divergent_barrier", grid=(1,), threadgroup=(64,), args={0: y})


def test_returned_threads_leave_the_barrier(lib):
    y = torch.full((64,), -1.0)
    lib.launch("early_exit_barrier", grid=(1,), threadgroup=(64,), args={0: y})
    assert torch.equal(y[:40], torch.arange(39, -1, -1, dtype=torch.float32))
    assert torch.all(y[40:] == -1)


def test_launch_validation(lib):
    y = torch.zeros(64)
    with pytest.raises(mslsim.MSLSimError, match=r"unknown kernel 'nope'.*available kernels:.*exchange_ok"):
        lib.launch("nope", grid=(1,), threadgroup=(1,), args={})
    with pytest.raises(mslsim.MSLSimError, match=r"missing argument for \[\[buffer\(1\)\]\]"):
        lib.launch("exchange_ok", grid=(1,), threadgroup=(64,), args={0: y})
    with pytest.raises(mslsim.MSLSimError, match=r"1025 threads"):
        lib.launch("exchange_ok", grid=(1,), threadgroup=(1025,), args={0: y, 1: y})
    with pytest.raises(mslsim.MSLSimError, match=r"grid must be positive"):
        lib.launch("exchange_ok", grid=(0, 1, 1), threadgroup=(64,), args={0: y, 1: y})
    with pytest.raises(mslsim.MSLSimError, match=r"contiguous"):
        lib.launch("exchange_ok", grid=(1,), threadgroup=(64,), args={0: torch.zeros(64, 2)[:, 0], 1: y})
    with pytest.raises(mslsim.MSLSimError, match=r"does not match the parameter type size 4"):
        lib.launch("oob_write", grid=(1,), threadgroup=(64,), args={0: y, 1: torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(mslsim.MSLSimError, match=r"needs a tensor"):
        lib.launch("exchange_ok", grid=(1,), threadgroup=(64,), args={0: 3, 1: y})
    with pytest.raises(mslsim.MSLSimError, match=r"match no \[\[buffer"):
        lib.launch("exchange_ok", grid=(1,), threadgroup=(64,), args={0: y, 1: y, 5: y})
    with pytest.raises(mslsim.MSLSimError, match=r"schedule"):
        lib.launch("exchange_ok", grid=(1,), threadgroup=(64,), args={0: y, 1: y}, schedule="fast")


def test_compile_error_is_clear():
    with pytest.raises(mslsim.MSLSimError, match=r"(?s)compiling.*failed.*:4:.*undeclared_thing"):
        mslsim.compile("""#include <metal_stdlib>
using namespace metal;
kernel void k(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = undeclared_thing;
}
""")


def test_spin_wait_on_atomics_progresses(lib):
    flag = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    for schedule in ("inorder", "random"):
        flag.zero_()
        out.zero_()
        lib.launch("spin_wait_ok", grid=(1,), threadgroup=(64,), args={0: flag, 1: out}, schedule=schedule)
        assert out.item() == 1 and flag.item() == 1


def test_livelock_is_reported(lib):
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(mslsim.MSLSimError, match=r"spin_forever.*livelock"):
        lib.launch("spin_forever", grid=(1,), threadgroup=(2,), args={0: flag})


def test_timeout_stops_infinite_loop(lib):
    y = torch.zeros(8)
    with pytest.raises(mslsim.MSLSimError, match=r"infinite_loop.*timeout"):
        lib.launch("infinite_loop", grid=(4,), threadgroup=(4,), args={0: y}, timeout=0.3, workers=2)
    # the emulator is still usable afterwards
    flag = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    lib.launch("spin_wait_ok", grid=(1,), threadgroup=(64,), args={0: flag, 1: out})
    assert out.item() == 1


def test_integer_division_by_zero(lib):
    y = torch.ones(8, dtype=torch.int32)
    with pytest.raises(mslsim.MSLSimError, match=r"div_zero.*division.*by zero.*broken\.metal:\d+"):
        lib.launch("div_zero", grid=(1,), threadgroup=(8,), args={0: y, 1: 3})


def test_stack_overflow_hits_guard_page(lib):
    y = torch.ones(4)
    with pytest.raises(mslsim.MSLSimError, match=r"big_stack.*stack overflow"):
        lib.launch("big_stack", grid=(1,), threadgroup=(4,), args={0: y, 1: 100000})
    # with a larger stack the same kernel runs
    lib.launch("big_stack", grid=(1,), threadgroup=(4,), args={0: torch.ones(4), 1: 100000}, stack_size=1 << 20)
