"""evaluate.py: the estimators against brute force, the benchmark loaders, and an end-to-end run on the tiny model."""

import itertools
import json
import os
import subprocess
import sys

import pytest

import evaluate as E
from conftest import ROOT

SHARED = os.path.join(os.path.dirname(ROOT), "shared", "benchmarks")
needs_shared = pytest.mark.skipif(not os.path.isdir(SHARED), reason="../shared/benchmarks is absent")


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_equals_brute_force_over_subsets(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert E.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        E.pass_at_k(3, 4, 1)


def test_benchmark_metrics_avg_pass_and_majority():
    correct = [[True, False, False, False], [True, True, True, False], [False] * 4]
    votes = [["3", "5", "5", None], ["7", "7", "7", "8"], [None] * 4]
    m = E.benchmark_metrics(correct, votes)
    assert m["avg@k"] == pytest.approx((0.25 + 0.75 + 0) / 3)
    assert m["pass@1"] == pytest.approx(m["avg@k"])
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["pass@2"] == pytest.approx((E.pass_at_k(4, 1, 2) + E.pass_at_k(4, 3, 2)) / 3)
    assert m["maj@k"] == pytest.approx(1 / 3)  # problem 1 votes "5" (wrong), problem 2 "7" (right), problem 3 none


def test_majority_vote_ties():
    assert E.majority_correct(["1", "2", "1", "2"], [True, False, True, False]) == 0.5  # two-way tie, one right
    assert E.majority_correct(["1", "2", "3"], [False, False, True]) == pytest.approx(1 / 3)
    assert E.majority_correct(["4", None, None, None], [True, False, False, False]) == 1.0  # non-votes don't count
    assert E.majority_correct([None, None], [False, False]) == 0.0


def test_vote_key_falls_back_to_the_last_number_as_math_verify_does():
    assert E.vote_key("so \\boxed{12} and then 13") == "12"
    assert E.vote_key("0+0=0, 0+1=1}") == "1"  # a format RL found on the tiny task: no \\boxed{}, still scored correct
    assert E.vote_key("it is -3/4.") == "-3/4"
    assert E.vote_key("no answer") is None


def test_last_boxed():
    assert E.last_boxed("so \\boxed{1} or rather \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert E.last_boxed("\\boxed {x = 3 }") == "x=3"
    assert E.last_boxed("no answer") is None
    assert E.last_boxed("\\boxed{\\frac{1}{2}") is None  # unbalanced


@needs_shared
@pytest.mark.parametrize("name, count", [("aime24", 30), ("aime25", 30), ("hmmt25", 30), ("math500", 500), ("amc23", 40)])
def test_loaders_read_the_shared_benchmark_files(name, count):
    import reward
    problems = E.load_benchmark(name, data_dir=SHARED)
    assert len(problems) == count
    assert all(p["question"].strip() and str(p["answer"]).strip() for p in problems)
    answers = [p["answer"] for p in problems]
    scores = reward.score_batch([f"The answer is \\boxed{{{reward.normalize_answer(a)}}}." for a in answers], answers)
    assert scores == [reward.CORRECT_REWARD] * count


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark 'aime26'"):
        E.load_benchmark("aime26")
    with pytest.raises(FileNotFoundError, match="math500.jsonl not found"):
        E.load_benchmark("math500", data_dir=str(tmp_path))
    (tmp_path / "math500.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "2+2?"}) + "\n")
    with pytest.raises(ValueError, match=r"math500.jsonl: row 1 lacks"):
        E.load_benchmark("math500", data_dir=str(tmp_path))


def test_end_to_end_on_the_tiny_model(tmp_path, tiny_model_path):
    out = tmp_path / "results.json"
    run = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny", "--benchmarks", "arith", "--k", "4",
                          "--limit", "40", "--output", str(out), "--responses"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    arith = results["benchmarks"]["arith"]
    assert len(arith["problems"]) == 40 and arith["k"] == 4
    verdicts = [p["correct"] for p in arith["problems"]]
    assert all(len(v) == 4 for v in verdicts)
    assert arith["avg@k"] == pytest.approx(sum(map(sum, verdicts)) / 160)
    assert arith["pass@4"] == pytest.approx(sum(any(v) for v in verdicts) / 40)
    assert 0 < arith["avg@k"] < 1
    assert results["settings"]["temperature"] == 0.6 and results["settings"]["top_p"] == 0.95
    assert "| arith |" in run.stdout
    import reward  # the stored verdicts are reward.py's verdicts on the stored responses
    first = arith["problems"][0]
    assert [s == reward.CORRECT_REWARD for s in reward.score_batch(first["responses"], [first["answer"]] * 4)] == first["correct"]
