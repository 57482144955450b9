#!/usr/bin/env bash
# Syntax-checks the macOS build on Linux, where no Apple SDK exists: the
# Objective-C++ MPS bridge (csrc/mps/*.mm: clang -x objective-c++
# -fsyntax-only -fblocks) and the C++ sources setup.py compiles with it, for
# the target arm64-apple-macos<floor> (the package's macOS floor), against
# the stub Apple headers in csrc/mps/stubs (with Apple's availability
# attributes) and a torch's own headers. A selector, type or function the
# bridge uses that the stubs (Apple's signatures) or torch's headers do not
# declare fails the check, and so does an API newer than the floor used
# outside an @available branch. The stubs model two SDK generations
# (csrc/mps/stubs/MacOSX<N>.sdk: the macOS 14 SDK of Xcode 15, the macOS 15
# SDK of Xcode 16) and each .mm is checked against every one, so an API that
# only the newer SDK declares fails unless a compile-time SDK guard hides it
# (@available is a run-time check).
#
#   scripts/check_mm_syntax.sh                       # every source, installed torch's headers
#   scripts/check_mm_syntax.sh --torch-include DIR   # another torch's include/ (e.g. a macOS
#                                                    # wheel's: scripts/macos_torch_headers.py)
#   scripts/check_mm_syntax.sh --sdk 14 ...          # one SDK generation only
#   scripts/check_mm_syntax.sh FILE.mm|FILE.cpp ...  # these files only (e.g. the mutation tests)
#   CLANG=clang++-17 scripts/check_mm_syntax.sh
#
# The C and C++ standard headers are Debian's aarch64 cross headers
# (apt-get install libc6-dev-arm64-cross libstdc++-12-dev-arm64-cross), given
# Darwin's int64_t by csrc/mps/stubs/glibc_as_darwin.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLANG="${CLANG:-$(command -v clang++-16 || command -v clang++ || true)}"
PYTHON="${PYTHON:-python3}"
if [[ -z "$CLANG" ]]; then
  echo "check_mm_syntax: no clang++ found (apt-get install clang-16)" >&2
  exit 2
fi

TORCH_INCLUDE=""
SDKS=()
files=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch-include) TORCH_INCLUDE="$2"; shift 2 ;;
    --sdk) SDKS=("$2"); shift 2 ;;
    *) files+=("$1"); shift ;;
  esac
done

if [[ -n "$TORCH_INCLUDE" ]]; then
  TORCH_INC=("$TORCH_INCLUDE" "$TORCH_INCLUDE/torch/csrc/api/include")
else
  read -r -a TORCH_INC <<<"$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))')"
fi
if [[ ! -f "${TORCH_INC[0]}/ATen/mps/MPSStream.h" ]]; then
  echo "check_mm_syntax: no ATen/mps/MPSStream.h under ${TORCH_INC[0]}" >&2
  exit 2
fi

CROSS=/usr/aarch64-linux-gnu/include
CXXVER="$(ls "$CROSS/c++" 2>/dev/null | sort -V | tail -1 || true)"
if [[ -z "$CXXVER" || ! -f "$CROSS/stdlib.h" ]]; then
  echo "check_mm_syntax: no aarch64 C/C++ headers under $CROSS" \
       "(apt-get install libc6-dev-arm64-cross libstdc++-12-dev-arm64-cross)" >&2
  exit 2
fi

STUBS="$ROOT/csrc/mps/stubs"
if [[ ${#SDKS[@]} -eq 0 ]]; then  # every generation, oldest first
  mapfile -t SDKS < <(cd "$STUBS" && ls -d MacOSX*.sdk | sed 's/^MacOSX//; s/\.sdk$//' | sort -n)
fi
for sdk in "${SDKS[@]}"; do
  if [[ ! -f "$STUBS/MacOSX$sdk.sdk/Availability.h" ]]; then
    echo "check_mm_syntax: no stub SDK $STUBS/MacOSX$sdk.sdk" >&2
    exit 2
  fi
done

FLOOR="$("$PYTHON" "$ROOT/csrc/mps/embed_metal.py" --macos-floor)"
GEN="$(mktemp -d)"
trap 'rm -rf "$GEN"' EXIT
"$PYTHON" "$ROOT/csrc/mps/embed_metal.py" "$GEN" >/dev/null

# Darwin target with Linux's libstdc++/glibc: no system include directories
# but these; clang predefines __nonnull/__nullable on Darwin, which glibc
# defines its own way; libstdc++ expects _GNU_SOURCE (g++ predefines it).
SYSTEM=(-nostdinc++ -nostdlibinc
        -isystem "$ROOT/csrc/mps/stubs/glibc_as_darwin"
        -isystem "$CROSS/c++/$CXXVER" -isystem "$CROSS/c++/$CXXVER/aarch64-linux-gnu" -isystem "$CROSS"
        -isystem "$("$CLANG" -print-resource-dir)/include"
        -U__nonnull -U__nullable -D_GNU_SOURCE)
PY_INC="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
INCLUDES=(-I "$STUBS" -I "$ROOT/csrc" -I "$ROOT/metal" -I "$GEN")
for d in "${TORCH_INC[@]}" "$PY_INC"; do INCLUDES+=(-isystem "$d"); done
# Selector / type / conversion / availability problems are errors.
FLAGS=(-target "arm64-apple-macos$FLOOR" -std=c++20 -fsyntax-only
       -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H
       -DAT_PER_OPERATOR_HEADERS -DTORCH_ASSERT_ONLY_METHOD_OPERATORS
       -Werror=objc-method-access -Werror=incompatible-pointer-types
       -Werror=objc-protocol-method-implementation -Werror=undeclared-selector
       -Werror=arc-unsafe-retained-assign -Werror=int-conversion
       -Werror=unguarded-availability -Werror=unguarded-availability-new -Werror=deprecated-declarations
       -Wno-nullability-completeness)

shopt -s nullglob
if [[ ${#files[@]} -eq 0 ]]; then
  # What setup.py compiles on macOS.
  files=("$ROOT"/csrc/*.cpp "$ROOT"/csrc/core/*.cpp "$ROOT"/csrc/cpu/*.cpp "$ROOT"/csrc/mps/*.cpp "$ROOT"/csrc/mps/*.mm)
fi
mm=() cpp=()
for f in "${files[@]}"; do if [[ "$f" == *.mm ]]; then mm+=("$f"); else cpp+=("$f"); fi; done
if [[ ${#files[@]} -eq 0 ]]; then
  echo "check_mm_syntax: no sources" >&2
  exit 1
fi

status=0
echo "check_mm_syntax: macOS $FLOOR, torch headers ${TORCH_INC[0]}"
for f in "${mm[@]}"; do
  for sdk in "${SDKS[@]}"; do
    echo "check_mm_syntax: ${f#"$ROOT"/} (macOS $sdk SDK)"
    "$CLANG" "${FLAGS[@]}" -x objective-c++ -fblocks -fobjc-arc "${SYSTEM[@]}" \
      -I "$STUBS/MacOSX$sdk.sdk" "${INCLUDES[@]}" "$f" || status=1
  done
done
if [[ ${#cpp[@]} -gt 0 ]]; then
  # No Apple framework headers in these: one SDK generation is enough.
  echo "check_mm_syntax: ${#cpp[@]} C++ files"
  printf '%s\0' "${cpp[@]}" | xargs -0 -n 1 -P "$(nproc)" \
    "$CLANG" "${FLAGS[@]}" -x c++ "${SYSTEM[@]}" -I "$STUBS/MacOSX${SDKS[0]}.sdk" "${INCLUDES[@]}" || status=1
fi
exit $status
