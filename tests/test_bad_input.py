"""Bad input through the real entry points: every case ends in exit code 2 and one line naming the culprit (the
flag, the file and row), never a traceback; and before the model loads, so it is fast."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT

from cegppo_utils.data import UserError


def write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return str(path)


def cases(tmp):
    """-> (train.py cases to run in-process, cases to run as processes), each (name, argv, expected text in the
    message); argv starts with the script."""
    good = write(tmp / "good.jsonl", '{"problem": "Compute 1 + 2 + 3.", "answer": 6}\n' * 3)
    malformed = write(tmp / "malformed.jsonl",
                      "".join(json.dumps({"problem": f"p{i}", "answer": i}) + "\n"
                              for i in range(4))
                      + '{"problem": "p5", "answer": 5\n')
    no_answer = write(tmp / "no_answer.jsonl", '{"problem": "a", "answer": 1}\n'
                                               '{"problem": "b", "answer": 2}\n{"problem": "c"}\n')
    list_answer = write(tmp / "list_answer.json", json.dumps([{"problem": "a", "answer": [1, 2]}]))
    binary = write(tmp / "binary.json", bytes(range(256)) * 4, "wb")
    not_json = write(tmp / "notes.json", "problem: 1 + 1\nanswer: 2\n")
    empty = write(tmp / "empty.jsonl", "")
    not_parquet = write(tmp / "fake.parquet", "not parquet")
    csv = write(tmp / "train.csv", "problem,answer\n1+1,2\n")
    bench_bad = write(tmp / "bench.jsonl", '{"problem": "1 + 1?", "answer": "2"}\n'
                                           '{"problem": "2 + 2?", "answer": "4"} trailing\n')
    a_file = write(tmp / "a_file", "x")
    (tmp / "data").mkdir()  # a folder that is not a model
    t = ["train.py", "--output-dir", str(tmp / "run"), "--max-steps", "1"]
    e = ["evaluate.py", "--model", "tiny", "--benchmarks", good, "--output", str(tmp / "out.json")]
    in_process = [  # train.py through train.run in this process: flags, data files, model, output folder
        ("lr negative", t + ["--lr", "-1e-4"],
         "--lr must be > 0 and at most 1 (an AdamW step moves a weight by about lr), got -0.0001"),
        ("lr inf", t + ["--lr", "inf"], "--lr must be > 0 and at most 1"),
        ("lr nan", t + ["--lr", "nan"],
         "--lr must be > 0 and at most 1 (an AdamW step moves a weight by about lr), got nan"),
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
        ("dynamic clip on cispo", t + ["--algo", "cispo", "--dynamic-clip", "id"],
         "--dynamic-clip does not apply to cispo"),
        # train.py: data files
        ("missing train file", t + ["--train-data", str(tmp / "missing.jsonl"), "--eval-every", "0"],
         "missing.jsonl: no such file"),
        ("missing relative path", t + ["--train-data", "tests/missing", "--eval-every", "0"],
         "tests/missing: no such file"),
        ("not a hub id", t + ["--train-data", "nothing-here", "--eval-every", "0"],
         "nothing-here: no such file, not a hub dataset id"),
        ("empty jsonl", t + ["--train-data", empty, "--eval-every", "0"], "empty.jsonl: no rows"),
        ("malformed line 5", t + ["--train-data", malformed, "--eval-every", "0"],
         "malformed.jsonl: line 5 is not valid JSON"),
        ("binary json", t + ["--train-data", binary, "--eval-every", "0"], "binary.json: not a UTF-8 text file"),
        ("not json", t + ["--train-data", not_json, "--eval-every", "0"],
         "notes.json: line 1 is not valid JSON (column 1"),
        ("not parquet", t + ["--train-data", not_parquet, "--eval-every", "0"],
         "fake.parquet: not a readable parquet file"),
        ("csv", t + ["--train-data", csv, "--eval-every", "0"], "unsupported file type '.csv'"),
        ("row without answer", t + ["--train-data", no_answer, "--eval-every", "0"],
         "no_answer.jsonl: line 3 has no answer"),
        ("list answer", t + ["--train-data", list_answer, "--eval-every", "0"],
         "list_answer.json: row 0: the answer must be a string or a number"),
        ("eval data missing", t + ["--eval-data", str(tmp / "gone.jsonl")], "gone.jsonl: no such file"),
        # train.py: model, output folder, prompt length
        ("missing model path", t + ["--model", str(tmp / "no-model")],
         "--model " + str(tmp / "no-model") + ": no such model folder"),
        ("folder without config", t + ["--model", str(tmp / "data")], "the folder has no config.json"),
        ("output under a file", ["train.py", "--output-dir", os.path.join(a_file, "run")],
         "cannot be created (" + a_file + " is a file)"),
        ("prompt too long", t + ["--max-prompt-len", "5"], "--max-prompt-len 5: the longest prompt"),
    ]
    return in_process, [
        # train.py through the process: the command line itself
        ("lr nan", t + ["--lr", "nan"],
         "--lr must be > 0 and at most 1 (an AdamW step moves a weight by about lr), got nan"),
        ("lr not a number", t + ["--lr", "fast"], "--lr: invalid float value: 'fast'"),
        ("unknown flag", t + ["--learning-rate", "1"], "unrecognized arguments: --learning-rate 1"),
        # evaluate.py
        ("limit -1", e + ["--limit", "-1"], "--limit must be >= 1 and below 2**31, got -1"),
        ("limit 0", e + ["--limit", "0"], "--limit must be >= 1 and below 2**31, got 0"),
        ("max-tokens 0", e + ["--max-tokens", "0"], "--max-tokens must be >= 1 and below 2**31, got 0"),
        ("temperature -1", e + ["--temperature", "-1"], "--temperature must be 0 (greedy) or in [0.01, 100], got -1.0"),
        ("k 0", e + ["--k", "0"], "--k must be >= 1 and at most 65536, got 0"),
        ("unknown benchmark", e[:3] + ["--benchmarks", "aime26"], "unknown benchmark(s) ['aime26']"),
        ("benchmark file bad row", e[:3] + ["--benchmarks", bench_bad], "bench.jsonl: line 2 is not valid JSON"),
        ("benchmark file missing", e[:3] + ["--benchmarks", str(tmp / "gone.jsonl")], "gone.jsonl: no such file"),
        ("output name too long", e[:5] + ["--output", str(tmp / "nowhere" / ("o" * 300 + ".json"))],
         "has a name of 305 bytes"),
        ("output under a file", e[:5] + ["--output", os.path.join(a_file, "out.json")], "is a file, not a folder"),
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- the adversarial table: malformed structure inside valid JSON, files that are not files, rows too
# large to read, answers that can never be verified, run folders with parts missing or planted ------------------

def jsonl(tmp, name, *rows):
    """A .jsonl file of rows given as JSON text (so that invalid JSON can be written too)."""
    return write(tmp / name, "".join(r + "\n" for r in rows))


def fake_checkpoint(folder, state=None):
    """A checkpoint folder with every part (.metadata, a shard, config.json, trainer_state.pt), built without a model:
    the cases below break one part each."""
    import torch
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(folder), no_dist=True)
    write(folder / "config.json", json.dumps({"model_type": "qwen2"}))
    torch.save(state if state is not None else
               {"step": 1, "rng": {}, "scheduler": {}, "data": {}, "loop": {}, "flags": {}},
               folder / "trainer_state.pt")
    return folder


class Planted:
    """A pickle that runs code when loaded: it writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def planted_run(tmp, name, part, content):
    """A run folder whose one checkpoint has `part` replaced by `content` (bytes), or removed (None)."""
    import pickle
    run = tmp / name
    ckpt = fake_checkpoint(run / "checkpoints" / "step_000001")
    write(run / "metrics.jsonl", '{"step": 1}\n')
    write(run / ".ce-gppo-run", "{}")  # a run's folder (runfolder.holds_run): its checkpoint is what is damaged
    if content is None:
        os.remove(ckpt / part)
    else:
        write(ckpt / part, pickle.dumps(content) if not isinstance(content, bytes) else content, "wb")
    return str(run)


