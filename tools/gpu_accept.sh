#!/usr/bin/env bash
# The GPU acceptance call: what waits for a GPU, in one command of at most 530 s on one H100 / H200, run from the
# repository root, on a machine that has only Python, torch with CUDA, transformers and triton and no network (the
# project's check machine: Python 3.12, torch 2.11, transformers 5.17, triton 3.6), or on your own GPU with
# requirements-gpu.txt's stack:
#
#     bash tools/gpu_accept.sh          # results in $OUT (default runs/gpu-accept/, new or empty): machine.txt, logs
#
# What such a machine lacks comes as four wheels (1.3 MB) in the gitignored folder .gpu-wheels/, fetched once on a
# machine with a package registry and carried with the working tree:
#
#     pip download --no-deps -d .gpu-wheels liger-kernel==0.8.5 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
#
# Parts, in this order, each under its own time limit, all within BUDGET_S (530) seconds; a part cut at its limit
# keeps what it printed, and the parts after it run in the time left:
#  1. OUT checked (a new or empty folder, not a file or a link, writable) before anything else runs: else one line,
#     exit code 2
#  2. the wheels, installed into a temporary folder put first on PYTHONPATH (no pip: unpacked), unless liger-kernel
#     and math-verify are installed already; the software and device, with what a pass here cannot validate for
#     requirements-gpu.txt's stack (torch 2.14's checkpointing, Liger's CuTe DSL RoPE, native GQA in varlen_attn)
#  3. the tiny model in .cache/ (carried, or built: about a minute)                                          <= 90 s
#  4. tests/test_cuda.py -m "not slow", one row per test as it ends: Liger's kernels against a model that never saw
#     them, its RoPE pinned to Triton and checked at the 1.5B preset's shape, the region split leaving the update
#     alone under Liger's kernels (no, full and selective checkpointing), selective checkpointing under FSDP2 with
#     Liger against no checkpointing, the varlen kernels, a bf16 run                                        <= 150 s
#  5. host syncs of the update stage per micro-batch and per optimizer step, counted by CUDA's sync-debug mode
#     (tools/bench.py host_syncs)                                                                             <= 60 s
#  6. compiled decoder layers under Liger: the plain model's gradients, graphs and graph breaks made         <= 100 s
#  7. what full and selective checkpointing keep of a 20,480-token row at the 1.5B shape, and the rotary's q and k
#     copies' memory and time (tools/bench.py checkpoint_memory)                                              <= 60 s
#  8. every lever of the one-GPU update on and off (tools/bench.py update_levers, 16 long-tailed sequences at the 1.5B
#     shape, packed; compiled layers with their graphs and graph breaks), one row per lever as it ends: the time left
# Every row of a number carries the software and device it was measured with.
#
# Without CUDA it is a dry run (the suite runs it so): OUT checked, the software printed, each part skipped in one
# line, exit 0. Settings are environment variables: OUT, PYTHON (the interpreter; default .venv/bin/python where it
# imports torch, else python3), BUDGET_S. Exit code: 2 for a bad setting (before anything runs); else the first failed
# part's (124: cut at its limit), else 0.
set -u

