#!/usr/bin/env bash
# Syntax-checks the Objective-C++ MPS bridge (csrc/mps/*.mm) on Linux, where
# no Apple SDK exists: clang -x objective-c++ -fsyntax-only -fblocks against
# the stub Apple headers in csrc/mps/stubs plus torch's own (MPS) headers.
# A selector, type or function the bridge uses that the stubs (Apple's
# signatures) or torch's headers do not declare fails the check.
#
#   scripts/check_mm_syntax.sh            # csrc/mps/*.mm; uses clang++-16, else clang++
#   scripts/check_mm_syntax.sh FILE.mm    # other files (e.g. the mutation test)
#   CLANG=clang++-17 scripts/check_mm_syntax.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLANG="${CLANG:-$(command -v clang++-16 || command -v clang++ || true)}"
PYTHON="${PYTHON:-python3}"
if [[ -z "$CLANG" ]]; then
  echo "check_mm_syntax: no clang++ found (apt-get install clang-16)" >&2
  exit 2
fi

TORCH_INC="$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))')"
GEN="$(mktemp -d)"
trap 'rm -rf "$GEN"' EXIT
"$PYTHON" "$ROOT/csrc/mps/embed_metal.py" "$GEN" >/dev/null

INCLUDES=(-I "$ROOT/csrc/mps/stubs" -I "$ROOT/csrc" -I "$ROOT/metal" -I "$GEN")
for d in $TORCH_INC; do INCLUDES+=(-isystem "$d"); done

status=0
shopt -s nullglob
if [[ $# -gt 0 ]]; then files=("$@"); else files=("$ROOT"/csrc/mps/*.mm); fi
if [[ ${#files[@]} -eq 0 ]]; then
  echo "check_mm_syntax: no csrc/mps/*.mm files" >&2
  exit 1
fi
for f in "${files[@]}"; do
  echo "check_mm_syntax: ${f#$ROOT/}"
  # -fobjc-runtime=macosx: the Apple runtime (ARC, @autoreleasepool) instead
  # of Linux's default GNUstep. Selector / type / conversion problems are errors.
  if ! "$CLANG" -x objective-c++ -std=c++20 -fsyntax-only -fblocks -fobjc-arc \
      -fobjc-runtime=macosx-13.0 \
      -Werror=objc-method-access -Werror=incompatible-pointer-types \
      -Werror=objc-protocol-method-implementation -Werror=undeclared-selector \
      -Werror=arc-unsafe-retained-assign -Werror=int-conversion \
      -Wno-nullability-completeness \
      "${INCLUDES[@]}" "$f"; then
    status=1
  fi
done
exit $status
