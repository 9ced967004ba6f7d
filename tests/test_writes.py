"""Issue 74: one way to open a file for writing (never through a link, the model cache's build lock included), a cache
that cannot take the tiny model refused in one line before any run folder is made, and evaluate.py never losing what
it sampled when its last write fails."""

import errno
import json
import os
import resource
import subprocess
import sys

import pytest
from conftest import ROOT, few_problems
from test_bad_input import run_evaluate_in_process, run_train_in_process, write

import evaluate as E
from cegppo_utils import runfolder as RF
from cegppo_utils import tiny
from cegppo_utils.data import UserError

TRAIN = ["train.py", "--max-steps", "1", "--eval-every", "0"]


def one_line_exit_2(code, err, *text):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and all(t in lines[0] for t in text), (code, err)


# --- the one way to open a file for writing -------------------------------------------------------------------------

def test_open_for_writing_empties_appends_or_keeps_a_file_and_never_follows_a_link(tmp_path):
    path = write(tmp_path / "log.txt", "old\n")
    with RF.open_for_writing(str(path), "log", "a") as f:
        f.write("more\n")
    with RF.open_for_writing(str(path), "log", "r+") as f:
        assert f.read() == "old\nmore\n"
    with RF.open_for_writing(str(path), "log") as f:
        f.write("new\n")
    assert open(path).read() == "new\n"
    target = write(tmp_path / "precious.txt", "keep me\n")
    os.symlink(target, tmp_path / "link")
    os.link(target, tmp_path / "hard")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for name, says in (("link", "is a symbolic link; refusing to follow it"),
                       ("hard", "is a file with 2 hard links; refusing to write it"),
                       ("fifo", "is not a regular file"), ("folder", "is a folder, not a regular file")):
        for mode in ("w", "a", "r+b"):
            with pytest.raises(UserError, match=f"^log: {tmp_path}/{name} {says}"):
                RF.open_for_writing(str(tmp_path / name), "log", mode)
    assert open(target).read() == "keep me\n"


# --- the tiny model's cache -----------------------------------------------------------------------------------------

