"""reward.py — math-verify rewards with hard time limits.

    import reward
    scores = reward.score_batch(responses, answers)                  # [+1.0 | -1.0, ...]
    scores, stats = reward.score_batch(responses, answers, return_stats=True)
    reward.score("... so the answer is \\boxed{27}.", 27.0)           # +1.0

What the official CE-GPPO code does (Kwai-Klear/CE-GPPO, a verl fork, `math_verify_from_sky` in
verl/utils/reward_score/math_dapo.py): math-verify `parse` over the whole decoded response, thinking
included, with the default extraction configs (LaTeX environments and \\boxed{}, then plain numbers and
expressions); fewer than two results (no sympy answer next to its matched string) scores -1; an extracted string
equal to the gold string scores +1; otherwise `verify(parse("\\boxed{gold}"), pred)`, gold first, decides +1 / -1.
Wrong, unparsable and timed-out answers all score -1. Its only time limits are math-verify's own (5 s per call,
through `signal.alarm`): they work only in a main thread, and an alarm lands only between Python bytecodes, so
work stuck inside one long C call runs on (Math-Verify issue #65: nested powers that hang despite the timeout).

Same verdicts here, with these differences:
  * hard time limits: scoring runs in worker processes, one item per worker at a time. The deadline is wall-clock
    time, like the official `signal.alarm`, counted from the moment the item is handed to an idle worker: once
    it has passed, the worker is SIGKILLed and replaced, the item scores `wrong_reward` and counts as a timeout,
    and the rest of the batch goes on. So one item occupies a worker for at most `deadline` seconds plus the
    kill (milliseconds), or about twice that if the first worker it ran on crashed under it (it is then retried
    once on another).
  * balanced scheduling: an item goes only to an idle worker, so none waits behind a hang, and a batch with h
    hang-prone items costs about ceil(h / workers) x deadline on top of the ordinary work.
  * a worker that dies other than by a deadline (a crash, the OOM killer, a kill from outside) is replaced and
    its item retried once; an item two workers die on scores `wrong_reward` and counts as an error.
  * bounded start-up: starting a worker waits at most START_TIMEOUT (60 s) for multiprocessing's fork server; one
    that does not answer (stopped, deadlocked) is killed, and the next try starts a fresh one. After
    MAX_FAILED_STARTS (3) failed starts in a row, or a worker that exits with an error or hangs while it warms up,
    score_batch raises RuntimeError. So no call blocks forever.
  * robust inputs: a gold that cannot be normalised (None, NaN, inf, a list, an int too long to print) scores
    wrong and counts as "no gold"; a response that is not text scores wrong and counts as "no answer". No item
    makes score_batch raise.
  * counts: timeouts, parse failures, errors and worker restarts come back with `return_stats=True`.
Optional, off by default as in the official code: `think=True` scores only the text after the last `</think>`.
"""

import collections
import decimal
import functools
import logging
import math
import multiprocessing
import multiprocessing.forkserver
import numbers
import os
import re
import resource
import signal
import sys
import threading
import time
import types
import weakref
from multiprocessing.connection import wait

CORRECT_REWARD = 1.0  # official values
WRONG_REWARD = -1.0
DEFAULT_DEADLINE = 5.0  # seconds per item; the official code gives math-verify 5 s per call
START_TIMEOUT = 60.0  # seconds to fork a worker (a cold fork server imports math-verify first), and again to warm up
MAX_FAILED_STARTS = 3  # failed worker starts in a row before we give up

# Verdict codes, one small int per item: workers send CORRECT, WRONG, NO_ANSWER or ERROR; the parent sets the rest.
CORRECT, WRONG, NO_ANSWER, NO_GOLD, TIMEOUT, ERROR = range(6)
_STAT_NAMES = {CORRECT: "correct", WRONG: "wrong", NO_ANSWER: "no_answer", NO_GOLD: "no_gold", TIMEOUT: "timeouts",
               ERROR: "errors"}


# --- inputs (parent side) ---------------------------------------------------------------------

_INTEGRAL_DECIMAL = re.compile(r"([+-]?)(\d+)\.0*")
_SCIENTIFIC = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d{1,4}")
MAX_GOLD_DIGITS = 4000  # a positional decimal longer than this is no gold (Python's int <-> str limit is 4300)