def adversarial_cases(tmp):
    """(name, argv, expected text): train.py cases run in-process, each bad in one way."""
    q = '"problem": "Compute 1 + 1."'
    files = {
        "fifo": None, "deep": jsonl(tmp, "deep.jsonl", '{' + q + ', "answer": ' + "[" * 50000 + "]" * 50000 + "}"),
        "deep array": write(tmp / "deep.json", "[" * 50000 + "]" * 50000),
        "message not an object": jsonl(tmp, "msg.jsonl",
                                       '{"prompt": [{"role": "user", "content": "hi"}, "and"], "answer": 1}'),
        "message list of strings": jsonl(tmp, "msgs.jsonl", '{"prompt": ["hi"], "answer": 1}'),
        "message without role": jsonl(tmp, "norole.jsonl", '{"prompt": [{"content": "hi"}], "answer": 1}'),
        "message content null": jsonl(tmp, "nullc.jsonl",
                                      '{"prompt": [{"role": "user", "content": null}], "answer": 1}'),
        "message content a list": jsonl(tmp, "listc.jsonl",
                                        '{"prompt": [{"role": "user", "content": ["hi"]}], "answer": 1}'),
        "unknown role": jsonl(tmp, "role.jsonl", '{"prompt": [{"role": "robot", "content": "hi"}], "answer": 1}'),
        "last message not the user's": jsonl(tmp, "last.jsonl",
                                             '{"prompt": [{"role": "user", "content": "hi"}, '
                                             '{"role": "assistant", "content": "2"}], "answer": 2}'),
        "huge integer answer": jsonl(tmp, "hugeint.jsonl", '{' + q + ', "answer": ' + "9" * 5000 + '}'),
        "huge negative integer": jsonl(tmp, "hugeneg.jsonl", '{' + q + ', "answer": -' + "9" * 4400 + '}'),
        "NaN answer": jsonl(tmp, "nan.jsonl", '{' + q + ', "answer": NaN}'),
        "Infinity answer": jsonl(tmp, "inf.jsonl", '{' + q + ', "answer": -Infinity}'),
        "answer 1e400": jsonl(tmp, "big.jsonl", '{' + q + ', "answer": 1e400}'),
        "answer 1e-400": jsonl(tmp, "small.jsonl", '{' + q + ', "answer": 1e-400}'),
        "id 1e999": jsonl(tmp, "bigid.jsonl", '{' + q + ', "answer": 2, "id": 1e999}'),
        "surrogate in question": jsonl(tmp, "surq.jsonl", '{"problem": "x \\ud800 y", "answer": 1}'),
        "surrogate in answer": jsonl(tmp, "sura.jsonl", '{' + q + ', "answer": "\\udfff"}'),
        "surrogate in message": jsonl(tmp, "surm.jsonl",
                                      '{"prompt": [{"role": "user", "content": "\\ud83d"}], "answer": 1}'),
        "answer 20000 characters": jsonl(tmp, "longa.jsonl", '{' + q + ', "answer": "' + "7" * 20000 + '"}'),
        "answer an object": jsonl(tmp, "obja.jsonl", '{' + q + ', "answer": {"value": 2}}'),
        "answer true": jsonl(tmp, "boola.jsonl", '{' + q + ', "answer": true}'),
        "answer blank": jsonl(tmp, "blanka.jsonl", '{' + q + ', "answer": "   "}'),
        "ground truth null": jsonl(tmp, "gtnull.jsonl", '{' + q + ', "reward_model": {"ground_truth": null}}'),
        "question blank": jsonl(tmp, "blankq.jsonl", '{"problem": "  ", "answer": 1}'),
        "row a string": jsonl(tmp, "str.jsonl", '{' + q + ', "answer": 2}', '"just text"'),
        "row an array": jsonl(tmp, "arr.jsonl", '[1, 2]'),
        "json number": write(tmp / "num.json", "42"),
        "array missing comma": write(tmp / "comma.json", '[{' + q + ', "answer": 2}\n {' + q + ', "answer": 2}]'),
        "array unterminated": write(tmp / "open.json", '[{' + q + ', "answer": 2},'),
        "array trailing data": write(tmp / "trail.json", '[{' + q + ', "answer": 2}] []'),
        "row of nulls in array": write(tmp / "nulls.json", '[null]'),
        "NUL bytes": write(tmp / "nul.jsonl", '{' + q + ', "answer": 2}\n\x00\x00\n'),
        "UTF-16 file": write(tmp / "utf16.jsonl", ('{' + q + ', "answer": 2}\n').encode("utf-16"), "wb"),
        "Latin-1 file": write(tmp / "latin1.jsonl", '{"problem": "caf\xe9", "answer": 2}\n'.encode("latin-1"), "wb"),
        "50 MB line": write(tmp / "line50.jsonl", '{"problem": "' + "x" * 50_000_000 + '", "answer": 1}\n'),
        "9 MB row in an array": write(tmp / "row9.json", '[{"problem": "' + "x" * 9 * 2**20 + '", "answer": 1}]'),
    }
    os.mkfifo(tmp / "fifo.jsonl")
    files["fifo"] = str(tmp / "fifo.jsonl")
    os.mkfifo(tmp / "fifo.parquet")
    files["parquet FIFO"] = str(tmp / "fifo.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": [1.5, float("nan")]}), tmp / "nan.parquet")
    files["parquet NaN answer"] = str(tmp / "nan.parquet")
    pq.write_table(pa.table({"problem": ["a"], "answer": [[1, 2]]}), tmp / "list.parquet")
    files["parquet list answer"] = str(tmp / "list.parquet")
    os.symlink(os.devnull, tmp / "null.jsonl")
    os.symlink(tmp / "loop.jsonl", tmp / "loop.jsonl")
    (tmp / "folder.jsonl").mkdir()
    # a scratch output folder by default (a case's own --output-dir comes later and wins): the repository's runs/tiny
    # may hold the quick start's run, which would be refused before the input under test is read
    t = ["train.py", "--output-dir", str(tmp / "runs" / "default"), "--max-steps", "1", "--eval-every", "0"]
    expect = {
        "fifo": "fifo.jsonl: a FIFO (named pipe), not a regular file",
        "parquet FIFO": "fifo.parquet: a FIFO (named pipe), not a regular file",
        "parquet NaN answer": "nan.parquet: row 1: the answer is nan, which no response can ever be verified against",
        "parquet list answer": "list.parquet: row 0: the answer must be a string or a number, got list",
        "deep": "deep.jsonl: line 1 is nested too deeply",
        "deep array": "deep.json: row 0 (line 1) is nested too deeply",
        "message not an object": "msg.jsonl: line 1: `prompt` message 1 is not an object (got str)",
        "message list of strings": "msgs.jsonl: line 1 has no question",
        "message without role": "norole.jsonl: line 1: `prompt` messages need a role and non-empty content (message 0)",
        "message content null": "nullc.jsonl: line 1: `prompt` messages need a role and non-empty content",
        "message content a list": "listc.jsonl: line 1: `prompt` messages need a role and non-empty content",
        "unknown role": "role.jsonl: line 1: `prompt` message 0 has role 'robot'",
        "last message not the user's": "last.jsonl: line 1: the last `prompt` message must be the user's question",
        "huge integer answer": "hugeint.jsonl: line 1: an integer with 5000 digits (more than 4300)",
        "huge negative integer": "hugeneg.jsonl: line 1: an integer with 4400 digits",
        "NaN answer": "nan.jsonl: line 1: NaN is not a number an answer can be checked against",
        "Infinity answer": "inf.jsonl: line 1: -Infinity is not a number",
        "answer 1e400": "big.jsonl: line 1: the number 1e400 is beyond a float's range",
        "answer 1e-400": "small.jsonl: line 1: the number 1e-400 is too small for a float",
        "id 1e999": "bigid.jsonl: line 1: the number 1e999 is beyond a float's range",
        "surrogate in question": "surq.jsonl: line 1: the question holds an unpaired surrogate",
        "surrogate in answer": "sura.jsonl: line 1: the answer holds an unpaired surrogate",
        "surrogate in message": "surm.jsonl: line 1: `prompt` message 0 holds an unpaired surrogate",
        "answer 20000 characters": "longa.jsonl: line 1: the answer has 20000 characters",
        "answer an object": "obja.jsonl: line 1: the answer must be a string or a number, got dict",
        "answer true": "boola.jsonl: line 1: the answer must be a string or a number, got bool",
        "answer blank": "blanka.jsonl: line 1 has no answer",
        "ground truth null": "gtnull.jsonl: line 1 has no answer",
        "question blank": "blankq.jsonl: line 1 has no question",
        "row a string": "str.jsonl: line 2 is not a JSON object (got str)",
        "row an array": "arr.jsonl: line 1 is not a JSON object (got list)",
        "json number": "num.json: line 1 is not a JSON object (got int)",
        "array missing comma": "comma.json: not valid JSON (line 2 column 2: expected ',' or ']' after row 0",
        "array unterminated": "open.json: row 1 (line 1) is not valid JSON",
        "array trailing data": "trail.json: not valid JSON (line 1 column",
        "row of nulls in array": "nulls.json: row 0 is not a JSON object (got NoneType)",
        "NUL bytes": "nul.jsonl: line 2 is not valid JSON",
        "UTF-16 file": "utf16.jsonl: not a UTF-8 text file",
        "Latin-1 file": "latin1.jsonl: not a UTF-8 text file",
        "50 MB line": "line50.jsonl: line 1 is longer than 8 MiB",
        "9 MB row in an array": "row9.json: row 0 (line 1) is longer than 8 MiB",
    }
    cases = [(name, t + ["--output-dir", str(tmp / "runs" / name.replace(" ", "-")), "--train-data", path],
              expect[name])
             for name, path in files.items()]
    cases += [
        ("device", t + ["--train-data", str(tmp / "null.jsonl")], "null.jsonl: a device, not a regular file"),
        ("symlink loop", t + ["--train-data", str(tmp / "loop.jsonl")],
         "loop.jsonl: cannot read it (Too many levels of symbolic links)"),
        ("folder named .jsonl", t + ["--train-data", str(tmp / "folder.jsonl")], "folder.jsonl is a folder"),
        ("eval data a FIFO", t[:-2] + ["--eval-every", "1", "--eval-data", files["fifo"],
                                       "--output-dir", str(tmp / "runs" / "ef")],
         "fifo.jsonl: a FIFO (named pipe), not a regular file"),
        ("eval data deep", t[:-2] + ["--eval-every", "1", "--eval-data", files["deep"],
                                     "--output-dir", str(tmp / "runs" / "ed")],
         "deep.jsonl: line 1 is nested too deeply"),
        ("output dir is a file", t + ["--output-dir", files["NaN answer"]], "is a file, not a folder"),
    ]
    # --resume on a run folder whose newest checkpoint lacks a part, holds a torn one, or a planted pickle
    marker = tmp / "PLANTED-CODE-RAN"
    cases += [
        (name, t + ["--resume", "--output-dir", planted_run(tmp, name.replace(" ", "-"), part, content)], text)
        for name, part, content, text in [
            ("checkpoint without trainer_state.pt", "trainer_state.pt", None,
             "has no trainer_state.pt (an incomplete checkpoint); move it aside to start again from step 0"),
            ("trainer_state.pt torn", "trainer_state.pt", b"PK\x03\x04 torn", "trainer_state.pt is not readable"),
            ("trainer_state.pt a planted pickle", "trainer_state.pt", Planted(marker),
             "trainer_state.pt holds objects other than tensors and plain values; refusing to load it"),
            ("trainer_state.pt empty", "trainer_state.pt", b"", "trainer_state.pt is not readable"),
            ("checkpoint without .metadata", ".metadata", None, "has no .metadata (an incomplete checkpoint)"),
            (".metadata a planted pickle", ".metadata", Planted(marker),
             ".metadata names posix.system, which a checkpoint's metadata never holds"),
            (".metadata torn", ".metadata", b"\x80\x04\x95", ".metadata is not readable"),
            ("checkpoint without shards", "__0_0.distcp", None, "holds no .distcp shards"),
            ("checkpoint config.json broken", "config.json", b'{"model_type": ',
             "config.json is not readable (not valid JSON"),
            ("checkpoint config.json a list", "config.json", b"[]", "config.json is not a JSON object"),
        ]
    ]
    # flags beyond what torch and the samplers take, lengths beyond the model's context (512 for the tiny model)
    cases += [(name, t + ["--output-dir", str(tmp / "runs" / "flags")] + extra, text) for name, extra, text in [
        ("seed 2**70", ["--seed", str(2**70)], "--seed must be in [0, 2**31)"),
        ("seed negative", ["--seed=-1"], "--seed must be in [0, 2**31)"),
        ("temperature 1e-300", ["--temperature", "1e-300"], "--temperature must be in [0.01, 100]"),
        ("temperature 1e30", ["--temperature", "1e30"], "--temperature must be in [0.01, 100]"),
        ("beta1 1e300", ["--beta1", "1e300"], "--beta1 must be at most 100"),
        ("beta2 1e39", ["--beta2", "1e39"], "--beta2 must be at most 100"),
        ("gen-prompts 2**70", ["--gen-prompts", str(2**70)], "--gen-prompts must be below 2**31"),
        ("top-k 2**32", ["--top-k", str(2**32)], "--top-k must be below 2**31"),
        ("max-steps 2**40", ["--max-steps", str(2**40)], "--max-steps must be below 2**31"),
        ("min above max response", ["--min-response-len", "100"],
         "--min-response-len (100) cannot exceed --max-response-len (48)"),
        ("response beyond context", ["--max-response-len", "10000"],
         "--max-prompt-len 64 + --max-response-len 10000 exceed the model's context of 512 tokens"),
    ]]
    # model folders with parts missing
    model = tmp / "model-no-weights"
    model.mkdir()
    write(model / "config.json", json.dumps({"model_type": "qwen2"}))
    torn = tmp / "model-torn-config"
    torn.mkdir()
    write(torn / "config.json", '{"model_type": ')
    checkpoint = fake_checkpoint(tmp / "exported" / "step_000001")
    cases += [
        ("model without weights", t + ["--output-dir", str(tmp / "runs" / "m1"), "--model", str(model)],
         "has config.json but no weights"),
        ("model config torn", t + ["--output-dir", str(tmp / "runs" / "m2"), "--model", str(torn)],
         "config.json is not readable (not valid JSON"),
        ("checkpoint given as model", t + ["--output-dir", str(tmp / "runs" / "m3"), "--model", str(checkpoint)],
         "its shards do not hold the weights its config.json describes"),
        ("output folder in use", t + ["--output-dir", str(tmp / "busy")], "busy is in use by another run (pid"),
    ]
    run = tmp / "state-list"
    fake_checkpoint(run / "checkpoints" / "step_000003", state=[1, 2, 3])
    write(run / ".ce-gppo-run", "{}")
    cases.append(("trainer state not a dict", t + ["--resume", "--output-dir", str(run)],
                  "is not a trainer state written by train.py"))
    for name, text in (("run config.json broken", "{"), ("run config.json a string", '"flags"')):
        folder = tmp / name.replace(" ", "-")
        folder.mkdir()
        write(folder / "config.json", text)
        cases.append((name, t + ["--resume", "--output-dir", str(folder)],
                      f"config.json is damaged ({'not valid JSON' if text == '{' else 'not a JSON object'}"))
    return cases, marker


