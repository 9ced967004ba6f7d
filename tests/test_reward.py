"""reward.py: official math-verify verdicts on real gold answers and common answer forms, garbage that must
score wrong within the deadline, hard kills, balanced scheduling, and the <think> option."""

import faulthandler
import fractions
import functools
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import math_verify  # noqa: F401  (workers started with fork inherit it instead of importing it each)
import pytest

import reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "..", "shared", "benchmarks")

# Math-Verify issue #65: math-verify spends its whole timeout on this one; without one it runs on for minutes.
HANG = r"The answer is \boxed{\dfrac{5^{\left(5^{\left(5^{\left(5^5\right)}\right)} - 4\right)} - 5}{16}}"
TOWER = r"The answer is \boxed{9^{9^{9^{9^{9}}}}}"
DEADLINE = 1.5  # short deadline for the pool that meets hangs
SLACK = 1.0  # IPC, the kill and the replacement's start on a busy 2-core machine


@pytest.fixture(scope="module")
def pool():
    with reward.RewardPool(workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def fast_pool():
    with reward.RewardPool(workers=2, deadline=DEADLINE) as p:
        yield p


def check(pool, cases, **kwargs):
    """cases: (response, answer, expected score); reports every mismatch at once."""
    scores = pool.score_batch([c[0] for c in cases], [c[1] for c in cases], **kwargs)
    wrong = [(r, a, want, got) for (r, a, want), got in zip(cases, scores) if got != want]
    assert not wrong, "\n".join(f"gold {a!r}: want {want:+}, got {got:+} for {r!r}" for r, a, want, got in wrong)


# --- real gold answers --------------------------------------------------------------------------

def benchmark_golds():
    """(benchmark, gold answer) for the 630 problems, read by the project's loaders (FACTS §7 layouts)."""
    try:
        from cegppo_utils.data import load_benchmark  # the loaders moved from evaluate.py to data.py
    except ImportError:
        from evaluate import load_benchmark
    return [(name, p["answer"]) for name in ("aime24", "aime25", "hmmt25", "math500", "amc23")
            for p in load_benchmark(name, data_dir=BENCHMARKS)]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(BENCHMARKS), reason="../shared/benchmarks not present")
def test_every_benchmark_gold_verifies_against_itself_and_not_against_a_different_answer(pool):
    golds = benchmark_golds()
    assert len(golds) == 630
    assert any(isinstance(a, float) for _, a in golds)  # AMC23 stores 27.0: normalisation is exercised
    responses, answers, expected, where = [], [], [], []
    for name, a in golds:
        text = reward.normalize_answer(a)
        cases = [
            # Reasoning with other numbers first, then the gold: +1.
            (f"Let me check: 12 + 30 = 42 and $\\frac{{3}}{{4}} \\cdot 8 = 6$.\n\n"
             f"The answer is \\boxed{{{text}}}", 1.0),
            # The gold plus one: a different value for every numeric gold; for an equation the 1 goes on the
            # right-hand side; tuples, sets and intervals plus one are not the tuple, set or interval.
            (f"The answer is \\boxed{{{text} + 1}}" if "=" in text else f"The answer is \\boxed{{{{{text}}} + 1}}",
             -1.0),
            # A fixed number that is no gold here.
            ("The answer is \\boxed{1000003}", -1.0),
        ]
        for response, want in cases:
            responses.append(response), answers.append(a), expected.append(want), where.append(name)
    scores, stats = pool.score_batch(responses, answers, return_stats=True)
    bad = [(w, a, r, s) for w, a, r, s, want in zip(where, answers, responses, scores, expected) if s != want]
    assert not bad, f"{len(bad)} wrong verdicts, e.g. " + "; ".join(f"{w} gold {a!r}: {s:+} for {r[-60:]!r}"
                                                                      for w, a, r, s in bad[:10])
    assert stats["timeouts"] == stats["errors"] == stats["restarts"] == 0
    assert stats["correct"] == len(golds)


# --- answer forms ---------------------------------------------------------------------------------