def _positional(value: decimal.Decimal):
    """A finite Decimal written without an exponent (1E-7 -> "0.0000001", 1E+23 -> "100000000000000000000000"),
    an integral one as an integer; None if that takes more than MAX_GOLD_DIGITS digits. math-verify reads "1e-07"
    as 1*e - 7 (Euler's e), so a gold must never reach it in scientific notation."""
    if not value.is_finite():
        return None
    sign, digits, exponent = value.as_tuple()
    if len(digits) + abs(exponent) > MAX_GOLD_DIGITS:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    text = format(value, "f")
    return text.rstrip("0") if "." in text else text


def normalize_answer(answer):
    """Gold answer (int, float or LaTeX string) -> the string that goes inside \\boxed{}; None if there is none.

    Benchmarks store ints, floats (AMC23: 27.0) or LaTeX strings. An integral number becomes its exact integer
    string, so that 27, 27.0 and "27.0" agree on the official exact-string shortcut as well as in `verify`.
    Floats, Decimals and strings in scientific notation ("1e-07") are written positionally ("0.0000001"): the
    float's shortest round-trip digits, never its repr, which math-verify would read as 1*e - 7.
    A gold that cannot be normalised (NaN, inf, a list, an int too long to print...) gives None: "no gold".
    """
    try:
        return _normalize(answer)
    except Exception:  # int -> str digit limit, an object whose methods raise: no gold rather than a lost batch
        return None


def _normalize(answer):
    if isinstance(answer, (bytes, bytearray)):
        answer = bytes(answer).decode("utf-8", "replace")
    if isinstance(answer, decimal.Decimal):
        return _positional(answer)
    if isinstance(answer, str):
        text = str.__str__(answer).strip()  # a plain str whatever the subclass: it must unpickle in a worker
        if _SCIENTIFIC.fullmatch(text):  # "1e-07" in a data file means the number, not 1*e - 7
            return _positional(decimal.Decimal(text))
        integral = _INTEGRAL_DECIMAL.fullmatch(text)
        if integral:  # "27.0" stored as a string: drop the zeros as text, exact however many digits
            sign, digits = integral[1], integral[2].lstrip("0") or "0"
            text = ("-" if sign == "-" and digits != "0" else "") + digits
        return text or None
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Integral):  # int, numpy ints
        return str(int(answer))
    if isinstance(answer, numbers.Rational):  # Fraction
        if answer.denominator == 1:
            return str(int(answer.numerator))
        return f"\\frac{{{answer.numerator}}}{{{answer.denominator}}}"
    if isinstance(answer, numbers.Real):  # float, numpy floats
        value = float(answer)
        if not math.isfinite(value):
            return None
        # The decimal the float stands for: its shortest round-trip digits (what the data file held: 1e23, not the
        # binary value 99999999999999991611392; 0.1, not 0.1000000000000000055...), written positionally.
        try:  # numpy's float32 prints its own shortest digits (0.1, where float() would give 0.10000000149...)
            exact = decimal.Decimal(str(answer)) if type(answer) is not float else None
        except (decimal.InvalidOperation, ValueError, TypeError):
            exact = None
        return _positional(exact if exact is not None and exact.is_finite() else decimal.Decimal(repr(value)))
    return None  # lists, dicts, other objects


def strip_thinking(response, think):
    """The text to score: everything (official), or with `think=True` only what follows the last `</think>`.

    With `think=True` a response without `</think>` scores wrong: its thinking never closed (with
    R1-Distill the opening `<think>` sits in the prompt, so a truncated response shows no tag at all).
    Returns None for a response that cannot hold an answer (not text).
    """
    if isinstance(response, (bytes, bytearray)):
        response = bytes(response).decode("utf-8", "replace")
    if not isinstance(response, str):
        return None
    response = str.__str__(response)  # a plain str whatever the subclass: it must unpickle in a worker
    if think:
        end = response.rfind("</think>")
        return None if end < 0 else response[end + len("</think>"):]
    return response


# --- scoring (worker side) --------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _parse_gold(gold):
    from math_verify import parse

    # Official: the gold is wrapped as \boxed{gold}; a gold that already holds a \boxed{} is used as it is.
    return parse(gold if "\\boxed" in gold else "\\boxed{" + gold + "}", parsing_timeout=None)


