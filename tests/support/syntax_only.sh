#!/bin/sh
# CXX_COMPILER_LAUNCHER of the targets built only to prove that they compile (the compile checks): the
# compiler runs its front end on the translation unit (-fsyntax-only: parsing, overload resolution,
# template instantiation, static_asserts, the front end's warnings) and generates no code, which is most
# of what an -O0 compile costs. The object file is left empty, and the dependency file the compiler still
# writes keeps the build tree up to date.
set -e
out=
prev=
for arg in "$@"; do
  if [ "$prev" = "-o" ]; then out=$arg; fi
  prev=$arg
done
"$@" -fsyntax-only
if [ -n "$out" ]; then : >"$out"; fi
