"""The offline tasks' data and verifier, splits, worked solutions, lengths; and a small warm start rebuilt twice."""

import os
import re

import pytest
import torch

import reward
from cegppo_utils import data, tiny


def test_sums_splits_are_deterministic_and_disjoint():
    a, b = tiny.sums_split("train", 300, seed=0), tiny.sums_split("train", 300, seed=0)
    assert a == b and tiny.sums_split("train", 300, seed=1) != a
    test = tiny.sums_split("test", 300, seed=0)
    train_sets = {tuple(sorted(r["numbers"])) for r in tiny.sums_split("train", 3000, seed=0)}
    assert not train_sets & {tuple(sorted(r["numbers"])) for r in test}  # held-out multisets never train
    assert all(12 <= len(r["numbers"]) <= 16 and all(1 <= x <= 9 for x in r["numbers"]) for r in a + test)
    held = data.load_benchmark("sums")
    assert len(held) == 128 and held == data.load_benchmark("sums")  # a fixed benchmark
    assert [r["answer"] for r in held] == [sum(r["numbers"]) for r in tiny.sums_split("test", 128, seed=0)]


def test_sums_worked_solutions_merge_the_pool_correctly_and_in_many_orders():
    rows = tiny.sums_split("train", 200, seed=3)
    for r in rows:
        pool = sorted(r["numbers"])
        lines = r["solution"].splitlines()
        for line in lines[:-1]:
            a, b, c = map(int, re.fullmatch(r"(\d+)\+(\d+)=(\d+)", line).groups())
            assert a + b == c
            pool.remove(a), pool.remove(b)  # both operands were in the pool
            pool.append(c)
        assert pool == [r["answer"]] and lines[-1] == f"\\boxed{{{r['answer']}}}"
    firsts = {r["solution"].splitlines()[0] for r in rows}
    assert len(firsts) > 50  # the order is free: many different first merges


@pytest.mark.parametrize("split, wrong", [(tiny.sums_split, +1), (tiny.merge_split, -1)])
def test_the_verifier_scores_worked_solutions_and_rejects_a_wrong_total(split, wrong):
    rows = split("test", 40, seed=0)
    bad = [r["solution"].rsplit("\\boxed", 1)[0] + f"\\boxed{{{r['answer'] + wrong}}}" for r in rows]
    scores = reward.score_batch([r["solution"] for r in rows] + bad, [r["answer"] for r in rows] * 2)
    assert scores == [1.0] * 40 + [-1.0] * 40


def test_sums_responses_are_long_in_the_task_tokenizer():
    rows = tiny.sums_split("train", 200, seed=5)
    tokenizer = tiny.build_tokenizer([r["problem"] + "\n" + r["solution"] for r in rows], 400)
    lengths = [len(tokenizer(r["solution"] + tiny.IM_END, add_special_tokens=False)["input_ids"]) for r in rows]
    assert 80 <= sum(lengths) / len(lengths) <= 200 and max(lengths) < tiny.TASKS["sums"].max_response_len
    prompts = [len(tokenizer(tiny.chat_prompt(tokenizer, r["problem"]), add_special_tokens=False)["input_ids"])
               for r in rows]
    assert max(prompts) <= 96  # the sums preset's --max-prompt-len


def test_merge_splits_are_deterministic_and_disjoint():
    a = tiny.merge_split("train", 300, seed=0)
    assert a == tiny.merge_split("train", 300, seed=0) and tiny.merge_split("train", 300, seed=1) != a
    test = tiny.merge_split("test", 300, seed=0)
    train_sets = {tuple(sorted(r["numbers"])) for r in tiny.merge_split("train", 3000, seed=0)}
    assert not train_sets & {tuple(sorted(r["numbers"])) for r in test}
    low, high = tiny.MERGE_TERMS
    assert all(low <= len(r["numbers"]) <= high and all(1 <= x <= 9 for x in r["numbers"]) for r in a + test)
    held = data.load_benchmark("merge")
    assert len(held) == 128 and held == data.load_benchmark("merge")
    assert [r["answer"] for r in held] == [sum(r["numbers"]) for r in tiny.merge_split("test", 128, seed=0)]


