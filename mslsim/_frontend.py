"""Front end of the MSL emulator: parse kernels out of preprocessed MSL and
rewrite the few constructs that are not valid C++ into shim macros.

Every rewrite keeps the line structure (or re-synchronises it with a line
marker) so compiler diagnostics and runtime errors point at the original
.metal source lines.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

BUILTINS = {
    "thread_position_in_grid": 0,
    "thread_position_in_threadgroup": 1,
    "threadgroup_position_in_grid": 2,
    "threads_per_threadgroup": 3,
    "dispatch_threads_per_threadgroup": 3,
    "threadgroups_per_grid": 4,
    "threads_per_grid": 5,
    "grid_size": 5,
    "thread_index_in_threadgroup": 6,
    "thread_index_in_simdgroup": 7,
    "simdgroup_index_in_threadgroup": 8,
    "threads_per_simdgroup": 9,
    "thread_execution_width": 9,
    "simdgroups_per_threadgroup": 10,
    "dispatch_simdgroups_per_threadgroup": 10,
    "thread_index_in_quadgroup": 11,
    "quadgroup_index_in_threadgroup": 12,
}

K_BUF, K_TG, K_BUILTIN = 0, 1, 2


class FrontendError(Exception):
    pass


@dataclass
class Param:
    name: str
    text: str
    kind: int
    index: int
    fc_guard: str | None = None  # [[function_constant(x)]] on the parameter
    where: str = ""              # file:line of the parameter
    builtin: str = ""            # the built-in attribute's name


@dataclass
class Kernel:
    name: str           # host name
    expr: str           # C++ expression naming the function (f or f<...>)
    params: list
    line: str = ""
    max_threads: int = 0  # [[max_total_threads_per_threadgroup(n)]], 0 if absent


@dataclass
class FunctionConstant:
    name: str
    type: str
    index: int


@dataclass
class Parsed:
    kernels: list = field(default_factory=list)
    constants: list = field(default_factory=list)
    text: str = ""         # C++ for the emulator (address spaces become macros)
    strict_text: str = ""  # the same before the const fix-up, for the strict pass (_strict.py)


def _match_paren(s: str, i: int, open_c="(", close_c=")") -> int:
    """s[i] == open_c; return index of the matching close."""
    depth = 0
    for m in re.compile(re.escape(open_c) + "|" + re.escape(close_c)).finditer(s, i):
        depth += 1 if m.group() == open_c else -1
        if depth == 0:
            return m.start()
    raise FrontendError("unbalanced '%s'" % open_c)


def _split_top(s: str, sep=",") -> list:
    out, depth, cur = [], 0, []
    for c in s:
        if c in "(<[{":
            depth += 1
        elif c in ")>]}":
            depth -= 1
        if c == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


def _blank(s: str) -> str:
    """Same length, newlines kept, everything else a space."""
    return re.sub(r"[^\n]", " ", s)


_ATTR_RE = re.compile(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*?)\]\]", re.S)
_MARK_RE = re.compile(r'^# (\d+) "((?:[^"\\]|\\.)*)"', re.M)


def _loc(text: str, pos: int):
    last = None
    for m in _MARK_RE.finditer(text, 0, pos):
        last = m
    if last is None:
        return "<source>", text.count("\n", 0, pos) + 1
    line = int(last.group(1)) + text.count("\n", last.end(), pos) - 1
    return last.group(2), line


def _int_expr(s: str) -> int:
    s = s.strip()
    if not re.fullmatch(r"[0-9xXa-fA-FuUlL+\-*/() ]+", s):
        raise FrontendError("cannot evaluate index expression %r" % s)
    s = re.sub(r"(?<=[0-9a-fA-F])[uUlL]+", "", s)
    return int(eval(s, {"__builtins__": {}}, {}))  # noqa: S307 - digits/operators only


_KERNEL_AS = ("device", "constant", "threadgroup", "ray_data", "object_data")


def _pointer_without_address_space(decl: str) -> str | None:
    """'thread' / 'none' when a kernel parameter is a pointer or reference without a kernel address space."""
    bare = re.sub(r"<[^<>]*>", " ", decl)
    while re.search(r"<[^<>]*>", bare):
        bare = re.sub(r"<[^<>]*>", " ", bare)
    if "*" not in bare and "&" not in bare:
        return None
    words = set(re.findall(r"\w+", bare))
    if words & set(_KERNEL_AS):
        return None
    return "thread" if "thread" in words else "none"


def _parse_params(text: str, start: int, end: int, kname: str, strict: bool) -> list:
    params = []
    pos = start
    for p in _split_top(text[start:end]):
        ploc = "%s:%d" % _loc(text, pos + len(p) - len(p.lstrip()))
        pos += len(p) + 1
        p = p.strip()
        if not p or p == "void":
            continue
        attrs = _ATTR_RE.findall(p)
        bare = _ATTR_RE.sub(" ", p).strip()
        m = re.search(r"(\w+)\s*$", bare)
        pname = m.group(1) if m else "?"
        kind = index = None
        guard = None
        builtin = ""
        for a in attrs:
            for item in _split_top(a):
                item = item.strip()
                mm = re.fullmatch(r"(\w+)\s*(?:\((.*)\))?", item, re.S)
                if not mm:
                    continue
                key, arg = mm.group(1), mm.group(2)
                if key in ("buffer", "threadgroup"):
                    kind, index = (K_BUF if key == "buffer" else K_TG), _int_expr(arg)
                    if not 0 <= index < 31:
                        raise FrontendError(f"{ploc}: kernel '{kname}': [[{key}({index})]] is out of range "
                                            "(0..30)")
                elif key == "function_constant":
                    guard = arg.strip()
                elif key in BUILTINS:
                    kind, index, builtin = K_BUILTIN, BUILTINS[key], key
                elif key in ("stage_in", "texture", "sampler", "payload", "mesh"):
                    raise FrontendError(f"{ploc}: kernel '{kname}': parameter '{pname}' uses [[{key}]], "
                                        "which mslsim does not support")
        if kind is None:
            if re.search(r"\b(device|constant)\b", bare):
                raise FrontendError(f"{ploc}: kernel '{kname}': parameter '{pname}' has no [[buffer(n)]] index")
            raise FrontendError(f"{ploc}: kernel '{kname}': parameter '{pname}' has no attribute mslsim "
                                f"understands (supported builtins: {', '.join(sorted(BUILTINS))})")
        missing = _pointer_without_address_space(bare) if strict and kind != K_BUILTIN else None
        if missing:
            what = "the thread address space" if missing == "thread" else "no address space"
            raise FrontendError(f"{ploc}: error: kernel '{kname}': pointer / reference parameter '{pname}' has "
                                f"{what}; Metal requires device, constant or threadgroup on kernel pointer and "
                                "reference parameters")
        params.append(Param(pname, p, kind, index, guard, ploc, builtin))
    return params


_INST_RE = re.compile(r"\btemplate\s*\[\[\s*host_name\s*\(\s*((?:\"[^\"]*\"\s*)+)\)\s*\]\]")


def _last_name(decl: str) -> str:
    """'decltype(f<A, B>) f<A, B>' -> 'f<A, B>'; 'T g' -> 'g'."""
    d = decl.rstrip()
    j = len(d)
    if d.endswith(">"):
        depth = 0
        for j in range(len(d) - 1, -1, -1):
            if d[j] == ">":
                depth += 1
            elif d[j] == "<":
                depth -= 1
                if depth == 0:
                    break
    m = re.search(r"[A-Za-z_][\w:]*\s*$", d[:j])
    if not m:
        raise FrontendError("cannot find the function name in host_name instantiation: %s" % decl[:200])
    return (m.group(0).strip() + d[j:]).strip()


def _strcat(lits: str) -> str:
    return "".join(re.findall(r'"([^"]*)"', lits))


# kernel definitions: the kernel qualifier, attributes, the return type (Metal requires void), the name
_KDEF_RE = re.compile(r"(\[\[\s*kernel\b[^\[\]]*\]\]|\bkernel\b)\s*((?:\[\[(?:[^\[\]]|\[[^\[\]]*\])*?\]\]\s*)*)"
                      r"([A-Za-z_][\w:<>,\s*&]*?)\s*\b(\w+)\s*\(")


# ------------------------------------------------------------ program scope
_BUILTIN_ATTR = re.compile(r"\[\[\s*(" + "|".join(BUILTINS) + r")\b")


def _code_only(text: str) -> str:
    """The text with line markers and pragmas blanked and string / character literals emptied (same
    length, quotes kept), so braces and semicolons in them do not count."""
    out = re.sub(r"^#[^\n]*", lambda m: _blank(m.group(0)), text, flags=re.M)
    return re.sub(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'', lambda m: m.group(0)[0] + " " * (len(m.group(0)) - 2)
                  + m.group(0)[-1], out)


def _strip_groups(s: str) -> str:
    """`[[attributes]]`, `__attribute__((...))`, `alignas(...)`, `decltype(...)` and `[array bounds]` blanked."""
    s = _ATTR_RE.sub(lambda m: _blank(m.group(0)), s)
    for word in ("__attribute__", "alignas", "decltype"):
        for m in reversed(list(re.finditer(r"\b" + word + r"\s*\(", s))):
            j = _match_paren(s, m.end() - 1)
            s = s[:m.start()] + _blank(s[m.start():j + 1]) + s[j + 1:]
    while "[" in s:
        i = s.index("[")
        j = _match_paren(s, i, "[", "]")
        s = s[:i] + _blank(s[i:j + 1]) + s[j + 1:]
    return s


def _without_parens(s: str) -> str:
    """Parenthesised groups blanked (same length)."""
    while True:
        t = re.sub(r"\([^()]*\)", lambda m: _blank(m.group(0)), s)
        if t == s:
            return s
        s = t


def _without_template_head(s: str) -> str:
    """`template <...> rest` -> `rest` (default template arguments may hold `=` and parentheses)."""
    m = re.match(r"\s*template\s*<", s)
    if not m:
        return s
    depth, flat = 1, _without_parens(s)  # parentheses hide comparisons such as `(N > 2)`
    for i in range(m.end(), len(flat)):
        depth += {"<": 1, ">": -1}.get(flat[i], 0)
        if depth == 0:
            return _without_template_head(s[i + 1:])
    return s


def _is_function_head(head: str) -> bool:
    """The text before a `{` at namespace scope opens a function body (not a class or an initializer)."""
    bare = _without_template_head(_strip_groups(head))
    if re.search(r"\boperator\b", bare):
        return True
    return "(" in bare and "=" not in _without_parens(bare)  # not `T x = {...}` / `T x = f({...})`


_NS_TOKEN = re.compile(r"[(\[{};]")


def _namespace_statements(code: str):
    """(start, end) of every statement at namespace scope that ends with `;` (declarations, incl. class
    definitions); function bodies are skipped. `code` is _code_only(text)."""
    out, start, i = [], 0, 0
    while True:
        m = _NS_TOKEN.search(code, i)
        if not m:
            return out
        i = m.start()
        c = code[i]
        if c in "([":
            i = _match_paren(code, i, c, ")" if c == "(" else "]") + 1
        elif c == "{":
            head = code[start:i]
            if re.search(r"\bnamespace\b[^;]*$", head) or re.fullmatch(r"\s*extern\s*\"[^\"]*\"\s*", head):
                i += 1
                start = i
                continue
            i = _match_paren(code, i, "{", "}") + 1
            if _is_function_head(head):
                start = i
        elif c == "}":  # closes a namespace
            i += 1
            start = i
        else:  # ';'
            out.append((start, i))
            i += 1
            start = i


_SKIPPED_DECLS = {"template", "typedef", "using", "static_assert", "namespace", "extern", "friend"}
_TYPE_KEYS = {"struct", "class", "union", "enum"}


def _check_program_scope(text: str, strict: bool):
    """Program-scope variables: Metal requires the constant address space (MSL specification, "constant
    address space"); a threadgroup variable there cannot even be emulated (its storage is per threadgroup),
    nor can program-scope built-in variables (MSL 3.1). Raises FrontendError naming the line."""
    code = _code_only(text)
    for start, end in _namespace_statements(code):
        stmt = code[start:end]
        words = re.findall(r"[A-Za-z_]\w*", _ATTR_RE.sub(" ", stmt))
        if not words or words[0] in _SKIPPED_DECLS:
            continue
        bare = _strip_groups(stmt)
        split = re.search(r"[={]", bare)
        declarator = bare[:split.start()] if split else bare
        if "(" in declarator:  # a function declaration
            continue
        names = re.findall(r"[A-Za-z_]\w*", declarator)
        if not names:
            continue
        if _TYPE_KEYS & set(names) and ((split and split.group() == "{") or ":" in declarator.replace("::", "")
                                         or len([w for w in names if w not in _TYPE_KEYS]) == 1):
            continue  # a class / enum definition or a forward declaration
        name = names[-1]
        pos = start + list(re.finditer(r"\b" + re.escape(name) + r"\b", declarator))[-1].start()
        file, line = _loc(text, pos)
        builtin = _BUILTIN_ATTR.search(stmt)
        if builtin:
            raise FrontendError(f"{file}:{line}: error: program-scope built-in variable '{name}' "
                                f"[[{builtin.group(1)}]] (MSL 3.1) is not supported by mslsim; take it as a kernel "
                                "parameter")
        if "constant" in names:
            continue
        if "threadgroup" in names:
            raise FrontendError(f"{file}:{line}: error: program-scope threadgroup variable '{name}'; Metal requires "
                                "threadgroup variables to be declared inside a kernel function (or passed as "
                                "[[threadgroup(n)]] kernel parameters)")
        if strict:
            raise FrontendError(f"{file}:{line}: error: program-scope variable '{name}' is not in the constant "
                                "address space; Metal requires program-scope variables to be declared constant "
                                "(and initialised)")


def parse(text: str, strict: bool = True) -> Parsed:
    """Kernels, function constants and the rewritten C++ of preprocessed MSL. strict: reject kernel pointer /
    reference parameters without a kernel address space (as Metal does)."""
    out = Parsed()
    # --- explicit instantiations: template [[host_name("x")]] [[kernel]] decltype(f<..>) f<..>;
    inst_spans = []
    insts = []
    for m in _INST_RE.finditer(text):
        end = text.index(";", m.end())
        # the declaration may contain parameter lists with ';'-free content only
        body = text[m.end():end]
        if body.count("(") != body.count(")"):
            j = _match_paren(text, text.index("(", m.end()))
            end = text.index(";", j)
            body = text[m.end():end]
        inst_spans.append((m.start(), end + 1))
        body = _ATTR_RE.sub(" ", body)
        body = re.sub(r"\bkernel\b", " ", body).strip()
        # the instantiated function is the last name (or template-id) of the declarator:
        #   decltype(f<A>) f<A>      |  my_fn_type f<A>      |  void f<A>(params...)
        b = body.strip()
        depth = 0
        for i, c in enumerate(b):
            if c in "<":
                depth += 1
            elif c in ">":
                depth -= 1
            elif c == "(" and depth == 0 and not b[:i].rstrip().endswith("decltype"):
                b = b[:i].rstrip()
                break
        expr = _last_name(b)
        expr = re.sub(r"\s+", " ", expr)
        base = re.match(r"[\w:]+", expr)
        if not base:
            raise FrontendError("cannot parse host_name instantiation: %s" % body.strip()[:200])
        insts.append((_strcat(m.group(1)), expr, base.group(0).split("::")[-1], m.start()))

    _check_program_scope(text, strict)
    defs = {}
    for m in _KDEF_RE.finditer(text):
        if any(a <= m.start() < b for a, b in inst_spans):
            continue
        name = m.group(4)
        po = m.end() - 1
        pc = _match_paren(text, po)
        nxt = text[pc + 1:pc + 200].lstrip()
        if not nxt.startswith("{"):
            continue  # declaration only
        file, line = _loc(text, m.start(4))
        where = f"{file}:{line}"
        returns = " ".join(w for w in m.group(3).split() if w not in ("static", "inline", "extern"))
        if strict and returns != "void":
            raise FrontendError(f"{where}: error: kernel '{name}' returns '{returns}'; Metal requires kernel "
                                "functions to return void")
        params = _parse_params(text, po + 1, pc, name, strict)
        # templated? look back to the previous ';' or '}' at top level
        back = text[max(0, m.start() - 2000):m.start()]
        cut = max(back.rfind(";"), back.rfind("}"))
        pre = back[cut + 1:]
        pre_nomark = _MARK_RE.sub("", pre)
        templated = re.search(r"\btemplate\s*<", pre_nomark) is not None
        attrs = m.group(1) + m.group(2) + pre_nomark
        hn = re.search(r"host_name\s*\(\s*((?:\"[^\"]*\"\s*)+)\)", attrs)
        mt = re.search(r"max_total_threads_per_threadgroup\s*\(\s*([^)]*)\)", attrs)
        max_threads = 0
        if mt:
            try:
                max_threads = _int_expr(mt.group(1))
            except FrontendError:
                max_threads = 0
        defs.setdefault(name, (params, max_threads))
        if not templated:
            out.kernels.append(Kernel(_strcat(hn.group(1)) if hn else name, name, params, where, max_threads))
    for host, expr, base, pos in insts:
        if base not in defs:
            file, line = _loc(text, pos)
            raise FrontendError(f"{file}:{line}: host_name(\"{host}\") instantiates '{base}', "
                                "which is not a [[kernel]] template defined in the source")
        file, line = _loc(text, pos)
        out.kernels.append(Kernel(host, expr, defs[base][0], f"{file}:{line}", defs[base][1]))
    seen = set()
    for k in out.kernels:
        if k.name in seen:
            raise FrontendError(f"duplicate kernel name '{k.name}'")
        seen.add(k.name)

    # --- rewrite into C++ -----------------------------------------------------
    chars = list(text)
    for a, b in inst_spans:
        chars[a:b] = _blank(text[a:b])
    text = "".join(chars)
    text = _rewrite_literals(text)

    fcs = []

    def fc_sub(m):
        typ, name, idx = m.group(1).strip(), m.group(2), m.group(3)
        typ = re.sub(r"\s+", " ", typ)
        fcs.append(FunctionConstant(name, typ, _int_expr(idx)))
        s = f"MSLSIM_FC({name}, {typ});"
        return s + _blank(m.group(0)[len(s):]) if len(s) <= len(m.group(0)) else s + "\n" * m.group(0).count("\n")

    text = re.sub(r"\bconstant\s+([^;\[\]{}()=]+?)\s+(\w+)\s*\[\[\s*function_constant\s*\(\s*([^)]*?)\s*\)\s*\]\]\s*;",
                  fc_sub, text)
    out.constants = fcs
    if fcs:
        names = [f.name for f in fcs]
        dep = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r"|is_function_constant_defined)\b")
        pieces, last = [], 0
        for m in re.finditer(r"\bconstant\s+([^;\[\]{}()=]+?)\s+(\w+)\s*=\s*([^;]*);", text):
            if not dep.search(m.group(3)):
                continue
            file, line = _loc(text, m.end())
            expr = " ".join(m.group(3).split())
            pieces.append(text[last:m.start()])
            typ = " ".join(re.sub(r"\b(static|constexpr|const|inline)\b", " ", m.group(1)).split())
            pieces.append(f'\n#define {m.group(2)} (static_cast<{typ}>({expr}))\n# {line} "{file}"\n')
            last = m.end()
        pieces.append(text[last:])
        text = "".join(pieces)

    # kernel-scope threadgroup arrays / variables
    def tg_sub(m):
        typ, name, dims = m.group(1).strip(), m.group(2), m.group(3) or ""
        s = f"MSLSIM_TG_DECL({name}, {dims.strip()}, {typ});"
        return s + "\n" * m.group(0).count("\n")

    text = re.sub(r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;(){}]*?>)?)\s+([A-Za-z_]\w*)\s*"
                  r"((?:\[[^\]\[;]+\]\s*)*);", tg_sub, text)
    # attributes are not needed any more (and [[threadgroup(0)]] would meet the macro)
    text = _ATTR_RE.sub(lambda m: _blank(m.group(0)), text)
    out.strict_text = text
    out.text = _CONST_RUN.sub(_dedupe_const, text)
    return out


_SPEC = r"(?:static|constexpr|const|inline|volatile|thread_local|extern)"
_CONST_RUN = re.compile(r"(?:\b" + _SPEC + r"\s+)*\bconstant\b(?:\s+" + _SPEC + r"\b)*")


def _dedupe_const(m):
    """`constant` becomes `const`; drop it where `const` is already there
    (`static constant constexpr const int X`, `const constant int& n`)."""
    s = m.group(0)
    if "const" in s.split():
        return re.sub(r"\bconstant\b", "        ", s)
    return s


_LIT_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|(?<![\w.])\.?\d(?:[eEpP][+-]|[\w.])*')


def _rewrite_literals(text: str) -> str:
    """1.0h -> 1.0_h (half literal); unsuffixed 1.5 -> 1.5f (MSL literals are float)."""
    out = []
    for line in text.split("\n"):
        if line.startswith("#"):
            out.append(line)
            continue

        def sub(m):
            s = m.group(0)
            if s[0] in "\"'":
                return s
            low = s.lower()
            if low.startswith("0x") or low.startswith("0b"):
                return s
            if low.endswith("h") and re.fullmatch(r"(\d+\.?\d*|\.\d+)(e[+-]?\d+)?h", low):
                return s[:-1] + "_h"
            if re.fullmatch(r"(\d+\.\d*|\.\d+)(e[+-]?\d+)?|\d+e[+-]?\d+", low):
                return s + "f"
            return s

        out.append(_LIT_RE.sub(sub, line))
    return "\n".join(out)


def generate(parsed: Parsed, prelude: str, keywords: str) -> str:
    g = [f'#include "{prelude}"', f'#include "{keywords}"', parsed.text, '# 1 "<mslsim-generated>"']
    g.append("#include <string.h>")
    g.append('#define MSLSIM_EXPORT __attribute__((visibility("default")))')
    for i, k in enumerate(parsed.kernels):
        kinds = ", ".join(str(p.kind) for p in k.params) or "0"
        idx = ", ".join(str(p.index) for p in k.params) or "0"
        n = len(k.params)
        g.append(f"""
extern "C" MSLSIM_EXPORT void mslsim_thunk_{i}(::mslsim::ThreadCtx* mslsim_c) {{
  ::mslsim::flush_subnormals_in_this_thread();
  using mslsim_F = decltype({k.expr});
  static_assert(::mslsim::fn_traits<mslsim_F>::arity == {n}, "mslsim: parameter count mismatch for kernel {k.name}");
  static const int mslsim_k[] = {{{kinds}}}, mslsim_x[] = {{{idx}}};
  ::mslsim::fn_traits<mslsim_F>::call(&{k.expr}, mslsim_c, mslsim_k, mslsim_x,
                                      std::make_index_sequence<::mslsim::fn_traits<mslsim_F>::arity>());
}}
extern "C" MSLSIM_EXPORT long long mslsim_pinfo_{i}(int mslsim_i, int mslsim_f) {{
  return ::mslsim::fn_traits<decltype({k.expr})>::info(mslsim_i, mslsim_f);
}}""")
    g.append('extern "C" MSLSIM_EXPORT int mslsim_fc_set(int mslsim_i, const void* mslsim_p, int mslsim_d) {\n  switch (mslsim_i) {')
    for i, f in enumerate(parsed.constants):
        g.append(f"    case {i}: if (mslsim_p) memcpy((void*)&{f.name}, mslsim_p, sizeof({f.name})); "
                 f"else memset((void*)&{f.name}, 0, sizeof({f.name})); mslsim_fcdef_{f.name} = mslsim_d != 0; return 0;")
    g.append("  }\n  return -1;\n}")
    g.append('extern "C" MSLSIM_EXPORT long long mslsim_fc_info(int mslsim_i, int mslsim_f) {\n  switch (mslsim_i) {')
    for i, f in enumerate(parsed.constants):
        g.append(f"    case {i}: return ::mslsim::value_info<decltype({f.name})>(mslsim_f);")
    g.append("  }\n  return -1;\n}")
    g.append(f'extern "C" MSLSIM_EXPORT int mslsim_nkernels(void) {{ return {len(parsed.kernels)}; }}')
    return "\n".join(g) + "\n"