LONG_TRACE = ("We need the number of apples. First 12 + 30 = 42, and $\\frac{3}{4}$ of 56 is 42. "
              "Then $x^2 = 49$ gives $x = 7$, so 7 boxes of 3 hold 21. Adding the 6 spare ones, 21 + 6 = 27.\n\n"
              "**Final answer.** \\boxed{27}")


def test_answer_forms(pool):
    check(pool, [
        # fractions and decimals
        (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"The answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"The answer is \boxed{0.5}", r"\frac{1}{3}", -1.0),
        # tuples and intervals: order and bracket type matter
        (r"So \boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"So \boxed{(\frac{\pi}{2}, 3)}", r"\left( 3, \frac{\pi}{2} \right)", -1.0),
        (r"So \boxed{(3, \pi)}", r"\left( 3, \frac{\pi}{2} \right)", -1.0),
        (r"So \boxed{(2, \infty)}", r"(2,\infty)", 1.0),
        (r"So \boxed{[2, \infty)}", r"(2,\infty)", -1.0),
        (r"So \boxed{(-\infty, 0]}", r"(-\infty, 0]", 1.0),
        (r"So \boxed{(-\infty, 0)}", r"(-\infty, 0]", -1.0),
        # x = 3 against 3, both ways
        (r"Hence \boxed{x = 3}", "3", 1.0),
        ("Solving, we find x = 3.", 3, 1.0),
        (r"Hence \boxed{3}", "x=3", 1.0),
        (r"Hence \boxed{x = 4}", "3", -1.0),
        # percent
        (r"So \boxed{50\%}", r"50\%", 1.0),
        (r"So \boxed{50\%}", "50", 1.0),
        (r"So \boxed{60\%}", r"50\%", -1.0),
        # thousands separators
        (r"So \boxed{1,000}", "1000", 1.0),
        ("The answer is 1,000.", 1000, 1.0),
        (r"So \boxed{1000}", r"1,\!000", 1.0),
        (r"So \boxed{1,001}", "1000", -1.0),
        # the answer at the end of a trace full of other numbers
        (LONG_TRACE, 27, 1.0),
        (LONG_TRACE, 42, -1.0),
        (LONG_TRACE, 21, -1.0),
        # int / float gold (AMC23 stores 27.0)
        (r"So \boxed{27}", 27.0, 1.0),
        (r"So \boxed{27}", "27.0", 1.0),
        (r"So \boxed{27.0}", 27, 1.0),
        (r"So \boxed{28}", 27.0, -1.0),
        # gold given already boxed is not boxed twice
        (r"So \boxed{5}", r"\boxed{5}", 1.0),
        (r"So \boxed{6}", r"\boxed{5}", -1.0),
        # text answers
        (r"So \boxed{\text{Evelyn}}", r"\text{Evelyn}", 1.0),
        (r"So \boxed{\text{Bob}}", r"\text{Evelyn}", -1.0),
    ])


def test_normalize_answer():
    assert reward.normalize_answer(27.0) == "27"
    assert reward.normalize_answer(-3.0) == "-3"
    assert reward.normalize_answer(27) == "27"
    assert reward.normalize_answer(" 27.00 ") == "27"
    assert reward.normalize_answer(0.5) == "0.5"
    assert reward.normalize_answer(fractions.Fraction(1, 2)) == r"\frac{1}{2}"
    assert reward.normalize_answer(r"  \frac{1}{2} ") == r"\frac{1}{2}"
    assert reward.normalize_answer("27.05") == "27.05"
    assert reward.normalize_answer(None) is None
    assert reward.normalize_answer("   ") is None
    assert reward.normalize_answer(math.nan) is None


class Unprintable:
    def __str__(self):
        raise RuntimeError("no str for you")


class OddStr(str):
    def __str__(self):
        raise RuntimeError("no str for you")


def test_normalize_answer_is_exact_for_large_integral_golds():
    # Through a float, "12345678901234567891.0" became ...567168 and "9007199254740993.0" ...992.
    assert reward.normalize_answer("12345678901234567891.0") == "12345678901234567891"
    assert reward.normalize_answer("9007199254740993.0") == "9007199254740993"
    assert reward.normalize_answer("1" + "0" * 400 + ".0") == "1" + "0" * 400
    assert reward.normalize_answer("-0012.000") == "-12"
    assert reward.normalize_answer("+5.0") == "5"
    assert reward.normalize_answer("-0.0") == "0"
    assert reward.normalize_answer(1e20) == "100000000000000000000"
    # A float gold stands for the decimal it was read from (its shortest round-trip digits), not for its binary value:
    # 2.0 ** 70 reads back as 1.1805916207174113e+21, as 1e23 does as 10**23 (binary: 99999999999999991611392).
    assert reward.normalize_answer(2.0 ** 70) == "11805916207174113" + "0" * 5
    assert reward.normalize_answer(2 ** 70) == str(2 ** 70)  # an int is exact
    assert reward.normalize_answer(10 ** 30) == "1" + "0" * 30
    assert reward.normalize_answer(fractions.Fraction(6, 3)) == "2"
    assert reward.normalize_answer(b" 27.0 ") == "27"
    assert reward.normalize_answer(OddStr("27.0")) == "27" and type(reward.normalize_answer(OddStr("27"))) is str


UNNORMALISABLE = {
    "10**5000 (too long to print)": 10 ** 5000,
    "inf": math.inf,
    "-inf": -math.inf,
    "nan": math.nan,
    "list": [1, 2],
    "dict": {"answer": 3},
    "unprintable object": Unprintable(),
    "bool": True,
    "empty bytes": b"",
}


def test_normalize_answer_never_raises():
    for name, gold in UNNORMALISABLE.items():
        assert reward.normalize_answer(gold) is None, name


def test_rewards_are_configurable_and_stats_count_each_outcome(pool):
    responses = [r"\boxed{3}", r"\boxed{4}", "no answer here", r"\boxed{3}"]
    scores, stats = pool.score_batch(responses, [3, 3, 3, None], correct_reward=1.0, wrong_reward=0.0,
                                     return_stats=True)
    assert scores == [1.0, 0.0, 0.0, 0.0]
    assert {k: stats[k] for k in ("n", "correct", "wrong", "no_answer", "no_gold", "timeouts", "restarts")} == \
        {"n": 4, "correct": 1, "wrong": 1, "no_answer": 1, "no_gold": 1, "timeouts": 0, "restarts": 0}


def test_answers_of_wrong_length_raise(pool):
    with pytest.raises(ValueError, match=r"3 responses but 2 answers"):
        pool.score_batch(["a", "b", "c"], [1, 2])
    assert pool.score_batch([], []) == []


def test_large_integral_golds_score_exactly(pool):
    big = "1" + "0" * 400
    check(pool, [
        (r"So \boxed{12345678901234567891}", "12345678901234567891.0", 1.0),
        (r"So \boxed{12345678901234567892}", "12345678901234567891.0", -1.0),
        (r"So \boxed{12345678901234567168}", "12345678901234567891.0", -1.0),  # what the float made of it
        (r"So \boxed{9007199254740993}", "9007199254740993.0", 1.0),
        (r"So \boxed{9007199254740992}", "9007199254740993.0", -1.0),
        (rf"So \boxed{{{big}}}", big + ".0", 1.0),
        (rf"So \boxed{{{big[:-1]}1}}", big + ".0", -1.0),
        (r"So \boxed{100000000000000000000}", 1e20, 1.0),
        (r"So \boxed{100000000000000000001}", 1e20, -1.0),
    ])


def test_golds_that_cannot_be_normalised_score_as_no_gold_and_the_batch_goes_on(pool):
    bad = list(UNNORMALISABLE.values())
    responses = [r"\boxed{3}"] + [r"\boxed{1}"] * len(bad) + [r"\boxed{4}", r"\boxed{5}"]
    scores, stats = pool.score_batch(responses, [3] + bad + [4, 6], return_stats=True)
    assert scores == [1.0] + [-1.0] * len(bad) + [1.0, -1.0]
    assert stats["no_gold"] == len(bad) and stats["correct"] == 2 and stats["wrong"] == 1


def test_a_gold_too_long_for_an_int_does_not_stop_the_batch(pool):
    huge = "1" + "0" * 5000  # past Python's 4,300-digit int/str limit, which math-verify meets inside the worker
    scores, stats = pool.score_batch([rf"\boxed{{{huge}}}", r"\boxed{2}"], [huge + ".0", 2], return_stats=True)
    assert scores[1] == 1.0 and stats["n"] == 2 and stats["timeouts"] == 0


def test_numpy_golds():
    np = pytest.importorskip("numpy")
    assert reward.normalize_answer(np.int64(-7)) == "-7"
    assert reward.normalize_answer(np.float64(27.0)) == "27"
    assert reward.normalize_answer(np.float32(0.5)) == "0.5"
    assert reward.normalize_answer(np.float64("nan")) is None
    assert reward.normalize_answer(np.array([1, 2])) is None


def test_responses_that_are_not_text_score_as_no_answer(pool):
    responses = [None, 3, 3.0, [r"\boxed{3}"], {"a": r"\boxed{3}"}, Unprintable(), b"\\boxed{3}",
                 bytearray(b"\\boxed{3}"), OddStr(r"\boxed{3}"), r"\boxed{3}"]
    scores, stats = pool.score_batch(responses, [3] * len(responses), return_stats=True)
    assert scores == [-1.0] * 6 + [1.0] * 4
    assert stats["no_answer"] == 6 and stats["correct"] == 4


def test_a_closed_pool_raises_and_a_forked_copy_does_not_stop_the_workers():
    pool = reward.RewardPool(workers=2)
    pool.score_batch([r"\boxed{1}", r"\boxed{2}"], [1, 2])
    before = [w.proc.pid for w in pool._workers]
    child = os.fork()
    if child == 0:  # what garbage collection, the end of the process or close() would do in a forked copy
        try:
            pool._finalizer()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    scores, stats = pool.score_batch([rf"\boxed{{{i}}}" for i in range(6)], list(range(6)), return_stats=True)
    assert scores == [1.0] * 6 and stats["restarts"] == 0
    assert [w.proc.pid for w in pool._workers] == before
    procs = [w.proc for w in pool._workers]
    pool.close()
    assert pool.closed and not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_batch([r"\boxed{1}"], [1])


def test_module_level_functions_use_a_reused_default_pool():
    assert reward.score(r"The answer is \boxed{27}.", 27.0) == 1.0
    first = [w.proc.pid for w in reward.default_pool()._workers]
    assert reward.score_batch([r"\boxed{1}", r"\boxed{2}"], [1, 1]) == [1.0, -1.0]
    assert [w.proc.pid for w in reward.default_pool()._workers] == first  # started once, reused


# --- the synthetic task: \boxed{N}, N a possibly negative integer ------------------------------------

def test_synthetic_integer_task(pool):
    check(pool, [
        ("12 + 5 = 17. The answer is \\boxed{17}", 17, 1.0),
        ("12 + 5 = 18. The answer is \\boxed{18}", 17, -1.0),
        ("5 - 12 = -7. The answer is \\boxed{-7}", -7, 1.0),
        ("5 - 12 = 7. The answer is \\boxed{7}", -7, -1.0),
        ("12 - 5 = -7. The answer is \\boxed{-7}", 7, -1.0),
        ("The answer is \\boxed{0}", 0, 1.0),
        ("The answer is \\boxed{-0}", 0, 1.0),
        ("The answer is \\boxed{017}", 17, 1.0),  # leading zero: the same integer
        ("The answer is \\boxed{-017}", -17, 1.0),
        ("The answer is \\boxed{170}", 17, -1.0),  # a trailing zero is not
        ("The answer is \\boxed{1 7}", 17, -1.0),
        ("The answer is \\boxed{17.0}", 17, 1.0),
        ("The answer is 17", 17, 1.0),  # no box: math-verify still reads the last number
        ("The answer is \\boxed{}", 17, -1.0),
    ])


# --- <think> ----------------------------------------------------------------------------------------

def test_think_option(pool):
    closed = "<think>\nMaybe it is \\boxed{5}? No.\n</think>\nThe answer is \\boxed{7}."
    truncated = "<think>\nMaybe it is \\boxed{5}? Let me keep going"
    r1_style = "Maybe it is \\boxed{5}? No.\n</think>\nThe answer is \\boxed{7}."  # <think> sat in the prompt
    only_in_thought = "<think>\nIt is \\boxed{5}.\n</think>\nI am not sure."
    cases = [(closed, 7), (closed, 5), (truncated, 5), (r1_style, 7), (only_in_thought, 5)]
    # Off (official): the whole text counts, thinking included.
    check(pool, [(r, a, want) for (r, a), want in zip(cases, [1.0, -1.0, 1.0, 1.0, 1.0])])
    # On: only what follows the last </think>; a thought that never closed scores wrong.
    check(pool, [(r, a, want) for (r, a), want in zip(cases, [1.0, -1.0, -1.0, 1.0, -1.0])], think=True)
    _, stats = pool.score_batch([truncated], [5], think=True, return_stats=True)
    assert stats["no_answer"] == 1


# --- garbage, hangs, kills ------------------------------------------------------------------------------

GARBAGE = {
    "empty": "",
    "whitespace": " \n\t ",
    "binary": random.Random(0).randbytes(4000).decode("latin-1"),
    "binary bytes": random.Random(1).randbytes(4000),
    "nul and control chars": "\x00\x01\x02\\boxed{\x00}\x1b[2J",
    "300k chars of text": "Let me think again. " * 15000,
    "300k chars of numbers": "1234567890 " * 27300,  # math-verify tries every number: slow, so killed
    "300k open braces": "\\boxed{" + "{" * 300000,
    "unbalanced braces": "\\boxed{\\frac{1}{2" + "{" * 500 + " so the answer is \\boxed{",
    "unmatched closing": "}}}} \\boxed{}}}} \\right) \\end{array} $$ $",
    "tower of exponents": TOWER,
    "issue 65 nested power": HANG,
    "not a string": None,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_scores_wrong_within_the_deadline(fast_pool, name):
    start = time.monotonic()
    scores, stats = fast_pool.score_batch([GARBAGE[name]], [42], return_stats=True)
    elapsed = time.monotonic() - start
    assert scores == [-1.0]
    assert elapsed < DEADLINE + SLACK, f"{name}: {elapsed:.2f} s"
    assert stats["correct"] == 0 and stats["errors"] == 0


def test_stuck_worker_is_killed_and_replaced_and_the_pool_keeps_scoring(fast_pool):
    before = {w.proc.pid for w in fast_pool._workers}
    scores, stats = fast_pool.score_batch([r"\boxed{3}", HANG, r"\boxed{4}"], [3, 5, 4], return_stats=True)
    assert scores == [1.0, -1.0, 1.0]
    assert stats["timeouts"] == 1 and stats["restarts"] == 1
    after = {w.proc.pid for w in fast_pool._workers}
    assert len(after) == 2 and len(after - before) >= 1  # a new process took the killed one's place
    assert all(w.proc.is_alive() for w in fast_pool._workers)
    # Scoring afterwards is unaffected, and needs no more restarts.
    scores, stats = fast_pool.score_batch([r"\boxed{3}", r"\boxed{\frac{1}{2}}", r"\boxed{9}"], [3, 0.5, 8],
                                          return_stats=True)
    assert scores == [1.0, 1.0, -1.0]
    assert stats["restarts"] == stats["timeouts"] == 0


def in_a_fresh_process(test):
    """Runs the test in a new pytest process, that holds only what the test imports. A worker started with fork
    copies the forking process, and in the suite's process that is one that earlier tests filled with torch's and
    pyarrow's threads: there the forked workers died at start-up (exit code -11) in 5 of these tests, and only after
    other tests had run in the same process. The pool itself forks from a fork server that imported math_verify and
    reward alone; these tests, which fork to hand the workers a patched judge, fork from a process as clean."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("REWARD_TEST_FRESH") == "1":
            return test(*args, **kwargs)
        node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=ROOT,
                              env={**os.environ, "REWARD_TEST_FRESH": "1"}, capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            pytest.fail(f"{node} in a fresh process:\n{done.stdout[-6000:]}{done.stderr[-3000:]}", pytrace=False)
    return run


def crashing_judge(marker, always):
    """A judge that kills its worker (SIGSEGV) on responses starting "crash": every time, or the first time only."""
    real = reward.judge

    def judge(response, gold):
        if response.startswith("crash") and (always or not marker.exists()):
            marker.touch()
            faulthandler.disable()  # pytest's handler would print the crash; the pool is what is tested
            os.kill(os.getpid(), signal.SIGSEGV)
        return real(response, gold)
    return judge


@pytest.mark.parametrize("always", [False, True])
@in_a_fresh_process
def test_an_item_whose_worker_crashes_is_retried_once_then_counts_as_an_error(tmp_path, monkeypatch, always):
    # The fork start method lets the workers inherit the patched judge.
    monkeypatch.setattr(reward, "judge", crashing_judge(tmp_path / "crashed", always))
    with reward.RewardPool(workers=2, deadline=60.0, start_method="fork") as pool:
        responses = [r"\boxed{1}", r"crash \boxed{2}", r"\boxed{3}", r"\boxed{4}", r"\boxed{5}", r"\boxed{6}"]
        start = time.monotonic()
        scores, stats = pool.score_batch(responses, [1, 2, 3, 4, 5, 7], return_stats=True)
        assert time.monotonic() - start < 20.0  # the deadline (60 s) played no part
        # A crash on the retry makes the item an error; a worker that crashed once is not the item's fault.
        assert scores == [1.0, -1.0 if always else 1.0, 1.0, 1.0, 1.0, -1.0]
        assert stats["errors"] == (1 if always else 0) and stats["timeouts"] == 0
        assert stats["restarts"] == (2 if always else 1)
        assert (tmp_path / "crashed").exists()
        # The replacements score normally.
        scores, stats = pool.score_batch([r"\boxed{2}", r"\boxed{3}"], [2, 2], return_stats=True)
        assert scores == [1.0, -1.0] and stats["restarts"] == 0


def test_a_worker_killed_while_idle_is_replaced_without_costing_an_item():
    with reward.RewardPool(workers=2, deadline=60.0) as pool:
        pool.score_batch([r"\boxed{1}", r"\boxed{2}"], [1, 2])
        victim = next(w for w in pool._workers if w.ready).proc  # the other one may still be starting
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10.0)
        assert victim.exitcode == -signal.SIGKILL
        scores, stats = pool.score_batch([rf"\boxed{{{i}}}" for i in range(8)], list(range(8)), return_stats=True)
        assert scores == [1.0] * 8
        assert stats["errors"] == 0 and stats["restarts"] == 1
        assert victim.pid not in {w.proc.pid for w in pool._workers}


def judge_that_kills_starting_workers(tokens, deaths):
    """A judge whose first call in a worker (its warm-up) kills that worker with `deaths`: an int n kills the first
    n workers (each claims one of n token files), "always" kills every one, "error" exits with an exception."""
    real = reward.judge
    warmed = []

    def judge(response, gold):
        if not warmed:
            warmed.append(True)
            if deaths == "error":
                raise ImportError("math_verify is broken")
            for k in range(1 if deaths == "always" else deaths):
                try:
                    os.close(os.open(tokens / str(k), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    continue
                os.kill(os.getpid(), signal.SIGKILL)
            if deaths == "always":
                os.kill(os.getpid(), signal.SIGKILL)
        return real(response, gold)
    return judge


@in_a_fresh_process
def test_workers_killed_while_starting_are_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(reward, "judge", judge_that_kills_starting_workers(tmp_path, 3))
    with reward.RewardPool(workers=2, deadline=60.0, start_method="fork") as pool:
        scores, stats = pool.score_batch([rf"\boxed{{{i}}}" for i in range(6)], [0, 1, 2, 3, 4, 4],
                                         return_stats=True)
        assert scores == [1.0] * 5 + [-1.0]
        assert stats["restarts"] == 3 and stats["errors"] == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2"]


@pytest.mark.parametrize("deaths, exit_code", [("always", -signal.SIGKILL), ("error", 1)])
@in_a_fresh_process
def test_a_worker_that_cannot_start_raises_a_clear_error(tmp_path, monkeypatch, deaths, exit_code):
    # Every start dies, or the warm-up raises (a broken math-verify): retrying cannot help, so the call says so.
    monkeypatch.setattr(reward, "judge", judge_that_kills_starting_workers(tmp_path, deaths))
    with reward.RewardPool(workers=2, deadline=60.0, start_method="fork") as pool:
        with pytest.raises(RuntimeError, match=rf"a reward worker failed to start \(exit code {exit_code}, .*"
                                               r"import math_verify"):
            pool.score_batch([r"\boxed{2}"], [2])


@in_a_fresh_process
def test_a_worker_whose_start_up_never_finishes_raises_a_clear_error(monkeypatch):
    real = reward.judge

    def judge(response, gold):  # the warm-up hangs, as an import stuck on a network file system would
        if response == "\\boxed{1}" and gold == "1":
            time.sleep(3600)
        return real(response, gold)
    monkeypatch.setattr(reward, "judge", judge)
    monkeypatch.setattr(reward, "START_TIMEOUT", 1.0)
    with reward.RewardPool(workers=1, deadline=60.0, start_method="fork") as pool:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"a reward worker failed to start \(no ready signal within 1 s"):
            pool.score_batch([r"\boxed{2}"], [2])
        assert time.monotonic() - start < 10.0


def parent_pid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_stopped_fork_server_is_replaced_within_a_bounded_time(monkeypatch):
    monkeypatch.setattr(reward, "START_TIMEOUT", 4.0)  # the first start after the stop waits this long
    with reward.RewardPool(workers=2, deadline=60.0) as pool:
        pool.score_batch([rf"\boxed{{{i}}}" for i in range(8)], list(range(8)))
        survivor, victim = (w.proc for w in pool._workers)
        server = parent_pid(survivor.pid)
        assert server != os.getpid()  # workers are forks of the fork server, not of us
        done = []
        call = threading.Thread(daemon=True, target=lambda: done.append(pool.score_batch(
            [rf"\boxed{{{i}}}" for i in range(20)], list(range(20)), return_stats=True)))
        os.kill(server, signal.SIGSTOP)
        try:
            os.kill(victim.pid, signal.SIGKILL)  # its replacement needs the stopped fork server
            start = time.monotonic()
            call.start()
            call.join(30.0)
            elapsed = time.monotonic() - start
            assert not call.is_alive(), "score_batch blocked on a stopped fork server"
        finally:
            try:
                os.kill(server, signal.SIGCONT)
            except ProcessLookupError:  # killed and reaped: the pool did that
                pass
            call.join(30.0)
        scores, stats = done[0]
        assert scores == [1.0] * 20 and stats["errors"] == stats["timeouts"] == 0 and stats["restarts"] >= 1
        assert elapsed < 20.0, f"{elapsed:.1f} s"
        replacement = next(w.proc for w in pool._workers if w.proc is not survivor)
        assert parent_pid(replacement.pid) not in (server, os.getpid())  # forked by a fresh fork server
        scores, stats = pool.score_batch([rf"\boxed{{{i}}}" for i in range(8)], list(range(8)), return_stats=True)
        assert scores == [1.0] * 8 and stats["restarts"] == 0


# --- balanced scheduling ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", ["spread", "adjacent"])
def test_hangs_cost_about_hangs_over_workers_deadlines(layout):
    deadline, workers, hangs = 3.0, 2, 4
    ordinary = [(f"So {i} + 1 = {i + 1}, and the answer is \\boxed{{{i}}}.", i) for i in range(300)]
    if layout == "spread":
        items = list(ordinary)
        for k in range(hangs):
            items.insert(75 * k + 10, (HANG, 5))
    else:  # one group of responses that all hang, as when a model repeats itself: they share a chunk
        items = ordinary[:100] + [(HANG, 5)] * hangs + ordinary[100:]
    with reward.RewardPool(workers=workers, deadline=deadline) as pool:
        pool.score_batch([r for r, _ in ordinary], [a for _, a in ordinary])  # start and warm the workers
        start = time.monotonic()
        pool.score_batch([r for r, _ in ordinary], [a for _, a in ordinary])
        plain = time.monotonic() - start
        start = time.monotonic()
        scores, stats = pool.score_batch([r for r, _ in items], [a for _, a in items], return_stats=True)
        wall = time.monotonic() - start
    assert scores == [-1.0 if r == HANG else 1.0 for r, _ in items]
    assert stats["timeouts"] == hangs and stats["restarts"] == hangs
    # 6 s; one worker taking all four would be 12 s. The slack covers two rounds of restarts and the ordinary items
    # on a loaded 2-core machine.
    balanced = math.ceil(hangs / workers) * deadline
    assert balanced <= wall < balanced + plain + 3.0, f"{layout}: {wall:.2f} s (plain batch {plain:.2f} s)"


# --- float golds are written positionally, never as their repr ------------------------

def test_float_golds_are_normalised_from_their_decimal_value_not_their_repr():
    import decimal
    np = pytest.importorskip("numpy")
    assert reward.normalize_answer(1e-7) == "0.0000001"  # repr "1e-07": math-verify reads 1*e - 7
    assert reward.normalize_answer(1.5e-12) == "0.0000000000015"
    assert reward.normalize_answer(1e23) == "1" + "0" * 23  # not the binary value 99999999999999991611392
    assert reward.normalize_answer(0.1) == "0.1" and reward.normalize_answer(-2.5e-5) == "-0.000025"
    assert reward.normalize_answer(decimal.Decimal("1E-7")) == "0.0000001"
    assert reward.normalize_answer(decimal.Decimal("2.50")) == "2.5"
    assert reward.normalize_answer(decimal.Decimal("NaN")) is None
    assert reward.normalize_answer("1e-07") == "0.0000001" and reward.normalize_answer("2.5E+3") == "2500"
    assert reward.normalize_answer(np.float32(0.1)) == "0.1"
    assert reward.normalize_answer(5e-324) == "0." + "0" * 323 + "5"  # the smallest float: still exact
    assert reward.normalize_answer(decimal.Decimal("1e-5000")) is None  # more digits than anything can compare
    assert reward.normalize_answer(1.7976931348623157e308) == "17976931348623157" + "0" * 292


@pytest.mark.slow
def test_float_golds_score_across_magnitudes_1e_minus_30_to_1e30(pool):
    import decimal
    wide = decimal.Context(prec=200)  # text + 1 exactly: the default 28 digits would round 1e30 + 1 back to 1e30
    cases = []
    for exponent in range(-30, 31):
        for mantissa in ("1", "3.7"):
            gold = float(f"{mantissa}e{exponent}")
            text = reward.normalize_answer(gold)
            assert "e" not in text.lower() and float(text) == gold, (gold, text)
            cases += [(rf"\boxed{{{text}}}", gold, 1.0),  # the number itself
                      (rf"\boxed{{e{exponent:+d}}}", gold, -1.0),  # Euler's e plus or minus an integer
                      (rf"\boxed{{{wide.add(decimal.Decimal(text), 1)}}}", gold, -1.0)]  # another number: text + 1
    check(pool, cases)
    # math-verify compares floats to 6 decimals (float_rounding=6, official): below 1e-6 it cannot tell two small
    # numbers apart, but it does tell them from 0 and from e - 7
    check(pool, [(r"\boxed{0.00000011}", 1e-7, 1.0), (r"\boxed{0}", 1e-7, -1.0), (r"\boxed{e-7}", 1e-7, -1.0)])