def judge(response, gold):
    """Official verdict for one (response, normalised gold) pair, no time limit: CORRECT, WRONG or NO_ANSWER.
    Runs in workers; call it directly only where a hang is acceptable."""
    from math_verify import parse, verify

    # math-verify's own alarms off (None): they cannot stop code stuck in C, and an alarm that interrupts the
    # LaTeX parser mid-update could leave its caches half-written. The parent's kill is the time limit.
    pred = parse(response, parsing_timeout=None)
    if len(pred) < 2:  # official: no sympy answer next to the matched string
        return NO_ANSWER
    if pred[1] == gold:  # official exact-string shortcut
        return CORRECT
    return CORRECT if verify(_parse_gold(gold), pred, timeout_seconds=None) else WRONG


def _judge_safely(response, gold):
    try:
        return judge(response, gold)
    except Exception:  # sympy/antlr errors, MemoryError, RecursionError: the answer is not verifiable
        return ERROR


def _worker_main(conn, cpu_seconds):
    """Worker loop: sends "ready" once warmed up, then answers each (response, gold) it receives with a verdict
    code. Exits when sent None or when the parent's end of `conn` closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise leave a core file
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # outcomes travel as codes, not log lines
    judge("\\boxed{1}", "1")  # compile the regexes and load the LaTeX parser before any deadline runs
    conn.send("ready")
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        # Process exit even if the parent dies without killing us: the kernel ends this process
        # (SIGXCPU) once this item has used a few seconds more CPU time than the deadline, even inside a C call.
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime) + cpu_seconds
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        conn.send(_judge_safely(*item))


# --- the pool (parent side) -------------------------------------------------------------------

def _default_workers():
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


_start_lock = threading.Lock()


def _start_process(proc, timeout, fork_server):
    """`proc.start()`, given at most `timeout` seconds: a fork server that does not answer must not block
    score_batch forever (it blocks there otherwise). Returns None, or why the start failed."""
    failure = []

    def start():
        with _start_lock:
            # Spawn and forkserver children import the parent's `__main__` again before they run
            # (for train.py: torch, transformers, vLLM, seconds per replaced worker). Workers need nothing from it,
            # and multiprocessing skips that import for a `python -m` entry point, so while the child's start-up
            # data is taken `__main__` shows that spec (unless reward.py is itself the script).
            main = sys.modules.get("__main__")
            spec = getattr(main, "__spec__", None)
            if main is not None and __name__ != "__main__":
                main.__spec__ = types.SimpleNamespace(name="__main__")
            try:
                proc.start()
            except Exception as e:
                failure.append(f"{type(e).__name__}: {e}")
            finally:
                if main is not None:
                    main.__spec__ = spec

    thread = threading.Thread(target=start, name="reward-start", daemon=True)
    thread.start()
    thread.join(timeout)
    if not thread.is_alive():
        return failure[0] if failure else None
    if fork_server:
        _kill_fork_server()  # the start blocked on it reads EOF and fails at once
        thread.join(5.0)
    if thread.is_alive():
        raise RuntimeError(f"could not start a reward worker: proc.start() blocked for {timeout:g} s, and killing "
                           "multiprocessing's fork server did not release it")
    return f"no answer from multiprocessing's fork server within {timeout:g} s; killed it"


def _kill_fork_server():
    # multiprocessing keeps no public handle on its fork server. Once this one is dead (it is our child, so
    # multiprocessing's waitpid sees it) the next start launches a fresh one; wait for that without reaping it.
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                break
            time.sleep(0.01)
    except (ProcessLookupError, ChildProcessError):
        pass


def _kill(w):
    # By pid: once a fork server has been replaced, multiprocessing takes the workers it forked for dead.
    try:
        os.kill(w.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_workers(workers, owner):
    if os.getpid() != owner:  # a forked copy of a pool must not stop its parent's workers
        return
    for w in workers:
        try:
            w.conn.send(None)
        except OSError:
            pass
    end = time.monotonic() + 1.0  # idle workers exit at once; busy ones are killed after a second
    for w in workers:
        w.proc.join(timeout=max(0.0, end - time.monotonic()))
        if w.proc.exitcode is None:
            _kill(w)
            w.proc.join(timeout=1.0)
        w.conn.close()
    workers.clear()


class RewardPool:
    """Worker processes that score (response, gold) pairs with a hard per-item deadline.

    workers       processes (default: usable cores, at most 8)
    deadline      wall-clock seconds an item may run, from the moment it is handed to an idle worker, before that
                  worker is killed and replaced
    start_method  "forkserver"; tests use "fork" to hand workers a patched `judge`
    Workers start on first use and are reused across calls; `close()`, the context manager, garbage collection or
    the end of the process stops them. `totals` holds the counts summed over all calls.
    """

    def __init__(self, workers=None, deadline=DEFAULT_DEADLINE, start_method="forkserver"):
        self.num_workers = workers or _default_workers()
        self.deadline = float(deadline)
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # The fork server, started on first use, imports math-verify once and forks each worker
            # from there: a replacement is ready in about 0.1 s, and the trainer itself is never forked.
            self._ctx.set_forkserver_preload(["math_verify", __name__])
        self._workers = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # Close(), the context manager, garbage collection and process exit all end up here, once.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, self._pid)
        self._failed_starts = 0  # worker starts in a row that failed or died before the worker was ready
        self.totals = collections.Counter()

    def close(self):
        """Stop the workers. Idempotent; a closed pool cannot score again."""
        self._finalizer()

    @property
    def closed(self):
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def score_batch(self, responses, answers, *, correct_reward=CORRECT_REWARD, wrong_reward=WRONG_REWARD,
                    think=False, return_stats=False):
        """Scores, one per pair: `correct_reward` if math-verify accepts the response, else `wrong_reward`.

        With `return_stats=True` returns `(scores, stats)`; stats counts, for this call: `n`, `correct`,
        `wrong` (an answer was found and differs), `no_answer` (parse failures: nothing extractable, an unclosed
        thinking block with think=True, a response that is not text), `no_gold` (a gold answer that is None,
        empty or cannot be normalised), `timeouts` (items that ran past the deadline), `errors` (exceptions, or two
        workers that died on the item), `restarts` (workers killed or crashed and replaced) and `seconds` (wall
        time).
        """
        responses, answers = list(responses), list(answers)
        if len(responses) != len(answers):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
        if self.closed or os.getpid() != self._pid:
            raise RuntimeError("score_batch on a closed RewardPool, or on one created by another process")
        start = time.monotonic()
        golds = [normalize_answer(a) for a in answers]
        texts = [strip_thinking(r, think) for r in responses]
        codes = [NO_GOLD if g is None else NO_ANSWER if t is None else None for t, g in zip(texts, golds)]
        with self._lock:
            restarts = self._run(texts, golds, codes) if None in codes else 0
            stats = dict.fromkeys(["n", *_STAT_NAMES.values(), "restarts"], 0)
            for code in codes:
                stats[_STAT_NAMES[code]] += 1
            stats.update(n=len(codes), restarts=restarts)
            self.totals.update(stats)
        stats["seconds"] = time.monotonic() - start
        scores = [correct_reward if code == CORRECT else wrong_reward for code in codes]
        return (scores, stats) if return_stats else scores

    def _run(self, texts, golds, codes):
        """Score every item whose code is None. Returns the number of workers replaced."""
        todo = collections.deque(i for i, code in enumerate(codes) if code is None)
        crashed = set()  # items a worker died on (not by a deadline) once already
        restarts = 0
        try:
            while len(self._workers) < self.num_workers:
                self._workers.append(self._start_worker())
            while todo or any(w.item is not None for w in self._workers):
                # An item goes only to an idle worker, so none waits behind a hang.
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and w.item is None and todo:
                        w.item, w.since = todo.popleft(), now
                        try:
                            w.conn.send((texts[w.item], golds[w.item]))
                        except OSError:  # it just died: its pipe reads EOF below
                            pass
                # Sleep until a worker answers or dies, or a deadline or start-up limit is due.
                due = min(map(self._due, self._workers))
                answered = wait([w.conn for w in self._workers], max(0.0, min(due - now, START_TIMEOUT)))
                now = time.monotonic()
                for w in list(self._workers):
                    alive = True
                    if w.conn in answered:
                        try:
                            message = w.conn.recv()
                        except (EOFError, OSError):  # its end of the pipe closed: the process is gone
                            alive = False
                        else:
                            if w.ready:
                                codes[w.item], w.item = message, None
                            else:  # "ready"
                                w.ready, self._failed_starts = True, 0
                    if alive and now < self._due(w):
                        continue
                    self._retire(w, alive, codes, todo, crashed)
                    self._workers.append(self._start_worker())
                    restarts += 1
        except BaseException:
            # Interrupted (Ctrl-C, an error): a worker still holding an item would answer it in the next call.
            for w in [w for w in self._workers if w.item is not None]:
                _kill(w)
                w.conn.close()
                self._workers.remove(w)
            raise
        return restarts

    def _due(self, w):
        """When `w` must have answered: the end of its start-up or its item's deadline; inf when idle."""
        if not w.ready:
            return w.since + START_TIMEOUT
        return math.inf if w.item is None else w.since + self.deadline

    def _retire(self, w, alive, codes, todo, crashed):
        """Take out `w`, which died (alive=False) or ran out of time (alive=True: killed here); settle its item."""
        if alive:
            _kill(w)
        w.proc.join(timeout=0.0 if alive else 1.0)  # a dead worker's exit code says how it died (ms, normally)
        w.conn.close()
        self._workers.remove(w)
        exitcode = w.proc.exitcode
        if not w.ready:
            if alive:
                self._start_failed(f"no ready signal within {START_TIMEOUT:g} s", fatal=True)
            self._start_failed(f"exit code {exitcode}", fatal=exitcode is not None and exitcode >= 0)
        elif w.item is not None:
            if alive or exitcode == -signal.SIGXCPU:  # killed by us, or by its CPU-time limit
                codes[w.item] = TIMEOUT
            elif w.item in crashed:  # a second worker died on it, so the item is the cause
                codes[w.item] = ERROR
            else:  # any other death may have had another cause (a kill from outside, the OOM killer): retry once
                crashed.add(w.item)
                todo.appendleft(w.item)

    def _start_worker(self):
        """A new worker, not ready yet: it says so once warmed up. Each try waits at most START_TIMEOUT."""
        while True:
            parent_end, child_end = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker_main, args=(child_end, math.ceil(self.deadline) + 2),
                                     name="reward-worker", daemon=True)
            failure = _start_process(proc, START_TIMEOUT, self._ctx.get_start_method() == "forkserver")
            child_end.close()
            if failure is None:
                return types.SimpleNamespace(proc=proc, conn=parent_end, item=None, since=time.monotonic(),
                                             ready=False)
            parent_end.close()
            self._start_failed(f"proc.start(): {failure}")

    def _start_failed(self, why, fatal=False):
        # A start that failed or was killed (from outside, the OOM killer) is tried again; an error
        # exit, a start-up that never finishes, or MAX_FAILED_STARTS failures in a row mean a broken installation.
        self._failed_starts += 1
        if fatal or self._failed_starts > MAX_FAILED_STARTS:
            raise RuntimeError(f"a reward worker failed to start ({why}, {self._failed_starts} failed starts in a "
                               "row); try `python -c 'import math_verify'`")


