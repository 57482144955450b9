"""mslsim: run unmodified Metal Shading Language compute kernels on the CPU.

The MSL source is preprocessed, lightly rewritten (see docs/MSLSIM.md) and
compiled as C++17 against a shim ``metal_stdlib``; every GPU thread of a
threadgroup runs as a fiber with Apple-GPU execution semantics (32-wide
simdgroups, rendezvous at barriers and simd collectives, shuffled schedule).

    import mslsim
    lib = mslsim.compile("metal/foo.metal")
    lib.launch("foo", grid=(4, 1, 1), threadgroup=(128, 1, 1), args={0: x, 1: y, 2: 128})
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

from . import _frontend, _strict

__all__ = ["compile", "Library", "LaunchStats", "MSLSimError", "MSLSimWarning", "MAX_THREADGROUP_MEMORY",
           "MAX_THREADS_PER_THREADGROUP", "cache_dir", "flush_subnormals_default"]

MAX_THREADGROUP_MEMORY = 32768
MAX_THREADS_PER_THREADGROUP = 1024
SIMD_WIDTH = 32

_PKG = os.path.dirname(os.path.abspath(__file__))
_INCLUDE = os.path.join(_PKG, "include")
_RUNTIME_SRC = os.path.join(_PKG, "runtime", "runtime.cpp")
_PRELUDE = os.path.join(_INCLUDE, "mslsim", "prelude.h")
_KEYWORDS = os.path.join(_INCLUDE, "mslsim", "keywords.h")

_CXXFLAGS = ["-std=c++17", "-O2", "-g1", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing", "-fwrapv",
             "-fno-math-errno", "-fvisibility=hidden", "-w"]
if sys.platform.startswith("linux"):
    # probe every stack page of big frames so a fiber stack overflow always hits the guard page
    _CXXFLAGS.append("-fstack-clash-protection")
# Race detection: ThreadSanitizer's compiler instrumentation only (a hook call before every load and
# store, defined in prelude.h; no TSan runtime is linked), without function entry / exit hooks.
_TSAN_GCC = ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0"]
_TSAN_CLANG = ["-fsanitize=thread"] + [f for o in ("func-entry-exit", "atomics", "memintrinsics")
                                        for f in ("-mllvm", f"-tsan-instrument-{o}=0")]
_RT_FLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-w"]


class MSLSimError(RuntimeError):
    """Any error of the emulator: bad launch, compile error, kernel fault, code Metal rejects, a race."""


class MSLSimWarning(UserWarning):
    """The strict pass could not run (no suitable clang); see docs/MSLSIM.md."""


def cache_dir() -> str:
    d = os.environ.get("TORCH_MARLIN_MSLSIM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "torch_marlin",
                                                                      "mslsim")
    os.makedirs(d, exist_ok=True)
    return d


def _cxx() -> list:
    c = os.environ.get("CXX")
    if c:
        return c.split()
    for cand in (["clang++"] if sys.platform == "darwin" else []) + ["c++", "g++", "clang++"]:
        if shutil.which(cand):
            return [cand]
    raise MSLSimError("no C++ compiler found (set $CXX)")


_compiler_id_cache = {}


def _compiler_id(cxx) -> str:
    key = tuple(cxx)
    if key not in _compiler_id_cache:
        try:
            out = subprocess.run(cxx + ["--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise MSLSimError(f"C++ compiler {' '.join(cxx)!r} does not work: {e}") from None
        _compiler_id_cache[key] = " ".join(cxx) + "\n" + out
    return _compiler_id_cache[key]


def _kernel_flags(cxx) -> list:
    return _CXXFLAGS + (_TSAN_CLANG if "clang version" in _compiler_id(cxx) else _TSAN_GCC)


def _read(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _atomic_write_from(tmp: str, dst: str):
    os.replace(tmp, dst)


def _link_flags():
    return ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []


_rt_lock = threading.Lock()
_rt = None


def _runtime():
    """Build (once, cached) and load the runtime library RTLD_GLOBAL."""
    global _rt
    with _rt_lock:
        if _rt is not None:
            return _rt
        cxx = _cxx()
        h = hashlib.sha256()
        for p in (_RUNTIME_SRC, os.path.join(_INCLUDE, "mslsim", "abi.h")):
            h.update(_read(p))
        h.update(" ".join(_RT_FLAGS).encode())
        h.update(_compiler_id(cxx).encode())
        path = os.path.join(cache_dir(), f"rt-{h.hexdigest()[:24]}.so")
        if not os.path.exists(path):
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
            os.close(fd)
            cmd = cxx + _RT_FLAGS + ["-o", tmp, _RUNTIME_SRC, "-lpthread"] + ([] if sys.platform == "darwin" else ["-ldl"])
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                os.unlink(tmp)
                raise MSLSimError("building the mslsim runtime failed:\n" + r.stderr[-4000:])
            _atomic_write_from(tmp, path)
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        lib.mslsim_launch.restype = ctypes.c_int
        lib.mslsim_launch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]
        _rt = lib
        return lib


class _LaunchArgs(ctypes.Structure):
    _fields_ = [
        ("thunk", ctypes.c_void_p),
        ("grid", ctypes.c_uint32 * 3),
        ("tg", ctypes.c_uint32 * 3),
        ("nbuf", ctypes.c_int32),
        ("buf_index", ctypes.c_int32 * 32),
        ("buf_ptr", ctypes.c_void_p * 32),
        ("buf_size", ctypes.c_uint64 * 32),
        ("buf_readonly", ctypes.c_int32 * 32),
        ("tg_dyn_size", ctypes.c_uint64 * 32),
        ("seed", ctypes.c_uint64),
        ("inorder", ctypes.c_int32),
        ("nworkers", ctypes.c_int32),
        ("stack_size", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_uint64),
        ("check_races", ctypes.c_int32),
    ]


class _LaunchStatsC(ctypes.Structure):
    _fields_ = [("barriers", ctypes.c_uint64), ("threadgroup_memory", ctypes.c_uint64),
                ("threadgroups", ctypes.c_uint64)]


@dataclass
class LaunchStats:
    """Returned by Library.launch."""
    kernel: str
    threadgroups: int
    threads_per_threadgroup: int
    barriers: int                 # threadgroup_barrier rendezvous completed (all threadgroups)
    threadgroup_memory: int       # bytes (static + dynamic) of the largest threadgroup
    buffer_bytes: dict            # buffer index -> bytes bound
    seconds: float


# type codes from fn_traits::info1 field 3
_TC_OTHER, _TC_INT, _TC_UINT, _TC_FLOAT, _TC_HALF, _TC_BFLOAT, _TC_BOOL = range(7)
# fn_traits::info1 fields of a parameter: size, const, pass by (value/pointer/reference), type code,
# components (1 scalar, N vec<T, N>), element type code, element size
_N_PINFO = 7


def _pack_scalar(value, size, tcode, what):
    """Pack a Python scalar as the C++ parameter type (size + type code from the compiled library)."""
    if isinstance(value, bool):
        value = int(value)
    if tcode == _TC_BFLOAT:
        if size != 2:
            raise MSLSimError(f"{what}: unexpected bfloat size {size}")
        bits = struct.unpack("<I", struct.pack("<f", float(value)))[0]
        if (bits & 0x7FFFFFFF) > 0x7F800000:
            return struct.pack("<H", (bits >> 16) | 0x40)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return struct.pack("<H", (bits >> 16) & 0xFFFF)
    if tcode in (_TC_FLOAT, _TC_HALF):
        fmt = {2: "<e", 4: "<f", 8: "<d"}.get(size)
    elif tcode == _TC_UINT:
        fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}.get(size)
    elif tcode in (_TC_INT, _TC_BOOL):
        fmt = {1: "<b", 2: "<h", 4: "<i", 8: "<q"}.get(size)
    else:
        fmt = None
    if fmt is None:
        raise MSLSimError(f"{what}: cannot pack a Python {type(value).__name__} into a {size}-byte "
                          "non-scalar parameter; pass a tensor or bytes of exactly that size")
    try:
        if fmt[-1] in "efd":
            return struct.pack(fmt, float(value))
        if not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise MSLSimError(f"{what}: expected an integer, got {value!r}")
        if fmt[-1] in "BHIQ" and value < 0:
            value &= (1 << (8 * size)) - 1
        return struct.pack(fmt, value)
    except (struct.error, OverflowError) as e:
        raise MSLSimError(f"{what}: value {value!r} does not fit the parameter type: {e}") from None


def _dims(v, what):
    if isinstance(v, int):
        v = (v,)
    try:
        v = tuple(int(x) for x in v)
    except TypeError:
        raise MSLSimError(f"{what} must be an int or a tuple of up to 3 ints, got {v!r}") from None
    if not 1 <= len(v) <= 3:
        raise MSLSimError(f"{what} must have 1 to 3 dimensions, got {v!r}")
    v = v + (1,) * (3 - len(v))
    if any(x <= 0 for x in v):
        raise MSLSimError(f"{what} must be positive in every dimension, got {v}")
    return v


def _default_workers():
    env = os.environ.get("TORCH_MARLIN_MSLSIM_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(os.cpu_count() or 1, 16))


class Library:
    """A compiled MSL library. Use :meth:`kernels` and :meth:`launch`."""

    def __init__(self, so_path, parsed, source_name, flush_subnormals=False):
        self.path = so_path
        self.source_name = source_name
        self.flush_subnormals = flush_subnormals  # compiled to flush subnormals (compile's argument)
        self._parsed = parsed
        self._dll = ctypes.CDLL(so_path)
        self._lock = threading.Lock()
        self._kernels = {}
        for i, k in enumerate(parsed.kernels):
            thunk = ctypes.cast(getattr(self._dll, f"mslsim_thunk_{i}"), ctypes.c_void_p).value
            pinfo = getattr(self._dll, f"mslsim_pinfo_{i}")
            pinfo.restype = ctypes.c_longlong
            pinfo.argtypes = [ctypes.c_int, ctypes.c_int]
            infos = [tuple(pinfo(j, f) for f in range(_N_PINFO)) for j in range(len(k.params))]
            self._kernels[k.name] = (k, thunk, infos)
        self._fc_set = self._dll.mslsim_fc_set
        self._fc_set.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        fci = self._dll.mslsim_fc_info
        fci.restype = ctypes.c_longlong
        fci.argtypes = [ctypes.c_int, ctypes.c_int]
        self._fcs = [(f, fci(i, 0), fci(i, 3)) for i, f in enumerate(parsed.constants)]

    def kernels(self):
        return list(self._kernels)

    def kernel_info(self, name):
        """Parameters of a kernel: name, kind (buffer/threadgroup/builtin), index, pointee size, const."""
        if name not in self._kernels:
            raise MSLSimError(f"unknown kernel {name!r}; available kernels: {', '.join(self._kernels) or '(none)'}")
        k, _, infos = self._kernels[name]
        kinds = {_frontend.K_BUF: "buffer", _frontend.K_TG: "threadgroup", _frontend.K_BUILTIN: "builtin"}
        builtin_names = {}
        for bn, bi in _frontend.BUILTINS.items():
            builtin_names.setdefault(bi, bn)
        out = []
        for p, (size, is_const, ptrkind, *_) in zip(k.params, infos):
            d = {"name": p.name, "kind": kinds[p.kind]}
            if p.kind == _frontend.K_BUILTIN:
                d["builtin"] = builtin_names[p.index]
            else:
                d.update(index=p.index, size=size, const=bool(is_const),
                         pass_by={0: "value", 1: "pointer", 2: "reference"}[ptrkind])
            if p.fc_guard:
                d["function_constant"] = p.fc_guard
            out.append(d)
        return out

    def function_constants(self):
        return {f.name: f.index for f, _, _ in self._fcs}

    def launch(self, name, grid=(1, 1, 1), threadgroup=(1, 1, 1), args=None, threadgroup_memory=None,
               constants=None, schedule="random", seed=0, workers=None, stack_size=None,
               timeout=None, check_races=True) -> LaunchStats:
        import torch
        if name not in self._kernels:
            raise MSLSimError(f"unknown kernel {name!r}; available kernels: {', '.join(self._kernels) or '(none)'}")
        k, thunk, infos = self._kernels[name]
        pre = f"kernel '{name}'"
        grid = _dims(grid, f"{pre}: grid")
        tg = _dims(threadgroup, f"{pre}: threadgroup")
        nthreads = tg[0] * tg[1] * tg[2]
        if nthreads > MAX_THREADS_PER_THREADGROUP:
            raise MSLSimError(f"{pre}: threadgroup {tg} has {nthreads} threads, more than the maximum of "
                              f"{MAX_THREADS_PER_THREADGROUP}")
        if k.max_threads and nthreads > k.max_threads:
            raise MSLSimError(f"{pre}: threadgroup {tg} has {nthreads} threads, more than the kernel's "
                              f"[[max_total_threads_per_threadgroup({k.max_threads})]]")
        if schedule not in ("random", "inorder"):
            raise MSLSimError(f"{pre}: schedule must be 'random' or 'inorder', got {schedule!r}")
        args = dict(args or {})
        tgmem = dict(threadgroup_memory or {})
        constants = dict(constants or {})

        # --- function constants
        fc_values = {}
        by_name = {f.name: i for i, (f, _, _) in enumerate(self._fcs)}
        by_index = {f.index: i for i, (f, _, _) in enumerate(self._fcs)}
        for key, val in constants.items():
            i = by_name.get(key) if isinstance(key, str) else by_index.get(key)
            if i is None:
                raise MSLSimError(f"{pre}: unknown function constant {key!r}; declared: "
                                  f"{', '.join(f'{f.name}({f.index})' for f, _, _ in self._fcs) or '(none)'}")
            f, size, tcode = self._fcs[i]
            fc_values[i] = _pack_scalar(val, size, tcode, f"{pre}: function constant {f.name}")

        def fc_true(guard):
            i = by_name.get(guard)
            if i is None:
                return True
            b = fc_values.get(i)
            return b is not None and any(b)

        la = _LaunchArgs()
        la.thunk = thunk
        la.grid[:] = grid
        la.tg[:] = tg
        keep = []
        nb = 0
        used_buf = set()
        buffer_bytes = {}
        for p, (size, is_const, ptrkind, tcode, *_) in zip(k.params, infos):
            if p.kind == _frontend.K_TG:
                if p.index not in tgmem:
                    raise MSLSimError(f"{pre}: parameter '{p.name}' is [[threadgroup({p.index})]] but "
                                      f"threadgroup_memory has no entry {p.index}")
                nbytes = int(tgmem[p.index])
                if nbytes <= 0:
                    raise MSLSimError(f"{pre}: threadgroup_memory[{p.index}] must be positive")
                la.tg_dyn_size[p.index] = nbytes
                continue
            if p.kind != _frontend.K_BUF:
                continue
            used_buf.add(p.index)
            what = f"{pre}: buffer({p.index}) '{p.name}'"
            if p.index not in args:
                if p.fc_guard and not fc_true(p.fc_guard):
                    continue
                raise MSLSimError(f"{pre}: missing argument for [[buffer({p.index})]] (parameter '{p.name}'); "
                                  f"bound: {sorted(args)}")
            v = args[p.index]
            readonly = bool(is_const)
            if isinstance(v, torch.Tensor):
                if v.device.type != "cpu":
                    raise MSLSimError(f"{what}: tensor must be on the CPU, got {v.device}")
                if not v.is_contiguous():
                    raise MSLSimError(f"{what}: tensor must be contiguous")
                nbytes = v.numel() * v.element_size()
                if ptrkind == 0 or (ptrkind == 2 and is_const):
                    if nbytes != size:
                        raise MSLSimError(f"{what}: set-bytes constant of {nbytes} bytes does not match the "
                                          f"parameter type size {size}")
                    readonly = True
                elif ptrkind == 2 and nbytes < size:  # device T& : a buffer holding at least one T
                    raise MSLSimError(f"{what}: buffer of {nbytes} bytes is smaller than the referenced type "
                                      f"({size} bytes)")
                ptr = v.data_ptr()
            else:
                if isinstance(v, (ctypes.Structure, ctypes.Array, memoryview)):
                    v = bytes(v)
                if ptrkind == 1:
                    if isinstance(v, (bytes, bytearray)):
                        raw = bytes(v)
                    else:
                        raise MSLSimError(f"{what}: a pointer parameter needs a tensor, got {type(v).__name__}")
                elif ptrkind == 2 and not is_const:
                    raise MSLSimError(f"{what}: a writable device reference parameter needs a tensor, "
                                      f"got {type(v).__name__}")
                elif isinstance(v, (bytes, bytearray)):
                    raw = bytes(v)
                    if len(raw) != size:
                        raise MSLSimError(f"{what}: {len(raw)} bytes given, the parameter type has {size}")
                elif isinstance(v, (int, float, bool)):
                    raw = _pack_scalar(v, size, tcode, what)
                else:
                    raise MSLSimError(f"{what}: unsupported argument type {type(v).__name__}")
                buf = ctypes.create_string_buffer(raw, len(raw))
                keep.append(buf)
                ptr = ctypes.addressof(buf)
                nbytes = len(raw)
                readonly = True
            la.buf_index[nb] = p.index
            la.buf_ptr[nb] = ptr
            la.buf_size[nb] = nbytes
            la.buf_readonly[nb] = 1 if readonly else 0
            buffer_bytes[p.index] = nbytes
            nb += 1
        la.nbuf = nb
        extra = sorted(set(args) - used_buf)
        if extra:
            raise MSLSimError(f"{pre}: args has indices {extra} that match no [[buffer(n)]] parameter "
                              f"(kernel buffers: {sorted(used_buf)})")
        extra = sorted(set(tgmem) - {p.index for p in k.params if p.kind == _frontend.K_TG})
        if extra:
            raise MSLSimError(f"{pre}: threadgroup_memory has indices {extra} that match no [[threadgroup(n)]] parameter")
        dyn = sum((int(v) + 15) // 16 * 16 for v in tgmem.values())
        if dyn > MAX_THREADGROUP_MEMORY:
            raise MSLSimError(f"{pre}: threadgroup memory over budget: dynamic [[threadgroup(n)]] arguments need "
                              f"{dyn} bytes, more than the Apple limit of {MAX_THREADGROUP_MEMORY}")
        la.seed = int(seed) & ((1 << 64) - 1)
        la.inorder = 1 if schedule == "inorder" else 0
        la.nworkers = int(workers) if workers else _default_workers()
        st = stack_size or int(os.environ.get("TORCH_MARLIN_MSLSIM_STACK", "0") or 0)
        la.stack_size = st
        if timeout is None:
            timeout = float(os.environ.get("TORCH_MARLIN_MSLSIM_TIMEOUT", "600") or 0)
        la.timeout_ms = int(max(0.0, float(timeout)) * 1000)
        la.check_races = 1 if check_races else 0
        err = ctypes.create_string_buffer(8192)
        stats = _LaunchStatsC()
        rt = _runtime()
        with self._lock:
            for i in range(len(self._fcs)):
                b = fc_values.get(i)
                if b is None:
                    self._fc_set(i, None, 0)
                else:
                    cb = ctypes.create_string_buffer(b, len(b))
                    self._fc_set(i, ctypes.addressof(cb), 1)
            t0 = time.perf_counter()
            rc = rt.mslsim_launch(ctypes.addressof(la), err, len(err), ctypes.addressof(stats))
            dt = time.perf_counter() - t0
        if rc != 0:
            raise MSLSimError(f"{pre}: {_symbolize(err.value.decode(errors='replace'))}")
        return LaunchStats(name, stats.threadgroups, nthreads, stats.barriers, stats.threadgroup_memory,
                           buffer_bytes, dt)

    def __repr__(self):
        return f"<mslsim.Library {self.source_name} kernels={self.kernels()}>"


def _symbolize(msg: str) -> str:
    """Replace each runtime "[pc lib.so+0xOFF]" tag by the kernel source line (addr2line)."""
    return re.sub(r" \[pc (.+?)\+0x([0-9a-fA-F]+)\]", lambda m: _source_line(m.group(1), m.group(2)), msg)


def _source_line(lib: str, offset: str) -> str:
    a2l = shutil.which("addr2line")
    if not a2l or not os.path.basename(lib).startswith("k-"):
        return ""
    try:
        r = subprocess.run([a2l, "-i", "-e", lib, "0x" + offset], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    locs = [ln.strip() for ln in r.stdout.splitlines() if ":" in ln and not ln.startswith("??")]
    cdir = cache_dir()
    mine = [ln for ln in locs if _INCLUDE not in ln and "<mslsim-generated>" not in ln and not ln.startswith(cdir)]
    return " at " + re.sub(r" \(discriminator \d+\)", "", mine[0]) if mine else ""


_lib_cache = {}
_lib_cache_lock = threading.Lock()


def _looks_like_path(source) -> bool:
    if isinstance(source, os.PathLike):
        return True
    return isinstance(source, str) and "\n" not in source and len(source) < 4096 and os.path.isfile(source)


FLUSH_SUBNORMALS_ENV = "TORCH_MARLIN_MSLSIM_FLUSH_SUBNORMALS"


def flush_subnormals_default() -> bool:
    """compile's flush_subnormals when not given: $TORCH_MARLIN_MSLSIM_FLUSH_SUBNORMALS (1 / 0), off if unset."""
    value = os.environ.get(FLUSH_SUBNORMALS_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise MSLSimError(f"${FLUSH_SUBNORMALS_ENV} must be 1 or 0, got {value!r}")


def compile(source, include_dirs=(), defines=None, strict=None,  # noqa: A001 - API name
            flush_subnormals=None) -> Library:
    """Compile MSL (a path or source text) for the CPU emulator; cached on disk.

    strict: check the source against what Apple's Metal compiler rejects (docs/MSLSIM.md): True requires
    the check, False skips it, None (default) runs it, and without a suitable clang warns and runs only the
    checks that need no clang (an error under CI, i.e. with $CI set).
    flush_subnormals: run as a GPU that flushes subnormals: fp16, bfloat and fp32 subnormal inputs and
    results of arithmetic become signed zeros. None (default): flush_subnormals_default().
    """
    if flush_subnormals is None:
        flush_subnormals = flush_subnormals_default()
    elif not isinstance(flush_subnormals, bool):
        raise MSLSimError(f"flush_subnormals must be True, False or None, got {flush_subnormals!r}")
    cxx = _cxx()
    if _looks_like_path(source):
        path = os.path.abspath(os.fspath(source))
        try:
            text = _read(path).decode()
        except OSError as e:
            raise MSLSimError(f"cannot read {path}: {e}") from None
        name = path
        base_dir = [os.path.dirname(path)]
    else:
        if not isinstance(source, str):
            raise MSLSimError("source must be a path or MSL text")
        if "\n" not in source and source.strip().endswith((".metal", ".h", ".msl")):
            raise MSLSimError(f"MSL source file not found: {source}")
        text, name, base_dir = source, "<mslsim source>", []
    dflags = []
    for k, v in (defines or {}).items():
        if isinstance(v, bool):
            v = int(v)
        dflags.append(f"-D{k}" if v is None else f"-D{k}={v}")
    incs = [f"-I{d}" for d in list(base_dir) + [os.fspath(d) for d in include_dirs]]
    metal_version = (defines or {}).get("__METAL_VERSION__", 310)
    if isinstance(metal_version, bool) or not isinstance(metal_version, int):
        raise MSLSimError(f"defines['__METAL_VERSION__'] must be an int such as 310 (MSL 3.1), got {metal_version!r}")
    # Apple's compiler defines __HAVE_BFLOAT__ from MSL 3.1 (-std=metal3.1) on, not before.
    bfloat = ["-D__HAVE_BFLOAT__=1"] if metal_version >= 310 else []
    pp_cmd = cxx + ["-x", "c++", "-std=c++17", "-E", "-D__METAL__=1", f"-D__METAL_VERSION__={metal_version}",
                    "-D__METAL_MACOS__=1", *bfloat, "-DMSLSIM=1", f"-I{_INCLUDE}"] + incs + dflags + ["-"]
    r = subprocess.run(pp_cmd, input=text, capture_output=True, text=True)
    if r.returncode != 0:
        raise MSLSimError(f"preprocessing {name} failed:\n{r.stderr[-6000:]}")
    pp = r.stdout.replace('"<stdin>"', '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"')
    flags = _kernel_flags(cxx) + (["-DMSLSIM_FLUSH_SUBNORMALS=1"] if flush_subnormals else [])
    h = hashlib.sha256()
    h.update(pp.encode())
    for p in sorted(os.listdir(os.path.join(_INCLUDE, "mslsim"))):
        h.update(p.encode())
        h.update(_read(os.path.join(_INCLUDE, "mslsim", p)))
    h.update(_read(os.path.join(_PKG, "_frontend.py")))
    h.update(" ".join(flags).encode())
    h.update(_compiler_id(cxx).encode())
    key = h.hexdigest()[:32]
    check = strict is not False
    with _lib_cache_lock:
        if key in _lib_cache and (not check or key in _strict_done):
            return _lib_cache[key]
    if check:
        errors = _strict.restriction_errors(pp, _INCLUDE)
        if errors:
            raise MSLSimError(_rejected(name, errors))
    try:
        parsed = _frontend.parse(pp, strict=check)
    except _frontend.FrontendError as e:
        raise MSLSimError(str(e) if str(e).startswith(name + ":") else f"{name}: {e}") from None
    except ValueError as e:  # unbalanced / truncated constructs
        raise MSLSimError(f"{name}: cannot parse the kernel source ({e})") from None
    d = cache_dir()
    strict_job = strict_ok = None
    if check:
        clang, clang_id = _strict_clang(strict)
        if clang:
            strict_ok = os.path.join(d, f"s-{_strict.cache_key(pp, clang_id)}.ok")
            if not os.path.exists(strict_ok):  # runs next to the C++ compile below
                strict_job = _strict.start(_strict.strict_unit(parsed), clang, d)
    so = os.path.join(d, f"k-{key}.so")
    build_error = None
    try:
        _runtime()
        if not os.path.exists(so):
            _build(parsed, key, name, cxx, flags, so)
    except MSLSimError as e:
        build_error = e
    except BaseException:
        if strict_job:
            _strict.cancel(strict_job)
        raise
    errors = _strict.finish(strict_job) if strict_job else []
    if errors:  # more precise than the C++ compiler's view of the same code
        raise MSLSimError(_rejected(name, errors)) from None
    if build_error:
        raise build_error
    if strict_job:
        with open(strict_ok, "w"):
            pass
    with _lib_cache_lock:
        lib = _lib_cache.get(key)
        if lib is None:
            lib = _lib_cache[key] = Library(so, parsed, name, flush_subnormals)
    if check:  # the types of built-in parameters, from the compiled library
        errors = _strict.builtin_type_errors((k, infos) for k, _, infos in lib._kernels.values())
        if errors:
            raise MSLSimError(_rejected(name, errors))
    with _lib_cache_lock:
        if check and strict_ok:
            _strict_done.add(key)
    return lib


_strict_done = set()
_warned = set()


def _rejected(name, errors) -> str:
    shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
    return (f"{name}: Apple's Metal compiler rejects this source (mslsim strict check; compile(strict=False) "
            "skips it):\n" + "\n".join(shown))


def _strict_clang(strict):
    """clang for the strict pass, or (None, None) after a warning; an error if required (strict=True, CI)."""
    clang, info = _strict.find_clang()
    if clang:
        return clang, info
    in_ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    if strict or in_ci:
        raise MSLSimError(f"the mslsim strict check needs clang: {info}" + (" (required under CI: $CI is set)"
                                                                            if in_ci else ""))
    if info not in _warned:
        _warned.add(info)
        warnings.warn(f"mslsim: {info}; the clang checks of the strict pass (address spaces, casts, variable-length "
                      "arrays, recursion) are skipped (the other Metal restrictions are still checked)", MSLSimWarning,
                      stacklevel=3)
    return None, None


def _build(parsed, key, name, cxx, flags, so):
    """Compile the generated C++ into the cached kernel library `so` (atomically)."""
    d = cache_dir()
    gen = _frontend.generate(parsed, _PRELUDE, _KEYWORDS)
    fd, cpp = tempfile.mkstemp(suffix=".cpp", prefix=f"k-{key}-", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(gen)
    obj = cpp[:-4] + ".o"
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
    os.close(fd)
    # compile and link separately: linking with -fsanitize=thread would pull in the TSan runtime
    r = subprocess.run(cxx + flags + ["-c", f"-I{_INCLUDE}", "-o", obj, cpp], capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run(cxx + ["-shared", "-o", tmp, obj] + _link_flags(), capture_output=True, text=True)
    if os.path.exists(obj):
        os.unlink(obj)
    if r.returncode != 0:
        os.unlink(tmp)
        kept = os.path.join(d, f"k-{key}.failed.cpp")
        os.replace(cpp, kept)
        msg = _summarize_errors(r.stderr)
        raise MSLSimError(f"compiling {name} failed (generated C++ kept at {kept}):\n{msg}")
    _atomic_write_from(tmp, so)
    os.replace(cpp, os.path.join(d, f"k-{key}.cpp"))


def _summarize_errors(stderr: str) -> str:
    lines = stderr.splitlines()
    errs = [ln for ln in lines if re.search(r"\b(error|fatal error)\b", ln)]
    head = "\n".join(errs[:25]) if errs else ""
    full = "\n".join(lines[:150]) + ("\n[...]" if len(lines) > 150 else "")
    return (head + "\n\ncompiler output:\n" + full) if head else full