def test_the_model_build_lock_is_never_written_through_a_link(tmp_path, capsys, monkeypatch):
    """A link (or a hard link) at .cache/tiny-qwen2-<hash>.lock, the model not built: train.py truncated the file it
    points to (open(lock, "w")) and went on to build. Now: one line, exit 2, the file untouched, no run folder; the
    same from the cache itself (evaluate.py and the tools build through it)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tiny, "DEFAULT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    lock = tiny.model_folder("arith") + ".lock"
    target = write(tmp_path / "precious.txt", "keep me\n")
    run = tmp_path / "run"
    os.symlink(target, lock)
    code, err = run_train_in_process([*TRAIN, "--output-dir", str(run)], capsys)
    one_line_exit_2(code, err, f"tiny model: its build lock: {lock} is a symbolic link; refusing to follow it")
    with pytest.raises(UserError, match="is a symbolic link; refusing to follow it"):
        tiny.ensure_tiny_model(log=lambda *a: None)
    os.remove(lock)
    os.link(target, lock)
    code, err = run_train_in_process([*TRAIN, "--output-dir", str(run)], capsys)
    one_line_exit_2(code, err, f"{lock} is a file with 2 hard links; refusing to write it")
    assert open(target).read() == "keep me\n" and os.stat(target).st_nlink == 2 and not os.path.lexists(run)


def test_a_cache_that_cannot_take_the_build_is_one_line_before_any_run_folder(tmp_path, capsys, monkeypatch):
    """The model not built, and its cache cannot be written (root writes through file modes, so: a file where the
    cache's parent folder should be, a folder where its lock should be): train.py stopped with a traceback and exit 1,
    leaving a new run folder with its .lock and marker. Now one line, exit 2, and no run folder; evaluate.py alike."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write(tmp_path / "a-file", "")
    monkeypatch.setattr(tiny, "DEFAULT_CACHE", str(tmp_path / "a-file" / "cache"))
    run = tmp_path / "runs" / "run"
    code, err = run_train_in_process([*TRAIN, "--output-dir", str(run)], capsys)
    one_line_exit_2(code, err, f"tiny model: its cache {tmp_path}/a-file/cache cannot be created ({tmp_path}/a-file is "
                    "a file); the model is not built yet: make the cache writable, or build it once as a user who can")
    assert not os.path.lexists(tmp_path / "runs")
    monkeypatch.setattr(tiny, "DEFAULT_CACHE", str(tmp_path / "cache"))
    os.makedirs(tiny.model_folder("merge") + ".lock")  # a stale lock nobody can open for writing
    code, err = run_train_in_process([*TRAIN, "--model", "tiny:merge", "--output-dir", str(run)], capsys)
    one_line_exit_2(code, err, f"merge model: its build lock: {tiny.model_folder('merge')}.lock is a folder")
    assert not os.path.lexists(tmp_path / "runs")
    bench, out = few_problems(tmp_path, 2), tmp_path / "results" / "r.json"
    code, err = run_evaluate_in_process(["evaluate.py", "--model", "tiny:merge", "--benchmarks", str(bench),
                                         "--output", str(out)], capsys)
    assert code == 2 and "merge model: its build lock:" in err and "Traceback" not in err, err
    assert not os.path.lexists(tmp_path / "results")


# --- evaluate.py keeps what it sampled ------------------------------------------------------------------------------

def evaluate_argv(bench, out, *more):
    return ["--model", "tiny", "--benchmarks", f"{bench},arith", "--limit", "2", "--k", "2", "--max-tokens", "24",
            "--sampler", "hf", "--responses", "--output", str(out), *more]


def without_times(results):
    return {**results, "benchmarks": {b: {k: v for k, v in r.items() if k != "seconds"}
                                      for b, r in results["benchmarks"].items()}}


@pytest.mark.slow
def test_a_final_write_that_fails_after_sampling_keeps_every_result(tmp_path, tiny_model_path, monkeypatch, capsys):
    """The rename onto --output fails once everything is sampled (an immutable file, a folder made read-only): one
    line names the partial file, which holds what --output would have held (a clean run of the same command), exit
    1; each benchmark's scores were printed as it finished."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bench, out = few_problems(tmp_path, 2), tmp_path / "r.json"
    real_replace = os.replace

    def refused_onto_output(src, dst, **kwargs):
        if os.fspath(dst) == str(out):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", refused_onto_output)
    with pytest.raises(SystemExit) as stopped:
        E.main(evaluate_argv(bench, out))
    kept = f"{out}.partial"
    assert stopped.value.code == f"evaluate.py: cannot write {out} (Operation not permitted); every result is kept " \
                                 f"in {kept} (the same JSON)"
    printed = capsys.readouterr().out
    assert f"{bench}: avg@2 " in printed and "arith: avg@2 " in printed
    monkeypatch.setattr(os, "replace", real_replace)
    clean = E.main(evaluate_argv(bench, tmp_path / "clean.json"))
    assert without_times(json.load(open(kept))) == without_times(json.load(open(tmp_path / "clean.json")))
    assert without_times(json.load(open(kept))) == without_times(clean) and not out.exists()
    assert all(len(p["responses"]) == 2 for b in clean["benchmarks"].values() for p in b["problems"])
    with pytest.raises(UserError, match=f"{kept} holds the results of an evaluation that stopped before renaming it"):
        E.check_output(str(out), overwrite=True)  # a rerun never overwrites what was kept


@pytest.mark.slow
def test_a_file_size_limit_stops_with_one_line_and_the_scores_printed(tmp_path, tiny_model_path):
    """`ulimit -f 1` (here 512 bytes, less than any results file): no results file can be written at all. The run
    ended in an OSError traceback, no score printed; now each benchmark's scores are printed before its results are
    written, and the stop is one line, exit 1, leaving no temporary file behind."""
    bench, out = few_problems(tmp_path, 4), tmp_path / "r.json"
    argv = ["--model", "tiny", "--benchmarks", str(bench), "--k", "2", "--max-tokens", "24", "--sampler", "hf",
            "--responses", "--output", str(out)]
    done = subprocess.run([sys.executable, "evaluate.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512)))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"evaluate.py: cannot write {out}.partial (File too large): " \
        f"stopped after {bench}, whose scores are above; no benchmark's results were written"
    assert f"{bench}: avg@2 " in done.stdout
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(bench)]


def test_overwrite_tries_the_real_replace_before_anything_is_sampled(tmp_path, capsys):
    """--overwrite onto a file a rename cannot replace (chattr +i): the early check passed, and the rename failed after
    sampling. Now refused in one line, exit 2, before the model loads; the file untouched."""
    out = write(tmp_path / "r.json", "{}")
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        code, err = run_evaluate_in_process(["evaluate.py", "--model", str(tmp_path / "no-model"), "--benchmarks",
                                             "arith", "--output", str(out), "--overwrite"], capsys)
        assert code == 2 and f"--output {out} is immutable (chattr +i): it cannot be replaced" in err, err
        assert "no such model folder" not in err  # found before the model
    finally:
        subprocess.run(["chattr", "-i", str(out)], capture_output=True)
    assert open(out).read() == "{}" and sorted(os.listdir(tmp_path)) == ["r.json"]
    E.check_output(str(out), overwrite=True)  # replaceable again: passes, and leaves nothing behind
    assert sorted(os.listdir(tmp_path)) == ["r.json"]
