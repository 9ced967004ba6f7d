"""A run folder survives what happens to real runs: kill -9 at three points (then --resume gives the parameters of an
uninterrupted run), a crash before the first checkpoint, a torn metrics row, NaN weights, another run's checkpoints,
a full disk."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import warm
from conftest import ROOT, parse_train_args
from test_train import SMALL, final_state, read_metrics

from cegppo_utils import flags, runfolder

FAST = SMALL + ["--sampler", "hf", "--max-steps", "3", "--save-every", "2"]  # checkpoints at steps 2 and 3


def train(output_dir, *extra, crash_at=None, interrupt_at=None, ctrl_c_at=None, expect=0):
    """train.py on FAST's flags; ctrl_c_at: SIGINT to its whole process group there, as a terminal's Ctrl-C (the run
    gets a session of its own, so the signal reaches it, its reward workers and fork server, and not the tests)."""
    env = {**os.environ, **({"TRAIN_CRASH_AT": crash_at} if crash_at else {}),
           **({"TRAIN_INTERRUPT_AT": interrupt_at} if interrupt_at else {}),
           **({"TRAIN_CTRL_C_AT": ctrl_c_at} if ctrl_c_at else {})}
    done = warm.run([sys.executable, "train.py", *FAST, "--output-dir", str(output_dir), *extra], cwd=ROOT,
                     capture_output=True, text=True, timeout=600, env=env, start_new_session=ctrl_c_at is not None)
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


@pytest.mark.slow
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
        discarded = ((out / "metrics.discarded.jsonl").read_text().splitlines()
                     if os.path.exists(out / "metrics.discarded.jsonl") else [])
        if point == "checkpoint:2":  # resumed from step 0: step 1's row and the torn line are kept aside (step 2's
            # row was not logged yet: a step's checkpoint is written before its row, so an evaluation can follow it)
            assert (len(discarded) == 2 and json.loads(discarded[0])["step"] == 1
                    and discarded[-1] == '{"step": 3, "reward_me')


@pytest.mark.slow
def test_nan_weights_stop_the_run_before_anything_is_saved(tmp_path, monkeypatch, tiny_model_path):
    """A weight that turns non-finite in an optimizer step (the loss and gradient norm of that step were finite) stops
    the run before any checkpoint or final/ is written. The issue's command (--lr inf) is now refused at start."""
    refused = warm.run([sys.executable, "train.py", *SMALL, "--lr", "inf",
                        "--train-prompts", "4", "--mini-batch-prompts",
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
    args = parse_train_args(SMALL + ["--sampler", "hf", "--train-prompts", "4", "--mini-batch-prompts", "4",
                                     "--max-steps", "4",
                                     "--save-every", "1", "--output-dir", str(tmp_path / "nan")])
    with pytest.raises(FloatingPointError, match="step 1: the parameters are no longer finite"):
        train.main(args)
    assert runfolder.checkpoint_dirs(str(tmp_path / "nan")) == [] and not os.path.exists(tmp_path / "nan" / "final")
    assert not os.path.exists(tmp_path / "nan" / "metrics.jsonl")  # the step that broke them is not logged either


@pytest.mark.slow
def test_another_runs_checkpoints_are_never_used(tmp_path, finished_run):
    tmp_path = tmp_path / "run"
    shutil.copytree(finished_run, tmp_path)
    fresh = train(tmp_path, expect=2)  # a new run refuses a folder with checkpoints
    assert "holds a run (checkpoints): pass --resume" in fresh.stderr
    other = train(tmp_path, "--resume", "--seed", "1", "--lr", "2e-4", expect=2)
    assert "--seed 1 (the run's: 0), --lr 0.0002 (the run's: 0.0001)" in other.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # untouched
    longer = train(tmp_path, "--resume", "--max-steps", "4")  # what may change on resume: how long it runs
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4] and "resumed from" in longer.stdout
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["flags"]["max_steps"] == 4 and config["flags"]["seed"] == 0


def test_a_full_disk_removes_the_partial_checkpoint_and_keeps_the_last_good_one(tmp_path, monkeypatch, tiny_model_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    optimizer = torch.optim.AdamW(model.parameters())
    runfolder.save_checkpoint(str(tmp_path), 1, 2, model, tokenizer, optimizer, {"flags": {}})
    real_save = dcp.save

    def full_disk(state, checkpoint_id, **kw):  # what torch's writer raises when the disk fills mid-file (see below)
        real_save(state, checkpoint_id=checkpoint_id, **kw)
        raise CheckpointException("write",
                                  {0: (RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                    "unexpected pos 123 vs 456"), [])})

    monkeypatch.setattr(dcp, "save", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(SystemExit, match=r"no space left on the device writing .*step_000002; "
                                         r"its partial folder was removed"):
        runfolder.save_checkpoint(str(tmp_path), 2, 2, model, tokenizer, optimizer, {"flags": {}})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]
    state = runfolder.load_checkpoint(str(tmp_path / "checkpoints" / "step_000001"), model, optimizer)
    assert state["step"] == 1
    # any other failure is not reported as a full disk, and still leaves no partial folder
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 0, 10**12))
    with pytest.raises(CheckpointException, match="enforce fail"):
        runfolder.save_checkpoint(str(tmp_path), 2, 2, model, tokenizer, optimizer, {"flags": {}})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]


