"""Issue 65's sweep: every entry point (train.py, evaluate.py, python -m tools.study, study_collapse, study_active,
mechanism, configs, bench, python -m cegppo_utils.plot, python -m cegppo_utils.runfolder export) against each class of
bad input: numbers of any size, a FIFO at a file the command reads, damaged rows and records, output paths that cannot
be written (a name too long, a file in the way, a trailing slash, a FIFO at the name), a folder that holds no run, and
(issue 74) a flag that a resume cannot honour, a YAML word where a number goes, an attention bench does not know.
Each case is a subprocess with torch and transformers unimportable (test_bad_input.without_torch) that must end within
seconds in one line on stderr and exit code 2, naming what was wrong: before any expensive work, and before torch."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT
from test_bad_input import fake_checkpoint, without_torch, write
from test_runfolder import recorded_run

from cegppo_utils import runfolder as RF

N401 = "1" * 401
HUGE = "11111111111111111111... (an integer of 401 digits)"


def runs(tmp):
    """Run folders as train.py leaves them (marker, config.json, rows, a checkpoint's name), each broken in one way;
    study roots holding one; a folder of unknown origin; a checkpoint. {name: path}."""
    made = {name: tmp / "runs" / name for name in ("ok", "fifo-metrics", "fifo-config", "fifo-lock", "non-utf8",
                                                   "list-row", "no-step", "torn-middle", "resumes-5")}
    made.update({"study-fifo": tmp / "study-fifo" / "tiny" / "grpo-s0",
                 "study-no-step": tmp / "study-no-step" / "tiny" / "grpo-s0"})
    for folder in made.values():
        recorded_run(folder, ["--max-steps", "4"], steps=[2])
    made["bf16"] = tmp / "runs" / "bf16"
    recorded_run(made["bf16"], ["--max-steps", "4", "--precision", "bf16"], steps=[2])
    for name, file in (("fifo-metrics", "metrics.jsonl"), ("study-fifo", "metrics.jsonl"),
                       ("fifo-config", "config.json"), ("fifo-lock", ".lock")):
        if os.path.exists(made[name] / file):
            os.remove(made[name] / file)
        os.mkfifo(made[name] / file)
    for name, row in (("non-utf8", b"\xff\xfe"), ("list-row", b"[1, 2]"), ("no-step", b'{"epoch": 1}'),
                      ("study-no-step", b'{"epoch": 1}'), ("torn-middle", b'{"step": 2, "rew')):
        write(made[name] / "metrics.jsonl", b'{"step": 1}\n' + row + b'\n{"step": 3}\n', "wb")
    record = json.loads((made["ok"] / "config.json").read_text())
    write(made["resumes-5"] / "config.json", json.dumps({**record, "resumes": 5}))
    made["foreign"] = tmp / "study-foreign" / "tiny" / "grpo-s0"
    (made["foreign"] / "checkpoints").mkdir(parents=True)
    write(made["foreign"] / "metrics.jsonl", '{"epoch":1,"loss":0.5}\n')
    made["checkpoint"] = fake_checkpoint(tmp / "loose" / "step_000001")
    for name in ("study-fifo", "study-no-step", "study-foreign"):
        made[name] = tmp / name
    return made


def cases(tmp):
    """(entry, argv, the text its one line must hold)."""
    r = {k: str(v) for k, v in runs(tmp).items()}
    t = str(tmp)
    os.mkfifo(tmp / "fifo.jsonl")
    os.mkfifo(tmp / "fifo.json")
    write(tmp / "FILE", "mine")
    (tmp / "D").mkdir()
    write(tmp / "huge.json", '{"lr": ' + N401 + "}")
    write(tmp / "bench.jsonl", '{"problem": "1 + 1?", "answer": 2}\n')
    write(tmp / "on.yaml", "max_steps: on\n")
    from test_study_collapse import good
    study = good()
    next(iter(next(iter(study.values())).values()))["steps"][2]["acc_mean"] = None
    write(tmp / "null.json", json.dumps(study))
    long, fifo, file = "n" * 300, f"{t}/fifo.jsonl", f"{t}/FILE"
    tr = ["train.py", "--max-steps", "2", "--output-dir", f"{t}/new"]
    ev = ["evaluate.py", "--model", "tiny", "--benchmarks", f"{t}/bench.jsonl", "--output", f"{t}/r.json"]
    st = ["-m", "tools.study", "--configs", "grpo", "--seeds", "0", "--steps", "4", "--figures", f"{t}/figs",
          "--json", f"{t}/s.json"]
    co = ["-m", "tools.study_collapse", "--figures", f"{t}/pages"]
    me = ["-m", "tools.mechanism", "--output", f"{t}/m.json"]
    return [
        # train.py
        ("train", tr + ["--n", N401], f"--n must be below 2**31, got {HUGE}"),
        ("train", tr + ["--lr", N401], "is beyond a float's range"),
        ("train", tr + ["--config", f"{t}/huge.json"], f"lr must be > 0 and at most 1 (an AdamW step moves a weight "
                                                       f"by about lr), got {HUGE}"),
        ("train", tr + ["--config", f"{t}/fifo.json"], "not a regular file"),
        ("train", tr + ["--train-data", fifo], "fifo.jsonl: a FIFO (named pipe), not a regular file"),
        ("train", tr + ["--eval-data", fifo, "--eval-every", "1"], "fifo.jsonl: a FIFO (named pipe)"),
        ("train", ["train.py", "--resume", r["foreign"]], "holds files of its own (checkpoints, metrics.jsonl) and no "
                                                          "run"),
        ("train", ["train.py", "--output-dir", r["foreign"]], "holds files of its own"),
        ("train", ["train.py", "--resume", r["fifo-metrics"]], "metrics.jsonl is not a regular file (a FIFO)"),
        ("train", ["train.py", "--resume", r["fifo-config"]], "config.json is not a regular file (a FIFO)"),
        ("train", ["train.py", "--resume", r["fifo-lock"]], ".lock is not a regular file (a FIFO)"),
        ("train", ["train.py", "--resume", r["non-utf8"]], "metrics.jsonl: line 2 is not UTF-8 text"),
        ("train", ["train.py", "--resume", r["list-row"]], "metrics.jsonl: line 2 is not a JSON object (got list)"),
        ("train", ["train.py", "--resume", r["no-step"]], "metrics.jsonl: line 2 has no step"),
        ("train", ["train.py", "--resume", r["torn-middle"]], "metrics.jsonl: line 2 is not valid JSON"),
        ("train", ["train.py", "--resume", r["resumes-5"]], "config.json: its resumes is 5"),
        ("train", ["train.py", "--resume", ""], "--resume is given an empty folder name"),
        ("train", ["train.py", "--resume", r["bf16"], "--max-steps", "2", "--region-grad-norms", "all"],
         "--region-grad-norms is read only with --precision fp32 on one process"),
        ("train", tr + ["--checkpoint-every", "10"], "give --save-every 10; to recompute activations, add "
                                                     "--gradient-checkpointing"),
        ("train", tr + ["--config", f"{t}/on.yaml"], "on.yaml: max_steps must be an int, got 'on'"),
        ("train", tr[:-1] + [f"{file}/run"], f"cannot be created ({file} is a file)"),
        ("train", tr[:-1] + [f"{t}/D/NEW1/NEW2/{long}"], "has a name of 300 bytes"),
        ("train", tr[:-1] + [fifo], "is a FIFO, not a folder"),
        # evaluate.py
        ("evaluate", ev + ["--k", N401], f"--k must be >= 1 and at most 65536, got {HUGE}"),
        ("evaluate", ev + ["--temperature", N401], "is beyond a float's range"),
        ("evaluate", ev + ["--seed", N401], f"--seed must be in [0, 2**63), got {HUGE}"),
        ("evaluate", ev[:3] + ["--benchmarks", fifo], "fifo.jsonl: a FIFO (named pipe)"),
        ("evaluate", ["evaluate.py", "--seed-of", r["fifo-metrics"], "2"], "metrics.jsonl is a FIFO, not a regular"),
        ("evaluate", ["evaluate.py", "--seed-of", r["fifo-config"], "2"], "config.json is a FIFO, not a regular"),
        ("evaluate", ["evaluate.py", "--seed-of", r["list-row"], "2"], "line 2 is not a JSON object (got list)"),
        ("evaluate", ["evaluate.py", "--seed-of", r["non-utf8"], "2"], "line 2 is not UTF-8 text"),
        ("evaluate", ["evaluate.py", "--seed-of", r["resumes-5"], "2"], "its resumes is 5, not a list of objects"),
        ("evaluate", ["evaluate.py", "--seed-of", r["foreign"], "2"], "not a run folder of this project"),
        ("evaluate", ["evaluate.py", "--seed-of", "", "2"], "--seed-of is empty"),
        ("evaluate", ev[:-1] + [f"{t}/newdir/"], "names a folder; name a file"),
        ("evaluate", ev[:-1] + [f"{file}/r.json"], f"its folder {file} is a file, not a folder"),
        ("evaluate", ev[:-1] + [f"{t}/{long}.json"], "has a name of 305 bytes"),
        ("evaluate", ev[:-1] + [fifo], "is a FIFO, not a regular file"),
        # python -m tools.study
        ("study", st + ["--plot-only", "--n", N401], f"--n must be below 2**31, got {HUGE}"),
        ("study", st + ["--steps", N401], f"{HUGE} must be below 2**31"),
        ("study", st + ["--plot-only", "--root", r["study-fifo"]], "metrics.jsonl is a FIFO, not a regular file"),
        ("study", st + ["--root", r["study-fifo"]], "metrics.jsonl is not a regular file (a FIFO)"),
        ("study", st + ["--plot-only", "--root", r["study-no-step"]], "metrics.jsonl: line 2 has no step"),
        ("study", st + ["--root", r["study-foreign"]], "holds files of its own (checkpoints, metrics.jsonl)"),
        ("study", st[:-2] + ["--json", f"{t}/fifo.json", "--plot-only"], "fifo.json is a FIFO"),
        ("study", st[:-2] + ["--json", f"{t}/sub/", "--plot-only"], "names a folder; name a file"),
        ("study", st[:-4] + ["--json", f"{t}/s.json", "--figures", f"{file}/figs", "--plot-only"],
         f"cannot be created ({file} is a file)"),
        # python -m tools.study_collapse, tools.study_active
        ("study_collapse", co + ["--json", f"{t}/fifo.json"], "fifo.json is a FIFO, not a regular file"),
        ("study_collapse", co + ["--json", f"{t}/null.json"], "its acc_mean is null"),
        ("study_collapse", ["-m", "tools.study_collapse", "--json", f"{t}/null.json", "--figures", f"{file}/p"],
         f"cannot be created ({file} is a file)"),
        ("study_active", ["-m", "tools.study_active", "--json", f"{t}/fifo.json"], "fifo.json is a FIFO"),
        ("study_active", ["-m", "tools.study_active", "--json", f"{t}/null.json", "--figures", f"{t}/D/{long}"],
         "has a name of 300 bytes"),
        # python -m tools.mechanism, tools.configs
        ("mechanism", me + ["--batches", N401], f"{HUGE} must be below 2**31"),
        ("mechanism", me + ["--lr", N401], "is beyond a float's range"),
        ("mechanism", me[:-1] + [f"{t}/newdir/"], "names a folder; name a file"),
        ("mechanism", me[:-1] + [f"{file}/m.json"], f"its folder {file} is a file, not a folder"),
        ("mechanism", me[:-1] + [fifo], "is a FIFO, not a regular file"),
        ("configs", ["-m", "tools.configs", "grpo", "nope"], "unknown configuration(s) ['nope']"),
        # python -m tools.bench
        ("bench", ["-m", "tools.bench", "--only", "update_throughput", "--update-attn", "bogus"],
         "argument --update-attn: invalid choice: 'bogus'"),
        ("bench", ["-m", "tools.bench", "--update-attn="], "argument --update-attn: an empty value"),
        # python -m cegppo_utils.plot
        ("plot", ["-m", "cegppo_utils.plot", r["fifo-metrics"]], "is a FIFO, not a regular file"),
        ("plot", ["-m", "cegppo_utils.plot", r["no-step"]], "metrics.jsonl: line 2 has no step"),
        ("plot", ["-m", "cegppo_utils.plot", r["list-row"]], "metrics.jsonl: line 2 is not a JSON object"),
        ("plot", ["-m", "cegppo_utils.plot", r["non-utf8"]], "metrics.jsonl: line 2 is not UTF-8 text"),
        ("plot", ["-m", "cegppo_utils.plot", r["ok"], "--out", f"{file}/plots"], f"cannot be created ({file} is a "
                                                                                  "file)"),
        ("plot", ["-m", "cegppo_utils.plot", r["ok"], "--window", N401], f"{HUGE} must be below 2**31"),
        ("plot", ["-m", "cegppo_utils.plot", r["foreign"]], "metrics.jsonl: line 1 has no step"),
        # python -m cegppo_utils.runfolder export
        ("export", ["-m", "cegppo_utils.runfolder", "export", "a\nb", f"{t}/out"], "a\\nb is not a checkpoint"),
        ("export", ["-m", "cegppo_utils.runfolder", "export", fifo, f"{t}/out"], "fifo.jsonl is not a checkpoint"),
        ("export", ["-m", "cegppo_utils.runfolder", "export", r["ok"], f"{t}/out"], "is not a checkpoint folder"),
        ("export", ["-m", "cegppo_utils.runfolder", "export", r["checkpoint"], f"{t}/{long}"],
         "has a name of 300 bytes"),
        ("export", ["-m", "cegppo_utils.runfolder", "export", r["checkpoint"], f"{file}/out"],
         f"its folder {file} is not a folder"),
    ]


def contents(folder) -> dict:
    """Every path under folder with what it is: a regular file's bytes, else its kind."""
    found = {}
    for where, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(where, name)
            found[os.path.relpath(path, folder)] = (open(path, "rb").read() if os.path.isfile(path) and not
                                                    os.path.islink(path) and not name.startswith("fifo") else
                                                    "folder" if os.path.isdir(path) else "other")
    return found


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    env = without_torch(tmp)
    found = cases(tmp)
    before = contents(tmp)

    def one(case):
        try:
            done = subprocess.run([sys.executable, *case[1]], cwd=ROOT, capture_output=True, text=True, timeout=30,
                                  env=env)
        except subprocess.TimeoutExpired:
            return "timed out (blocked?)", "", ""
        return done.returncode, done.stdout, done.stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, found))
    return tmp, found, results, before


def test_every_entry_point_ends_bad_input_in_one_line_and_exit_2_before_torch(sweep):
    tmp, found, results, _ = sweep
    wrong = []
    for (entry, argv, text), (code, out, err) in zip(found, results, strict=True):
        lines = err.strip().splitlines()
        if code != 2 or len(lines) != 1 or text not in lines[0] or "was imported" in err:
            wrong.append(f"{entry} {' '.join(a[:60] for a in argv[-3:])}: exit {code}, want 2 and one line with "
                         f"{text!r}; stderr: {err[-600:]}")
    assert not wrong, "\n".join(wrong)
    assert {entry for entry, _, _ in found} == {"train", "evaluate", "study", "study_collapse", "study_active",
                                                "mechanism", "configs", "bench", "plot", "export"}
    assert len(found) >= 60, len(found)


def test_the_sweep_left_what_it_found_as_it_was(sweep):
    """Nothing refused wrote anything: no output, no folder made, no run adopted (the foreign folder's rows are
    where they were), no lock, marker or probe left behind."""
    tmp, _, _, before = sweep
    assert contents(tmp) == before
    assert not RF.holds_run(str(tmp / "study-foreign" / "tiny" / "grpo-s0"))
