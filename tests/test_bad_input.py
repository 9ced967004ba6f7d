"""Bad input through the real entry points: every case ends in exit code 2 and one line naming the culprit (the
flag, the file and row), never a traceback; and before the model loads, so it is fast."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT


def write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return str(path)


def cases(tmp):
    """-> (train.py cases to run in-process, cases to run as processes), each (name, argv, expected text in the message); argv starts with the script."""
    good = write(tmp / "good.jsonl", '{"problem": "Compute 1 + 2 + 3.", "answer": 6}\n' * 3)
    malformed = write(tmp / "malformed.jsonl", "".join(json.dumps({"problem": f"p{i}", "answer": i}) + "\n" for i in range(4))
                      + '{"problem": "p5", "answer": 5\n')
    no_answer = write(tmp / "no_answer.jsonl", '{"problem": "a", "answer": 1}\n{"problem": "b", "answer": 2}\n{"problem": "c"}\n')
    list_answer = write(tmp / "list_answer.json", json.dumps([{"problem": "a", "answer": [1, 2]}]))
    binary = write(tmp / "binary.json", bytes(range(256)) * 4, "wb")
    not_json = write(tmp / "notes.json", "problem: 1 + 1\nanswer: 2\n")
    empty = write(tmp / "empty.jsonl", "")
    not_parquet = write(tmp / "fake.parquet", "not parquet")
    csv = write(tmp / "train.csv", "problem,answer\n1+1,2\n")
    bench_bad = write(tmp / "bench.jsonl", '{"problem": "1 + 1?", "answer": "2"}\n{"problem": "2 + 2?", "answer": "4"} trailing\n')
    a_file = write(tmp / "a_file", "x")
    (tmp / "data").mkdir()  # a folder that is not a model
    t = ["train.py", "--output-dir", str(tmp / "run"), "--max-steps", "1"]
    e = ["evaluate.py", "--model", "tiny", "--benchmarks", good, "--output", str(tmp / "out.json")]
    in_process = [  # train.py through train.run in this process: flags, data files, model, output folder
        ("lr negative", t + ["--lr", "-1e-4"], "--lr must be > 0 and at most 1 (an AdamW step moves a weight by about lr), got -0.0001"),
        ("lr inf", t + ["--lr", "inf"], "--lr must be > 0 and at most 1"),
        ("lr nan", t + ["--lr", "nan"], "--lr must be > 0 and at most 1 (an AdamW step moves a weight by about lr), got nan"),
        ("lr too large", t + ["--lr", "1e39"], "--lr must be > 0 and at most 1"),
        ("lr not a number", t + ["--lr", "fast"], "--lr: invalid float value: 'fast'"),
        ("beta2 nan", t + ["--beta2", "nan"], "--beta2 must be >= 0 and finite"),
        ("beta1 negative", t + ["--beta1", "-0.5"], "--beta1 must be >= 0"),
        ("eps-low 1.5", t + ["--eps-low", "1.5"], "--eps-low must be in (0, 1], got 1.5"),
        ("eps-high inf", t + ["--eps-high", "inf"], "--eps-high must be > 0 and finite"),
        ("entropy-coef negative", t + ["--entropy-coef", "-1"], "--entropy-coef must be >= 0"),
        ("clip-ratio-c too small", t + ["--clip-ratio-c", "1.1"], "--clip-ratio-c must exceed 1 + eps_high"),
        ("unknown algo", t + ["--algo", "ppo"], "--algo must be one of"),
        ("unknown preset", t + ["--preset", "r2"], "unknown preset 'r2'"),
        ("unknown flag", t + ["--learning-rate", "1"], "unrecognized arguments: --learning-rate 1"),
        ("top-p 0", t + ["--top-p", "0"], "--top-p must be in (0, 1]"),
        ("n 1", t + ["--n", "1"], "--n must be >= 2"),
        ("micro-batch", t + ["--micro-batch-size", "7"], "--micro-batch-size (7) must divide"),
        ("rollout correction", t + ["--rollout-correction", "tis"], "--rollout-correction must be one of"),
        ("eval without eval data", t + ["--train-data", good], "--eval-every 25 needs --eval-data"),
        ("dynamic clip on cispo", t + ["--algo", "cispo", "--dynamic-clip", "id"], "--dynamic-clip does not apply to cispo"),
        # train.py: data files
        ("missing train file", t + ["--train-data", str(tmp / "missing.jsonl"), "--eval-every", "0"], "missing.jsonl: no such file"),
        ("missing relative path", t + ["--train-data", "tests/missing", "--eval-every", "0"], "tests/missing: no such file"),
        ("not a hub id", t + ["--train-data", "nothing-here", "--eval-every", "0"], "nothing-here: no such file, not a hub dataset id"),
        ("empty jsonl", t + ["--train-data", empty, "--eval-every", "0"], "empty.jsonl: no rows"),
        ("malformed line 5", t + ["--train-data", malformed, "--eval-every", "0"], "malformed.jsonl: line 5 is not valid JSON"),
        ("binary json", t + ["--train-data", binary, "--eval-every", "0"], "binary.json: not a UTF-8 text file"),
        ("not json", t + ["--train-data", not_json, "--eval-every", "0"], "notes.json: not valid JSON (line 1 column 1"),
        ("not parquet", t + ["--train-data", not_parquet, "--eval-every", "0"], "fake.parquet: not a readable parquet file"),
        ("csv", t + ["--train-data", csv, "--eval-every", "0"], "unsupported file type '.csv'"),
        ("row without answer", t + ["--train-data", no_answer, "--eval-every", "0"], "no_answer.jsonl: line 3 has no answer"),
        ("list answer", t + ["--train-data", list_answer, "--eval-every", "0"], "list_answer.json: row 0: the answer must be a string or a number"),
        ("eval data missing", t + ["--eval-data", str(tmp / "gone.jsonl")], "gone.jsonl: no such file"),
        # train.py: model, output folder, prompt length
        ("missing model path", t + ["--model", str(tmp / "no-model")], "--model " + str(tmp / "no-model") + ": no such model folder"),
        ("folder without config", t + ["--model", str(tmp / "data")], "the folder has no config.json"),
        ("output under a file", ["train.py", "--output-dir", os.path.join(a_file, "run")], "cannot write there"),
        ("prompt too long", t + ["--max-prompt-len", "5"], "--max-prompt-len 5: the longest prompt"),
    ]
    return in_process, [
        # train.py through the process: the command line itself
        ("lr nan", t + ["--lr", "nan"], "--lr must be > 0 and at most 1 (an AdamW step moves a weight by about lr), got nan"),
        ("lr not a number", t + ["--lr", "fast"], "--lr: invalid float value: 'fast'"),
        ("unknown flag", t + ["--learning-rate", "1"], "unrecognized arguments: --learning-rate 1"),
        # evaluate.py
        ("limit -1", e + ["--limit", "-1"], "--limit must be >= 1, got -1"),
        ("limit 0", e + ["--limit", "0"], "--limit must be >= 1, got 0"),
        ("max-tokens 0", e + ["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        ("temperature -1", e + ["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        ("k 0", e + ["--k", "0"], "--k must be >= 1, got 0"),
        ("unknown benchmark", e[:3] + ["--benchmarks", "aime26"], "unknown benchmark(s) ['aime26']"),
        ("benchmark file bad row", e[:3] + ["--benchmarks", bench_bad], "bench.jsonl: line 2 is not valid JSON"),
        ("benchmark file missing", e[:3] + ["--benchmarks", str(tmp / "gone.jsonl")], "gone.jsonl: no such file"),
        ("output in a missing folder", e[:5] + ["--output", str(tmp / "nowhere" / "out.json")], "--output"),
        ("output under a file", e[:5] + ["--output", os.path.join(a_file, "out.json")], "cannot write in"),
    ]


def run(argv):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return done.returncode, done.stderr


def run_train_in_process(argv, capsys):
    """train.run, the function behind `python train.py`: (exit code, stderr); an exception escaping it is a failure."""
    import traceback
    import train
    try:
        train.run(argv[1:])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception:
        return "raised", traceback.format_exc()
    return code, capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, tiny_model_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    in_process, others = cases(tmp_path)
    results = [run_train_in_process(argv, capsys) for _, argv, _ in in_process]  # saves ~2 s of imports per case
    with ThreadPoolExecutor(max_workers=3) as pool:  # ~2 s of imports each; 2 cores
        results += list(pool.map(lambda case: run(case[1]), others))
    wrong = []
    for (name, argv, expected), (code, stderr) in zip(in_process + others, results, strict=True):
        lines = [line for line in stderr.splitlines() if line.strip()]
        error_lines = [line for line in lines if "error" in line]
        if code != 2 or "Traceback" in stderr or len(error_lines) != 1 or expected not in error_lines[0]:
            wrong.append(f"{name}: exit {code}, want 2 and one line with {expected!r}; stderr:\n{stderr[-1500:]}")
    assert not wrong, "\n\n".join(wrong)
    assert len(in_process) >= 35 and len(others) >= 10


def test_errors_come_before_the_model_loads(tmp_path, tiny_model_path):
    """A data error is found before any model weights are read: seconds, not the model's load time."""
    import time
    good = write(tmp_path / "bad.jsonl", '{"problem": "a"}\n')
    start = time.monotonic()
    code, stderr = run(["train.py", "--train-data", good, "--eval-every", "0", "--output-dir", str(tmp_path / "r"),
                        "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"])  # a hub model: never reached
    assert code == 2 and "bad.jsonl: line 1 has no answer" in stderr
    assert not os.path.exists(tmp_path / "r" / "metrics.jsonl")
    assert time.monotonic() - start < 60
