#!/usr/bin/env bash
# Every C++ file of fsdpx laid out as .clang-format says, by the clang-format it was written for.
#   tools/check_format.sh          exit 1, naming each file clang-format would change (the `format` test)
#   tools/check_format.sh --fix    rewrite them in place (`make format`)
# The version is pinned (tools/setup.sh installs it into .venv): another version lays out differently.
# Env: CLANG_FORMAT (default: .venv/bin/clang-format, else clang-format on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
want=$(sed -n "s/^CLANG_FORMAT_VERSION=//p" tools/setup.sh)  # the one pin
tool=${CLANG_FORMAT:-$([[ -x .venv/bin/clang-format ]] && echo .venv/bin/clang-format || command -v clang-format || true)}
[[ -n $tool ]] || { echo "check_format: no clang-format; run tools/setup.sh (it installs clang-format $want into .venv)"; exit 1; }
have=$("$tool" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1)
[[ $have == "$want" ]] || { echo "check_format: $tool is clang-format $have; the layout is clang-format $want's (tools/setup.sh)"; exit 1; }
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.hpp' '*.ipp' '*.cpp')
else  # an exported tree
  mapfile -t files < <(find include tests examples benchmarks tools -name '*.hpp' -o -name '*.ipp' -o -name '*.cpp' | sort)
fi
if [[ ${1:-} == --fix ]]; then
  "$tool" -i "${files[@]}"
  exit 0
fi
# One warning per misplaced line, "file:line:col: error: code should be clang-formatted".
if ! out=$("$tool" --dry-run --Werror "${files[@]}" 2>&1); then
  printf 'check_format: not laid out as .clang-format says (tools/check_format.sh --fix, or make format):\n'
  grep -oE '^[^:]+:[0-9]+' <<<"$out" | awk -F: '!seen[$1]++ {printf "  %s (first at line %s)\n", $1, $2}'
  exit 1
fi
echo "check_format: ${#files[@]} files laid out as .clang-format says"
