#!/usr/bin/env bash
# Installs what building and testing fsdpx needs, and nothing that is already there:
#   Debian packages (compiler, CMake, Open MPI, Catch2, Boost, OpenSSL, nlohmann/json, CLI11; clang with libFuzzer for
#   the fuzz tests): installed when root, else printed;
#   LibTorch: PyTorch 2.13.0 in .venv, unless Torch_DIR or CMAKE_PREFIX_PATH already points at one (the
#   Python-side tests still get torch in .venv);
#   Conan (packaging), clang-format (the layout), pytest, ruff and mypy (the Python tests) in .venv; NCCL headers (nvidia-nccl-cu13) in .venv when nvcc is present.
# With --demo (make demo), only what building and running the demo needs: the packages without clang,
# and LibTorch; `make test` installs the rest when it runs this again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
scope=all
case ${1:-} in
  --demo) scope=demo ;;
  "") ;;
  *) echo "usage: tools/setup.sh [--demo]" >&2; exit 2 ;;
esac
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
say() { printf 'fsdpx setup: %s\n' "$*"; }

# ---- system packages ---------------------------------------------------------------------------
packages=(g++ make cmake libopenmpi-dev openmpi-bin catch2 libboost-dev libssl-dev openssl nlohmann-json3-dev zlib1g-dev libcli11-dev python3)
optional=(clang libclang-rt-14-dev)  # libFuzzer: the fuzz tests, skipped with a message without it
[[ $scope == demo ]] && optional=()
if command -v dpkg-query >/dev/null; then
  missing=() missing_optional=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  for p in "${optional[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing_optional+=("$p")
  done
  if ((${#missing[@]} + ${#missing_optional[@]})); then
    if [[ $(id -u) == 0 ]]; then
      say "installing ${missing[*]} ${missing_optional[*]}"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends "${missing[@]}" "${missing_optional[@]}" >/dev/null
    elif ((${#missing[@]})); then
      say "missing Debian packages; run:"
      echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]} ${missing_optional[*]}"
      exit 1
    else
      say "optional: ${missing_optional[*]} (clang's libFuzzer; without them the fuzz tests are skipped)"
    fi
  fi
else
  say "not a Debian system: make sure a C++20 compiler, CMake >= 3.22, MPI, Catch2 v2, Boost, OpenSSL, nlohmann/json and CLI11 are installed"
fi

# ---- LibTorch ----------------------------------------------------------------------------------
has_user_torch() {
  [[ -n ${Torch_DIR:-} && -f ${Torch_DIR}/TorchConfig.cmake ]] && return 0
  local p
  IFS=':;' read -ra prefixes <<<"${CMAKE_PREFIX_PATH:-}"
  for p in "${prefixes[@]}"; do
    [[ -n $p && ( -f $p/Torch/TorchConfig.cmake || -f $p/share/cmake/Torch/TorchConfig.cmake ) ]] && return 0
  done
  return 1
}
if [[ ! -x $VENV/bin/python ]]; then
  say "creating $VENV"
  python3 -m venv "$VENV" || { say "python3 -m venv failed; install python3-venv"; exit 1; }
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
has_module() { "$VENV/bin/python" -c "import $1" >/dev/null 2>&1; }
if has_user_torch; then
  # The build uses yours; the tests that compare with Python (torch.load, transformers, the Python
  # receiver) still need torch in .venv, so they are not skipped.
  say "using your LibTorch (Torch_DIR / CMAKE_PREFIX_PATH) for the build"
  has_module torch || { say "installing PyTorch $TORCH_VERSION (CPU) into $VENV for the Python-side tests"; pip_install "torch==$TORCH_VERSION"; }
elif ! "$VENV/bin/python" -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  say "installing PyTorch $TORCH_VERSION (CPU) into $VENV for LibTorch"
  pip_install "torch==$TORCH_VERSION"
fi
if [[ $scope == demo ]]; then
  say "ready for the demo (make test installs what the tests need besides)"
  exit 0
fi

# ---- what only the tests and the packaging need ------------------------------------------------
has_module conans || { say "installing Conan into $VENV"; pip_install conan; }
has_module safetensors || { say "installing safetensors into $VENV (checkpoint interop tests)"; pip_install safetensors; }
has_module google_crc32c || { say "installing google-crc32c into $VENV (fast CRC-32C for the Python receiver; optional)"; pip_install google-crc32c || say "could not install google-crc32c: the Python receiver checks frames with its torch CRC-32C"; }
has_module transformers || { say "installing transformers into $VENV (the LR schedules and the Hugging Face models are tested against its own)"; pip_install transformers; }
has_module setuptools || { say "installing setuptools into $VENV (pip-installs python/fsdpx_sync in its test)"; pip_install setuptools; }
has_module pytest || { say "installing pytest into $VENV (runs the Python tests, tests/sync/python_*_test.py)"; pip_install pytest; }
# The linters pinned, as clang-format below: another version finds other things (the python_lint test).
RUFF_VERSION=0.17.6
MYPY_VERSION=2.4.1
[[ $("$VENV/bin/python" -m ruff --version 2>/dev/null) == "ruff $RUFF_VERSION" ]] ||
  { say "installing ruff $RUFF_VERSION into $VENV (the python_lint test)"; pip_install "ruff==$RUFF_VERSION"; }
[[ $("$VENV/bin/python" -m mypy --version 2>/dev/null) == "mypy $MYPY_VERSION"* ]] ||
  { say "installing mypy $MYPY_VERSION into $VENV (the python_lint test)"; pip_install "mypy==$MYPY_VERSION"; }
# The layout's one clang-format (tools/check_format.sh, the `format` test): another version lays out differently.
CLANG_FORMAT_VERSION=19.1.7
[[ $("$VENV/bin/clang-format" --version 2>/dev/null) == *" $CLANG_FORMAT_VERSION"* ]] ||
  { say "installing clang-format $CLANG_FORMAT_VERSION into $VENV (the format test)"; pip_install "clang-format==$CLANG_FORMAT_VERSION"; }

# ---- NCCL headers, so the NCCL backend is at least compiled on machines without a GPU ----------
if command -v nvcc >/dev/null && ! has_module nvidia.nccl && [[ ! -f /usr/include/nccl.h ]]; then
  say "installing nvidia-nccl-cu13 into $VENV (nccl.h for the NCCL backend's compile check)"
  pip_install nvidia-nccl-cu13 || say "could not install nvidia-nccl-cu13: the NCCL compile check is skipped"
fi
say "ready"
