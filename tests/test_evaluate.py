"""evaluate.py: the estimators against brute force, the benchmark loaders, and an end-to-end run on the tiny model."""

import itertools
import json
import os
import sys

import pytest
import warm
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
@pytest.mark.parametrize("name, count", [("aime24", 30), ("aime25", 30), ("hmmt25", 30),
                                         ("math500", 500), ("amc23", 40)])
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
    (tmp_path / "math500.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" +
                                            json.dumps({"problem": "2+2?"}) + "\n")
    with pytest.raises(SystemExit, match=r"math500.jsonl: line 2 lacks"):
        data.load_benchmark("math500", data_dir=str(tmp_path))


@pytest.mark.slow
def test_end_to_end_on_the_tiny_model(tmp_path, tiny_model_path):
    out = tmp_path / "results.json"
    run = warm.run([sys.executable, "evaluate.py", "--model", "tiny", "--benchmarks", "arith", "--k", "4",
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
    assert [s == reward.CORRECT_REWARD for s in reward.score_batch(first["responses"],
                                                                   [first["answer"]] * 4)] == first["correct"]


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
    refused = warm.run(base, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"{path}: problem long has a " in refused.stderr and "--skip-long" in refused.stderr
    assert not out.exists()  # found before anything was sampled
    done = warm.run(base + ["--skip-long"], cwd=ROOT, capture_output=True, text=True, timeout=600)
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
    with pytest.raises(SystemExit) as stopped:  # its traceback, then one line saying what is kept and where
        E.main(["--model", "tiny", "--benchmarks", f"arith,{long_prompt_file(tmp_path)}", "--k", "2", "--limit", "4",
                "--max-tokens", "24", "--sampler", "hf", "--skip-long", "--output", str(out)])
    assert stopped.value.code == f"evaluate.py: stopped by RuntimeError; the results of arith are kept in {out}.partial"
    saved = json.loads((tmp_path / "r.json.partial").read_text())["benchmarks"]
    assert list(saved) == ["arith"] and len(saved["arith"]["problems"]) == 4 and not out.exists()


def test_main_reads_as_its_stages_in_under_60_lines():
    """The house's rule for a script's main (issue 48): evaluate.py's reads top to bottom in under 60 lines."""
    import inspect
    assert len(inspect.getsource(E.main).splitlines()) < 60


def test_every_function_is_within_60_lines():
    """The house's rule (issue 57: parse_args was 63 lines): every function of evaluate.py within 60 lines."""
    import inspect
    long = {name: len(inspect.getsource(f).splitlines()) for name, f in inspect.getmembers(E, inspect.isfunction)
            if f.__module__ == E.__name__ and len(inspect.getsource(f).splitlines()) > 60}
    assert not long, long


def recorded_eval_run(folder, logged_seed=None, precision="fp32"):
    """A run folder as train.py leaves it, for --seed-of: config.json (seed 3), a checkpoint folder of step 5, and a
    metrics row of step 5 with its eval_seed where logged_seed is given."""
    from conftest import parse_train_args

    from cegppo_utils import flags, runfolder
    args = parse_train_args(["--seed", "3", "--precision", precision, "--sampler", "hf", "--output-dir", str(folder)])
    os.makedirs(folder / "checkpoints" / "step_000005")
    (folder / "config.json").write_text(json.dumps({"preset": "tiny", "flags": flags.flat_flags(args)}))
    (folder / runfolder.RUN_MARKER).write_text("{}")
    row = {"step": 5, "eval_acc": 0.5, **({"eval_seed": logged_seed} if logged_seed is not None else {})}
    (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    return folder


def test_seed_of_takes_what_train_py_evaluated_a_step_with(tmp_path, monkeypatch, capsys):
    """--seed-of RUN STEP: the step's logged eval_seed (else the formula train.py uses), the run's sampler, its
    precision as vLLM's dtype (vLLM's auto samples float32 weights in bf16 on a CPU), its held-out set and token
    budget, and that step's checkpoint as the model; what is given on the command line stays."""
    from cegppo_utils import heldout
    monkeypatch.chdir(tmp_path)
    run = recorded_eval_run(tmp_path / "run", logged_seed=3 * 1_000_003 + 4 + 500_000)
    args = E.parse_args(["--seed-of", "run", "5"])
    assert (args.seed, args.sampler, args.dtype, args.benchmarks) == (3_500_013, "hf", "float32", ["arith"])
    assert args.model == os.path.join("run", "checkpoints", "step_000005") and args.run["max_response_len"] == 48
    assert args.output == os.path.join("runs", "eval", "run-checkpoints-step_000005-arith-seed-3500013.json")
    assert heldout.eval_seed(3, 5) == 3_500_013  # the formula, where no row logged it
    (run / "metrics.jsonl").write_text("")
    given = E.parse_args(["--seed-of", str(run), "5", "--model", "tiny", "--dtype", "bfloat16", "--sampler", "vllm"])
    assert (given.seed, given.model, given.dtype, given.sampler) == (3_500_013, "tiny", "bfloat16", "vllm")
    assert E.parse_args(["--model", "tiny"]).dtype == "weights"  # without a run: the dtype the weights are stored in
    for argv, said in ((["--seed-of", str(run), "5", "--seed", "1"], "--seed and --seed-of both give the seed"),
                       (["--seed-of", str(run), "x"], "the step must be a whole number"),
                       (["--seed-of", str(run), "\u00b2"], "the step must be a whole number"),  # isdigit, not int
                       (["--seed-of", str(run), "\u0663"], "the step must be a whole number"),  # int() reads it: 3
                       (["--seed-of", str(tmp_path), "5"], "not a run folder"),
                       (["--seed-of", str(run), "7"], "keeps no checkpoint of step 7")):
        with pytest.raises(SystemExit) as stopped:
            E.parse_args(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("\n") == 1 and said in err, err


def refused(argv, capsys) -> str:
    """parse_args(argv)'s refusal: exit code 2 and one line on stderr, returned."""
    with pytest.raises(SystemExit) as stopped:
        E.parse_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    return err


def test_seed_of_refuses_a_run_trained_on_several_ranks(tmp_path, capsys):
    """Under torchrun each rank scored its share of the held-out set with rank_seed(eval_seed): one seed cannot
    sample what they sampled. The world size is config.json's, of the launch or of any resume."""
    run = recorded_eval_run(tmp_path / "run")
    record = json.loads((run / "config.json").read_text())
    for sizes in ({"world_size": 2}, {"world_size": 1, "resumes": [{"world_size": 4}]}):
        (run / "config.json").write_text(json.dumps({**record, **sizes}))
        err = refused(["--seed-of", str(run), "5"], capsys)
        ranks = sizes["resumes"][0]["world_size"] if "resumes" in sizes else 2
        assert f"--seed-of {run}: the run trained under torchrun with world size {ranks}, " in err, err
    (run / "config.json").write_text(json.dumps({**record, "world_size": 1, "resumes": [{"world_size": 1}]}))
    assert E.parse_args(["--seed-of", str(run), "5"]).seed == 3_500_013


def test_seed_of_step_0_is_the_model_the_run_started_from(tmp_path, capsys):
    """Step 0 (the evaluation before training) scored the run's --model, which no checkpoint holds; a step_000000
    checkpoint, where one is kept, is that same policy and is taken first."""
    run = recorded_eval_run(tmp_path / "run")
    args = E.parse_args(["--seed-of", str(run), "0"])
    assert (args.model, args.seed) == ("tiny", 3 * 1_000_003 - 1 + 500_000)
    os.makedirs(run / "checkpoints" / "step_000000")
    assert E.parse_args(["--seed-of", str(run), "0"]).model == str(run / "checkpoints" / "step_000000")
    config = json.loads((run / "config.json").read_text())
    del config["flags"]["model"]
    (run / "config.json").write_text(json.dumps(config))
    assert "keeps no checkpoint of step 1" in refused(["--seed-of", str(run), "1"], capsys)


def test_the_hf_sampler_loads_the_model_in_the_dtype_it_records(tiny_model_path):
    """train.py's HF sampler computes a bf16 run in bf16 (FSDP2's mixed precision), so --dtype (or --seed-of's
    precision) sets the dtype HF generate loads the model in; "weights" and "auto" resolve to the dtype it used, the
    one the results record."""
    import argparse

    import torch
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for given, used in (("bfloat16", torch.bfloat16), ("half", torch.float16), ("auto", torch.float32),
                        ("weights", torch.float32), ("float32", torch.float32)):
        args = argparse.Namespace(sampler="hf", dtype=given, seed=0)
        sampler = E.make_eval_sampler(args, tiny_model_path, tokenizer, 512, {})
        assert sampler.model.dtype == used and args.dtype == str(used).removeprefix("torch."), given


def test_an_existing_output_is_answered_with_another_name(tmp_path, capsys):
    """A rerun refused because its file exists is told how to write another (--output FILE, a free name given); a
    seed other than 0 has a default file of its own."""
    out = tmp_path / "r.json"
    out.write_text("{}")
    (tmp_path / "r-2.json").write_text("{}")
    with pytest.raises(SystemExit):
        E.parse_args(["--model", "tiny", "--benchmarks", "arith", "--output", str(out)])
    assert f"--output {out} exists; pass --overwrite to replace it, or --output FILE to write another (e.g. --output " \
           f"{tmp_path}/r-3.json)" in capsys.readouterr().err
    assert E.parse_args(["--model", "tiny", "--benchmarks", "arith", "--seed", "7"]).output == \
        os.path.join("runs", "eval", "tiny-arith-seed-7.json")


@pytest.mark.slow
def test_seed_of_re_derives_a_runs_held_out_score_sample_for_sample(tmp_path, tiny_model_path):
    """A run's eval_acc, re-derived: `evaluate.py --seed-of RUN 1` on the step's policy samples what the run's own vLLM
    engine sampled, every response, and scores the same. vLLM's dtype auto (evaluate.py's default before) sampled the
    float32 weights in bf16: 43 of the 210 arith problems scored otherwise at step 1."""
    from conftest import vllm_or_skip
    vllm_or_skip()
    from cegppo_utils import tiny
    problems = tmp_path / "held-out.jsonl"
    problems.write_text("".join(json.dumps({"problem": p["problem"], "answer": p["answer"]}) + "\n"
                                for p in tiny.TASKS["arith"].held_out()[:40]))
    run = tmp_path / "run"
    trained = warm.run([sys.executable, "train.py", "--gen-prompts", "8", "--n", "4", "--max-steps", "1",
                        "--eval-every", "1", "--no-eval-before-train", "--eval-data", str(problems),
                        "--sampler", "vllm", "--log-samples-every", "0", "--output-dir", str(run)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert trained.returncode == 0, trained.stderr[-3000:]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    out = tmp_path / "eval.json"
    done = warm.run([sys.executable, "evaluate.py", "--seed-of", str(run), "1", "--responses", "--output",
                     str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["settings"]["dtype"] == "float32" and results["settings"]["seed"] == row["eval_seed"]
    scored = results["benchmarks"][str(problems)]
    logged = {r["id"]: r for r in map(json.loads, (run / "eval" / "step_000001.jsonl").read_text().splitlines())}
    assert len(scored["problems"]) == 40 == len(logged)
    for p in scored["problems"]:
        assert p["responses"] == logged[p["id"]]["responses"], p["id"]
    assert scored["avg@k"] == row["eval_acc"]