# --- module-level default pool ----------------------------------------------------------------

_default_pool = None
_default_lock = threading.Lock()


def default_pool():
    """The shared pool (default settings), created on first use; like every pool it is closed at exit."""
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed or _default_pool._pid != os.getpid():
            _default_pool = RewardPool()
        return _default_pool


def score_batch(responses, answers, *, correct_reward=CORRECT_REWARD, wrong_reward=WRONG_REWARD, think=False,
                return_stats=False, pool=None):
    """Score response i against gold answers[i] (int, float or LaTeX string); see `RewardPool.score_batch`.
    Uses `pool`, or the module's default pool."""
    return (pool or default_pool()).score_batch(responses, answers, correct_reward=correct_reward,
                                                wrong_reward=wrong_reward, think=think, return_stats=return_stats)


def score(response, answer, *, correct_reward=CORRECT_REWARD, wrong_reward=WRONG_REWARD, think=False, pool=None):
    """Score one response against one gold answer (through the pool, so the deadline holds here too)."""
    return score_batch([response], [answer], correct_reward=correct_reward, wrong_reward=wrong_reward,
                       think=think, pool=pool)[0]


if __name__ == "__main__":
    examples = [("The answer is \\boxed{27}.", 27.0), ("So x = \\frac{1}{2}, i.e. 0.5", "0.5"), ("no idea", 3)]
    got, counts = score_batch([r for r, _ in examples], [a for _, a in examples], return_stats=True)
    for (r, a), s in zip(examples, got):
        print(f"{s:+.0f}  gold={a!r:8} {r!r}")
    print(counts)
