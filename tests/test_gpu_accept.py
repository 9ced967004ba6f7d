"""tools/gpu_accept.sh, the one GPU acceptance call: its settings (OUT above all) checked before anything runs, each
bad one in one line with exit code 2; on a machine without CUDA a dry run that names each part it skips; and the
header it prints: the software beside the numbers, and what a pass on another stack does not validate."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from tools import gpu_check

SCRIPT = os.path.join(ROOT, "tools", "gpu_accept.sh")
PARTS = ["wheels", "tiny model", "cuda tests", "host syncs", "compiled layers", "checkpoint memory", "levers"]


def accept(tmp_path, *args, **env):
    """The script run from another folder, as a user might; PYTHON defaults to a stand-in that records being run."""
    ran = tmp_path / "python-ran"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!/bin/sh\necho \"$@\" >> {ran}\nexit 1\n")
    stand_in.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stand_in), **env}
    out = subprocess.run(["bash", SCRIPT, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return out, ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA does")
def test_without_cuda_it_is_a_dry_run_that_names_each_part_it_skips(tmp_path):
    out, _ = accept(tmp_path, OUT="results", PYTHON=sys.executable)
    assert out.returncode == 0, out.stderr[-2000:]
    skipped = [line for line in out.stdout.splitlines() if line.endswith(": skipped: no CUDA device (a dry run)")]
    assert [line.split(":")[0] for line in skipped] == PARTS
    results = tmp_path / "results"  # relative to where it was run, not the repository root
    assert sorted(os.listdir(results)) == ["machine.txt"]
    header = (results / "machine.txt").read_text()
    assert header.count("software: Python ") == 1 and f"torch {torch.__version__}" in header
    assert "not validated here: Liger's CuTe DSL RoPE: not run" in header
    assert out.stdout.count("software: ") == 1


@pytest.mark.parametrize("case", ["a file", "a link", "holds files", "under a file", "bad budget", "an argument",
                                  "no interpreter"])
def test_a_bad_setting_is_one_line_and_exit_2_before_anything_runs(tmp_path, case):
    """Issue 74: OUT=notes.txt (an existing file) printed mkdir's error and then ran the CUDA tests and the bench."""
    notes = tmp_path / "notes.txt"
    notes.write_text("kept\n")
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "machine.txt").write_text("an earlier run\n")
    os.symlink(tmp_path / "earlier", tmp_path / "link")
    env, args, message = {"OUT": "fresh"}, (), None
    if case == "a file":
        env["OUT"], message = "notes.txt", "OUT=notes.txt is a file, not a folder"
    elif case == "a link":
        env["OUT"], message = "link", "OUT=link is a symbolic link"
    elif case == "holds files":
        env["OUT"], message = "earlier", "OUT=earlier already holds files"
    elif case == "under a file":
        env["OUT"], message = "notes.txt/results", "OUT=notes.txt/results cannot be made"
    elif case == "bad budget":
        env["BUDGET_S"], message = "9 minutes", "BUDGET_S=9 minutes: a whole number of seconds >= 60"
    elif case == "an argument":
        args, message = ("--dry-run",), "takes no arguments (got: --dry-run)"
    else:
        env["PYTHON"], message = "python-that-is-not-there", "PYTHON=python-that-is-not-there: no such interpreter"
    out, ran = accept(tmp_path, *args, **env)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("gpu_accept.sh: ") and message in out.stderr
    assert not ran.exists()  # no interpreter started: nothing ran
    assert notes.read_text() == "kept\n" and os.listdir(tmp_path / "earlier") == ["machine.txt"]
    assert not (tmp_path / "fresh").exists()  # no folder made for a run that does not start


def test_the_header_names_what_another_stack_cannot_validate(monkeypatch):
    """On a torch other than requirements-gpu.txt's, with a varlen kernel without enable_gqa, without vLLM: each is
    a line; Liger's CuTe DSL RoPE is always one (the project pins Triton's)."""
    import importlib.util

    from cegppo_utils import attention
    monkeypatch.setattr(attention, "torch_varlen", lambda: lambda q, k, v, cu_q, cu_k, max_q, max_k, is_causal: q)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name))
    lines = gpu_check.not_validated_here({"torch": "9.9.9", "transformers": "0.0.1", "liger-kernel": "0.0.1"})
    assert lines[0].startswith("selective checkpointing under torch 9.9.9") and torch.__version__ in lines[0]
    assert lines[1].startswith("native grouped-query attention in varlen_attn") and "takes no enable_gqa" in lines[1]
    assert lines[2].startswith("Liger's CuTe DSL RoPE: not run (the project pins LIGER_KERNEL_IMPL_ROPE=nvidia-triton)")
    assert any(line.startswith("transformers 0.0.1: this is ") for line in lines)
    assert lines[-1].startswith("vLLM (") and len(lines) == 6
    pins = gpu_check.pinned_versions()
    assert pins["liger-kernel"] == "0.8.5" and pins["torch"].count(".") == 2
    monkeypatch.setattr(attention, "torch_varlen", lambda: lambda q, k, v, *a, enable_gqa=False: q)
    assert not any("grouped-query" in line for line in gpu_check.not_validated_here(pins))