refuse() {
    echo "gpu_accept.sh: $1" >&2
    exit 2
}
[ $# -eq 0 ] || refuse "takes no arguments (got: $*); its settings are the variables OUT, PYTHON and BUDGET_S"
OUT="${OUT:-runs/gpu-accept}"
BUDGET_S="${BUDGET_S:-530}"
[[ "$BUDGET_S" =~ ^[0-9]+$ ]] && [ "$BUDGET_S" -ge 60 ] || refuse "BUDGET_S=$BUDGET_S: a whole number of seconds >= 60"
PY="${PYTHON:-}"
[ -z "$PY" ] || command -v "$PY" >/dev/null 2>&1 || refuse "PYTHON=$PY: no such interpreter"
[ -L "$OUT" ] && refuse "OUT=$OUT is a symbolic link; name a folder (nothing is written through a link)"
[ -e "$OUT" ] && [ ! -d "$OUT" ] && refuse "OUT=$OUT is a file, not a folder; name a new or empty folder"
[ -d "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ] &&
    refuse "OUT=$OUT already holds files (an earlier run's?); name a new or empty folder, or move them away"
mkdir -p "$OUT" 2>/dev/null || refuse "OUT=$OUT cannot be made (a file on its path, or no permission)"
probe="$OUT/.gpu-accept-probe.$$"
{ : >"$probe"; } 2>/dev/null && rm -f "$probe" || refuse "OUT=$OUT cannot be written to"
OUT="$(cd "$OUT" && pwd)"
case "$PY" in */*) [ -e "$PY" ] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # before the cd
cd "$(dirname "$0")/.." || refuse "cannot enter the repository root above $0"
if [ -z "$PY" ]; then
    if .venv/bin/python -c "import torch" >/dev/null 2>&1; then PY=.venv/bin/python; else PY=python3; fi
fi

START=$SECONDS
FAILED=0
NOTES=()
note() {  # a part's closing line, printed now and again at the end
    echo "$1"
    NOTES+=("$1")
}

# run_part NAME LIMIT LOG PATTERN COMMAND...: COMMAND under min(LIMIT, the time left), its output in $OUT/LOG, the
# lines matching PATTERN shown as they come; a part that fails or is cut keeps its exit code for the end
run_part() {
    local name=$1 limit=$2 log=$3 pattern=$4
    shift 4
    local left=$((BUDGET_S - (SECONDS - START)))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 10 ]; then
        note "$name: not run: the $BUDGET_S s are spent"
        [ "$FAILED" -eq 0 ] && FAILED=124
        return
    fi
    local began=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$log" | grep --line-buffered -E "$pattern"
    local code=${PIPESTATUS[0]}
    local what="exit $code"
    [ "$code" -ne 0 ] && what="exit $code: $(grep -v '^\s*$' "$OUT/$log" | tail -1 | cut -c 1-200)"
    [ "$code" -eq 124 ] || [ "$code" -eq 137 ] && what="cut at its limit; the rows above are what ran"
    note "$name: $what ($((SECONDS - began)) s of $limit; log $OUT/$log)"
    [ "$code" -ne 0 ] && [ "$FAILED" -eq 0 ] && FAILED=$code
}

PARTS=("wheels" "tiny model" "cuda tests" "host syncs" "compiled layers" "checkpoint memory" "levers")
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" >/dev/null 2>&1; then
    CUDA=1
else
    CUDA=0
fi

if [ "$CUDA" -eq 1 ]; then
    if "$PY" -c "import importlib.metadata as m; [m.version(n) for n in ('liger-kernel', 'math-verify')]" \
        >/dev/null 2>&1; then
        note "wheels: none installed (liger-kernel and math-verify are installed for $PY)"
    elif ls .gpu-wheels/*.whl >/dev/null 2>&1; then
        TARGET="$(mktemp -d "${TMPDIR:-/tmp}/gpu-accept-wheels.XXXXXX")"
        trap 'rm -rf "$TARGET"' EXIT
        if ! "$PY" -m pip install --quiet --no-deps --no-index --no-compile --target "$TARGET" .gpu-wheels/*.whl \
            >"$OUT/wheels.log" 2>&1; then
            for wheel in .gpu-wheels/*.whl; do  # pure-Python wheels: unpacked onto the path, they are installed
                "$PY" -m zipfile -e "$wheel" "$TARGET" >>"$OUT/wheels.log" 2>&1
            done
        fi
        export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
        note "wheels: $(ls .gpu-wheels/*.whl | wc -l) from .gpu-wheels/ into a temporary folder first on PYTHONPATH"
    else
        note "wheels: FAIL: liger-kernel or math-verify is not installed and .gpu-wheels/ holds no wheels (fetch them: this script's header)"
        FAILED=1
    fi
fi
{
    date -u +"%Y-%m-%d %H:%M UTC"
    git log -1 --format="commit %H" 2>/dev/null
    [ "$CUDA" -eq 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c "from tools import gpu_check; gpu_check.print_acceptance_header()" 2>&1
} | tee "$OUT/machine.txt"

if [ "$CUDA" -eq 0 ]; then
    for part in "${PARTS[@]}"; do
        echo "$part: skipped: no CUDA device (a dry run)"
    done
    exit 0
fi

run_part "tiny model" 90 tiny-model.log "cache|Error" "$PY" -m cegppo_utils.tiny
TESTS=(PASSED FAILED ERROR SKIPPED "[0-9]+ (passed|failed|skipped|deselected)")
run_part "cuda tests" 150 cuda-tests.log "$(IFS='|'; echo "${TESTS[*]}")" \
    "$PY" -m pytest -v -rs -p no:cacheprovider -m "not slow" tests/test_cuda.py
run_part "host syncs" 60 host-syncs.log "^host_syncs:|Error" \
    "$PY" -m tools.bench --only host_syncs --device cuda --output "$OUT/host-syncs.json"
run_part "compiled layers" 100 compiled-layers.log "^compiled layers:|$(IFS='|'; echo "${TESTS[*]}")" \
    "$PY" -m pytest -v -s -rs -p no:cacheprovider tests/test_cuda.py -k compiled_layers_under_liger
run_part "checkpoint memory" 60 checkpoint-memory.log "^checkpoint_memory:|Error" \
    "$PY" -m tools.bench --only checkpoint_memory --device cuda --output "$OUT/checkpoint-memory.json"
run_part "levers" "$BUDGET_S" levers.log "^update_levers:|Error" \
    "$PY" -m tools.bench --only update_levers --device cuda --update-sequences 16 --output "$OUT/levers.json"

echo
echo "gpu_accept.sh: $((SECONDS - START)) s of $BUDGET_S; results in $OUT"
for line in "${NOTES[@]}"; do
    echo "  $line"
done
grep -E "^(software|not validated)" "$OUT/machine.txt"
exit "$FAILED"