def run_evaluate_in_process(argv, capsys):
    """evaluate.main, as `python evaluate.py` runs it: (exit code, stderr)."""
    import traceback

    import evaluate
    try:
        evaluate.main(argv[1:])
        return 0, capsys.readouterr().err
    except UserError as e:
        return 2, capsys.readouterr().err + f"evaluate.py: error: {e}\n"
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), capsys.readouterr().err
    except Exception:
        return "raised", traceback.format_exc()


def evaluate_cases(tmp):
    good = write(tmp / "good.jsonl", '{"problem": "Compute 1 + 2 + 3.", "answer": 6}\n' * 3)
    e = ["evaluate.py", "--model", "tiny", "--benchmarks", good, "--output", str(tmp / "out.json")]
    (tmp / "results").mkdir()
    model = tmp / "model-no-weights"
    return [
        ("output is a folder", e[:5] + ["--output", str(tmp / "results")],
         "--output " + str(tmp / "results") + " is a folder; name a file"),
        ("temperature 1e-300", e + ["--temperature", "1e-300"],
         "--temperature must be 0 (greedy) or in [0.01, 100], got 1e-300"),
        ("temperature 1e30", e + ["--temperature", "1e30"], "--temperature must be 0 (greedy) or in [0.01, 100]"),
        ("seed 2**70", e + ["--seed", str(2**70)], "--seed must be in [0, 2**63)"),
        ("k 10**9", e + ["--k", str(10**9)], "--k must be >= 1 and at most 65536"),
        ("max-tokens 2**40", e + ["--max-tokens", str(2**40)], "--max-tokens must be >= 1 and below 2**31"),
        ("benchmark a FIFO", e[:3] + ["--benchmarks", str(tmp / "fifo.jsonl"), "--output", str(tmp / "o.json")],
         "fifo.jsonl: a FIFO"),
        ("benchmark deep", e[:3] + ["--benchmarks", str(tmp / "deep.jsonl"), "--output", str(tmp / "o.json")],
         "deep.jsonl: line 1 is nested too deeply"),
        ("model without weights", ["evaluate.py", "--model", str(model)] + e[3:], "has config.json but no weights"),
    ]