def test_merge_worked_solutions_are_right_and_open_lines_with_free_choices():
    rows = tiny.merge_split("train", 300, seed=2)
    for r in rows:
        pool, lines = list(r["numbers"]), r["solution"].splitlines()
        assert len(lines) == len(pool)  # one merge per number but the last, then the boxed total
        for line in lines[:-1]:
            a, b, c, left = re.fullmatch(r"(\d+)\+(\d+)=(\d+)(?:, left ((?:\d+ )*\d+))?", line).groups()
            a, b, c = int(a), int(b), int(c)
            assert a + b == c
            pool.remove(a), pool.remove(b)  # both operands were in the pool
            pool.append(c)
            if len(pool) > 1:  # the list is the pool after this merge, the new sum last
                assert sorted(map(int, left.split())) == sorted(pool) and int(left.split()[-1]) == c
            else:
                assert left is None
        assert pool == [r["answer"]] == [sum(r["numbers"])] and lines[-1] == f"\\boxed{{{r['answer']}}}"
    # the order is free: most of the 81 ordered pairs of digits open some solution
    assert len({r["solution"].splitlines()[0].split(",")[0] for r in rows}) > 60


def test_merge_responses_fit_the_task_budget():
    rows = tiny.merge_split("train", 300, seed=5)
    tokenizer = tiny.build_tokenizer([r["problem"] + "\n" + r["solution"] for r in rows], 400)
    lengths = [len(tokenizer(r["solution"] + tiny.IM_END, add_special_tokens=False)["input_ids"]) for r in rows]
    assert 60 <= sum(lengths) / len(lengths) <= 100 and max(lengths) < tiny.TASKS["merge"].max_response_len
    prompts = [len(tokenizer(tiny.chat_prompt(tokenizer, r["problem"]), add_special_tokens=False)["input_ids"])
               for r in rows]
    assert max(prompts) <= 64


@pytest.mark.parametrize("task", ["arith", "sums", "merge"])
def test_each_task_is_a_training_source_and_a_benchmark(task):
    rows = data.load_rows(task)
    held = data.load_benchmark(task)
    assert rows and held and all(r["prompt"][0]["role"] == "user" and r["answer"] is not None for r in rows[:50] + held)
    assert not {data.question_of(r) for r in held} & {data.question_of(r) for r in rows}
    assert data.benchmark_defaults(task)["max_tokens"] == tiny.TASKS[task].max_response_len


@pytest.mark.slow
def test_a_warm_start_rebuilt_has_the_same_weights(tmp_path):
    """The merge warm start (a small step count) built twice from scratch on one machine: the same weights, by the
    hash train.py records in config.json (models.weights_hash) and study.py checks."""
    from cegppo_utils import models
    cfg = tiny.MergeConfig(sft_steps=6)
    first = tiny.ensure_merge_model(cache_dir=str(tmp_path / "a"), cfg=cfg, log=lambda *a: None)
    second = tiny.ensure_merge_model(cache_dir=str(tmp_path / "b"), cfg=cfg, log=lambda *a: None)
    assert models.weights_hash(first) == models.weights_hash(second) is not None
    with torch.no_grad():  # and the hash sees one changed weight
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(second)
        model.get_parameter("lm_head.weight")[0, 0] += 1e-7
        model.save_pretrained(tmp_path / "c")
    assert models.weights_hash(str(tmp_path / "c")) != models.weights_hash(first)


def test_two_processes_asking_for_a_model_at_once_build_it_once(tmp_path):
    """Two runs started together on a fresh checkout: the second waits on the first's lock and finds the model built,
    instead of spending minutes building a copy of its own. (flock locks an open file, so two threads of one process
    exclude each other as two processes would.)"""
    import threading
    builds, started, go = [], threading.Event(), threading.Event()

    class Saved:  # what build() returns: a model and a tokenizer, each saved into the folder it is given
        def save_pretrained(self, folder):
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "config.json"), "w") as f:
                f.write("{}")

    def build():
        builds.append(threading.current_thread().name)
        started.set()
        assert go.wait(10)  # the second caller arrives while this build is under way
        return Saved(), Saved()

    path, said = str(tmp_path / "cache" / "model"), []

    def ask():
        said.append(tiny._cached(path, tiny.TinyConfig(), build, "test model", log=said.append))
    first = threading.Thread(target=ask, name="first")
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=ask, name="second")
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting on the lock, not building
    go.set()
    first.join(10)
    second.join(10)
    assert builds == ["first"] and said.count(path) == 2
    assert f"test model: saved to {path}" in said
    assert f"test model: using the cached warm-started model in {path}" in said
