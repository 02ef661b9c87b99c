#!/usr/bin/env bash
# Create or reuse .venv with fedfuse and its pinned dependencies (idempotent: a .venv whose stamp
# matches pyproject.toml and the Python version is reused at once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
# Fashion-MNIST, the benchmark data (dataset='fashion-mnist'): Debian's package, installed once where apt and root are
fmnist=/usr/share/datasets/fashion-mnist
if [ ! -f "$fmnist/t10k-labels-idx1-ubyte.gz" ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian's dataset-fashion-mnist (Fashion-MNIST's idx files, into $fmnist)"
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >/dev/null; }; } \
      || echo "setup: WARNING: apt-get could not install dataset-fashion-mnist; dataset='fashion-mnist' needs data-root" >&2
  else
    echo "setup: WARNING: Fashion-MNIST is not installed and apt-get/root is not available here: run" \
         "'sudo apt-get install dataset-fashion-mnist', or point data-root at a folder holding its four idx files" >&2
  fi
fi
stamp_of() { { cat pyproject.toml; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1; }
want=$(stamp_of)
# The reuse check reads files only, no Python import (torch's alone takes seconds): the stamp, written after the
# last install passed its import check; the `fedfuse` command and the interpreter it names; each package's folder.
# `rm .venv/.fedfuse-stamp` forces a reinstall and its import check.
installed() {
  [ -x .venv/bin/python ] && [ -f .venv/.fedfuse-stamp ] && [ "$(cat .venv/.fedfuse-stamp)" = "$want" ] || return 1
  [ -x .venv/bin/fedfuse ] && [ -x "$(head -n 1 .venv/bin/fedfuse | sed 's/^#! *//')" ] || return 1
  local site pkg
  for site in .venv/lib/python3*/site-packages; do
    for pkg in "fedfuse-*.dist-info" flwr torch torchvision timm captum ot; do
      compgen -G "$site/$pkg" >/dev/null || return 1
    done
    return 0
  done
  return 1
}
if installed; then
  echo "setup: reusing up-to-date .venv"
  exit 0
fi
echo "setup: installing fedfuse into .venv (first time: torch + CUDA wheels, a few minutes)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# editable: the `fedfuse` command (fedfuse.cli) runs the checkout's code; the benchmarks: python -m simulations.bench
.venv/bin/python -m pip install --quiet -e ".[dev]"
.venv/bin/python -c "import fedfuse, flwr, torch, torchvision, timm, captum, ot; print('setup: torch', torch.__version__, '| flwr', flwr.__version__)"
.venv/bin/fedfuse --version
echo "$want" > .venv/.fedfuse-stamp