@pytest.mark.slow
def test_adversarial_input_is_one_line_and_exit_code_2(tmp_path, tiny_model_path, capsys, monkeypatch):
    """The issue-23 table: each case fails in its own way, before any model loads, in one line naming the culprit."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from cegppo_utils import runfolder
    cases, marker = adversarial_cases(tmp_path)
    said = []
    busy = runfolder.lock_output_dir(str(tmp_path / "busy"), log=said.append)  # another run holds this folder
    cases = [(name, argv, expected, run_train_in_process) for name, argv, expected in cases]
    cases += [(name, argv, expected, run_evaluate_in_process) for name, argv, expected in evaluate_cases(tmp_path)]
    wrong = []
    for name, argv, expected, run_it in cases:
        code, stderr = run_it(argv, capsys)
        lines = [line for line in stderr.splitlines() if "error" in line]
        if code != 2 or "Traceback" in stderr or len(lines) != 1 or expected not in lines[0]:
            wrong.append(f"{name}: exit {code}, want 2 and one line with {expected!r}; stderr:\n{stderr[-1500:]}")
    busy.release()
    assert not wrong, "\n\n".join(wrong)
    assert not marker.exists(), "a planted pickle ran its code"
    assert len(cases) >= 80


def test_a_dead_runs_lock_is_reported_and_taken_over(tmp_path, capsys):
    """A .lock whose holder is gone (the kernel dropped its flock) does not block the folder; train.py says so."""
    folder = tmp_path / "run"
    folder.mkdir()
    write(folder / ".lock", json.dumps({"pid": 999999, "host": "elsewhere", "started": "2026-01-01T00:00:00"}))
    bad = write(tmp_path / "bad.jsonl", '{"problem": "a"}\n')
    import train
    with pytest.raises(SystemExit) as stopped:
        train.run(["--output-dir", str(folder), "--train-data", bad, "--eval-every", "0"])
    captured = capsys.readouterr()
    assert stopped.value.code == 2 and "bad.jsonl: line 1 has no answer" in captured.err
    assert ("found the lock of a run that ended without releasing it (pid 999999 on elsewhere, started "
            "2026-01-01") in captured.out
    assert (folder / ".lock").read_text() == ""  # released on the way out


MEASURE = """
import resource
from cegppo_utils import data
data.task_names()  # imports what load_rows imports, before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    data.load_rows({path!r})
except SystemExit as e:
    print(e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024, "MiB")
