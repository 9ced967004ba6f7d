"""Issue 65: one rule for "this folder holds a run", one reader of a run's files, one check of an output path, one
reading of a number; each break the sixth review found, as it was found. Commands run with torch and transformers
unimportable (test_bad_input.without_torch), so each answer is shown to come before they load."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, parse_train_args
from test_bad_input import fake_checkpoint, run_train_in_process, without_torch, write
from test_runfolder import recorded_run

import evaluate
from cegppo_utils import flags
from cegppo_utils import runfolder as RF
from cegppo_utils.runfolder import paths

N401 = "1" * 401  # past a float (about 1.8e308), far inside Python's 4,300-digit int limit


def command(tmp_path, *argv, env=None, timeout=60):
    """A program as a user runs it, torch unimportable: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env or without_torch(tmp_path))
    return done.returncode, done.stdout, done.stderr


def refused(tmp_path, *argv, text):
    """argv ends in one line holding `text` on stderr and exit code 2, before torch loads; returns the line."""
    code, out, err = command(tmp_path, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and text in lines[0] and "was imported" not in err, (argv, out, err)
    return lines[0]


def listing(folder) -> dict:
    """Every path under folder with its bytes (None for a folder): what a refused command must leave as it was."""
    found = {}
    for where, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(where, name)
            found[os.path.relpath(path, folder)] = None if os.path.isdir(path) else open(path, "rb").read()
    return found


# --- one rule for "this folder holds a run" -----------------------------------------------------------------------

def test_a_foreign_folder_with_checkpoints_and_metrics_is_not_adopted_by_a_resume(tmp_path):
    """The review's command: `mkdir -p X/checkpoints; echo '{"epoch":1,"loss":0.5}' > X/metrics.jsonl; train.py
    --resume --output-dir X` was accepted, and wrote .ce-gppo-run, .lock, config.json and metrics.discarded.jsonl into
    X, moving X's own rows out of its metrics.jsonl."""
    x = tmp_path / "X"
    (x / "checkpoints").mkdir(parents=True)
    write(x / "metrics.jsonl", '{"epoch":1,"loss":0.5}\n')
    before = listing(x)
    for argv in (["--resume", "--output-dir", str(x)], ["--resume", str(x)]):
        refused(tmp_path, "train.py", *argv, text=f"{x} holds files of its own (checkpoints, metrics.jsonl) and no run")
    assert listing(x) == before and not RF.holds_run(str(x))


def test_a_run_is_its_marker_finals_record_or_a_checkpoint_whose_manifest_verifies(tmp_path):
    for name in ("marker", "final", "checkpoint", "none"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        write(tmp_path / name / "metrics.jsonl", '{"step": 1}\n')
        write(tmp_path / name / "config.json", json.dumps({"flags": {}}))  # anyone can write one: not a run
    write(tmp_path / "marker" / RF.RUN_MARKER, "{}")
    os.makedirs(tmp_path / "final" / "final")
    write(tmp_path / "final" / "final" / RF.FINAL_RECORD, '{"step": 3}')
    ckpt = fake_checkpoint(tmp_path / "checkpoint" / "checkpoints" / "step_000001")
    assert not RF.holds_run(str(tmp_path / "checkpoint"))  # no manifest yet: a checkpoint of unknown origin
    RF.write_manifest(str(ckpt), {"lr": 0.001})
    assert [RF.holds_run(str(tmp_path / n)) for n in ("marker", "final", "checkpoint", "none")] == [1, 1, 1, 0]
    assert RF.checkpoint_flags(str(ckpt)) == {"lr": 0.001}
    write(ckpt / "__0_0.distcp", "truncated", "w")  # its size no longer the one recorded
    assert not RF.holds_run(str(tmp_path / "checkpoint"))
    os.mkfifo(tmp_path / "none" / RF.RUN_MARKER)  # a marker is a regular file
    assert not RF.holds_run(str(tmp_path / "none"))


def test_a_finished_run_is_answered_from_finals_record_without_its_checkpoints_and_once_under_torchrun(tmp_path):
    """final/'s record says step 2 = --max-steps, but checkpoints/ was deleted: --resume loaded torch and would have
    retrained from step 0. Under torchrun each rank printed the answer."""
    run = tmp_path / "run"
    recorded_run(run, ["--max-steps", "2"], steps=[2], final=True)
    shutil.rmtree(run / "checkpoints")
    code, out, err = command(tmp_path, "train.py", "--resume", str(run))
    assert code == 0 and err == "" and out.startswith(f"train.py: {run} finished at step 2; nothing to resume"), err
    ranks = {**without_torch(tmp_path), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    said = [command(tmp_path, "train.py", "--resume", str(run), env={**ranks, "RANK": rank}) for rank in "01"]
    assert [(code, "finished at step 2" in out, err) for code, out, err in said] == [(0, True, ""), (0, False, "")]


def test_evaluate_seed_of_takes_a_run_by_the_same_rule_and_never_the_empty_name(tmp_path):
    x = tmp_path / "X"
    x.mkdir()
    write(x / "config.json", json.dumps({"flags": {"seed": 0}}))  # a config.json alone is not a run
    refused(tmp_path, "evaluate.py", "--seed-of", str(x), "2", text=f"--seed-of {x}: not a run folder of this project")
    refused(tmp_path, "evaluate.py", "--seed-of", "", "2", text="--seed-of is empty")  # not the current folder


# --- one reader of a run's files ------------------------------------------------------------------------------------

def test_a_fifo_where_a_run_keeps_a_file_is_refused_without_blocking(tmp_path):
    """A FIFO at RUN/metrics.jsonl blocked `evaluate.py --seed-of RUN 2` forever, and `tools.study --plot-only` over a
    --root holding it: the reader refuses anything but a regular file before opening it."""
    run = tmp_path / "runs" / "tiny" / "grpo-s0"
    recorded_run(run, ["--max-steps", "4"])
    os.remove(run / "metrics.jsonl")
    os.mkfifo(run / "metrics.jsonl")
    fifo = f"{run}/metrics.jsonl is a FIFO, not a regular file"
    refused(tmp_path, "evaluate.py", "--seed-of", str(run), "2", text=fifo)
    refused(tmp_path, "-m", "tools.study", "--plot-only", "--configs", "grpo", "--seeds", "0", "--steps", "4",
            "--root", str(tmp_path / "runs"), "--json", str(tmp_path / "s.json"), "--figures", str(tmp_path / "f"),
            text=fifo)
    refused(tmp_path, "train.py", "--resume", str(run), text="metrics.jsonl is not a regular file (a FIFO)")
    assert not os.path.exists(tmp_path / "s.json") and not os.path.exists(tmp_path / "f")


@pytest.mark.parametrize("line, text", [(b"\xff\xfe not UTF-8", "line 2 is not UTF-8 text"),
                                        (b"[1, 2]", "line 2 is not a JSON object (got list)"),
                                        (b'{"epoch": 1}', "line 2 has no step (an integer >= 0)"),
                                        (b'{"step": true}', "line 2 has a step that is not an integer >= 0"),
                                        (b'{"step": 2, "reward_me', "line 2 is not valid JSON")])
def test_a_damaged_row_is_one_line_naming_the_file_and_line_before_torch(tmp_path, line, text):
    """A row that is not an object, has no integer step, or is not UTF-8 raised UnicodeDecodeError or AttributeError
    (lost_row) at --resume, and AttributeError at --seed-of: now one line, before torch loads. A torn line is one
    only where it is the last and has no newline (test_runfolder's killed runs)."""
    run = tmp_path / "run"
    recorded_run(run, ["--max-steps", "4"], steps=[2])
    write(run / "metrics.jsonl", b'{"step": 1}\n' + line + b'\n{"step": 3}\n', "wb")
    where = f"{run}/metrics.jsonl: {text}"
    refused(tmp_path, "train.py", "--resume", str(run), text=where)
    refused(tmp_path, "evaluate.py", "--seed-of", str(run), "2", text=where)
    write(run / "metrics.jsonl", b'{"step": 1}\n' + line, "wb")  # the same as the last line, without its newline
    if b"reward_me" in line or b"\xff" in line:  # torn: an append cut short, which the readers leave out
        assert [r["step"] for r in RF.read_jsonl(str(run / "metrics.jsonl"))] == [1]
    else:  # a whole row, and not a run's
        with pytest.raises(RF.UserError):
            RF.read_jsonl(str(run / "metrics.jsonl"))


def test_a_hand_edited_run_record_is_named_not_met_as_a_traceback(tmp_path):
    run = tmp_path / "run"
    recorded_run(run, ["--max-steps", "4"], steps=[2])
    record = json.loads((run / "config.json").read_text())
    for key, value, text in (("resumes", 5, "its resumes is 5, not a list of objects (edited by hand?)"),
                             ("resumes", [{"world_size": "2"}], 'its resumes[0].world_size is "2", not an integer'),
                             ("world_size", 0, "its world_size is 0, not an integer >= 1")):
        write(run / "config.json", json.dumps({**record, key: value}))
        refused(tmp_path, "evaluate.py", "--seed-of", str(run), "2", text=f"{run}/config.json: {text}")
        refused(tmp_path, "train.py", "--resume", str(run), text=f"{run}/config.json: {text}")


def test_the_tools_read_rows_by_the_same_rule(tmp_path):
    """`python -m cegppo_utils.plot RUN` on a row without step or a list row raised KeyError / AttributeError;
    study_collapse on a row with "acc_mean": null, which its NUMBERS allow, raised TypeError."""
    run = tmp_path / "run"
    recorded_run(run, ["--max-steps", "4"])
    for row, text in (('{"reward_mean": 0.5}', "line 2 has no step"), ("[1, 2]", "line 2 is not a JSON object")):
        write(run / "metrics.jsonl", '{"step": 1, "reward_mean": 0.1}\n' + row + "\n")
        refused(tmp_path, "-m", "cegppo_utils.plot", str(run), "--out", str(tmp_path / "plots"),
                text=f"{run}/metrics.jsonl: {text}")
    from test_study_collapse import good
    study = good()
    name, runs = next(iter(study.items()))
    next(iter(runs.values()))["steps"][2]["acc_mean"] = None
    write(tmp_path / "study.json", json.dumps(study))
    refused(tmp_path, "-m", "tools.study_collapse", "--json", str(tmp_path / "study.json"), "--figures",
            str(tmp_path / "pages"), text="its acc_mean is null")
    assert not os.path.exists(tmp_path / "plots") and not os.path.exists(tmp_path / "pages")


# --- one check of an output path ------------------------------------------------------------------------------------

def test_an_output_folder_that_cannot_be_made_is_refused_before_torch_and_leaves_no_folder(tmp_path, capsys):
    """`--output-dir D/NEW1/NEW2/<a 300-byte name>` was refused after torch loaded and left NEW1/NEW2; `--output-dir
    FILE/run` too was refused only after torch loaded."""
    (tmp_path / "D").mkdir()
    long = str(tmp_path / "D" / "NEW1" / "NEW2" / ("n" * 300))
    refused(tmp_path, "train.py", "--output-dir", long, text="has a name of 300 bytes (nnnn")
    write(tmp_path / "FILE", "mine")
    refused(tmp_path, "train.py", "--output-dir", str(tmp_path / "FILE" / "run"),
            text=f"--output-dir {tmp_path}/FILE/run cannot be created ({tmp_path}/FILE is a file)")
    code, err = run_train_in_process(["train.py", "--output-dir", long], capsys)  # train.run's own lock: the same
    assert code == 2 and "has a name of 300 bytes" in err
    assert os.listdir(tmp_path / "D") == [] and (tmp_path / "FILE").read_text() == "mine"


def test_evaluate_knows_its_output_is_writable_before_it_samples(tmp_path, monkeypatch):
    """`--output newdir/` and a default name over 255 bytes (a long benchmark path) failed on the write, after every
    benchmark had been sampled and scored."""
    refused(tmp_path, "evaluate.py", "--model", "tiny", "--benchmarks", "arith", "--output",
            str(tmp_path / "new") + "/", text="names a folder; name a file")
    refused(tmp_path, "evaluate.py", "--model", "tiny", "--benchmarks", "arith", "--output",
            str(tmp_path / ("r" * 300 + ".json")), text="has a name of 305 bytes")
    monkeypatch.chdir(tmp_path)
    names = set()
    for tail in ("a", "b"):
        bench = write(tmp_path / ("x" * 200 + tail + ".jsonl"), '{"problem": "1 + 1?", "answer": 2}\n')
        args = evaluate.parse_args(["--model", "tiny", "--benchmarks", bench])
        evaluate.check_output(args.output, default=True)
        assert len(os.path.basename(args.output).encode()) <= 255 and args.output.startswith("runs/eval/tiny-")
        names.add(args.output)
    assert len(names) == 2 and not os.path.exists(tmp_path / "runs")  # one name each; nothing made before results


def test_a_signal_or_a_failure_during_the_folder_probe_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A SIGTERM while rank 0 probed a new folder left .write-test-XXXX behind: the run said "nothing of it is kept",
    and a fresh run there was then refused ("holds files of its own"). The probe is made and removed with SIGINT and
    SIGTERM held (paths.signals_held), in a try/finally."""
    import train
    out = tmp_path / "new" / "run"
    real = paths._create_probe

    def then(effect):
        def create(path):
            fd = real(path)
            if os.path.dirname(path) == str(out):  # the run's own probe (train.py's start), not the path check's
                effect()
            return fd
        return create

    monkeypatch.setattr(paths, "_create_probe", then(lambda: os.kill(os.getpid(), signal.SIGTERM)))
    argv = ["--output-dir", str(out), "--max-steps", "1", "--eval-every", "0"]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        train.run(argv)
    assert str(stopped.value).startswith("train.py: terminated (SIGTERM) before the run began; nothing of it is kept")
    assert os.listdir(tmp_path) == []  # the probe, the lock, the marker and the folders made for them
    monkeypatch.setattr(paths, "_create_probe", then(lambda: 1 / 0))
    with pytest.raises(SystemExit):
        train.run(argv)
    assert not [n for n in os.listdir(out) if n.startswith(".write-test-")]
    RF.check_output_folder(str(out), resume=False)  # a fresh run there is taken
    capsys.readouterr()


def test_the_probe_holds_a_signal_until_its_file_is_gone(tmp_path, monkeypatch):
    seen = []

    def handler(signum, frame):
        seen.append(sorted(os.listdir(tmp_path)))  # what the folder holds when the signal is acted on

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        real = paths._create_probe
        monkeypatch.setattr(paths, "_create_probe", lambda path: (real(path), os.kill(os.getpid(), signal.SIGTERM))[0])
        assert paths.probe(str(tmp_path)) is None
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [[]] and os.listdir(tmp_path) == []


# --- numbers --------------------------------------------------------------------------------------------------------

def test_a_number_of_any_size_is_one_line(tmp_path):
    """loss.Rule.problem called math.isfinite on a 401-digit int: OverflowError, from train.py --n, a config's lr,
    evaluate.py --k and tools.study --n."""
    write(tmp_path / "c.json", '{"lr": ' + N401 + "}")
    write(tmp_path / "d.json", '{"weight_decay": ' + N401 + "}")
    shown = "11111111111111111111... (an integer of 401 digits)"
    cases = [(["train.py", "--n", N401], f"--n must be below 2**31, got {shown}"),
             (["train.py", "--config", str(tmp_path / "c.json")], f"lr must be > 0 and at most 1 (an AdamW step moves "
                                                                   f"a weight by about lr), got {shown}"),
             (["train.py", "--config", str(tmp_path / "d.json")], f"weight_decay {shown} is beyond a float's range"),
             (["train.py", "--weight-decay", N401], "is beyond a float's range"),
             (["evaluate.py", "--model", "tiny", "--benchmarks", "arith", "--k", N401], f"--k must be >= 1 and at "
                                                                                     f"most 65536, got {shown}"),
             (["-m", "tools.study", "--n", N401, "--plot-only", "--json", str(tmp_path / "s.json")],
              f"--n must be below 2**31, got {shown}")]
    for argv, text in cases:
        refused(tmp_path, *argv, text=text)


def test_default_folders_are_one_per_run(tmp_path, monkeypatch):
    """`--lr 0.00012345671` and `--lr 0.00012345674` both named runs/tiny-lr-0.000123457 (:g), and --train-data
    data/a_b.jsonl and data/a-b.jsonl shared runs/tiny-train-data-data-a-b.jsonl."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("a_b", "a-b"):
        write(tmp_path / "data" / f"{name}.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    folder = lambda *argv: parse_train_args(list(argv)).output_dir  # noqa: E731
    assert folder("--lr", "0.00012345671") == "runs/tiny-lr-0.00012345671"
    assert folder("--lr", "0.00012345674") == "runs/tiny-lr-0.00012345674"
    assert folder("--lr", "3e-4") == "runs/tiny-lr-0.0003"  # written exactly by :g: as before
    a, b = (folder("--train-data", f"data/{n}.jsonl", "--eval-every", "0") for n in ("a_b", "a-b"))
    assert a != b and a.startswith("runs/tiny-train-data-data-a_b.jsonl-") and b.startswith(
        "runs/tiny-train-data-data-a-b.jsonl-")


# --- an option the run does not read: refused only for a value that asks for something (issue 74) ---------------

def refusal(argv, capsys) -> str:
    """train.py's command line refuses argv in one line with exit code 2: that line."""
    with pytest.raises(SystemExit) as stopped:
        parse_train_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    return err.strip()


def test_an_explicit_default_or_off_is_taken_where_its_option_is_not_read(tmp_path, capsys):
    """Each was refused as "leave it out, or turn that on", although none asks for anything the run does not do:
    scripts and config files write defaults and offs. Typed, from a JSON or a YAML config, the same run; a value that
    asks for something is still refused, and the line says which value is taken."""
    taken = {"--algo gpg --region-grad-norms off": ("region_grad_norms", "off"),
             "--algo gpg --region-grad-norms last": ("region_grad_norms", "last"),
             "--checkpoint-every 1": ("checkpoint_every", 1),
             "--no-selective-checkpointing": ("selective_checkpointing", False),
             "--no-fsdp-one-process": ("fsdp_one_process", False),
             "--max-rl --no-scale-adv-by-std": ("scale_adv_by_std", False),
             "--max-rl --scale-adv-by-std": ("scale_adv_by_std", True),
             "--algo grpo --beta1 0 --beta2 0": ("beta2", 0.0),  # CE-GPPO's terms at 0: grpo's clipped tokens
             "--algo grpo --beta1 0.5": ("beta1", 0.5),
             "--algo gspo --clip-ratio-c 0": ("clip_ratio_c", 0.0),
             "--micro-batch-tokens 512 --micro-batch-size 32": ("micro_batch_size", 32),
             "--rollout-correction none --rollout-correction-threshold 2": ("rollout_correction_threshold", 2.0)}
    for line, (name, value) in taken.items():
        assert flags.flat_flags(parse_train_args(line.split()))[name] == value, line
    config = {"algo": "gpg", "region_grad_norms": "off", "checkpoint_every": 1, "selective_checkpointing": False,
              "fsdp_one_process": False, "max_rl": True, "scale_adv_by_std": False}
    typed = parse_train_args(["--algo", "gpg", "--region-grad-norms", "off", "--checkpoint-every", "1",
                              "--no-selective-checkpointing", "--no-fsdp-one-process", "--max-rl",
                              "--no-scale-adv-by-std", "--output-dir", str(tmp_path / "run")])
    json_file = write(tmp_path / "c.json", json.dumps(config))
    yaml_file = write(tmp_path / "c.yaml", "algo: gpg\nregion_grad_norms: off\ncheckpoint_every: 1\n"
                                           "selective_checkpointing: no\nfsdp_one_process: off\nmax_rl: yes\n"
                                           "scale_adv_by_std: false\n")
    for source in (json_file, yaml_file):
        from_file = parse_train_args(["--config", source, "--output-dir", str(tmp_path / "run")])
        assert flags.flat_flags(from_file) == flags.flat_flags(typed), source
    for argv, said in (
            (["--algo", "gpg", "--region-grad-norms", "all"],
             "--region-grad-norms is read only with --precision fp32 on one process, with an algorithm that has clip "
             "regions, which this run does not use; leave it out (or give --region-grad-norms off), or turn that on"),
            (["--selective-checkpointing"], "--selective-checkpointing is read only with --gradient-checkpointing, "
             "which this run does not use; leave it out (or give --no-selective-checkpointing), or turn that on"),
            (["--fsdp-one-process"], "--fsdp-one-process is read only with --precision bf16 in one process"),
            (["--algo", "grpo", "--beta1", "0.3"], "--beta1 does not apply to grpo (only ce_gppo reads it)"),
            (["--algo", "gspo", "--clip-ratio-c", "3"], "--clip-ratio-c does not apply to gspo"),
            (["--rollout-correction", "token-tis", "--icepop-low", "0.3"], "--icepop-low is read only with "
             "--rollout-correction token-icepop, which this run does not use; leave it out, or turn that on")):
        assert said in refusal(argv, capsys), argv


def test_checkpoint_every_alone_says_what_it_is_and_names_save_every(capsys):
    """`--checkpoint-every 10` alone pointed only to --gradient-checkpointing; whoever typed it most likely meant to
    save the run every 10 steps."""
    assert refusal(["--checkpoint-every", "10"], capsys) == (
        "train.py: error: --checkpoint-every is read only with --gradient-checkpointing, which this run does not use: "
        "it recomputes the activations of every k-th decoder layer in backward, it does not save the run; to save the "
        "run every 10 steps, give --save-every 10; to recompute activations, add --gradient-checkpointing")
    assert parse_train_args(["--gradient-checkpointing", "--checkpoint-every", "10"]).checkpoint_every == 10


def test_a_resume_refuses_what_it_cannot_honour_as_a_fresh_run_does(tmp_path, capsys):
    """`--resume BF16RUN --max-steps 2 --region-grad-norms all` was taken, config.json then recorded "all", and no
    split was ever logged (a bf16 run cannot), where a fresh bf16 run refused the flag. Refused alike now, before
    torch loads, the run's folder left as it was; its default and "off" are taken, as the rule for a fresh run takes
    them, and on an fp32 run "all" is what it says."""
    bf16, fp32 = tmp_path / "bf16", tmp_path / "fp32"
    recorded_run(bf16, ["--precision", "bf16", "--max-steps", "4"], steps=[2])
    recorded_run(fp32, ["--max-steps", "4"], steps=[2])
    fresh = refusal(["--precision", "bf16", "--region-grad-norms", "all"], capsys)
    before = listing(bf16)
    line = refused(tmp_path, "train.py", "--resume", str(bf16), "--max-steps", "2", "--region-grad-norms", "all",
                   text="--region-grad-norms is read only with --precision fp32 on one process")
    assert line == fresh and listing(bf16) == before
    for value in ("last", "off"):
        resumed = parse_train_args(["--resume", str(bf16), "--max-steps", "3", "--region-grad-norms", value])
        assert (resumed.region_grad_norms, resumed.max_steps, resumed.precision) == (value, 3, "bf16")
    assert parse_train_args(["--resume", str(fp32), "--region-grad-norms", "all"]).region_grad_norms == "all"


def test_yaml_on_off_yes_and_no_are_the_words_a_text_option_expects(tmp_path, capsys):
    """`region_grad_norms: off` in a YAML config was refused as "must be a str, got False": YAML 1.1 reads a plain
    on/off/yes/no as a boolean. For a text option it is the word as written; for a switch, still the switch; for a
    number, a refusal naming the word. true and false stay booleans (YAML 1.2 and JSON read them so)."""
    config = write(tmp_path / "c.yaml", "region_grad_norms: off\ndynamic_sampling: Off\ncurves: yes\nrun_name: No\n")
    args = parse_train_args(["--config", config])
    assert (args.region_grad_norms, args.dynamic_sampling, args.curves, args.run_name) == ("off", False, True, "No")
    for text, said in (("max_steps: on\n", "max_steps must be an int, got 'on'"),
                       ("region_grad_norms: ON\n", "region_grad_norms must be one of ['all', 'last', 'off'], got 'ON'"),
                       ("region_grad_norms: false\n", "region_grad_norms must be a str, got False")):
        path = write(tmp_path / "bad.yaml", text)
        assert refusal(["--config", path], capsys) == f"train.py: error: --config {path}: {said}", text


def test_under_torchrun_rank_0_alone_prints_a_refusal(tmp_path):
    """torchrun starts each rank with the same flags: each printed the refusal (2 lines, interleaved at random). Every
    rank ends with exit code 2; rank 0 (RANK, set before anything starts) says why, once."""
    ranks = {**without_torch(tmp_path), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    said = [command(tmp_path, "train.py", "--checkpoint-every", "10", "--max-stepz", "3",
                    env={**ranks, "RANK": rank, "LOCAL_RANK": rank}) for rank in "01"]
    assert said[0][0] == 2 and said[0][1] == "" and said[0][2].count("\n") == 1, said[0]
    assert "--max-stepz -> --max-steps" in said[0][2] and said[1] == (2, "", "")
    said = [command(tmp_path, "train.py", "--checkpoint-every", "10", env={**ranks, "RANK": rank, "LOCAL_RANK": rank})
            for rank in "01"]
    assert "give --save-every 10" in said[0][2] and said[0][2].count("\n") == 1 and said[1] == (2, "", "")


# --- wording ---------------------------------------------------------------------------------------------------------

def test_the_exports_errors_are_one_line(tmp_path):
    """`python -m cegppo_utils.runfolder export $'a\\nb' OUT` printed 2 lines; a 5,000-character path, a 5,107-character
    line."""
    line = refused(tmp_path, "-m", "cegppo_utils.runfolder", "export", "a\nb", "OUT", text="a\\nb is not a checkpoint")
    assert line.startswith("runfolder.py: error: ")
    line = refused(tmp_path, "-m", "cegppo_utils.runfolder", "export", "x" * 5000, "OUT", text="(5000 characters)")
    assert len(line) < 600


def test_a_hand_edited_config_json_is_named_before_torch_loads(tmp_path):
    """After a hand edit of config.json's lr, --resume said "belongs to a run with other flags (--lr 0.0001 there,
    0.5 now); resume with the same flags" although the user typed no lr, and said it after torch loaded."""
    run = tmp_path / "run"
    args = recorded_run(run, ["--max-steps", "4", "--lr", "1e-4"], steps=[2])
    record = json.loads((run / "config.json").read_text())
    write(run / "checkpoints" / "step_000002" / "shards.json", json.dumps({"files": {}, "flags": record["flags"]}))
    record["flags"]["lr"] = 0.5
    write(run / "config.json", json.dumps(record))
    line = refused(tmp_path, "train.py", "--resume", str(run),
                   text=f"--resume {run}: its config.json holds other flags than its checkpoint {run}/checkpoints/"
                   "step_000002 was written with (--lr 0.5 in config.json, 0.0001 in step_000002); restore config.json "
                   "(edited by hand?)")
    assert "now" not in line and args.lr == 1e-4
