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

Same verdicts here, with three differences:
  * hard time limits: scoring runs in worker processes; an item that runs past `deadline` seconds has its worker
    SIGKILLed and replaced, scores `wrong_reward` and counts as a timeout; the rest of the batch goes on.
    math-verify's own alarms are off inside the workers: the kill is the time limit. (Time a worker spends waiting
    for a CPU on an oversubscribed machine is forgiven, up to 4 x deadline; and a CPU-time rlimit ends a stuck
    worker even if the trainer dies without killing it.)
  * balanced scheduling: workers pull chunks of items as they free up and the deadline applies per item, so a
    batch with h hang-prone items costs about ceil(h / workers) x deadline on top of the ordinary work.
  * counts: timeouts, parse failures, errors and worker restarts come back with `return_stats=True`.
Optional, off by default as in the official code: `think=True` scores only the text after the last `</think>`.

Workers come from a `forkserver`: a fresh interpreter that imports math-verify once and forks each worker, so the
trainer (PyTorch and vLLM threads, CUDA) is never forked, and a replacement worker is ready in under 0.1 s (the
workers do not re-import the trainer's main script; see `_start_process`).
"""

import collections
import functools
import logging
import math
import multiprocessing
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
START_TIMEOUT = 120.0  # seconds a new worker may take to import and warm up before we give up
MAX_FAILED_STARTS = 3  # workers in a row killed by a signal before they were ready, before we give up
# A worker that got less than this share of a CPU while its item's deadline ran out was waiting for a CPU (an
# oversubscribed machine), not stuck: it gets more time, up to STARVED_LIMIT deadlines.
STARVED_SHARE = 0.25
STARVED_LIMIT = 4.0

# Verdict codes, one small int per item: workers send CORRECT, WRONG, NO_ANSWER or ERROR; the parent sets the rest.
CORRECT, WRONG, NO_ANSWER, NO_GOLD, TIMEOUT, ERROR = range(6)
_STAT_NAMES = {CORRECT: "correct", WRONG: "wrong", NO_ANSWER: "no_answer", NO_GOLD: "no_gold", TIMEOUT: "timeouts",
               ERROR: "errors"}


# --- inputs (parent side) ---------------------------------------------------------------------

_INTEGRAL_DECIMAL = re.compile(r"[+-]?\d+\.0*")


def normalize_answer(answer):
    """Gold answer (int, float or LaTeX string) -> the string that goes inside \\boxed{}; None if there is none.

    Benchmarks store ints, floats (AMC23: 27.0) or LaTeX strings. An integral float becomes the int string so
    that 27.0 and 27 agree on the official exact-string shortcut as well as in `verify`.
    """
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Rational):  # int, numpy ints, Fraction
        if answer.denominator == 1:
            return str(int(answer.numerator))
        return f"\\frac{{{answer.numerator}}}{{{answer.denominator}}}"
    if isinstance(answer, numbers.Real):  # float, numpy floats
        value = float(answer)
        if value.is_integer():
            return str(int(value))
        return repr(value) if math.isfinite(value) else None
    text = str(answer).strip()
    if _INTEGRAL_DECIMAL.fullmatch(text):  # "27.0" stored as a string
        text = str(int(float(text)))
    return text or None


def strip_thinking(response, think):
    """The text to score: everything (official), or with `think=True` only what follows the last `</think>`.

    With `think=True` a response without `</think>` scores wrong: its thinking never closed (with
    R1-Distill the opening `<think>` sits in the prompt, so a truncated response shows no tag at all).
    Returns None for a response that cannot hold an answer.
    """
    if isinstance(response, (bytes, bytearray)):
        response = bytes(response).decode("utf-8", "replace")
    if not isinstance(response, str):
        return None
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


def _limit_cpu(seconds, hard):
    # Kernel backstop, for when the parent dies without killing us: SIGXCPU ends this process once it has used
    # `seconds` more CPU time, even inside a C call no Python signal handler could interrupt. While the parent
    # lives its kill comes first: by then the item has used at most one deadline of CPU time.
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime) + seconds
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


READY, CANCELLED = -1, -2  # control messages from workers, in the index slot


def _worker_main(conn, wake, cpu_seconds):
    """Worker loop. Receives ("work", [(index, response, gold), ...]) and ("cancel", [index, ...]) on `conn`;
    sends back (index, code, wall_time, cpu_time) for every item it scores, clocks read as it finished, plus
    (READY, 0, ...) once at start and (CANCELLED, 0, ...) after each cancel. It writes to `wake` only when the
    parent must act: after READY and CANCELLED, and when it runs out of items; per-item results wait in the pipe
    until then, so the parent does not wake once per item. An idle worker exits when the parent's end of `conn`
    closes; a busy one at the latest after `cpu_seconds` of CPU time on one item."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would otherwise leave a core file
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # outcomes travel as codes, not log lines
    judge("\\boxed{1}", "1")  # compile the regexes and load the LaTeX parser before any deadline runs
    conn.send((READY, 0, time.monotonic(), time.process_time()))
    wake.send_bytes(b"")
    items = collections.deque()
    while True:
        # Read what the parent sent (a cancel must land before the next item starts); block only when idle.
        while not items or conn.poll():
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            kind, payload = message
            if kind == "work":
                items.extend(payload)
            else:  # the parent gave these items to an idle worker while we were busy
                dropped = set(payload)
                items = collections.deque(item for item in items if item[0] not in dropped)
                conn.send((CANCELLED, 0, time.monotonic(), time.process_time()))
                wake.send_bytes(b"")
        index, response, gold = items.popleft()
        _limit_cpu(cpu_seconds, hard)
        # One message per item, so that after a kill the parent knows exactly which items finished, and when.
        conn.send((index, _judge_safely(response, gold), time.monotonic(), time.process_time()))
        if not items:
            wake.send_bytes(b"")


# --- the pool (parent side) -------------------------------------------------------------------

def _default_workers():
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _cpu_seconds(pid):
    """CPU time process `pid` has used (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


_start_lock = threading.Lock()


def _start_process(proc):
    """`proc.start()`, without the child re-running the parent's main script.

    spawn and forkserver children import the parent's `__main__` again before they run (the fork server's
    preload of `__main__` is handed no path in Python 3.11, so it does not help): for train.py that means torch,
    transformers and vLLM again, seconds for every replaced worker. The worker's code lives in this module and
    needs nothing from `__main__`, so while the child is set up `__main__` shows the spec of a `python -m`
    entry point, whose re-import multiprocessing skips.
    """
    main = sys.modules.get("__main__")
    if main is None or main.__dict__.get("_worker_main") is _worker_main:  # reward.py is itself the script
        proc.start()
        return
    with _start_lock:
        spec = main.__spec__
        main.__spec__ = types.SimpleNamespace(name="__main__")
        try:
            proc.start()
        finally:
            main.__spec__ = spec


def _stop_workers(workers):
    for w in workers:
        try:
            w.conn.send(None)
        except Exception:
            pass
    end = time.monotonic() + 1.0  # idle workers exit at once; busy ones are killed after a second
    for w in workers:
        w.proc.join(timeout=max(0.0, end - time.monotonic()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(timeout=5.0)
        w.conn.close()
        w.wake.close()
    workers.clear()


class RewardPool:
    """Worker processes that score (response, gold) pairs with a hard per-item deadline.

    workers      processes (default: usable cores, at most 8)
    deadline     seconds one item may run before its worker is killed and replaced. Wall-clock seconds, except
                 that a worker which got under a quarter of a CPU meanwhile was only waiting for one (the machine
                 is oversubscribed): it gets more time, up to 4 x deadline, so a load spike cannot fail an answer
    chunk_size   most items sent to a worker in one message; chunks shrink as a batch drains
    steal_after  seconds an item may run before the unstarted rest of its worker's chunk goes to idle workers
    Workers start on first use and are reused across calls; `close()`, garbage collection or the end of the
    process stops them.
    `totals` holds the counts summed over all calls.

    Scheduling: items go out in chunks, in batch order, to whichever worker is free. Each worker streams back one
    result per item, stamped with the time it finished, so the parent always knows which item a worker is on and
    since when: an item's deadline starts when the one before it finished. The parent reads results when it has
    to act anyway (a worker ran out of items, a deadline is due), not once per item. When no work is left to hand
    out but a worker is stuck on a slow item with unstarted items behind it, those items are cancelled there (the
    worker confirms) and handed to idle workers. So a hang delays only itself, and h hangs cost about
    ceil(h / workers) deadlines in all. A worker that dies other than by a deadline (a crash, a kill from outside)
    is replaced and the item it was on is retried once; an item two workers die on counts as an error.
    """

    def __init__(self, workers=None, deadline=DEFAULT_DEADLINE, chunk_size=32, steal_after=0.25,
                 start_method="forkserver"):
        self.num_workers = workers or _default_workers()
        self.deadline = float(deadline)
        self.chunk_size = max(1, int(chunk_size))
        self.steal_after = float(steal_after)
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Takes effect if the fork server is not running yet: it then imports math-verify once, and each
            # worker is a cheap fork of it.
            self._ctx.set_forkserver_preload(["math_verify", __name__])
        self._workers = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self.totals = collections.Counter()
        self._failed_starts = 0  # workers in a row that died before they were ready

    def _start_worker(self):
        parent_end, child_end = self._ctx.Pipe()
        wake_r, wake_w = self._ctx.Pipe(duplex=False)
        cpu_seconds = math.ceil(self.deadline) + 2  # see _limit_cpu
        proc = self._ctx.Process(target=_worker_main, args=(child_end, wake_w, cpu_seconds), name="reward-worker",
                                 daemon=True)
        _start_process(proc)
        child_end.close()
        wake_w.close()
        # queue: the indices it holds, in the order it runs them; since, cpu_since: wall clock and its CPU time
        # when its current item (or start-up) began; draining: a cancel is not confirmed yet, so it may be running
        # an item we handed elsewhere.
        return types.SimpleNamespace(proc=proc, conn=parent_end, wake=wake_r, queue=collections.deque(),
                                     since=time.monotonic(), cpu_since=0.0, ready=False, draining=False)

    def _replace(self, w):
        """Kill `w` (if still alive) and put a fresh worker in its slot."""
        w.proc.kill()
        w.proc.join(timeout=5.0)
        w.conn.close()
        w.wake.close()
        self._workers[self._workers.index(w)] = self._start_worker()

    def close(self):
        """Stop the workers. Idempotent; a closed pool cannot score again."""
        if os.getpid() == self._pid:  # a forked copy of this object must not stop the parent's workers
            self._finalizer()
        else:
            self._finalizer.detach()

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
        thinking block with think=True, a non-string response), `no_gold` (answer None or empty), `timeouts`
        (items that ran past the deadline), `errors` (exceptions, or two workers that died on the item), `restarts`
        (workers killed or crashed and replaced) and `seconds` (wall time).
        """
        responses, answers = list(responses), list(answers)
        if len(responses) != len(answers):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
        if self.closed or os.getpid() != self._pid:
            raise RuntimeError("score_batch on a closed RewardPool, or on one created by another process")
        start = time.monotonic()
        n = len(responses)
        codes = [None] * n
        texts, golds = [None] * n, [None] * n
        for i in range(n):
            golds[i] = normalize_answer(answers[i])
            texts[i] = strip_thinking(responses[i], think)
            if golds[i] is None:
                codes[i] = NO_GOLD
            elif texts[i] is None:
                codes[i] = NO_ANSWER
        todo = collections.deque(i for i in range(n) if codes[i] is None)
        with self._lock:
            restarts = self._run(todo, texts, golds, codes) if todo else 0
            stats = dict.fromkeys(["n", *_STAT_NAMES.values(), "restarts"], 0)
            for code in codes:
                stats[_STAT_NAMES[code]] += 1
            stats.update(n=n, restarts=restarts)
            self.totals.update(stats)
        stats["seconds"] = time.monotonic() - start
        scores = [correct_reward if code == CORRECT else wrong_reward for code in codes]
        return (scores, stats) if return_stats else scores

    def _run(self, todo, texts, golds, codes):
        """Hand `todo` out until every item has a code. Returns the number of workers replaced."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        restarts = 0
        crashed = set()  # items a worker died on (not by a deadline) once already

        def idle(w):
            return w.ready and not w.draining and not w.queue

        def feed():
            for w in self._workers:
                while idle(w) and todo:
                    size = min(self.chunk_size, -(-len(todo) // (2 * len(self._workers))))
                    chunk = [i for i in (todo.popleft() for _ in range(min(size, len(todo)))) if codes[i] is None]
                    if not chunk:
                        continue
                    try:
                        w.conn.send(("work", [(i, texts[i], golds[i]) for i in chunk]))
                    except OSError:  # it died just now; the collection step below replaces it
                        todo.extendleft(reversed(chunk))
                        break
                    w.queue.extend(chunk)
                    w.since = time.monotonic()  # it was waiting in recv: its first item starts now

        def busy(w):  # running an item we track, or possibly one we handed elsewhere (unconfirmed cancel)
            return w.queue or w.draining

        def next_look(w, now):  # when `w` may next be overdue
            if not w.ready:
                return w.since + START_TIMEOUT
            if not busy(w):
                return math.inf
            due = w.since + self.deadline
            return due if due > now else now + 0.05  # starved: look again shortly

        def overdue(w, now):
            if not w.ready:
                return now - w.since > START_TIMEOUT
            wall = now - w.since
            if not busy(w) or wall <= self.deadline:
                return False
            if wall >= STARVED_LIMIT * self.deadline:
                return True
            cpu = _cpu_seconds(w.proc.pid)  # time spent waiting for a CPU does not count against the item
            return cpu is None or cpu - w.cpu_since >= STARVED_SHARE * wall

        try:
            while todo or any(w.queue or w.draining for w in self._workers):
                # 1. Free workers pull the next chunk. With nothing left to hand out, a worker stuck on one item
                #    gives up the items queued behind it, which free workers then pull.
                feed()
                wake = []
                if not todo and any(idle(w) for w in self._workers):
                    for v in self._workers:
                        if len(v.queue) < 2 or v.draining:
                            continue
                        if time.monotonic() - v.since < self.steal_after:
                            wake.append(v.since + self.steal_after)
                            continue
                        stolen = list(v.queue)[1:]
                        try:
                            v.conn.send(("cancel", stolen))
                        except OSError:  # it just died; step 3 replaces it
                            pass
                        v.queue, v.draining = collections.deque([v.queue[0]]), True
                        todo.extend(stolen)
                    feed()

                # 2. Sleep until a worker runs out of items or confirms, a death, a deadline or a time to steal.
                now = time.monotonic()
                wake += [next_look(w, now) for w in self._workers]
                timeout = max(0.0, min(wake) - now)
                wait([w.wake for w in self._workers] + [w.proc.sentinel for w in self._workers],
                     None if math.isinf(timeout) else timeout)

                # 3. Collect results; replace workers that died or ran past their limit.
                for w in list(self._workers):
                    alive = self._drain(w, codes)
                    if alive and not overdue(w, time.monotonic()):
                        continue
                    stuck = w.queue[0] if w.queue else None
                    if alive:
                        w.proc.kill()
                    w.proc.join(timeout=5.0)
                    if not w.ready:
                        self._failed_starts += 1
                        # Killed by a signal (from outside, the OOM killer) while it started: start another. An
                        # error exit, a hung start-up or repeated deaths mean a broken installation instead.
                        if alive or w.proc.exitcode >= 0 or self._failed_starts > MAX_FAILED_STARTS:
                            self._workers.remove(w)
                            raise RuntimeError(f"a reward worker failed to start (exit code {w.proc.exitcode}, "
                                               f"{self._failed_starts} failed starts in a row); "
                                               "try `python -c 'import math_verify'`")
                    self._drain(w, codes)  # results written just before the end still count
                    if w.queue and w.queue[0] == stuck and codes[stuck] is None:
                        if alive or w.proc.exitcode == -signal.SIGXCPU:  # killed by us or by its CPU limit
                            codes[stuck] = TIMEOUT
                        elif stuck in crashed:  # a second worker died on it: the item is the cause
                            codes[stuck] = ERROR
                        else:  # any other death may have had another cause (a kill from outside, the OOM
                            crashed.add(stuck)  # killer) and may have come before the item began: retry once
                    todo.extendleft(i for i in reversed(w.queue) if codes[i] is None)  # the rest goes back in front
                    w.queue.clear()
                    self._replace(w)
                    restarts += 1
        except BaseException:
            # Interrupted (Ctrl-C, an error): a worker still holding items would send stale results into the next
            # call, so replace it.
            for w in list(self._workers):
                if w.queue or w.draining:
                    self._replace(w)
            raise
        return restarts

    def _drain(self, w, codes):
        """Read everything `w` has sent. Returns False if its pipes are closed (the worker is gone)."""
        alive = True
        try:  # wake-ups first: every result written before a wake-up is then readable below
            while w.wake.poll():
                w.wake.recv_bytes()
        except (EOFError, OSError):
            alive = False
        try:
            while w.conn.poll():
                index, code, w.since, w.cpu_since = w.conn.recv()  # its next item (if any) started then
                if index == READY:
                    w.ready = True
                    self._failed_starts = 0
                elif index == CANCELLED:
                    w.draining = False
                else:
                    if w.queue and w.queue[0] == index:
                        w.queue.popleft()
                    if codes[index] is None:  # may also be an item it began just before a cancel reached it
                        codes[index] = code
        except (EOFError, OSError):
            alive = False
        return alive


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
