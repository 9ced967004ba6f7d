"""Issue 41 and 40: a run folder is created, never adopted (a planted lock link, the root, a model or checkpoint folder,
a parent); export writes only where it may and refuses shards its config does not describe; config files read
safely; float flags bounded in float32; config.json keeps the launch. Fast: no training run (the SIGTERM case is in
test_runfolder.py beside Ctrl-C)."""

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import warm
from conftest import ROOT, parse_train_args
from test_bad_input import fake_checkpoint, run_evaluate_in_process, run_train_in_process, write

from cegppo_utils import flags
from cegppo_utils import runfolder as RF
from cegppo_utils.runfolder import export as RF_export


def refused(call, *text):
    """call() ends in a UserError (exit code 2) whose one line holds every text; returns the message."""
    with pytest.raises(SystemExit) as stopped:
        call()
    message = str(stopped.value)
    assert stopped.value.code == 2 and "\n" not in message and all(t in message for t in text), message
    return message


def own_run(folder):
    """A folder a run created: its marker, config.json and a final/ model."""
    (folder / "final").mkdir(parents=True)
    write(folder / RF.RUN_MARKER, "{}")
    write(folder / "config.json", json.dumps({"flags": {"seed": 0}}))
    write(folder / "final" / "config.json", '{"model_type": "qwen2"}')
    write(folder / "final" / "model.safetensors", "weights")
    return folder


# --- the lock --------------------------------------------------------------------------------------