# --- a real full disk, the output-folder lock, planted pickles, model folders with parts missing ---------

class Tokenizer:
    """What save_checkpoint needs of a tokenizer."""

    def save_pretrained(self, folder):
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            f.write("{}")


def small_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64)
    model = Qwen2ForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters())


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MiB file system (tmpfs; needs root), or None where one cannot be mounted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_really_full_disk_stops_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path, small_disk, monkeypatch):
    """torch's writer on a full file system raises CheckpointException, a BaseException: caught, reported as a full
    disk, the partial folder removed. On a real 3 MiB tmpfs where the test runs as root; elsewhere the writer's own
    fsync fails with ENOSPC, so the exception still comes from torch's writer, not from a stand-in."""
    import errno

    import torch.distributed.checkpoint.filesystem as fs
    from torch.distributed.checkpoint.api import CheckpointException
    model, optimizer = small_model()
    out = str(small_disk or tmp_path / "out")
    runfolder.save_checkpoint(out, 1, 2, model, Tokenizer(), optimizer, {"flags": {}})  # ~1.6 MiB: fits once
    if small_disk is None:
        def no_space(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(fs.os, "fsync", no_space)
    with pytest.raises(SystemExit, match=r"no space left on the device writing .*step_000002; "
                                         r"its partial folder was removed"):
        runfolder.save_checkpoint(out, 2, 2, model, Tokenizer(), optimizer, {"flags": {}})
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_000001"]  # no step_000002.tmp left
    state = runfolder.load_checkpoint(os.path.join(out, "checkpoints", "step_000001"), model, optimizer)
    assert state["step"] == 1
    assert issubclass(CheckpointException, BaseException) and not issubclass(CheckpointException, Exception)


def test_ctrl_c_during_a_checkpoint_write_leaves_no_partial_folder(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    model, optimizer = small_model()
    runfolder.save_checkpoint(str(tmp_path), 1, 2, model, Tokenizer(), optimizer, {"flags": {}})
    real_save = dcp.save

    def interrupted(state, checkpoint_id, **kw):
        real_save(state, checkpoint_id=checkpoint_id, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runfolder.save_checkpoint(str(tmp_path), 2, 2, model, Tokenizer(), optimizer, {"flags": {}})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]


def test_ctrl_c_inside_torchs_checkpoint_code_stops_as_ctrl_c(tmp_path, monkeypatch):
    """Ctrl-C while torch.distributed.checkpoint writes or reads arrives wrapped in its CheckpointException (a
    BaseException): it was a traceback and exit 1 (train.py caught neither). The interrupt itself comes out: the write
    leaves no partial folder, the read is not called a damaged checkpoint."""
    import torch.distributed.checkpoint.filesystem as fs
    model, optimizer = small_model()
    runfolder.save_checkpoint(str(tmp_path), 1, 2, model, Tokenizer(), optimizer, {"flags": {}})

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(fs.os, "fsync", ctrl_c)  # inside torch's writer, as SIGINT lands there
        with pytest.raises(KeyboardInterrupt):
            runfolder.save_checkpoint(str(tmp_path), 2, 2, model, Tokenizer(), optimizer, {"flags": {}})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]
    monkeypatch.setattr(torch, "load", ctrl_c)  # the optimizer's plain values are read through it, inside dcp.load
    with pytest.raises(KeyboardInterrupt):
        runfolder.load_checkpoint(str(tmp_path / "checkpoints" / "step_000001"), model, optimizer)


HOLD = """
import time
from cegppo_utils import runfolder
lock = runfolder.lock_output_dir({folder!r})
print("locked", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_one_run_per_output_folder_and_a_dead_runs_lock_is_reported(tmp_path):
    folder = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(folder=folder)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit, match=rf"--output-dir {folder} is in use by another run "
                                             rf"\(pid {holder.pid} on .*, "
                                             r"started .*\); wait for it to end, or choose another --output-dir"):
            runfolder.lock_output_dir(folder)
    finally:
        holder.kill()  # kill -9: the kernel drops its flock; its note stays in the file
        holder.wait()
    said = []
    lock = runfolder.lock_output_dir(folder, log=said.append)
    assert len(said) == 1 and f"found the lock of a run that ended without releasing it (pid {holder.pid} on" in said[0]
    with pytest.raises(SystemExit, match="is in use by another run"):  # a second lock in this very process, too
        runfolder.lock_output_dir(folder)
    lock.release()
    said.clear()
    with runfolder.lock_output_dir(folder, log=said.append):  # released cleanly: nothing to report
        assert said == []
    assert open(os.path.join(folder, ".lock")).read() == ""


def test_planted_pickles_in_a_checkpoint_are_refused_without_running(tmp_path):
    import pickle

    from test_bad_input import Planted
    model, optimizer = small_model()
    ckpt = runfolder.save_checkpoint(str(tmp_path), 1, 2, model, Tokenizer(), optimizer,
                                     {"flags": {"seed": 0}, "scheduler": {}, "data": {}, "loop": {"step": 1}})
    assert runfolder.check_checkpoint(ckpt)["flags"] == {"seed": 0}
    marker = tmp_path / "ran"
    for part, text in (("trainer_state.pt", "holds objects other than tensors and plain values"),
                       (".metadata", "names posix.system, which a checkpoint's metadata never holds")):
        kept = open(os.path.join(ckpt, part), "rb").read()
        with open(os.path.join(ckpt, part), "wb") as f:
            pickle.dump(Planted(marker), f)
        with pytest.raises(SystemExit, match=text):
            runfolder.check_checkpoint(ckpt)
        with pytest.raises(SystemExit, match=text):
            runfolder.load_checkpoint(ckpt, model, optimizer)
        with open(os.path.join(ckpt, part), "wb") as f:
            f.write(kept)
    assert not marker.exists()
    # a dotted global reaches through an allowed module to a function: refused too
    meta = os.path.join(ckpt, ".metadata")
    with open(meta, "wb") as f:
        f.write(b"\x80\x04ctorch.distributed.checkpoint.filesystem\n"
                b"os.system\n(Vtrue\ntR.")  # plain pickle would run it
    with pytest.raises(SystemExit, match=r"names torch.distributed.checkpoint.filesystem.os.system"):
        runfolder.check_checkpoint(ckpt)


def test_model_folders_with_parts_missing_are_one_line(tmp_path):
    from test_bad_input import fake_checkpoint
    model, _ = small_model()
    good = tmp_path / "good"
    model.save_pretrained(good)
    runfolder.check_model_folder(str(good))

    def broken(name, change):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        change(folder)
        return str(folder)

    def write(path, content, mode="w"):
        with open(path, mode) as f:
            f.write(content)

    weights = "model.safetensors"
    size = os.path.getsize(good / weights)
    cases = {
        "no weights": (lambda f: os.remove(f / weights), "has config.json but no weights"),
        "no config": (lambda f: os.remove(f / "config.json"), "the folder has no config.json"),
        "config torn": (lambda f: write(f / "config.json", '{"model_type": "qw'),
                        "config.json is not readable (not valid JSON"),
        "config a list": (lambda f: write(f / "config.json", "[]"), "config.json is not a JSON object"),
        "config not a model": (lambda f: write(f / "config.json", '{"a": 1}'), "config.json names no model_type"),
        "config binary": (lambda f: write(f / "config.json", b"\xff\xfe\x00", "wb"), "config.json is not readable"),
        "weights truncated": (lambda f: os.truncate(f / weights, size // 2),
                              f"truncated or damaged ({size // 2} bytes"),
        "weights empty": (lambda f: os.truncate(f / weights, 0), "not a safetensors file"),
        "weights garbage": (lambda f: write(f / weights, b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", "wb"),
                            "not a safetensors file"),
        "weights padded": (lambda f: write(f / weights, b"\x00" * 9, "ab"),
                           f"({size + 9} bytes; its header declares {size})"),
        "index names a missing shard": (lambda f: write(f / "model.safetensors.index.json", json.dumps(
            {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})),
                                        "names 1 weight file(s) that are missing"),
        "index without a map": (lambda f: write(f / "model.safetensors.index.json", "{}"), "has no weight_map"),
    }
    wrong = []
    for name, (change, text) in cases.items():
        try:
            runfolder.check_model_folder(broken(name.replace(" ", "-"), change))
            wrong.append(f"{name}: accepted")
        except SystemExit as e:
            if e.code != 2 or text not in str(e) or "\n" in str(e):
                wrong.append(f"{name}: {e}")
    checkpoint = fake_checkpoint(tmp_path / "checkpoints" / "step_000001")
    try:
        runfolder.check_model_folder(str(checkpoint))
        wrong.append("a checkpoint: accepted")
    except SystemExit as e:
        if "is a training checkpoint, not a model folder: export it first" not in str(e):
            wrong.append(f"a checkpoint: {e}")
    assert not wrong, "\n".join(wrong)


def test_a_row_lost_to_a_failed_evaluation_is_restored_from_its_checkpoint(tmp_path):
    """The checkpoint of step N is written before step N's evaluation, the row after it: a run stopped in between
    resumes with row N restored from the checkpoint (without eval_acc), so metrics.jsonl has no gap."""
    from test_bad_input import fake_checkpoint
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": 0.25}\n')
    state = {"step": 3, "rng": {}, "row": {"step": 3, "reward_mean": 0.75}}
    ckpt = str(fake_checkpoint(tmp_path / "checkpoints" / "step_000003", state=state))
    said = []
    runfolder.begin(str(tmp_path), True, ckpt, {}, {}, log=said.append)
    assert [(r["step"], r.get("eval_lost")) for r in runfolder.read_jsonl(tmp_path / "metrics.jsonl")] == \
        [(1, None), (2, None), (3, True)]
    runfolder.begin(str(tmp_path), True, ckpt, {}, {}, log=said.append)  # already there: nothing added
    assert [r["step"] for r in runfolder.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3] and len(said) == 1


def test_a_planted_object_in_a_checkpoint_shard_is_refused_without_running(tmp_path):
    """DCP stores non-tensor entries (the optimizer's lr, betas, ...) as pickles inside the .distcp shards and its
    default planner loads them with weights_only=False; load_checkpoint reads them with weights_only=True."""
    import torch.distributed.checkpoint as dcp
    from test_bad_input import Planted
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, optimizer = small_model()
    folder = runfolder.save_checkpoint(str(tmp_path), 1, 2, model, Tokenizer(), optimizer, {"flags": {}})
    runfolder.load_checkpoint(folder, model, optimizer)  # the honest one loads
    marker = tmp_path / "ran"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    optimizer_state["param_groups"][0]["lr"] = Planted(marker)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder, no_dist=True)
    with pytest.raises(SystemExit, match=r"\.metadata has \d+ bytes, "
                                         r"not the \d+ written when the checkpoint was saved"):
        runfolder.check_checkpoint(folder)  # the shards' recorded sizes and hashes no longer match
    runfolder.write_manifest(folder)  # whoever can rewrite the shards can rewrite their manifest too
    runfolder.check_checkpoint(folder)  # its .metadata is DCP's own
    with pytest.raises(SystemExit, match="holds objects other than tensors and plain values in its shards; refusing"):
        runfolder.load_checkpoint(folder, model, optimizer)
    assert not marker.exists()


@pytest.mark.slow
def test_ctrl_c_ends_in_the_command_that_resumes_exactly_from_the_early_checkpoint(tmp_path, finished_run):
    """Ctrl-C as a terminal sends it (SIGINT to the process group: train.py, its reward workers, the fork server)
    while step 3 samples, with checkpoints every 25 steps but the first at step 2 (--save-first): one line naming
    that checkpoint and the command that goes on, exit 1, no traceback; that command, as printed, then ends where the
    uninterrupted run did."""
    out = tmp_path / "run"
    stopped = train(out, "--save-every", "25", "--save-first", "2", ctrl_c_at="sampling:3", expect=1)
    lines = [line for line in stopped.stderr.splitlines() if line.strip() and not line.startswith("train:")]
    assert "Traceback" not in stopped.stderr and lines[-1].startswith("train.py: interrupted; the last checkpoint, ")
    command = lines[-1].split("is kept. Continue from step 2: ")[1]
    assert command == f".venv/bin/python train.py --resume {out}", lines[-1]
    assert open(out / ".lock").read() == ""  # released
    resumed = warm.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    same_parameters(final_state(finished_run), final_state(out))
    assert [os.path.basename(c) for c in runfolder.checkpoint_dirs(str(out))] == ["step_000002", "step_000003"]


@pytest.mark.slow
def test_sigterm_ends_like_ctrl_c_and_resume_goes_on(tmp_path, tiny_model_path):
    """SIGTERM (kill, a scheduler's preemption) while step 3 samples: one line naming the checkpoint kept and the
    command that goes on, exit 1 (it was exit 143 and nothing said), the lock released; --resume then finishes the
    run. It asks for the tiny model its train.py trains on, as every test that trains does."""
    out = tmp_path / "run"
    done = warm.run([sys.executable, "train.py", *FAST, "--output-dir", str(out)], cwd=ROOT, capture_output=True,
                    text=True, timeout=600, env={**os.environ, "TRAIN_TERMINATE_AT": "sampling:3"})
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("train:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1] == (f"train.py: terminated (SIGTERM); "
                         f"the last checkpoint, {out}/checkpoints/step_000002, is kept. "
                         f"Continue from step 2: .venv/bin/python train.py --resume {out}")
    assert open(out / ".lock").read() == ""  # released
    train(out, "--resume")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.slow
def test_a_second_run_on_a_busy_folder_is_refused_at_once(tmp_path):
    """Two train.py on one folder: the second is refused while the first holds the lock (here: a helper process
    holding it, so the test does not depend on timing)."""
    folder = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(folder=folder)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = train(folder, expect=2)
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"train.py: error: --output-dir {folder} is in use by another run (pid {holder.pid} on ")
        assert (last.endswith("); wait for it to end, or choose another --output-dir")
                and "Traceback" not in second.stderr)
        assert not os.path.exists(os.path.join(folder, "metrics.jsonl"))
    finally:
        holder.kill()
        holder.wait()


# --- resume in one command: the run's own settings, a finished or busy run answered first ----------------------

def recorded_run(folder, argv, steps=(), final=False):
    """A run folder as train.py leaves it, without training: config.json with the flags of `argv` (as begin() writes
    it), the marker, a metrics row, and checkpoint folders at `steps` (empty: only their names are read here)."""
    args = parse_train_args([*argv, "--output-dir", str(folder)])
    os.makedirs(folder / "checkpoints", exist_ok=True)
    flags_ = {k: v for k, v in flags.flat_flags(args).items() if k != "resume"}
    (folder / "config.json").write_text(json.dumps({"preset": args.preset, "command": ["train.py"], "flags": flags_}))
    (folder / runfolder.RUN_MARKER).write_text("{}")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    for step in steps:
        os.makedirs(folder / "checkpoints" / f"step_{step:06d}")
    if final:  # final/ holds the newest checkpoint's policy, and says so
        os.makedirs(folder / "final")
        (folder / "final" / runfolder.FINAL_RECORD).write_text(json.dumps({"step": max(steps)}))
    return args


def refusal(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_train_args(argv)
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_resume_reads_the_runs_own_settings_and_refuses_only_what_was_typed(tmp_path, capsys):
    run = tmp_path / "run"
    started = recorded_run(run, ["--preset", "merge", "--gen-prompts", "4", "--lr", "3e-4", "--seed", "3"], steps=[5])
    for argv in (["--resume", str(run)], [f"--resume={run}"], ["--resume", "--output-dir", str(run)],
                 ["--output-dir", str(run), "--resume", "--lr", "3e-4"]):  # the run's own value may be typed
        resumed = parse_train_args(argv)
        assert flags.flat_flags(resumed) == {**flags.flat_flags(started), "resume": True}, argv
        assert resumed.preset == "merge" and resumed.mini_batch_prompts == 1  # derived when it started, not now
    longer = parse_train_args(["--resume", str(run), "--max-steps", "300", "--eval-every", "10", "--save-every", "7"])
    assert (longer.max_steps, longer.eval_every, longer.save_every, longer.lr) == (300, 10, 7, 3e-4)
    shutil.copytree(run, tmp_path / "moved")  # a folder moved since: it goes on where it is now
    assert parse_train_args(["--resume", str(tmp_path / "moved")]).output_dir == str(tmp_path / "moved")
    err = refusal(["--resume", str(run), "--seed", "4", "--gen-prompts", "8", "--max-steps", "300"], capsys)
    assert f"--resume {run}: --seed 4 (the run's: 3), --gen-prompts 8 (the run's: 4); a run resumes with its own " \
           "settings" in err
    assert "--max-steps" not in err.split("may restate")[0] and "mini-batch" not in err  # only what was typed, differs
    assert "--preset 'tiny' (the run's: 'merge')" in refusal(["--resume", str(run), "--preset", "tiny"], capsys)
    assert "name two folders" in refusal(["--resume", str(run), "--output-dir", str(tmp_path / "other")], capsys)


def test_a_finished_run_is_answered_before_torch_loads(tmp_path):
    """--resume on a run whose last checkpoint is its last step and whose final/ is written: exit 0 and one line
    ("finished at step N; nothing to resume", the command that trains on), from the flags alone: torch and transformers
    cannot even be imported here. With a larger --max-steps it goes on (and so reaches for torch)."""
    from test_bad_input import without_torch
    run = tmp_path / "run"
    recorded_run(run, ["--max-steps", "4"], steps=[2, 4], final=True)
    env = without_torch(tmp_path)
    done = warm.run([sys.executable, "train.py", "--resume", str(run)], cwd=ROOT, capture_output=True,
                    text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == (f"train.py: {run} finished at step 4; nothing to resume. Its policy is in {run}/final; to "
                           f"train on, raise --max-steps: .venv/bin/python train.py --resume {run} "
                           f"--max-steps N (N > 4)\n")
    on = warm.run([sys.executable, "train.py", "--resume", str(run), "--max-steps", "6"], cwd=ROOT,
                  capture_output=True, text=True, timeout=120, env=env)
    assert on.returncode != 0 and "torch was imported" in on.stderr  # past the answers, into the run's imports


HOLD_RUN = """
import time
from cegppo_utils import runfolder
lock = runfolder.lock_output_dir({folder!r}, resume=True)
print("locked", flush=True)
time.sleep(120)
"""


def test_a_live_runs_folder_is_answered_in_use_first(tmp_path, capsys):
    """A folder that holds a run which another process is running: a new run on it and a resume of it are both told
    it is in use, by which pid (before "holds a run: pass --resume"); the resume before torch loads."""
    from test_bad_input import run_train_in_process, without_torch
    run = tmp_path / "run"
    recorded_run(run, [], steps=[5])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN.format(folder=str(run))], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        in_use = f"--output-dir {run} is in use by another run (pid {holder.pid} on "
        code, err = run_train_in_process(["train.py", "--output-dir", str(run), "--max-steps", "2"], capsys)
        assert code == 2 and in_use in err and "holds a run" not in err, err
        resumed = warm.run([sys.executable, "train.py", "--resume", str(run)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env=without_torch(tmp_path))
        assert resumed.returncode == 2 and resumed.stderr.startswith(f"train.py: error: {in_use}"), resumed.stderr
    finally:
        holder.kill()
        holder.wait()


def test_every_stop_message_ends_in_the_command_that_goes_on(tmp_path, monkeypatch):
    """Ctrl-C, SIGTERM and an error name what is kept and the exact command that continues: this python and train.py
    as typed, the folder quoted for a shell (under torchrun on one node: its launch)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["train.py", "--max-steps", "9"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "my run"
    command = f".venv/bin/python train.py --resume '{run}'"
    assert runfolder.resume_command(str(run)) == command
    # stopped before the run recorded itself (its config.json): the command as typed, not a --resume of nothing
    assert runfolder.interrupted(str(run)) == ("train.py: interrupted before the run began; nothing of it is kept. "
                                               "Start it again: .venv/bin/python train.py --max-steps 9")
    assert runfolder.kept_note(str(run)) == ("the run had not begun (nothing of it is kept). Start it again: "
                                             ".venv/bin/python train.py --max-steps 9")
    os.makedirs(run)
    (run / "config.json").write_text(json.dumps({"flags": {}}))
    (run / runfolder.RUN_MARKER).write_text("{}")  # begun: its marker, its config.json
    assert runfolder.interrupted(str(run)) == f"train.py: interrupted before the first checkpoint. Start again from " \
                                              f"step 0: {command}"
    assert runfolder.kept_note(str(run)) == f"no checkpoint was written yet. Start again from step 0: {command}"
    os.makedirs(run / "checkpoints" / "step_000005")
    assert runfolder.interrupted(str(run), how="terminated (SIGTERM)") == (
        f"train.py: terminated (SIGTERM); the last checkpoint, {run}/checkpoints/step_000005, is kept. Continue from "
        f"step 5: {command}")
    assert runfolder.kept_note(str(run)).endswith(f"is intact. Continue from step 5: {command}")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert runfolder.resume_command(str(run)) == f"torchrun --nproc-per-node=2 train.py --resume '{run}'"


# --- issue 59: the finished-run answer is what final/ holds; a run stopped before it began --------------------------

def test_the_finished_run_answer_names_the_step_final_holds(tmp_path):
    """A finished run is answered (before torch loads) only where final/ holds its newest checkpoint's step: a run
    that finished at 2, was resumed to 4 and stopped after checkpoint 3 is not "finished at step 3" while final/
    still holds step 2's policy; its resume goes on (to write step 3's final/). A final/ without its record (written
    before records were kept) is not taken on trust either."""
    from test_bad_input import without_torch
    run = tmp_path / "run"
    recorded_run(run, ["--max-steps", "2"], steps=[2, 3], final=True)
    (run / "final" / runfolder.FINAL_RECORD).write_text(json.dumps({"step": 2}))
    env = without_torch(tmp_path)
    resume = [sys.executable, "train.py", "--resume", str(run), "--max-steps", "3"]
    on = warm.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert on.returncode != 0 and "torch was imported" in on.stderr and "finished" not in on.stdout, on.stdout
    assert runfolder.finished_step(str(run), 3) is None and runfolder.final_step(str(run)) == 2
    os.remove(run / "final" / runfolder.FINAL_RECORD)
    assert runfolder.final_step(str(run)) is None and runfolder.finished_step(str(run), 3) is None
    (run / "final" / runfolder.FINAL_RECORD).write_text(json.dumps({"step": 3}))
    done = warm.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.startswith(f"train.py: {run} finished at step 3; nothing to resume"), \
        done.stdout + done.stderr


@pytest.mark.slow
def test_a_resume_stopped_after_a_checkpoint_then_finished_writes_that_steps_final(tmp_path, finished_run):
    """The issue's sequence: a run finished at step 3 (final/ = step 3); `--resume --max-steps 5` killed while step 5
    samples (checkpoint 4 kept, final/ still step 3's); then `--resume --max-steps 4` exits 0 with final/ holding
    step 4's policy (the checkpoint's weights), recorded as step 4, and a further resume is answered finished."""
    from safetensors.torch import load_file
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    train(out, "--resume", "--max-steps", "5", "--save-every", "1", crash_at="sampling:5", expect=-9)
    assert runfolder.step_of(runfolder.checkpoint_dirs(str(out))[-1]) == 4 and runfolder.final_step(str(out)) == 3
    done = train(out, "--resume", "--max-steps", "4")
    assert "finished" not in done.stdout and "resumed from" in done.stdout, done.stdout
    assert runfolder.final_step(str(out)) == 4
    exported = runfolder.export_hf(str(out / "checkpoints" / "step_000004"), str(tmp_path / "step4"))
    same_parameters(load_file(os.path.join(exported, "model.safetensors")), final_state(out))
    again = train(out, "--resume", "--max-steps", "4")
    assert again.stdout.startswith(f"train.py: {out} finished at step 4; nothing to resume"), again.stdout


def test_a_run_stopped_before_it_began_leaves_nothing_and_names_its_command(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) before the run recorded itself (its config.json: loading the model, say) takes back the
    folder the lock made, and the stop line gives the command as typed: a --resume of that folder would be refused,
    as a folder that holds no run."""
    import train as train_py
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "new" / "run"

    def stopped_while_loading(args):
        assert os.path.isdir(out)  # the lock made it
        raise KeyboardInterrupt

    monkeypatch.setattr(train_py, "main", stopped_while_loading)
    argv = ["--output-dir", str(out), "--max-steps", "2"]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        train_py.run(argv)
    assert str(stopped.value) == ("train.py: interrupted before the run began; nothing of it is kept. Start it again: "
                                  f".venv/bin/python train.py --output-dir {out} --max-steps 2")
    assert not os.path.exists(tmp_path / "new")



def test_final_step_reads_no_fifo_planted_at_finals_record(tmp_path):
    """A FIFO at final/ce-gppo-final.json would block open() until a writer came: final_step answers None at once."""
    import threading
    (tmp_path / "final").mkdir()
    os.mkfifo(tmp_path / "final" / runfolder.FINAL_RECORD)
    answered = []
    reader = threading.Thread(target=lambda: answered.append(runfolder.final_step(str(tmp_path))), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert answered == [None]
    os.remove(tmp_path / "final" / runfolder.FINAL_RECORD)
    (tmp_path / "final" / runfolder.FINAL_RECORD).write_text('{"step": 4}')
    assert runfolder.final_step(str(tmp_path)) == 4


def test_atomic_writes_are_synced_before_the_rename_and_take_the_umask_unchanged(tmp_path, monkeypatch):
    """write_text_atomically (through write_file_atomically): the file's content is fsynced before os.replace makes
    it path's, the folder after; its mode is 0666 less the umask, read without setting the umask (which every other
    thread would see changed for a moment)."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append("fsync folder" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        real_replace(src, dst)

    def umask(mask):
        raise AssertionError("the umask was set")

    old = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "umask", umask)
        runfolder.write_text_atomically(str(tmp_path / "a.json"), "é\n")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert events == ["fsync file", "replace", "fsync folder"]
    assert (tmp_path / "a.json").read_bytes() == "é\n".encode() and os.listdir(tmp_path) == ["a.json"]
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
