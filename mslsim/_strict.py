"""Strict pass of the MSL emulator: reject what Apple's Metal compiler rejects.

The emulator compiles MSL as plain C++ in which the address spaces are
macros, so it accepts code that Metal refuses. This pass closes that gap:

* restrictions of the MSL specification checked on the preprocessed tokens
  (C++ features Metal does not have): `double`, `goto`, `new` / `delete`,
  `virtual`, `try` / `catch` / `throw`, `thread_local`, `register`, `typeid`,
  `dynamic_cast`, the C++ standard library (`std::` names and standard or
  system headers other than Metal's own);
* address spaces, with clang (`clang -fsyntax-only`-like, see
  include/mslsim/strict.h): `device`, `constant`, `threadgroup` are real
  `__attribute__((address_space(N)))` qualifiers and `thread` is the default,
  so clang rejects a pointer or reference of one address space where another
  (or `thread`) is expected: calls, assignments, initialisations, returns,
  template arguments, member functions called on device / threadgroup /
  constant objects;
* C-style casts between address spaces (clang accepts them and emits an
  `addrspacecast`; Metal has no conversion between address spaces), from the
  same LLVM IR;
* variable-length arrays (a clang extension in C++, an error here);
* recursion (direct or mutual), from the call graph of the LLVM IR clang
  emits for the kernels (template recursion over different arguments is not
  recursion and is allowed, as in Metal);
* built-in attributes on parameters of a type Metal does not allow, from the
  parameter types of the compiled library (builtin_type_errors).

Kernel pointer / reference parameters without an address space, program-scope
variables outside the constant address space and kernels that do not return
void are rejected by the front end (_frontend.py).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

_PKG = os.path.dirname(os.path.abspath(__file__))
STRICT_HEADER = os.path.join(_PKG, "include", "mslsim", "strict.h")
MIN_CLANG = 17  # __bf16 arithmetic on x86-64

_MARK_RE = re.compile(r'^# (\d+) "((?:[^"\\]|\\.)*)"((?: \d+)*)\s*$')

# ------------------------------------------------------------------ tokens
_FORBIDDEN = {
    "double": "'double' is not supported in Metal (use float)",
    "goto": "'goto' is not supported in Metal",
    "new": "'new' is not supported in Metal (no dynamic allocation)",
    "delete": "'delete' is not supported in Metal (no dynamic allocation)",
    "virtual": "virtual functions are not supported in Metal",
    "try": "exceptions are not supported in Metal ('try')",
    "catch": "exceptions are not supported in Metal ('catch')",
    "throw": "exceptions are not supported in Metal ('throw')",
    "thread_local": "'thread_local' is not supported in Metal",
    "register": "the 'register' storage class is not supported in Metal",
    "typeid": "run-time type information is not supported in Metal ('typeid')",
    "dynamic_cast": "run-time type information is not supported in Metal ('dynamic_cast')",
}
_STRIP_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
_IDENT = re.compile(r"[A-Za-z_]\w*")


def restriction_errors(pp: str, shim_dir: str) -> list:
    """Violations of the MSL restrictions in preprocessed MSL: ["file:line: error: ...", ...]."""
    errors = []
    file, line = "<source>", 0
    stack = []  # (file, system) of the include chain
    system = False
    for raw in pp.split("\n"):
        m = _MARK_RE.match(raw)
        if m:
            new_file, flags = m.group(2), m.group(3).split()
            if "1" in flags:  # entering an included file
                if "3" in flags and not system and not _is_internal(file) and not _under(new_file, shim_dir):
                    errors.append(f"{file}:{line + 1}: error: '{os.path.basename(new_file)}' ({new_file}) is a C/C++ "
                                  "standard library or system header; the C++ standard library is not available "
                                  "in Metal (use <metal_stdlib>)")
                stack.append((file, system))
            elif "2" in flags and stack:  # returning
                stack.pop()
            file, line, system = new_file, int(m.group(1)) - 1, "3" in flags
            continue
        line += 1
        if raw.startswith("#") or system or _is_internal(file) or _under(file, shim_dir):
            continue
        code = _STRIP_LITERALS.sub('""', raw)
        for t in _IDENT.finditer(code):
            word = t.group(0)
            if word == "std":
                rest = code[t.end():].lstrip()
                before = code[:t.start()].rstrip()
                if rest.startswith("::") or before.endswith("namespace"):
                    errors.append(f"{file}:{line}: error: the C++ standard library ('std::') is not available in "
                                  "Metal (use the metal:: equivalents)")
                continue
            msg = _FORBIDDEN.get(word)
            if msg is None:
                continue
            if word == "delete" and code[:t.start()].rstrip().endswith("="):
                continue  # '= delete' (a deleted function) is fine
            errors.append(f"{file}:{line}: error: {msg}")
    return _dedupe(errors)


def _dedupe(items):
    seen, out = set(), []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _is_internal(file: str) -> bool:
    return file.startswith("<") and file not in ("<mslsim source>", "<stdin>")


def _under(path: str, d: str) -> bool:
    return os.path.abspath(path).startswith(os.path.abspath(d) + os.sep)


# ------------------------------------------------------- built-in parameters
# Types Metal accepts for a kernel parameter's built-in attribute (MSL specification, "Attributes for
# kernel function input arguments"): positions and sizes uint / ushort or their 2- and 3-vectors,
# indices and counts uint / ushort.
_GRID_BUILTINS = {"thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
                  "threads_per_threadgroup", "dispatch_threads_per_threadgroup", "threadgroups_per_grid",
                  "threads_per_grid", "grid_size"}
_TC_UINT = 2  # fn_traits::info1 type code (mslsim/__init__.py)


def builtin_type_errors(kernels) -> list:
    """Built-in parameters of a type Metal rejects, from (Kernel, parameter infos of the compiled library)."""
    errors, seen = [], set()
    for k, infos in kernels:
        for p, info in zip(k.params, infos):
            if not p.builtin or p.where in seen:  # template instantiations share the parameter
                continue
            components, element_type, element_size = info[4:7]
            vectors = p.builtin in _GRID_BUILTINS
            if info[2] == 0 and element_type == _TC_UINT and element_size in (2, 4) and (
                    components in ((1, 2, 3) if vectors else (1,))):
                continue
            declared = " ".join(re.sub(r"\[\[.*?\]\]", " ", p.text).split()[:-1])
            allowed = "uint, uint2, uint3, ushort, ushort2 or ushort3" if vectors else "uint or ushort"
            seen.add(p.where)
            errors.append(f"{p.where}: error: kernel '{k.name}': parameter '{p.name}' has type '{declared}', "
                          f"which Metal does not allow for [[{p.builtin}]] ({allowed})")
    return errors


# ----------------------------------------------------------- clang discovery
_clang_cache = {}


def find_clang():
    """(command list, version string) of a clang++ >= MIN_CLANG, or (None, reason)."""
    env = os.environ.get("TORCH_MARLIN_MSLSIM_CLANG")
    cands = [env] if env else ["clang++-19", "clang++-20", "clang++-21", "clang++-18", "clang++-17", "clang++"]
    key = tuple(cands)
    if key in _clang_cache:
        return _clang_cache[key]
    result = (None, f"no clang++ >= {MIN_CLANG} found (tried {', '.join(cands)}; apt-get install clang-19, or set "
                    "TORCH_MARLIN_MSLSIM_CLANG)")
    for c in cands:
        exe = shutil.which(c)
        if not exe:
            continue
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        m = re.search(r"clang version (\d+)", out)
        if m and int(m.group(1)) >= MIN_CLANG:
            result = ([exe], out)
            break
        if m and env:
            result = (None, f"TORCH_MARLIN_MSLSIM_CLANG={env} is clang {m.group(1)}; the strict pass needs clang "
                            f">= {MIN_CLANG}")
    _clang_cache[key] = result
    return result


# --------------------------------------------------------------- rewriting
_VEC_NAME = r"(?:packed_)?(?:bool|char|uchar|short|ushort|int|uint|long|ulong|half|bfloat|float)[234]"
_VEC_CTOR = re.compile(r"(?<![\w.])((?:(?:::)?metal::)?(?:" + _VEC_NAME + r"|vec\s*<[^<>;(){}]*>))\s*\(")
# `float get() device const {`: an address-space-qualified member function
_AS_METHOD = re.compile(r"\)(\s*(?:const\s+)?)\b(device|threadgroup|constant|thread)\b(?=\s*(?:const\b\s*)?(?:[{;:]|->|"
                        r"noexcept\b|override\b|final\b))")


@dataclass
class StrictUnit:
    text: str
    as_methods: bool = False  # the source has address-space-qualified member functions


def strict_unit(parsed) -> StrictUnit:
    """The translation unit of the strict pass (compiled with -include strict.h)."""
    text = _VEC_CTOR.sub(lambda m: "mslsim_mk<" + m.group(1) + ">(", parsed.strict_text)
    # clang has no address-space-qualified member functions outside OpenCL: drop the qualifier and
    # remember that `this` address-space errors cannot be judged in this source.
    text, n = _AS_METHOD.subn(lambda m: ")" + m.group(1) + " " * len(m.group(2)), text)
    keep = ['# 1 "<mslsim-strict>"']
    for i, k in enumerate(parsed.kernels):
        keep.append(f'extern "C" __attribute__((used)) void* const mslsim_keep_{i} = (void*)&{k.expr};')
    return StrictUnit(text + "\n" + "\n".join(keep) + "\n", n > 0)


# ------------------------------------------------------------- diagnostics
_DIAG = re.compile(r"^(.*?):(\d+):(\d+): (error|fatal error|note|warning): (.*)$")


@dataclass
class Diag:
    file: str
    line: int
    col: int
    message: str
    notes: list = field(default_factory=list)  # (file, line, col, message)

    def key(self):
        return (self.file, self.line, self.col)

    def render(self) -> str:
        lines = [f"{self.file}:{self.line}:{self.col}: error: {_readable(self.message)}"]
        for f, ln, c, msg in self.notes[:8]:
            if f == STRICT_HEADER:  # a Metal library function: the candidate, without the shim's location
                if not msg.startswith("expanded from macro"):
                    lines.append(f"  note (Metal library): {_readable(msg)}")
            elif not f.startswith("<mslsim-strict>") and not f.startswith("/usr/"):
                lines.append(f"  {f}:{ln}:{c}: note: {_readable(msg)}")
        return "\n".join(lines)


def _readable(msg: str) -> str:
    msg = re.sub(r"'([^']*?)mslsim_tgt_\w+' \(aka '([^']*)'\)", r"'\2'", msg)  # kernel-scope threadgroup arrays
    msg = re.sub(r"^variable length arrays (?:in C\+\+ are a Clang extension|are a C99 feature)",
                 "variable length arrays are not supported in Metal (an array size must be a constant expression)",
                 msg)
    return (msg.replace("generic address space", "thread address space (the default)")
            .replace("__attribute__((address_space(1)))", "device")
            .replace("__attribute__((address_space(2)))", "constant")
            .replace("__attribute__((address_space(3)))", "threadgroup")
            .replace("address space '1'", "address space 'device'")
            .replace("address space '2'", "address space 'constant'")
            .replace("address space '3'", "address space 'threadgroup'"))


def parse_diagnostics(stderr: str) -> list:
    errors = []
    for ln in stderr.splitlines():
        m = _DIAG.match(ln)
        if not m:
            continue
        file, line, col, kind, msg = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4), m.group(5)
        if kind in ("error", "fatal error"):
            errors.append(Diag(file, line, col, msg))
        elif kind == "note" and errors:
            errors[-1].notes.append((file, line, col, msg))
    return errors


_AS_WORDS = r"(?:device|constant|threadgroup)"
_COPY_NOTE = re.compile(r"\(the implicit (?:copy|move) (?:constructor|assignment operator)\) not viable: "
                        r"(?:cannot bind reference in address space|'this' object is in address space)")
_BRACE_ELISION = re.compile(r"^no viable conversion from '(?:const )?" + _AS_WORDS + r" [^'*&]+' to ")
_MIXED_CONDITIONAL = re.compile(r"^incompatible operand types \('(?:const )?(?:" + _AS_WORDS + r" )?([^'*&]+)' and "
                                r"'(?:const )?(?:" + _AS_WORDS + r" )?([^'*&]+)'\)")
_THIS_AS = re.compile(r"^cannot initialize object parameter of type '[^']*' with an expression of type '(?:const )?"
                      + _AS_WORDS + r" ")


def is_copy_artifact(d: Diag, as_methods: bool) -> bool:
    """Errors of clang's C++ address spaces that Metal does not have: copying a struct out of or into
    device / threadgroup / constant memory uses its implicit copy constructor / assignment, which Metal
    allows in every address space but clang only in the default one."""
    if any(_COPY_NOTE.search(n[3]) for n in d.notes):
        return True
    if _BRACE_ELISION.search(d.message):
        return True
    m = _MIXED_CONDITIONAL.search(d.message)
    if m and m.group(1) == m.group(2):  # `c ? device_struct : constant_struct`: both copied out
        return True
    if as_methods and _THIS_AS.search(d.message):
        return True
    return False


# --------------------------------------------------------------- recursion
_DEFINE = re.compile(r"^define\b[^@]*@(\"[^\"]+\"|[\w.$]+)\(.*?(?:!dbg (!\d+))?\s*\{\s*$")
_CALL = re.compile(r"\b(?:call|invoke)\b[^@]*?@(\"[^\"]+\"|[\w.$]+)\((.*?)(?:, !dbg (!\d+))?\s*$")
_META = re.compile(r"^(!\d+) = (?:distinct )?!(\w+)\((.*)\)\s*$")


class _IRMetadata:
    """The debug-info metadata of LLVM IR: source locations of `!dbg` references."""

    def __init__(self, ir: str):
        self.meta = {}
        for ln in ir.splitlines():
            m = _META.match(ln)
            if m:
                self.meta[m.group(1)] = (m.group(2), m.group(3))

    @staticmethod
    def field_of(node, name):
        m = re.search(r"\b" + name + r": (\"(?:[^\"\\]|\\.)*\"|[^,]+)", node[1]) if node else None
        return m.group(1).strip('"') if m else None

    def where(self, ref):
        """"file:line" of a !dbg reference, or None."""
        field_of = self.field_of
        node = self.meta.get(ref)
        if not node:
            return None
        line = field_of(node, "line")
        scope = node
        while scope and field_of(scope, "file") is None and field_of(scope, "scope"):
            scope = self.meta.get(field_of(scope, "scope"))
        f = self.meta.get(field_of(scope, "file")) if scope else None
        fname = field_of(f, "filename") if f else None
        d = field_of(f, "directory") if f else None
        if fname and d and not os.path.isabs(fname) and not fname.startswith("<"):
            fname = os.path.join(d, fname)
        return f"{fname or '?'}:{line or '?'}"


def recursion_errors(ir: str) -> list:
    """Cycles in the call graph of the emitted kernels: ["file:line: error: recursion ...", ...]."""
    md = _IRMetadata(ir)
    meta, field_of, where = md.meta, md.field_of, md.where
    graph, sub, calls, cur = {}, {}, {}, None
    for ln in ir.splitlines():
        m = _DEFINE.match(ln)
        if m:
            cur = m.group(1)
            graph[cur] = []
            sub[cur] = m.group(2)
            continue
        if cur is None:
            continue
        if ln.startswith("}"):
            cur = None
            continue
        m = _CALL.search(ln)
        if m and not m.group(1).startswith("llvm."):
            graph[cur].append(m.group(1))
            calls.setdefault((cur, m.group(1)), m.group(3))

    def name(f):
        n = field_of(meta.get(sub.get(f)), "name") if sub.get(f) else None
        return n or f

    errors = []
    for comp in _sccs(graph):
        if len(comp) == 1 and comp[0] not in graph.get(comp[0], []):
            continue
        cycle = _cycle_in(comp, graph)
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            site = where(calls.get((a, b))) or where(sub.get(a)) or "?"
            steps.append(f"{name(a)} calls {name(b)} at {site}")
        first = where(calls.get((cycle[0], cycle[1]))) or where(sub.get(cycle[0])) or "<source>:?"
        kind = "recursion" if len(comp) == 1 else "mutual recursion"
        errors.append(f"{first}: error: {kind} is not supported in Metal: " + "; ".join(steps))
    return errors


_AS_NAMES = {"": "thread", "0": "thread", "1": "device", "2": "constant", "3": "threadgroup"}
_ADDRSPACECAST = re.compile(r"\baddrspacecast \(?ptr(?: addrspace\((\d+)\))? .*?\bto ptr(?: addrspace\((\d+)\))?")
_DBG = re.compile(r"!dbg (!\d+)")


def cast_errors(ir: str) -> list:
    """Conversions of pointers between address spaces in the emitted kernels. Metal has no such
    conversion; clang's C++ allows it in a C-style cast (an implicit one is an error there already), and
    emits an `addrspacecast`: ["file:line: error: ...", ...]."""
    md, errors = None, []
    for ln in ir.splitlines():
        m = _ADDRSPACECAST.search(ln)
        if not m:
            continue
        md = md or _IRMetadata(ir)
        dbg = _DBG.search(ln)
        site = (md.where(dbg.group(1)) if dbg else None) or "<source>:?"
        src, dst = _AS_NAMES.get(m.group(1) or "", "?"), _AS_NAMES.get(m.group(2) or "", "?")
        errors.append(f"{site}: error: cast of a {src} pointer to a {dst} pointer: Metal does not convert "
                      "pointers between address spaces (not even with a cast)")
    return _dedupe(errors)


def _sccs(graph):
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, [])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph.get(w, []))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def _cycle_in(comp, graph):
    """A cycle through comp[0] inside the strongly connected component (BFS)."""
    members = set(comp)
    start = sorted(comp)[0]
    prev = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in graph.get(v, []):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in members and w not in prev:
                prev[w] = v
                queue.append(w)
    return [start, start]


# ------------------------------------------------------------------- driver
# Metal rules clang checks in both runs (with and without address spaces), kept as errors of the strict pass.
_RULE_DIAGS = re.compile(r"^variable length arrays ")


def _clang_cmd(clang, as_on: bool, src: str, out_ll: str):
    # warnings off, except variable length arrays (a clang extension in C++; Metal has none) as errors
    return clang + ["-x", "c++", "-std=c++17", "-fno-exceptions", "-fno-rtti", "-Wno-everything",
                    "-Werror=vla-extension", "-ferror-limit=0",
                    "-fno-color-diagnostics", "-fno-caret-diagnostics", "-fno-diagnostics-fixit-info",
                    "-fno-diagnostics-show-option",
                    "-fno-spell-checking", f"-DMSLSIM_STRICT_AS={1 if as_on else 0}", "-include", STRICT_HEADER,
                    "-S", "-emit-llvm", "-O0", "-gline-tables-only", "-o", out_ll, src]


def start(unit: StrictUnit, clang, workdir: str):
    """Start the strict clang run in the background; finish() collects it."""
    fd, src = tempfile.mkstemp(suffix=".cpp", prefix="strict-", dir=workdir)
    with os.fdopen(fd, "w") as f:
        f.write(unit.text)
    ll = src[:-4] + ".ll"
    proc = subprocess.Popen(_clang_cmd(clang, True, src, ll), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    return (unit, clang, src, ll, proc)


def cancel(job):
    _, _, src, ll, proc = job
    proc.kill()
    proc.communicate()
    _remove(src, ll)


def finish(job) -> list:
    """Errors of the strict pass (address spaces, recursion) as rendered strings."""
    unit, clang, src, ll, proc = job
    try:
        _, stderr = proc.communicate()
        errors = [d for d in parse_diagnostics(stderr) if not is_copy_artifact(d, unit.as_methods)]
        ir = _read(ll) if proc.returncode == 0 else None
        if proc.returncode != 0:
            # Errors clang also reports without address spaces are shim gaps or plain C++ errors (the
            # emulator's compile reports those): only the rest are address-space errors.
            ll2 = src[:-4] + ".plain.ll"
            r = subprocess.run(_clang_cmd(clang, False, src, ll2), capture_output=True, text=True)
            plain = {d.key() for d in parse_diagnostics(r.stderr)}
            errors = [d for d in errors if d.key() not in plain or _RULE_DIAGS.search(d.message)]
            ir = _read(ll2) if r.returncode == 0 else None
        if errors:
            return [d.render() for d in errors]
        return (recursion_errors(ir) + cast_errors(ir)) if ir else []
    finally:
        _remove(src, ll, src[:-4] + ".plain.ll")


def _remove(*paths):
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def _read(p):
    try:
        with open(p) as f:
            return f.read()
    except OSError:
        return None


def cache_key(pp: str, clang_id: str) -> str:
    h = hashlib.sha256()
    h.update(pp.encode())
    shim = os.path.dirname(STRICT_HEADER)
    for p in [os.path.abspath(__file__), os.path.join(_PKG, "_frontend.py")] + [
            os.path.join(shim, n) for n in sorted(os.listdir(shim))]:
        with open(p, "rb") as f:
            h.update(f.read())
    h.update(clang_id.encode())
    return h.hexdigest()[:32]