def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path, capsys):
    target = write(tmp_path / "precious.txt", "keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / ".lock")
    refused(lambda: RF.lock_output_dir(str(run)), f"{run}/.lock is a symbolic link; refusing to follow it")
    code, err = run_train_in_process(["train.py", "--output-dir", str(run), "--max-steps", "1"], capsys)
    assert code == 2 and "is a symbolic link; refusing to follow it" in err and "Traceback" not in err
    os.remove(run / ".lock")
    os.link(target, run / ".lock")  # a hard link would be written through as well
    refused(lambda: RF.lock_output_dir(str(run)), "is a file with 2 hard links; refusing to write it")
    os.remove(run / ".lock")
    os.mkfifo(run / ".lock")
    refused(lambda: RF.lock_output_dir(str(run)), "is not a regular file")
    assert open(target).read() == "keep me\n" and os.stat(target).st_nlink == 1


# --- which folders a run writes into -------------------------------------------------------------------

def test_a_fresh_run_writes_only_into_a_new_empty_or_own_folder(tmp_path):
    check = RF.check_output_folder
    check(str(tmp_path / "new"), False)  # missing
    (tmp_path / "empty").mkdir()
    check(str(tmp_path / "empty"), False)
    lock = RF.lock_output_dir(str(tmp_path / "empty"))  # marks it as a run's
    lock.release()
    assert os.path.isfile(tmp_path / "empty" / RF.RUN_MARKER)
    check(str(tmp_path / "empty"), False)  # its own folder: a new run may start there again
    run = own_run(tmp_path / "run")
    refused(lambda: check("/", False), "--output-dir / is the root of the file system")
    refused(lambda: check("/", True), "is the root of the file system")
    for resume in (False, True):
        refused(lambda: check(str(run / "final"), resume), "is inside the run folder")
        refused(lambda: check(str(run / "checkpoints" / "step_000001"), resume), "is inside the run folder")
    model = tmp_path / "model"
    model.mkdir()
    write(model / "config.json", '{"model_type": "qwen2"}')
    write(model / "model.safetensors", "weights")
    refused(lambda: check(str(model), True), "is a model folder (config.json and weights)")
    ckpt = fake_checkpoint(tmp_path / "loose" / "step_000004")
    refused(lambda: check(str(ckpt), True), "is a checkpoint folder")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    write(foreign / "config.json", '{"model_type": "qwen2"}')
    write(foreign / "notes.txt", "mine")
    refused(lambda: check(str(foreign), False), "holds files of its own (config.json, notes.txt) and no run")
    refused(lambda: check(str(foreign), True), "and no run")  # its config.json is not a run's: not resumed either
    foreign_run = tmp_path / "foreign-run"  # a metrics.jsonl of unknown origin: no run of this project (holds_run)
    foreign_run.mkdir()
    write(foreign_run / "metrics.jsonl", '{"step": 1}\n')
    for resume in (True, False):
        refused(lambda: check(str(foreign_run), resume), "holds files of its own (metrics.jsonl) and no run")


def test_train_refuses_a_model_folder_a_parent_and_the_root_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parent = tmp_path / "parent"
    run = own_run(parent / "run")
    write(parent / "config.json", '{"model_type": "qwen2", "mine": true}')
    before = {p: open(p).read() for p in (parent / "config.json", run / "config.json", run / "final" / "config.json")}
    config = write(run / "again.yaml", "output_dir: ..\nmax_steps: 1\n")
    monkeypatch.chdir(run)  # `output_dir: ..` is the run's parent
    t = ["train.py", "--max-steps", "1"]
    for argv, text in ((t + ["--config", config], "--output-dir .. holds files of its own"),
                       (t + ["--output-dir", str(run / "final")], "is inside the run folder"),
                       (t + ["--output-dir", "/"], "--output-dir / is the root of the file system")):
        code, err = run_train_in_process(argv, capsys)
        assert code == 2 and text in err and "Traceback" not in err, err
    assert {p: open(p).read() for p in before} == before
    assert sorted(os.listdir(parent)) == ["config.json", "run"] and not os.path.exists("/.lock")
    assert sorted(os.listdir(run / "final")) == ["config.json", "model.safetensors"]


# --- checkpoints: only step_<digits> ----------------------------------------------------------------

def test_only_step_digits_are_checkpoints_and_rotation_spares_the_rest(tmp_path):
    from test_runfolder import Tokenizer, small_model
    root = tmp_path / "checkpoints"
    for name in ("step_000001_keep", "step_best", "step_000009.tmp", "step_x"):
        (root / name).mkdir(parents=True)
    write(root / "step_000008", "a file, not a folder")
    model, optimizer = small_model()
    for step in (2, 3, 4):
        RF.save_checkpoint(str(tmp_path), step, 2, model, Tokenizer(), optimizer, {"flags": {}})
    assert sorted(os.listdir(root)) == ["step_000001_keep", "step_000003", "step_000004", "step_000008",
                                        "step_000009.tmp", "step_best", "step_x"]
    assert RF.checkpoint_dirs(str(tmp_path))[-1].endswith("step_000004")  # not step_best
    (root / "step_9").mkdir()  # ordered by number, not by text ("step_10" < "step_9" as text)
    (root / "step_10").mkdir()
    assert [os.path.basename(d) for d in RF.checkpoint_dirs(str(tmp_path))] == ["step_000003", "step_000004", "step_9",
                                                                                "step_10"]


# --- export and evaluate on checkpoints --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_model_path):
    """A real checkpoint of the tiny model (Qwen2, biased q/k/v) with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    out = tmp_path_factory.mktemp("ckpt")
    return RF.save_checkpoint(str(out), 1, 2, model, tokenizer, torch.optim.AdamW(model.parameters()), {"flags": {}})


def copy_checkpoint(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        config = json.loads(open(os.path.join(dst, "config.json")).read())
        config.update(edit)
        write(os.path.join(dst, "config.json"), json.dumps(config))
    return str(dst)


def test_export_writes_only_into_a_new_empty_or_earlier_export(tmp_path, tiny_checkpoint):
    def export(out, *extra):
        return RF.main(["export", tiny_checkpoint, str(out), *extra])

    export(tmp_path / "out")
    RF.check_model_folder(str(tmp_path / "out"))
    refused(lambda: export(tmp_path / "out"), "is not empty; pass --overwrite")
    os.remove(tmp_path / "out" / "tokenizer.json")
    export(tmp_path / "out", "--overwrite")  # an earlier export, replaced whole
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")
    file = write(tmp_path / "results.json", "{}")
    refused(lambda: export(file, "--overwrite"), "exists and is not a folder")
    assert open(file).read() == "{}"
    run = own_run(tmp_path / "run")
    refused(lambda: export(run, "--overwrite"), "is a run folder")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    write(foreign / "notes.txt", "mine")
    refused(lambda: export(foreign, "--overwrite"), "--overwrite replaces only a model folder")
    assert os.listdir(foreign) == ["notes.txt"] and os.path.isfile(run / "final" / "model.safetensors")
    refused(lambda: export(tiny_checkpoint, "--overwrite"), "is a checkpoint folder")
    (tmp_path / "empty").mkdir()
    export(tmp_path / "empty")


def test_export_and_evaluate_refuse_shards_their_config_does_not_describe(tmp_path, tiny_checkpoint, capsys,
                                                                          monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = json.load(open(os.path.join(tiny_checkpoint, "config.json")))
    cases = [  # (folder, what the one line says)
        (copy_checkpoint(tiny_checkpoint, tmp_path / "fewer", {"num_hidden_layers": config["num_hidden_layers"] - 1,
                                                               **({"layer_types": config["layer_types"][:-1]}
                                                                  if "layer_types" in config else {})}),
         "its shards do not hold the weights its config.json describes (0 of"),
        (copy_checkpoint(tiny_checkpoint, tmp_path / "llama", {"model_type": "llama",
                                                               "architectures": ["LlamaForCausalLM"]}),
         "not in the model, e.g. model.model.layers.0.self_attn.k_proj.bias"),  # llama drops qwen2's biases
        (copy_checkpoint(tiny_checkpoint, tmp_path / "unknown", {"model_type": "qwen99"}),
         "transformers cannot build a model from its config.json"),
        (copy_checkpoint(tiny_checkpoint, tmp_path / "step_000002.tmp"), "is a checkpoint whose write did not finish"),
    ]
    shard = copy_checkpoint(tiny_checkpoint, tmp_path / "no-shard")
    os.remove(os.path.join(shard, "__0_0.distcp"))
    cases.append((shard, "shard __0_0.distcp is missing"))
    bench = write(tmp_path / "bench.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    for folder, text in cases:
        refused(lambda: RF.main(["export", folder, str(tmp_path / "out")]), text)
        code, err = run_evaluate_in_process(["evaluate.py", "--model", folder, "--benchmarks", bench, "--sampler", "hf",
                                             "--output", str(tmp_path / "results.json")], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and lines[-1].startswith("evaluate.py: error: ") and text in lines[-1], err
        assert "train.py" not in err and not os.path.exists(os.path.join(folder, "hf"))
    assert not os.path.exists(tmp_path / "out")
    partial = copy_checkpoint(tiny_checkpoint, tmp_path / "partial")
    os.makedirs(os.path.join(partial, "hf"))
    write(os.path.join(partial, "hf", "config.json"), json.dumps(config))
    code, err = run_evaluate_in_process(["evaluate.py", "--model", partial, "--benchmarks", bench, "--sampler", "hf",
                                         "--output", str(tmp_path / "results.json")], capsys)
    assert code == 2 and "hf is incomplete or damaged (the folder has config.json but no weights" in err
    assert f"remove {partial}/hf to export it again" in err


@pytest.mark.slow
def test_runfolder_export_prints_its_error(tmp_path, tiny_checkpoint):
    """As a program: one line naming runfolder.py and the cause, exit code 2 (its UserError is a SystemExit whose
    message Python itself would not print)."""
    shard = copy_checkpoint(tiny_checkpoint, tmp_path / "no-shard")
    os.remove(os.path.join(shard, "__0_0.distcp"))
    done = warm.run([sys.executable, "-m", "cegppo_utils.runfolder", "export", shard, str(tmp_path / "out")],
                    cwd=ROOT,
                    capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == \
        f"runfolder.py: error: {shard}: shard __0_0.distcp is missing (1 of 1); the checkpoint is incomplete"


@pytest.fixture
def read_only(tmp_path):
    """(make(folder) -> a read-only copy of folder, undo) on a read-only mount where the test runs as root (root writes
    through file modes), by file modes otherwise."""
    mounts = []

    def make(folder):
        copy = tmp_path / "ro" / os.path.basename(folder)
        if os.geteuid() != 0:
            shutil.copytree(folder, copy)
            for d, _, _ in os.walk(copy):
                os.chmod(d, 0o555)
            return str(copy)
        (tmp_path / "ro").mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128m", "tmpfs", str(tmp_path / "ro")],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a read-only file system here")
        mounts.append(str(tmp_path / "ro"))
        shutil.copytree(folder, copy)
        assert subprocess.run(["mount", "-o", "remount,ro", str(tmp_path / "ro")], capture_output=True).returncode == 0
        return str(copy)

    yield make
    for m in mounts:
        subprocess.run(["umount", "-l", m], capture_output=True)
    for d, _, _ in os.walk(tmp_path / "ro"):
        os.chmod(d, 0o755)


def test_a_read_only_checkpoint_evaluates_from_a_cache_export(tmp_path, tiny_checkpoint, read_only, capsys,
                                                              monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = read_only(tiny_checkpoint)
    assert not RF.writable(ckpt)
    bench = write(tmp_path / "bench.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    code, err = run_evaluate_in_process(["evaluate.py", "--model", ckpt, "--benchmarks", bench, "--sampler", "hf",
                                         "--k", "1",
                                         "--max-tokens", "4", "--output", str(tmp_path / "results.json")], capsys)
    assert code == 0, err
    (export,) = os.listdir(tmp_path / "cache" / "ce-gppo" / "exports")
    RF.check_model_folder(str(tmp_path / "cache" / "ce-gppo" / "exports" / export))
    results = json.load(open(tmp_path / "results.json"))
    assert results["settings"]["model"] == ckpt and [b["k"] for b in results["benchmarks"].values()] == [1]
    assert not os.path.exists(os.path.join(ckpt, "hf"))
    said = []
    assert RF.exported(ckpt, log=said.append).endswith(export) and said == [f"{ckpt}: using its export cached in "
                                                                          f"{tmp_path}/cache/ce-gppo/exports/{export}"]


def test_evaluate_refuses_an_output_on_a_read_only_mount(tmp_path, read_only, monkeypatch):
    """evaluate.py tries to write in --output's folder (runfolder.writable), and for the default one in its nearest
    existing parent, before anything is sampled: os.access reads the modes (root passes them), and on a FUSE mount
    without an access handler it says yes to anything, as it does here."""
    import evaluate
    (tmp_path / "results").mkdir()
    folder = read_only(str(tmp_path / "results"))
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)
    with pytest.raises(evaluate.UserError, match=f"^--output {folder}/r.json: its folder {folder} takes no file \\("):
        evaluate.check_output(os.path.join(folder, "r.json"))
    with pytest.raises(evaluate.UserError, match=f"its folder {folder}/eval cannot be created in {folder} \\("):
        evaluate.check_output(os.path.join(folder, "eval", "r.json"), default=True)
    evaluate.check_output(str(tmp_path / "r.json"))  # a folder that can be written passes


def test_evaluate_refuses_an_unknown_dtype_before_the_engine(tmp_path, capsys):
    bench = write(tmp_path / "bench.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    code, err = run_evaluate_in_process(["evaluate.py", "--model", "tiny", "--benchmarks", bench, "--sampler", "vllm",
                                         "--dtype", "float77", "--output", str(tmp_path / "r.json")], capsys)
    assert code == 2 and err.strip().splitlines()[-1].startswith("evaluate.py: error: argument --dtype: invalid "
                                                                 "choice: 'float77'")


# --- flags: float32 bounds, the NaN stop, config files ----------------------------------------------------

def test_float_flags_that_float32_rounds_to_0_or_inf_are_refused(capsys):
    for extra, text in ((["--tau-pos", "1e-46"], "--tau-pos 1e-46 is 0 in float32"),
                        (["--kl-coef", "1e39"], "--kl-coef 1e+39 is inf in float32"),
                        (["--entropy-coef", "1e-50"], "--entropy-coef 1e-50 is 0 in float32")):
        with pytest.raises(SystemExit) as stopped:
            parse_train_args(extra)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and len(err.strip().splitlines()) == 1 and text in err, err
    assert parse_train_args(["--algo", "sapo", "--tau-pos", "1e-40"]).loss.tau_pos == 1e-40  # a float32 subnormal: kept


def test_the_nan_stop_says_whether_a_checkpoint_exists(tmp_path, monkeypatch, capsys):
    import train

    def nan_step(args):  # a run that began (its config.json written), then broke
        write(os.path.join(args.output_dir, "config.json"), json.dumps({"flags": {}}))
        raise FloatingPointError("step 3: the loss is nan; stopping")

    monkeypatch.setattr(train, "main", nan_step)
    with pytest.raises(SystemExit) as stopped:
        train.run(["--output-dir", str(tmp_path / "run")])
    assert str(stopped.value) == ("train.py: step 3: the loss is nan; stopping; no checkpoint was written yet. "
                                  "Start again "
                                  f"from step 0: {RF.resume_command(str(tmp_path / 'run'))}")
    fake_checkpoint(tmp_path / "run" / "checkpoints" / "step_000002")
    with pytest.raises(SystemExit) as stopped:
        train.run(["--output-dir", str(tmp_path / "run"), "--resume"])
    assert str(stopped.value).endswith(f"stopping; the last checkpoint, {tmp_path}/run/checkpoints/step_000002, is "
                                       f"intact. Continue from step 2: {RF.resume_command(str(tmp_path / 'run'))}")


def config_error(path, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_train_args(["--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("train.py: error: --config "), err
    return err


def test_config_files_are_read_safely(tmp_path, capsys):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    cases = {
        "anchors.yaml": (bomb + "lr: *i\n", "YAML anchors and aliases are not accepted (line 1)"),
        "dup.yaml": ("lr: 0.1\nseed: 1\nlr: 0.2\n", "the key 'lr' appears twice"),
        "dup.json": ('{"lr": 0.1, "lr": 0.2}', "the key 'lr' appears twice"),
        "spellings.yaml": ("max_steps: 3\nmax-steps: 4\n", "max_steps is given twice (as 'max-steps')"),
        "type.yaml": ("lr: fast\n", "lr must be a float, got 'fast'"),
        "int.yaml": ("max_steps: 2.5\n", "max_steps must be an int, got 2.5"),
        "long.yaml": ("lr: " + "9" * 5000 + "x\n", "lr must be a float, got '99999"),
        "hf.yaml": ("learning_rate: 0.001\n", "unknown flag 'learning_rate'; did you mean 'lr'?"),
        "resume.yaml": ("resume: true\n", "resume is not a setting of a run; pass --resume on the command line"),
        "big.json": ('{"lr": 0.1' + " " * (2 << 20) + "}", "a config file is at most 1048576 bytes"),
        "binary.yaml": (b"\xff\xfe\x00", "not a UTF-8 text file"),
    }
    for name, (content, text) in cases.items():
        err = config_error(write(tmp_path / name, content, "wb" if isinstance(content, bytes) else "w"), capsys)
        assert text in err and len(err) < 400, (name, err)
    os.mkfifo(tmp_path / "fifo.yaml")  # open() blocked here for ever, waiting for a writer
    done = []
    reader = threading.Thread(target=lambda: done.append(config_error(tmp_path / "fifo.yaml", capsys)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert done and "not a regular file (a FIFO, device or folder)" in done[0]
    args = parse_train_args(["--config", write(tmp_path / "ok.yaml", "lr: 1e-4\nkl_coef: 2E-3\nmax_steps: 7\n")])
    assert args.lr == 1e-4 and args.loss.kl_coef == 2e-3 and args.max_steps == 7  # YAML 1.2 numbers, as JSON reads them


# --- config.json: the launch kept, resume not a setting ------------------------------------------------

def test_config_json_keeps_the_launch_and_a_rerun_from_it_is_a_new_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    launch = {"command": ["train.py", "--output-dir", str(run)], "started": "2026-01-01T00:00:00", "host": "a"}
    flags_now = flags.flat_flags(parse_train_args(["--output-dir", str(run)]))
    RF.begin(str(run), False, None, flags_now, launch)
    for i, host in enumerate(("b", "c")):
        RF.begin(str(run), True, None, {**flags_now, "resume": True},
                 {"command": ["train.py", "--output-dir", str(run), "--resume"],
                  "started": f"2026-01-0{i + 2}", "host": host})
    config = json.load(open(run / "config.json"))
    assert (config["command"], config["started"], config["host"]) == (launch["command"], launch["started"], "a")
    assert [(r["command"][-1], r["started"], r["host"]) for r in config["resumes"]] == \
        [("--resume", "2026-01-02", "b"), ("--resume", "2026-01-03", "c")]
    assert "resume" not in config["flags"]
    rerun = parse_train_args(["--config", str(run / "config.json"), "--output-dir", str(tmp_path / "new")])
    assert rerun.resume is False and rerun.output_dir == str(tmp_path / "new")
    legacy = write(tmp_path / "legacy.json",
                   json.dumps({"flags": {**flags_now, "resume": True}}))  # saved before this fix
    assert parse_train_args(["--config", legacy, "--output-dir", str(tmp_path / "new")]).resume is False


def test_a_missing_logging_package_names_the_whole_install_command(monkeypatch):
    """requirements-logging.txt asks pip not to move torch or transformers; the message gives the command with both
    pinned to what is installed, for the venv's own Python."""
    import importlib.util

    import transformers
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RF.UserError) as e:
        RF.check_loggers(tensorboard=True, wandb=False)
    assert str(e.value).startswith("--tensorboard needs the tensorboard package: ")
    assert str(e.value).endswith(f"-m pip install -r requirements-logging.txt torch=={torch.__version__.split('+')[0]} "
                                 f"transformers=={transformers.__version__}")


