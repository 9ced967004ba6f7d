"""A run folder survives what happens to real runs: kill -9 at three points (then --resume gives the parameters of an
uninterrupted run), a crash before the first checkpoint, a torn metrics row, NaN weights, another run's checkpoints,
a full disk."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import runfolder
from conftest import ROOT, parse_train_args, train_update
from test_train import SMALL, final_state, read_metrics

FAST = SMALL + ["--sampler", "hf", "--max-steps", "3", "--save-every", "2"]  # checkpoints at steps 2 and 3


def train(output_dir, *extra, crash_at=None, expect=0):
    env = {**os.environ, **({"TRAIN_CRASH_AT": crash_at} if crash_at else {})}
    done = subprocess.run([sys.executable, "train.py", *FAST, "--output-dir", str(output_dir), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == expect, (done.returncode, done.stderr[-3000:])
    return done


def same_parameters(a, b):
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_path):
    """An uninterrupted 3-step run (checkpoints at steps 2 and 3); tests copy it before changing anything."""
    path = tmp_path_factory.mktemp("finished") / "run"
    train(path)
    return path


def test_killed_runs_resume_to_the_parameters_of_an_uninterrupted_run(tmp_path, finished_run):
    want, want_rows = final_state(finished_run), read_metrics(finished_run)
    assert [r["step"] for r in want_rows] == [1, 2, 3]
    # kill -9 (SIGKILL: exit -9) while sampling step 3, inside step 3's update, and inside the first checkpoint's write
    for point in ("sampling:3", "update:3", "checkpoint:2"):
        out = tmp_path / point.replace(":", "-")
        train(out, crash_at=point, expect=-9)
        if point == "checkpoint:2":  # no checkpoint was completed: a half-written one is never used
            assert runfolder.checkpoint_dirs(str(out)) == [] and os.path.isdir(out / "checkpoints" / "step_000002.tmp")
            train(out, expect=2)  # a fresh start into that folder is refused: it holds a run
            with open(out / "metrics.jsonl", "a") as f:
                f.write('{"step": 3, "reward_me')  # and a torn last row, as a full disk or a crash mid-append leaves
        resumed = train(out, "--resume")
        assert "resumed from" in resumed.stdout or "starting from step 0" in resumed.stdout
        rows = read_metrics(out)
        assert [r["step"] for r in rows] == [1, 2, 3], point  # each step once
        assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in want_rows], point
        same_parameters(want, final_state(out))
        discarded = (out / "metrics.discarded.jsonl").read_text().splitlines() if os.path.exists(out / "metrics.discarded.jsonl") else []
        if point == "checkpoint:2":  # resumed from step 0: both earlier rows and the torn line are kept aside
            assert len(discarded) == 3 and discarded[-1] == '{"step": 3, "reward_me'


def test_nan_weights_stop_the_run_before_anything_is_saved(tmp_path, monkeypatch, tiny_model_path):
    """A weight that turns non-finite in an optimizer step (the loss and gradient norm of that step were finite) stops
    the run before any checkpoint or final/ is written. The issue's command (--lr inf) is now refused at start."""
    refused = subprocess.run([sys.executable, "train.py", *SMALL, "--lr", "inf", "--train-prompts", "4", "--mini-batch-prompts",
                              "4", "--max-steps", "4", "--save-every", "2", "--output-dir", str(tmp_path / "inf")],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "--lr must be > 0 and at most 1" in refused.stderr
    assert not os.path.exists(tmp_path / "inf" / "checkpoints")

    import train
    real_step = torch.optim.AdamW.step

    def step_then_corrupt(self, *a, **k):  # what an overflowing update does to a weight
        out = real_step(self, *a, **k)
        with torch.no_grad():
            self.param_groups[0]["params"][3].view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_corrupt)
    args = parse_train_args(SMALL + ["--sampler", "hf", "--train-prompts", "4", "--mini-batch-prompts", "4", "--max-steps", "4",
                                     "--save-every", "1", "--output-dir", str(tmp_path / "nan")])
    with pytest.raises(FloatingPointError, match="step 1: the parameters are no longer finite"):
        train.main(args)
    assert runfolder.checkpoint_dirs(str(tmp_path / "nan")) == [] and not os.path.exists(tmp_path / "nan" / "final")
    assert not os.path.exists(tmp_path / "nan" / "metrics.jsonl")  # the step that broke them is not logged either


def test_another_runs_checkpoints_are_never_used(tmp_path, finished_run):
    tmp_path = tmp_path / "run"
    shutil.copytree(finished_run, tmp_path)
    fresh = train(tmp_path, expect=2)  # a new run refuses a folder with checkpoints
    assert "holds a run (checkpoints): pass --resume" in fresh.stderr
    other = train(tmp_path, "--resume", "--seed", "1", "--lr", "2e-4", expect=2)
    assert "--seed 0 there, 1 now" in other.stderr and "--lr 0.0001 there, 0.0002 now" in other.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # untouched
    longer = train(tmp_path, "--resume", "--max-steps", "4")  # what may change on resume: how long it runs
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4] and "resumed from" in longer.stdout
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["flags"]["max_steps"] == 4 and config["flags"]["seed"] == 0


def test_a_full_disk_removes_the_partial_checkpoint_and_keeps_the_last_good_one(tmp_path, monkeypatch, tiny_model_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    optimizer = torch.optim.AdamW(model.parameters())
    runfolder.save_checkpoint(str(tmp_path), 1, 2, model, tokenizer, optimizer, {"flags": {}})
    real_save = dcp.save

    def full_disk(state, checkpoint_id, **kw):  # what torch's writer raises when the disk fills mid-file
        real_save(state, checkpoint_id=checkpoint_id, **kw)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 123 vs 456")

    monkeypatch.setattr(dcp, "save", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(SystemExit, match=r"no space left on the device writing .*step_000002; its partial folder was removed"):
        runfolder.save_checkpoint(str(tmp_path), 2, 2, model, tokenizer, optimizer, {"flags": {}})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]
    state = runfolder.load_checkpoint(str(tmp_path / "checkpoints" / "step_000001"), model, optimizer)
    assert state["step"] == 1
    # any other failure is not reported as a full disk, and still leaves no partial folder
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, 10**12))
    with pytest.raises(RuntimeError, match="enforce fail"):
        runfolder.save_checkpoint(str(tmp_path), 2, 2, model, tokenizer, optimizer, {"flags": {}})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]
