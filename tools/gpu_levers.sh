#!/usr/bin/env bash
# What waits for a GPU (docs/performance.md, "Levers of the one-GPU update"), in one call of under 10 minutes on one
# H100 / H200, from the repository root:
#
#     bash tools/gpu_levers.sh            # results in $OUT (default: runs/gpu-levers/), logs and JSON
#
# 1. the CUDA tests (tests/test_cuda.py, fast tier): Liger's kernels against a model that never saw them, selective
#    checkpointing's gradients under Liger's in-place RoPE (fp32 and bf16, padded and packed, and the policy without
#    the copies shown wrong), the fused log-probs, the varlen kernels, a bf16 run; at most 180 s
# 2. every lever of the one-GPU update on and off in one call of tools.bench (update_levers: the whole update stage,
#    32 long-tailed sequences at the 1.5B shape, packed): each lever's row is printed as it ends, so a run cut short
#    keeps what it measured; the compiled levers come last; at most 390 s
#
# Needs: torch with CUDA, transformers and liger-kernel (requirements-gpu.txt; vllm is not used); the tiny model in
# .cache/ (carried, or built by the tests in about a minute). PYTHON picks the interpreter (default: .venv/bin/python
# where it runs, else python3). Exit code: the CUDA tests' (0 when all passed), or the bench's when they passed.
set -u
OUT="${OUT:-runs/gpu-levers}"
mkdir -p "$OUT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if .venv/bin/python -c "import torch" >/dev/null 2>&1; then PY=.venv/bin/python; else PY=python3; fi
fi
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
    "$PY" -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'), 'triton', m.version('triton'))" \
        2>&1 | tail -1
    git log -1 --format="commit %H" 2>/dev/null
} | tee "$OUT/machine.txt"
timeout 180 "$PY" -m pytest -q -rs -m "not slow" tests/test_cuda.py 2>&1 | tee "$OUT/cuda-tests.log" | tail -25
tests=${PIPESTATUS[0]}
timeout 390 "$PY" -m tools.bench --only update_levers --device cuda --update-sequences 32 \
    --output "$OUT/levers.json" 2>&1 | tee "$OUT/levers.log" | grep --line-buffered -E "^update_levers:|Error|error" | tail -20
bench=${PIPESTATUS[0]}
echo "cuda tests exit $tests; update_levers exit $bench (124: cut at its time limit; the rows above are what ran)"
[ "$tests" -ne 0 ] && exit "$tests"
exit "$bench"