# --- issue 48: config files checked everywhere, values quoted as written, `~` expanded ------------------------------

def test_config_file_keys_are_checked_everywhere_and_quoted_as_written(tmp_path, capsys):
    run_config = {"command": ["train.py"], "preset": "tiny", "versions": {}, "flags": {"lr": 0.001}}
    cases = {
        "beside.json": (json.dumps({**run_config, "lr": 0.5}), "unknown key 'lr' at the top level beside `flags`"),
        "preset.yaml": ("preset: [1]\nlr: 0.001\n", "preset must be a string naming a preset"),
        "preset.json": (json.dumps({**run_config, "preset": 7}), "preset must be a string naming a preset"),
        "n.yaml": ("n: 1e400\n", "n: 1e400 is beyond a float's range"),
        "lr.yaml": ("lr: 1.5e999\n", "lr: 1.5e999 is beyond a float's range"),
        "lr.json": ('{"lr": -2E+400}', "lr: -2E+400 is beyond a float's range"),
        "int.yaml": ("max_steps: 2.50\n", "max_steps must be an int, got 2.50"),
    }
    for name, (content, text) in cases.items():
        err = config_error(write(tmp_path / name, content), capsys)
        assert text in err and "inf" not in err.split(text)[0][-40:], (name, err)
    args = parse_train_args(["--config", write(tmp_path / "ok.json", json.dumps(run_config))])
    assert args.lr == 0.001  # a run's own config.json, its record keys beside `flags`, still reads


