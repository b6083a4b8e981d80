#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian machine, idempotently:
# system packages (OpenMPI for mpirun tests; SLURM + munge for the slurm tests, when
# root), a virtual environment in .venv with the CPU build of torch, and the package
# with its test extras in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
apt_pkgs=(openmpi-bin libopenmpi-dev slurm-wlm munge)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
extras="test"
command -v mpicc >/dev/null && extras="test,mpi"
.venv/bin/python -m pip install -q -e ".[${extras}]"
