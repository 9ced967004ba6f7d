"""evaluate.py: the estimators against brute force, the benchmark loaders, and an end-to-end run on the tiny model."""

import itertools
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

import evaluate as E
from cegppo_utils import data

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
    verdicts = [{"3": True, "5": False}, {"7": True, "8": False}, {}]  # each string judged on its own
    m = E.benchmark_metrics(correct, votes, verdicts)
    assert m["avg@k"] == pytest.approx((0.25 + 0.75 + 0) / 3)
    assert m["pass@1"] == pytest.approx(m["avg@k"])
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["pass@2"] == pytest.approx((E.pass_at_k(4, 1, 2) + E.pass_at_k(4, 3, 2)) / 3)
    assert m["maj@k"] == pytest.approx(1 / 3)  # problem 1 votes "5" (wrong), problem 2 "7" (right), problem 3 none


def test_majority_vote_ties():
    assert E.majority_correct(["1", "2", "1", "2"], {"1": True, "2": False}) == 0.5  # two-way tie, one right
    assert E.majority_correct(["1", "2", "3"], {"1": False, "2": False, "3": True}) == pytest.approx(1 / 3)
    assert E.majority_correct(["4", None, None, None], {"4": True}) == 1.0  # non-votes don't count
    assert E.majority_correct([None, None], {}) == 0.0


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


@pytest.mark.slow
@needs_shared
@pytest.mark.parametrize("name, count", [("aime24", 30), ("aime25", 30), ("hmmt25", 30), ("math500", 500), ("amc23", 40)])
def test_loaders_read_the_shared_benchmark_files(name, count):
    import reward
    problems = data.load_benchmark(name, data_dir=SHARED)
    assert len(problems) == count
    assert all(data.question_of(p).strip() and str(p["answer"]).strip() for p in problems)
    answers = [p["answer"] for p in problems]
    scores = reward.score_batch([f"The answer is \\boxed{{{reward.normalize_answer(a)}}}." for a in answers], answers)
    assert scores == [reward.CORRECT_REWARD] * count


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(SystemExit, match="unknown benchmark 'aime26'"):
        data.load_benchmark("aime26")
    with pytest.raises(SystemExit, match="math500.jsonl not found"):
        data.load_benchmark("math500", data_dir=str(tmp_path))
    (tmp_path / "math500.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "2+2?"}) + "\n")
    with pytest.raises(SystemExit, match=r"math500.jsonl: line 2 lacks"):
        data.load_benchmark("math500", data_dir=str(tmp_path))


@pytest.mark.slow
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


def test_majority_verdict_depends_on_the_string_not_on_sample_order():
    """Samples voting '5' may have mixed verdicts (math-verify reads the whole response); the vote's verdict is the
    string's own: \\boxed{5} against the gold."""
    verdicts = E.vote_verdicts([["5", "5", "7"]], [5])
    assert verdicts == [{"5": True, "7": False}]
    for correct in ([True, False, False], [False, True, False]):
        assert E.benchmark_metrics([correct], [["5", "5", "7"]], verdicts)["maj@k"] == 1.0


def long_prompt_file(tmp_path):
    rows = [{"problem": "Compute 2 + 3 + 4.", "answer": 9, "id": "short"},
            {"problem": "Compute " + " + ".join(["1"] * 300) + ".", "answer": 300, "id": "long"}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["hf", "vllm"])
def test_a_file_benchmark_with_a_prompt_too_long_for_the_model(tmp_path, tiny_model_path, sampler):
    if sampler == "vllm":
        from conftest import vllm_or_skip
        vllm_or_skip()
    path, out = long_prompt_file(tmp_path), tmp_path / "r.json"
    base = [sys.executable, "evaluate.py", "--model", "tiny", "--benchmarks", f"arith,{path}", "--k", "2",
            "--max-tokens", "24", "--limit", "3", "--sampler", sampler, "--output", str(out)]
    refused = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"{path}: problem long has a " in refused.stderr and "--skip-long" in refused.stderr
    assert not out.exists()  # found before anything was sampled
    done = subprocess.run(base + ["--skip-long"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["benchmarks"]
    assert results[path]["skipped_ids"] == ["long"] and [p["id"] for p in results[path]["problems"]] == ["short"]
    assert len(results["arith"]["problems"]) == 3 and results["arith"]["skipped"] == 0
    assert "k=2, 1 problems, --limit 3, 1 skipped" in done.stdout  # our rows say what they are


@pytest.mark.slow
def test_finished_benchmarks_survive_a_later_failure(tmp_path, monkeypatch, tiny_model_path):
    real, calls = E.evaluate, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the sampler died")
        return real(*args, **kwargs)

    monkeypatch.setattr(E, "evaluate", second_fails)
    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match="the sampler died"):
        E.main(["--model", "tiny", "--benchmarks", f"arith,{long_prompt_file(tmp_path)}", "--k", "2", "--limit", "4",
                "--max-tokens", "24", "--sampler", "hf", "--skip-long", "--output", str(out)])
    saved = json.loads(out.read_text())["benchmarks"]
    assert list(saved) == ["arith"] and len(saved["arith"]["problems"]) == 4


def test_main_reads_as_its_stages_in_under_60_lines():
    """The house's rule for a script's main (issue 48): evaluate.py's reads top to bottom in under 60 lines."""
    import inspect
    assert len(inspect.getsource(E.main).splitlines()) < 60