def test_a_literal_tilde_is_the_home_folder_wherever_a_path_is_read(tmp_path, monkeypatch, capsys):
    """`--output-dir=~/x` (no shell expands a ~ after =) or `output_dir: ~/x` in a config file is the home folder's x,
    never a folder named ~ in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    data = write(home / "train.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    (home / "model").mkdir()  # a --model path that does not exist is refused with the flags
    args = parse_train_args(["--output-dir=~/x", "--train-data", "~/train.jsonl", "--eval-data=~/train.jsonl",
                             "--model", "~/model"])
    assert (args.output_dir, args.train_data, args.eval_data, args.model) == \
        (f"{home}/x", data, data, f"{home}/model")
    config = write(home / "c.yaml", "output_dir: ~/y\ntrain_data: ~/train.jsonl\neval_data: ~/train.jsonl\n")
    args = parse_train_args(["--config", "~/c.yaml"])
    assert (args.output_dir, args.train_data, args.eval_data) == (f"{home}/y", data, data)
    code, err = run_train_in_process(["train.py", "--output-dir=~/run", "--model=~/no-model", "--eval-every", "0"],
                                     capsys)
    assert code == 2 and f"--model {home}/no-model: no such model folder" in err, err
    import evaluate
    args = evaluate.parse_args(["--model=~/m", "--output=~/r.json", "--data-dir=~/d", "--benchmarks", "~/train.jsonl"])
    assert (args.model, args.output, args.data_dir, args.benchmarks) == (f"{home}/m", f"{home}/r.json", f"{home}/d",
                                                                          [data])
    assert os.listdir(work) == [] and config


# --- issue 48: nothing written through a link, nothing outside what the run owns -----------------------------------

def test_nothing_is_written_through_a_link_planted_at_a_temporary_name(tmp_path, capsys, monkeypatch):
    import evaluate
    target = write(tmp_path / "precious.txt", "keep me\n")
    run = own_run(tmp_path / "run")
    write(run / "metrics.jsonl", '{"step": 1}\n{"step": 2}\n')
    (run / "eval").mkdir()
    for name in ("config.json.tmp", "metrics.jsonl.tmp", "eval/step_1.jsonl.tmp", "results.json.tmp"):
        os.symlink(target, run / name)
    RF.begin(str(run), True, None, {"seed": 0}, {"command": ["train.py", "--resume"]})  # --resume: config.json, rows
    RF.write_jsonl(str(run / "eval" / "step_1.jsonl"), [{"id": 1}])
    evaluate.write_json(str(run / "results.json"), {"benchmarks": {}})
    assert open(target).read() == "keep me\n"
    for name in ("config.json", "metrics.jsonl", "eval/step_1.jsonl", "results.json"):
        assert not os.path.islink(run / name) and os.path.isfile(run / name), name
    assert json.load(open(run / "config.json"))["flags"] == {"seed": 0}
    assert open(run / "metrics.discarded.jsonl").read() == '{"step": 1}\n{"step": 2}\n'
    refused(lambda: RF.check_output_folder(str(run), True), f"{run}/config.json.tmp is a symbolic link")  # at start
    for name in ("config.json.tmp", "metrics.jsonl.tmp", "eval/step_1.jsonl.tmp", "results.json.tmp", "metrics.jsonl"):
        os.remove(run / name)
    os.symlink(target, run / "metrics.jsonl")  # a log that is a link: refused at start and on every append
    refused(lambda: RF.check_output_folder(str(run), True), f"{run}/metrics.jsonl is a symbolic link")
    refused(lambda: RF.append_jsonl(str(run / "metrics.jsonl"), [{"step": 3}]), "is a symbolic link; refusing")
    assert open(target).read() == "keep me\n"


def test_a_checkpoint_write_never_follows_a_link_planted_at_its_temporary_folder(tmp_path):
    from test_runfolder import Tokenizer, small_model
    users = tmp_path / "users"
    users.mkdir()
    write(users / "notes.txt", "mine")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    os.symlink(users, tmp_path / "run" / "checkpoints" / "step_000002.tmp")
    os.symlink(users, tmp_path / "run" / "checkpoints" / "step_000002.old")
    model, optimizer = small_model()
    RF.save_checkpoint(str(tmp_path / "run"), 2, 2, model, Tokenizer(), optimizer, {"flags": {}})
    assert os.listdir(users) == ["notes.txt"] and open(users / "notes.txt").read() == "mine"
    assert RF.is_checkpoint(str(tmp_path / "run" / "checkpoints" / "step_000002"))


def test_export_through_a_symlinked_parent_checks_the_folder_the_kernel_writes(tmp_path, tiny_checkpoint, monkeypatch):
    """`export CKPT LINK/../exp`: the kernel resolves LINK first, so the export goes beside LINK's target; the
    folder named ./exp (the user's) is neither checked in its place nor replaced."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "exp").mkdir(parents=True)
    (elsewhere / "inner").mkdir(parents=True)
    write(work / "exp" / "notes.txt", "mine")
    os.symlink(elsewhere / "inner", work / "LINK")
    monkeypatch.chdir(work)
    RF.main(["export", tiny_checkpoint, "LINK/../exp"])
    assert os.listdir(work / "exp") == ["notes.txt"]
    RF.check_model_folder(str(elsewhere / "exp"))
    refused(lambda: RF.main(["export", tiny_checkpoint, "LINK/../exp"]), f"{elsewhere}/exp is not empty")
    assert os.listdir(work / "exp") == ["notes.txt"]


def test_a_forged_marker_beside_a_users_config_is_refused_and_nothing_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "mine"
    folder.mkdir()
    config = write(folder / "config.json", '{"my": "settings"}')
    write(folder / RF.RUN_MARKER, "{}")
    for resume in (False, True):
        refused(lambda: RF.check_output_folder(str(folder), resume),
                "its run marker is not backed by a run's config.json (one with `flags`)")
    code, err = run_train_in_process(["train.py", "--output-dir", str(folder), "--max-steps", "1"], capsys)
    assert code == 2 and "its run marker is not backed by a run's config.json" in err, err
    assert open(config).read() == '{"my": "settings"}' and sorted(os.listdir(folder)) == [RF.RUN_MARKER, "config.json"]
    own = own_run(tmp_path / "own")  # the marker and a run's config.json agree: its own folder
    RF.check_output_folder(str(own), False)


# --- issue 48: checkpoints verified before anything loads from them --------------------------------------------------

def test_a_truncated_or_damaged_shard_is_refused_before_anything_is_evaluated(tmp_path, tiny_checkpoint, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bench = write(tmp_path / "bench.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    shard = "__0_0.distcp"
    truncated = copy_checkpoint(tiny_checkpoint, tmp_path / "truncated" / "step_000001")
    with open(os.path.join(truncated, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(truncated, shard)) - 100)
    damaged = copy_checkpoint(tiny_checkpoint, tmp_path / "damaged" / "step_000001")
    with open(os.path.join(damaged, shard), "r+b") as f:  # one byte changed, the size kept
        f.seek(os.path.getsize(os.path.join(damaged, shard)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = sorted(os.listdir(truncated))
    for folder, text in ((truncated, f"shard {shard} is truncated ("),
                         (damaged, f"{shard} is damaged (its SHA-256 differs from the one recorded")):
        code, err = run_evaluate_in_process(["evaluate.py", "--model", folder, "--benchmarks", bench, "--sampler", "hf",
                                             "--k", "1", "--max-tokens", "4", "--output", str(tmp_path / "r.json")],
                                            capsys)
        assert code == 2 and text in err.strip().splitlines()[-1], err
        assert sorted(os.listdir(folder)) == before, "left something behind"
        refused(lambda: RF.main(["export", folder, str(tmp_path / "out")]), text)
        refused(lambda: RF.check_checkpoint(folder), text)  # --resume
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "r.json")


# --- issue 48: races and leftovers ------------------------------------------------------------------------------------

def test_two_exports_of_one_checkpoint_at_once_make_one_and_both_use_it(tmp_path, tiny_checkpoint, monkeypatch):
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "step_000001")
    real_export, calls, said = RF.export_hf, [], []

    def slow_export(checkpoint, out):  # holds the export open long enough that the two overlap
        calls.append(out)
        real_export(checkpoint, out)
        threading.Event().wait(1.0)
        return out

    monkeypatch.setattr(RF_export, "export_hf", slow_export)
    results, errors = [], []

    def evaluate_one():
        try:
            results.append(RF.exported(ckpt, log=said.append))
        except BaseException as e:  # noqa: BLE001 (a failure is what the test looks for)
            errors.append(repr(e))

    both = [threading.Thread(target=evaluate_one) for _ in range(2)]
    for t in both:
        t.start()
        threading.Event().wait(0.2)
    for t in both:
        t.join(timeout=120)
    assert errors == [] and len(calls) == 1 and results == [os.path.join(ckpt, "hf")] * 2, (errors, calls, results)
    assert any("another process is exporting it; waiting for it" in line for line in said), said
    RF.check_model_folder(os.path.join(ckpt, "hf"))


def test_a_refused_run_leaves_no_folder_or_file_it_created(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    missing = ["--model", str(tmp_path / "no-model"), "--max-steps", "1", "--eval-every", "0"]
    code, err = run_train_in_process(["train.py", "--output-dir", str(tmp_path / "a" / "b" / "run"), *missing], capsys)
    assert code == 2 and "no such model folder" in err and not os.path.exists(tmp_path / "a"), err
    (tmp_path / "empty").mkdir()
    code, err = run_train_in_process(["train.py", "--output-dir", str(tmp_path / "empty"), *missing], capsys)
    assert code == 2 and os.listdir(tmp_path / "empty") == []
    run = own_run(tmp_path / "run")  # a folder that was a run before keeps what it had
    before = sorted(os.listdir(run))
    code, err = run_train_in_process(["train.py", "--output-dir", str(run), *missing], capsys)
    assert code == 2 and sorted(os.listdir(run)) == before


def test_a_damaged_config_json_is_refused_not_rewritten(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    fake_checkpoint(run / "checkpoints" / "step_000001")
    write(run / "metrics.jsonl", '{"step": 1}\n')
    write(run / RF.RUN_MARKER, "{}")
    torn = write(run / "config.json", '{"command": ["train.py", "--output-dir"], "started": "2026-01-01", "fla')
    refused(lambda: RF.check_output_folder(str(run), True),
            f"{run}/config.json is damaged (not valid JSON", "holds the run's launch record; restore it")
    code, err = run_train_in_process(["train.py", "--output-dir", str(run), "--resume", "--max-steps", "2"], capsys)
    assert code == 2 and "config.json is damaged (not valid JSON" in err, err
    assert open(torn).read().endswith('"fla')


def test_what_stands_in_for_the_lock_the_marker_or_config_json_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in (".lock", RF.RUN_MARKER, "config.json"):
        run = tmp_path / name.strip(".")
        fake_checkpoint(run / "checkpoints" / "step_000001")
        write(run / "metrics.jsonl", '{"step": 1}\n')
        if name != "config.json":
            write(run / "config.json", json.dumps({"flags": {}}))
        (run / name).mkdir()
        text = f"{run}/{name} is not a regular file (a folder)"
        refused(lambda: RF.check_output_folder(str(run), True), text)
        refused(lambda: RF.lock_output_dir(str(run), resume=True), text)
        code, err = run_train_in_process(["train.py", "--output-dir", str(run), "--resume", "--max-steps", "2"], capsys)
        assert code == 2 and text in err and "Traceback" not in err, err


def test_the_export_cache_is_reported_bounded_and_cleanable(tmp_path, tiny_checkpoint, read_only, capsys, monkeypatch):
    """Exports of read-only checkpoints go to the cache (fp32: about 7 GB at 1.5B): each says its size and how to
    list or remove them, the cache keeps the EXPORT_CACHE_KEEP most recently used, and an XDG_CACHE_HOME that is a
    file or read-only is one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bundle = tmp_path / "bundle"
    copy_checkpoint(tiny_checkpoint, bundle / "a" / "step_000001")
    shutil.copytree(bundle / "a", bundle / "b", copy_function=os.link)  # a second checkpoint in no more space
    (bundle / "cache").mkdir()
    ro = read_only(str(bundle))
    monkeypatch.setattr(RF_export, "EXPORT_CACHE_KEEP", 1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    said = []
    first = RF.exported(os.path.join(ro, "a", "step_000001"), log=said.append)
    assert any(line.startswith(f"{first}: 0.0") and "GB; the export cache keeps the 1 most recently used" in line
               and "runfolder cache lists them, --clear removes them" in line for line in said), said
    second = RF.exported(os.path.join(ro, "b", "step_000001"), log=said.append)
    assert not os.path.exists(first) and os.path.isdir(second)
    assert any(f"export cache: removed {first}" in line for line in said), said
    capsys.readouterr()
    RF.main(["cache"])
    listed = capsys.readouterr().out
    assert f"{second}  0.0" in listed and os.path.join(ro, "b", "step_000001") in listed
    RF.main(["cache", "--clear"])
    assert os.listdir(tmp_path / "cache" / "ce-gppo" / "exports") == []
    bench = write(tmp_path / "bench.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    for cache, text in ((write(tmp_path / "a_file", "x"), "cannot be created (Not a directory; XDG_CACHE_HOME is"),
                        (os.path.join(ro, "cache"), "cannot be created (")):  # read-only: EROFS, or EACCES by modes
        monkeypatch.setenv("XDG_CACHE_HOME", cache)
        code, err = run_evaluate_in_process(["evaluate.py", "--model", os.path.join(ro, "a", "step_000001"),
                                             "--benchmarks", bench, "--sampler", "hf", "--output",
                                             str(tmp_path / "r.json")], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and text in lines[-1] and "set XDG_CACHE_HOME to a writable folder" in lines[-1], err


# --- issue 59 and 57: empty values, one-line refusals, one rule for unread options, resume, folders -----------------

def refusal_line(argv, capsys) -> str:
    """train.py's command line refuses argv: exit 2 and exactly one line on stderr, returned."""
    with pytest.raises(SystemExit) as stopped:
        parse_train_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def before_torch(tmp_path, argv, **env):
    """`python train.py ARGV` where torch and transformers cannot be imported: (exit code, stdout + stderr)."""
    from test_bad_input import without_torch
    done = warm.run([sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                    env={**without_torch(tmp_path), **env})
    return done.returncode, done.stdout + done.stderr


CHOICE_FLAGS = [f for f in flags.RUN_FIELDS + flags.LOSS_FIELDS
                if f.metadata.get("rule") is not None and f.metadata["rule"].choices is not None
                and flags.field_type(f) is str]


def test_an_empty_value_is_a_bad_value_not_the_default(tmp_path, capsys):
    """An unset shell variable (`--config "$CFG"`) is refused in one line: --config '' started a 100-step run,
    --preset '' ran tiny; every choice flag, path and config value alike. The run's name may be empty (its folder's)."""
    assert {f.name for f in CHOICE_FLAGS} >= {"algo", "precision", "sampler", "rollout_correction", "loss_agg_mode",
                                              "dynamic_clip", "kl_estimator"}
    for argv in [["--config", ""], ["--preset", ""], ["--resume", ""], ["--resume="], ["--output-dir", ""],
                 ["--model", ""], ["--train-data", ""]] + [[f"--{f.name.replace('_', '-')}", ""] for f in CHOICE_FLAGS]:
        err = refusal_line(argv, capsys)
        flag = argv[0].split("=")[0]
        assert f"{flag} is empty" in err or f"{flag} is given an empty" in err or f"{flag} must be one of" in err, err
    config = write(tmp_path / "c.yaml", 'model: ""\n')
    assert refusal_line(["--config", config], capsys) == f"train.py: error: --config {config}: model is empty; give " \
                                                          "it a value, or leave it out"
    assert parse_train_args(["--run-name", ""]).run_name == "tiny"
    code, said = before_torch(tmp_path, ["--config", ""])  # the case: it trained into runs/tiny
    assert code == 2 and said.strip().splitlines() == ["train.py: error: --config is empty (an unset shell variable?); "
                                                       "give it a value, or leave the flag out"], said


def test_a_bad_value_in_a_config_file_or_a_runs_config_json_is_the_files(tmp_path, capsys):
    """`algo: gpro` in a YAML file was a KeyError traceback; through a hand-edited config.json and --resume too. A bad
    value read from a file is one line naming the file, not a flag as if typed: an edited lr, a preset `tinny`."""
    from test_runfolder import recorded_run
    config = write(tmp_path / "c.yaml", "algo: gpro\n")
    assert refusal_line(["--config", config], capsys).startswith(
        f"train.py: error: --config {config}: algo must be one of ['bandpo', 'ce_gppo', ")
    run = tmp_path / "run"
    recorded_run(run, ["--max-steps", "4"], steps=[2])
    saved = json.loads((run / "config.json").read_text())
    source = f"--resume {run}: {run}/config.json"
    for edit, said in (({"algo": "gpro"}, f"{source}: algo must be one of ['bandpo', 'ce_gppo', "),
                       ({"lr": 5}, f"{source}: lr must be > 0 and at most 1 (an AdamW step moves a weight by about "
                                   "lr), got 5"),
                       ({"train_prompts": 64}, f"{run}/config.json: --train-prompts (64) cannot exceed --gen-prompts")):
        (run / "config.json").write_text(json.dumps({**saved, "flags": {**saved["flags"], **edit}}))
        assert refusal_line(["--resume", str(run)], capsys).startswith(f"train.py: error: {said}"), edit
    (run / "config.json").write_text(json.dumps({**saved, "preset": "tinny"}))
    assert refusal_line(["--resume", str(run)], capsys) == (
        f"train.py: error: {run}/config.json: unknown preset 'tinny'; choose one of {sorted(flags.PRESETS)}; did you "
        "mean 'tiny'?")
    assert refusal_line(["--preset", "tinny"], capsys).startswith("train.py: error: unknown preset 'tinny'")  # typed


def test_every_refusal_is_one_readable_line(tmp_path, capsys):
    """A newline in a path is escaped, not a second line; 10,000 unknown flags are named by the first few, at once (9 s
    and a 78,930-character line before); a 100,000-character --algo and a 1,000,000-character `model:` in a config
    file are cut to their start and length."""
    import time
    err = refusal_line(["--train-data", "my\ndata.jsonl"], capsys)
    assert "--train-data my\\ndata.jsonl: no such file" in err
    start = time.perf_counter()
    err = refusal_line([f"--bogus-{i}" for i in range(10_000)], capsys)
    assert time.perf_counter() - start < 3 and len(err) < 300, err
    assert err.startswith("train.py: error: unrecognized arguments: --bogus-0 --bogus-1 ") and "and 9995 more" in err
    err = refusal_line(["--algo", "x" * 100_000], capsys)
    assert "(100001 characters)" in err and len(err) < 1000, err[:300]
    config = write(tmp_path / "long.yaml", "model: " + "m" * 1_000_000 + "\n")
    err = refusal_line(["--config", config], capsys)
    assert "(1000000 characters): no such model folder" in err and len(err) < 1000, err[:300]
    assert RF.one_line("a\x1b[31mred\ttab") == "a\\x1b[31mred\\ttab"
    # C1 controls (U+0085 ends a line for some readers) and the line and paragraph separators stay on the line too
    assert RF.one_line("a\x85b\u2028c\u2029d\x9f e\u00e9") == "a\\x85b\\u2028c\\u2029d\\x9f e\u00e9"


def test_an_option_nothing_reads_is_refused_by_one_rule(capsys):
    """An option typed where the algorithm or mode does not read it changes nothing, so it is refused as --dynamic-clip
    on an algorithm without it is: --erc-low on grpo and --icepop-low under token-tis were accepted silently. Where
    the algorithm or mode reads it, it is taken."""
    for argv, said in (
            (["--algo", "grpo", "--erc-low", "0.9"], "--erc-low does not apply to grpo (only gppo_erc and grpo_erc "
                                                     "read it); leave it out, or choose one of those with --algo"),
            (["--algo", "grpo", "--beta1", "0.3"], "--beta1 does not apply to grpo (only ce_gppo reads it)"),
            (["--rollout-correction", "token-tis", "--icepop-low", "0.3"],
             "--icepop-low is read only with --rollout-correction token-icepop, which this run does not use"),
            (["--rollout-correction", "token-icepop", "--rollout-correction-threshold", "3"],
             "--rollout-correction-threshold is read only with --rollout-correction token-tis, token-mis, seq-tis"),
            (["--entropy-target", "0.3"], "--entropy-target is read only with --adaptive-entropy"),
            (["--kl-estimator", "k2"], "--kl-estimator is read only with --kl-coef above 0"),
            (["--od-initial-entropy", "0"], "--od-initial-entropy is read only with --dynamic-clip od"),
            (["--norm-len", "10"], "--norm-len is read only with --loss-agg-mode seq-mean-token-sum-norm"),
            (["--micro-batch-tokens", "512", "--micro-batch-size", "8"],
             "--micro-batch-size is read only with padded micro-batches (--micro-batch-tokens 0)"),
            (["--selective-checkpointing"], "--selective-checkpointing is read only with --gradient-checkpointing"),
            (["--algo", "cispo", "--dynamic-clip", "id"], "--dynamic-clip does not apply to cispo")):
        assert said in refusal_line(argv, capsys), argv
    for argv in (["--algo", "gppo_erc", "--erc-low", "0.9"], ["--rollout-correction", "token-icepop",
                                                              "--icepop-low", "0.3"],
                 ["--adaptive-entropy", "--entropy-target", "0.3"], ["--kl-coef", "0.01", "--kl-estimator", "k2"],
                 ["--dynamic-clip", "od", "--od-initial-entropy", "0"],
                 ["--algo", "dppo_tv", "--norm-len", "10"], ["--micro-batch-size", "8"],
                 ["--gradient-checkpointing", "--selective-checkpointing"]):
        parse_train_args(argv)


def test_packed_micro_batches_take_the_default_micro_batch_size():
    """--micro-batch-tokens 512 with the default --micro-batch-size was refused ("must divide ... 16"), while the size
    is unused when packing (docs/training.md)."""
    args = parse_train_args(["--micro-batch-tokens", "512"])
    assert args.micro_batch_tokens == 512 and (args.mini_batch_prompts * args.n) % args.micro_batch_size == 0
    assert parse_train_args(["--preset", "merge", "--micro-batch-tokens", "512", "--n", "6"]).micro_batch_tokens == 512


def test_resume_accepts_the_launch_command_typed_again(tmp_path, capsys):
    """`--resume RUN --norm-len 0` restates the launch (0 is the run's max response length, as it recorded it: 48);
    `--resume RUN --output-dir RUN/` names one folder; a value that really differs is refused, naming config.json."""
    from test_runfolder import recorded_run
    run = tmp_path / "run"
    launch = ["--algo", "dppo_tv", "--norm-len", "0", "--seed", "3"]
    started = recorded_run(run, launch, steps=[2])
    assert started.loss.norm_len == 48
    for argv in (["--resume", str(run), *launch], ["--resume", str(run), "--output-dir", f"{run}/"],
                 ["--resume", f"{run}/", "--output-dir", str(run)]):
        assert flags.flat_flags(parse_train_args(argv))["norm_len"] == 48, argv
    err = refusal_line(["--resume", str(run), "--norm-len", "10", "--seed", "3"], capsys)
    assert err.startswith(f"train.py: error: --resume {run}: --norm-len 10 (the run's: 48); a run resumes with its own "
                          f"settings ({run}/config.json): a flag typed beside --resume may restate the run's own "
                          "value, or change how long it runs and what it logs"), err


def test_a_folder_without_a_run_is_not_resumed_and_an_occupied_one_is_refused_before_torch(tmp_path):
    """`--resume DIR` where DIR holds no run of this project (missing, empty, someone's files) trained from step 0;
    it is refused before torch loads, nothing created. A new run into a folder that holds a run is refused before
    torch loads too (it took 9-13 s, torch loading first)."""
    from test_runfolder import recorded_run
    empty, notes = tmp_path / "empty", tmp_path / "notes"
    empty.mkdir(), notes.mkdir()
    write(notes / "notes.txt", "mine")
    for folder, said in ((tmp_path / "nonexist", "no such folder"), (empty, "holds no run of this project"),
                         (notes, "holds files of its own (notes.txt) and no run")):
        code, out = before_torch(tmp_path, ["--resume", str(folder)])
        assert code == 2 and len(out.strip().splitlines()) == 1 and said in out, out
    assert not os.path.exists(tmp_path / "nonexist") and os.listdir(empty) == []
    run = tmp_path / "run"
    recorded_run(run, [], steps=[2])
    code, out = before_torch(tmp_path, ["--output-dir", str(run)])
    assert code == 2 and out.startswith(f"train.py: error: {run} holds a run (checkpoints): pass --resume"), out


def test_a_refused_run_leaves_no_folder_even_for_a_literal_tilde(tmp_path):
    """`--output-dir=~/x` with a --model that does not exist: refused (exit 2) before torch loads and before the
    folder is made; $HOME/x was left behind."""
    home = tmp_path / "home"
    home.mkdir()
    for model in ("~/no-model", "./no-model", "tiny:nope"):
        code, out = before_torch(tmp_path, ["--output-dir=~/x", "--model", model], HOME=str(home))
        assert code == 2 and len(out.strip().splitlines()) == 1 and "--model " in out, out
    assert os.listdir(home) == []


def test_default_output_folders_of_different_runs_differ():
    """Without --output-dir: runs/PRESET for the preset's own algorithm, runs/PRESET-ALGO for another, and
    -FLAG-VALUE for each setting given that the run computes with (how long it runs or what it logs is not one): the
    quick start's run and `--algo grpo --max-steps 20` no longer share runs/tiny, nor README's Table 1 commands."""
    folder = lambda *argv: parse_train_args(list(argv)).output_dir  # noqa: E731
    assert folder("--preset", "tiny") == "runs/tiny" == folder("--max-steps", "20", "--algo", "ce_gppo")
    assert folder("--preset", "tiny", "--algo", "grpo", "--max-steps", "20") == "runs/tiny-grpo"
    assert folder("--preset", "r1-distill-1.5b", "--algo", "grpo") == "runs/r1-distill-1.5b-grpo"
    assert folder("--preset", "r1-distill-1.5b", "--beta1", "0.75") == "runs/r1-distill-1.5b-beta1-0.75"
    assert folder("--preset", "r1-distill-1.5b", "--beta1", "0.5") == "runs/r1-distill-1.5b"  # the preset's own value
    assert folder("--lr", "3e-4", "--seed", "2") == "runs/tiny-seed-2-lr-0.0003"  # in the order of --help
    assert folder("--algo", "grpo", "--output-dir", "runs/mine") == "runs/mine"
    long = folder("--algo", "grpo", "--lr", "3e-4", "--seed", "2", "--gen-prompts", "16", "--temperature", "0.9",
                  "--top-p", "0.95", "--max-response-len", "40")
    assert long.startswith("runs/tiny-grpo-") and len(long) < 40
    # the launch command typed again with --resume finds the run's own folder
    assert parse_train_args(["--preset", "tiny", "--algo", "grpo", "--output-dir", "runs/tiny-grpo"]).run_name == \
        "tiny-grpo"