"""


@pytest.mark.slow
def test_a_50_mb_line_is_refused_with_bounded_memory_and_a_fifo_without_blocking(tmp_path):
    """Rows are read one at a time, each at most data.MAX_ROW_CHARS: a 50 MB line costs tens of MiB, not the line
    times Python's overhead. A FIFO (which blocked train.py and evaluate.py in open() or read()) is refused at once."""
    path = write(tmp_path / "line.jsonl", '{"problem": "' + "x" * 50_000_000 + '", "answer": 1}\n')
    done = subprocess.run([sys.executable, "-c", MEASURE.format(path=path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    message, grew = done.stdout.strip().splitlines()
    assert "line.jsonl: line 1 is longer than 8 MiB" in message
    assert int(grew.split()[0]) < 150, grew
    os.mkfifo(tmp_path / "fifo.jsonl")
    code, stderr = run(["evaluate.py", "--model", "tiny", "--benchmarks", str(tmp_path / "fifo.jsonl"), "--output",
                        str(tmp_path / "out.json")])
    assert code == 2 and "fifo.jsonl: a FIFO (named pipe), not a regular file" in stderr


def test_the_held_out_budget_is_capped_to_the_samplers_context():
    """--preset r1-distill-1.5b --eval-data aime24 would ask 32,768 tokens of a sampler holding 4,096 + 16,384: eval_acc
    samples at most --max-response-len, said once at start."""
    import train
    from cegppo_utils import flags
    args = flags.parse_args(["--preset", "r1-distill-1.5b", "--eval-data", "aime24", "--eval-every", "50"], "")
    said = []
    settings = train.eval_settings(args, said.append)
    assert settings["max_tokens"] == 16384 and settings["k"] == 32
    assert "its budget of 32768 tokens exceeds the sampler's context (4096 + 16384)" in said[0]
    args = flags.parse_args(["--eval-every", "5"], "")  # the tiny task's own budget fits: nothing said
    said.clear()
    assert train.eval_settings(args, said.append)["max_tokens"] <= args.max_response_len and said == []


THREADS = """
import os
from cegppo_utils import data
import pyarrow.parquet  # noqa: F401 (its own threads, if any, start with the import: the baseline)
before = len(os.listdir("/proc/self/task"))
for path in {paths!r}:
    try:
        [data.to_row(record, where, i) for i, (where, record) in enumerate(data.read_records(path))]
    except SystemExit as e:
        print(e)
print(before, len(os.listdir("/proc/self/task")))
"""


def test_a_refused_parquet_file_leaves_no_reader_thread_running(tmp_path):
    """Issue 48: a refused parquet file ended in SIGABRT after its error line in 4 of 30 runs. pyarrow read the file
    object on its own I/O threads, which call back into Python; one still running at interpreter exit aborts the
    process. Read in memory on the calling thread, no thread outlives the read (counted in /proc/self/task)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": [1.5, float("nan")]}), tmp_path / "nan.parquet")
    paths = [write(tmp_path / "fake.parquet", "not parquet"), str(tmp_path / "nan.parquet"),
             write(tmp_path / "torn.parquet", open(tmp_path / "nan.parquet", "rb").read()[:-30], "wb")]
    done = subprocess.run([sys.executable, "-c", THREADS.format(paths=paths)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    *errors, counts = done.stdout.strip().splitlines()
    before, after = map(int, counts.split())
    assert after == before, f"{after - before} thread(s) left running by the parquet reader"
    assert [e.split(": ", 1)[1][:40] for e in errors] == ["not a readable parquet file (it does not",
                                                          "row 1: the answer is nan, which no respo",
                                                          "not a readable parquet file (it does not"], errors


# --- answered before torch loads: flag errors, --help, config files ---------------------------------------

def without_torch(tmp):
    """An environment in which importing torch or transformers fails: a folder first on the path holding stand-ins
    that raise. A command that answers from it never imported them."""
    for name in ("torch", "transformers"):
        os.makedirs(tmp / "stand-ins" / name, exist_ok=True)
        write(tmp / "stand-ins" / name / "__init__.py", f"raise ImportError('{name} was imported')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp / "stand-ins"), ROOT])}


def test_flag_errors_and_help_are_answered_before_torch_loads(tmp_path):
    """A mistyped flag, a bad value, --help and a broken config file, through train.py, evaluate.py and the tools that
    read train.py's flags, with torch and transformers unimportable: each answers (exit 2, or 0 for --help) from
    the flags alone. Their time on an idle core is in docs/training.md."""
    env = without_torch(tmp_path)
    indented = write(tmp_path / "indented.yaml", "lr: 1e-4\n  max_steps: 3\n")
    commands = [
        (["train.py", "--max-stepz", "3"], 2, "did you mean: --max-stepz -> --max-steps?"),
        (["train.py", "--preset", "merge", "--lr", "-1"], 2, "--lr must be > 0 and at most 1"),
        (["train.py", "--algo", "bandpo", "--band-divergence", "js"], 2, "--band-divergence must be one of"),
        (["train.py", "--config", indented], 2, "line 2, column 12: mapping values are not allowed here"),
        (["train.py", "--preset", "sums", "--help"], 0, "preset in effect: sums"),
        (["evaluate.py", "--model", "tiny", "--k", "0"], 2, "--k must be >= 1"),
        (["evaluate.py", "--help"], 0, "avg@k, pass@k and maj@k"),
        (["-m", "tools.mechanism", "--output", "x.json", "--gen-promts", "4"], 2, "--gen-promts -> --gen-prompts"),
        (["-m", "tools.mechanism", "--help"], 0, "The entropy mechanism, measured paired"),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda c: subprocess.run([sys.executable, *c[0]], cwd=ROOT, capture_output=True, text=True,
                                                      timeout=120, env=env), commands))
    for (argv, code, text), result in zip(commands, done, strict=True):
        said = result.stdout + result.stderr
        assert result.returncode == code and text in said and "was imported" not in said, (argv, said[-2000:])


def test_the_rollout_corrections_named_for_the_flags_are_correction_pys():
    from cegppo_utils import correction, flags
    assert flags.CORRECTION_MODES == correction.MODES and flags.ICEPOP_BAND == correction.ICEPOP_BAND


def test_a_yaml_error_names_its_line(tmp_path, capsys):
    """A YAML mistake is one line naming where it is: the line and column found, and where the block it broke
    started when that is another line (an indentation error shows up below its cause)."""
    from conftest import parse_train_args
    for text, where in (("lr: 1e-4\n  max_steps: 3\n", "line 2, column 12: mapping values are not allowed here"),
                        ("lr: 1e-4\nmax_steps:\n  - 3\n - 4\n", "line 4, column 2: expected <block end>, but found "
                         "'<block sequence start>', while parsing a block mapping that starts on line 1"),
                        ("lr: [1e-4, 2\n", "line 2, column 1: expected ',' or ']', but got '<stream end>', while "
                                           "parsing a flow sequence that starts on line 1")):
        path = write(tmp_path / "bad.yaml", text)
        with pytest.raises(SystemExit) as stopped:
            parse_train_args(["--config", path])
        err = capsys.readouterr().err.strip()
        assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
        assert err == f"train.py: error: --config {path}: not valid YAML ({where})", err


def test_evaluate_help_says_each_default_once_and_results_go_to_runs_eval(tmp_path, monkeypatch, capsys):
    import evaluate
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--help"])
    shown = capsys.readouterr().out
    options = [o for o in shown.split("\n  --")[1:]]
    assert len(options) >= 15 and all(o.count("(default") <= 1 for o in options), shown
    assert "(default: None)" not in shown and "(default: 0.6)" in shown and "official validation: 0.6" not in shown
    monkeypatch.chdir(tmp_path)
    args = evaluate.parse_args(["--model", "runs/my run/final", "--benchmarks", "aime24,amc23"])
    assert args.output == os.path.join("runs", "eval", "runs-my-run-final-aime24-amc23.json")
    evaluate.check_output(args.output, default=args.output_is_default)  # passes, and makes nothing yet: a run refused
    assert not os.path.exists(tmp_path / "runs")                           # after it leaves no folder behind
    evaluate.write_json(args.output, {"benchmarks": {}})  # the first results make runs/eval; not the repository root
    assert os.path.isfile(tmp_path / args.output) and not os.path.exists(tmp_path / "results.json")
    (tmp_path / "a-file").write_text("")  # a parent that cannot hold the folder is refused before anything runs
    with pytest.raises(evaluate.UserError, match="cannot be created .*a-file is a file"):
        evaluate.check_output(os.path.join("a-file", "eval", "x.json"), default=True)
    assert evaluate.parse_args(["--model", "tiny", "--benchmarks", "arith"]).output == "runs/eval/tiny-arith.json"
