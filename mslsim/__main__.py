"""python -m mslsim FILE.metal [-I DIR] [-D NAME[=VALUE]] [--no-strict]: compile (with the
strict check of what Apple's Metal compiler rejects, unless --no-strict) and list the kernels."""
import argparse
import sys

from . import MSLSimError, compile as _compile


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mslsim", description=__doc__)
    ap.add_argument("source")
    ap.add_argument("-I", dest="include", action="append", default=[])
    ap.add_argument("-D", dest="define", action="append", default=[])
    ap.add_argument("--no-strict", action="store_true", help="skip the strict check (docs/MSLSIM.md)")
    a = ap.parse_args(argv)
    defines = {}
    for d in a.define:
        k, _, v = d.partition("=")
        defines[k] = v if v else None
    try:
        lib = _compile(a.source, include_dirs=a.include, defines=defines, strict=False if a.no_strict else None)
    except MSLSimError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{lib.source_name}: {len(lib.kernels())} kernel(s), cached at {lib.path}")
    for fc, idx in lib.function_constants().items():
        print(f"  function constant {fc} [[function_constant({idx})]]")
    for k in lib.kernels():
        print(f"  {k}")
        for p in lib.kernel_info(k):
            if p["kind"] == "builtin":
                print(f"      {p['name']}: [[{p['builtin']}]]")
            else:
                extra = " const" if p["const"] else ""
                fc = f", function_constant({p['function_constant']})" if "function_constant" in p else ""
                print(f"      {p['name']}: [[{p['kind']}({p['index']}){fc}]] {p['pass_by']} to {p['size']} bytes{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
