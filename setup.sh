#!/usr/bin/env bash
# One-command setup: creates .venv/ in the repository root and installs the stack into it.
# Re-running is cheap: it reinstalls only when requirements.txt changed.
set -euo pipefail
cd "$(dirname "$0")"

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "setup.sh: needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$python" -m venv .venv

stamp=".venv/.installed-$(sha256sum requirements.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
  rm -f .venv/.installed-* && touch "$stamp"
fi

# On a machine with an NVIDIA GPU the installed torch must be a CUDA build.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "setup.sh: a GPU is present but the installed torch " + torch.__version__ + " cannot use it")'
  echo "setup.sh: CUDA stack ready in .venv/"
else
  echo "setup.sh: CPU stack ready in .venv/"
fi
