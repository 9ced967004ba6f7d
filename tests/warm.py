"""`python train.py ...` for the tests, started warm: a process forked from an interpreter that has imported torch,
transformers and vllm already, instead of a new interpreter that spends 3-9 s importing them again (about 50 runs in
the suite). The child is a process of its own, as with subprocess: its own pid, session (start_new_session), signals,
exit code (-9 when killed), environment, working folder and output files; the script runs as __main__ (runpy), as
`python SCRIPT`, `python -m MODULE` or `python -c CODE` would run it.

What differs from a fresh interpreter, and why it does not matter here:
- torch, transformers and vllm were imported under the test worker's environment, so a variable they read at import
  (thread counts, ATEN_CPU_CAPABILITY, anything TORCH_/VLLM_/PYTHON...) is honoured only by a real subprocess: run()
  and popen() fall back to one when the environment they are given changes such a variable (IMPORT_TIME_PREFIXES);
- str hashing is seeded once per server, so two warm runs share it where two interpreters would not (nothing in a
  run's numbers may depend on set order; the suite's bad-input and kill-before-torch checks keep real subprocesses);
- PYTHONPATH is honoured where the script's own modules are looked up (after its folder, as an interpreter puts it);
  one whose folders hold a module the server imported already (a stand-in for torch) means a real subprocess;
- SIGINT raises KeyboardInterrupt in the child whatever the worker ignores (a shell that starts the suite in the
  background leaves it ignored, and a Ctrl-C test needs it); a preexec_fn (a resource limit, say) is honoured by a
  real subprocess only, so one given means a real subprocess.

torchrun() launches a script's ranks the same way: one warm child per rank with the variables torchrun gives a rank
on one node (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), rank 0 serving the rendezvous store where
torchrun's agent would. The suite keeps one launch of train.py under the real torchrun (test_distributed.py).

The server (this file run as a script) reads one JSON request per line: start (fork a child, answer its pid) or wait
(its exit code, or None after a timeout). One server per test worker, started at first use, ended with the worker.
"""

import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "ATEN_", "TORCH", "PYTORCH", "CUDA", "VLLM_", "PYTHON", "LD_", "HF_",
                        "TRANSFORMERS", "TOKENIZERS", "KMP_", "GOMP_")

ENGINE_MODULES = ("vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.v1.executor.uniproc_executor",
                  "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.qwen2",
                  "vllm.model_executor.model_loader", "vllm.v1.attention.backends.cpu_attn",
                  "vllm.entrypoints.launchers.cli_args", "compressed_tensors")


# --- the server ---------------------------------------------------------------------------------------------------

def serve():
    """Import what a run imports, then fork a child per request."""
    # the answers on a copy of stdout, and stdout itself onto stderr: a library's print cannot garble an answer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    import runpy
    import traceback

    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (the lazy modules a run loads)
    try:  # under the settings rollout._import_vllm gives it (its logger reads the level once, at import)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import vllm  # noqa: F401
        import vllm.entrypoints.llm  # noqa: F401
    except ImportError:
        pass
    for name in ENGINE_MODULES:  # what starting an engine imports on its way: ~1 s of each vLLM run otherwise
        try:
            importlib.import_module(name)
        except ImportError:  # another vLLM's layout: that run imports it itself
            pass
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    library_path = [p for p in sys.path[1:] if os.path.abspath(p) not in own]  # the path a child starts from
    requests = sys.stdin.buffer
    imported = sorted({name.partition(".")[0] for name in sys.modules})  # what a PYTHONPATH must not shadow
    # Out of the collector's sight: a child's full collection (and its exit) walked every object the imports made,
    # copying each page it touched out of the server's memory, ~1.6 s a child, where a fresh interpreter spends ~0.3
    gc.freeze()
    replies.write(json.dumps({"ready": True, "imported": imported}).encode() + b"\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        if request["op"] == "wait":
            replies.write(json.dumps({"code": wait(request["pid"], request["timeout"])}).encode() + b"\n")
            replies.flush()
            continue
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid:
            replies.write(json.dumps({"pid": pid}).encode() + b"\n")
            replies.flush()
            continue
        # the child: a process of its own, then the script as __main__; SystemExit ends the interpreter normally
        replies.close()
        if request["new_session"]:
            os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
        argv = request["argv"]
        sys.path[1:] = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p] \
            + library_path
        try:
            if argv[0] == "-c":
                sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            elif argv[0] == "-m":
                sys.argv, sys.path[0] = [argv[1], *argv[2:]], request["cwd"]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
        except KeyboardInterrupt:  # as an interpreter does: the traceback, then death by SIGINT
            traceback.print_exc()
            sys.stdout.flush(), sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)


def wait(pid, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(0.02)


# --- the client ---------------------------------------------------------------------------------------------------

_server, _imported, _lock = None, set(), threading.Lock()


def _start():
    global _server, _imported
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        ready = json.loads(_server.stdout.readline())
        assert ready["ready"], ready
        _imported = set(ready["imported"])


def _ask(request):
    with _lock:
        _start()
        _server.stdin.write(json.dumps(request).encode() + b"\n")
        _server.stdin.flush()
        return json.loads(_server.stdout.readline())


def warm_argv(args, env):
    """The script (or -m module, or -c code) and its arguments where a warm start runs it as an interpreter would,
    else None."""
    args = [os.fspath(a) for a in args]
    if len(args) < 2 or args[0] != sys.executable or not (args[1] in ("-m", "-c") or args[1].endswith(".py")):
        return None
    changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
    if any(k.startswith(IMPORT_TIME_PREFIXES) for k in changed - {"PYTHONPATH"}):
        return None
    if "PYTHONPATH" in changed and shadows(env.get("PYTHONPATH", "")):
        return None
    return args[1:]


def shadows(pythonpath):
    """Whether a folder on this PYTHONPATH holds a module the server imported already (a stand-in for torch, say): in
    a fresh interpreter that one would be imported instead."""
    with _lock:
        _start()
    for folder in filter(os.path.isdir, pythonpath.split(os.pathsep)):
        names = {n[:-3] if n.endswith(".py") else n for n in os.listdir(folder)}
        if names & _imported:
            return True
    return False


class Popen:
    """subprocess.Popen for a warm run: pid, wait(timeout), poll(), send_signal, kill, returncode. stdout and stderr:
    open files (written from their end) or None (discarded)."""

    def __init__(self, args, argv, cwd, env, stdout, stderr, start_new_session):
        self.args, self.returncode = args, None
        out, err = (os.devnull if stream is None else stream.name for stream in (stdout, stderr))
        self.pid = _ask({"op": "start", "argv": argv, "cwd": os.fspath(cwd or os.getcwd()), "env": env,
                         "stdout": out, "stderr": err, "new_session": start_new_session})["pid"]

    def wait(self, timeout=None):
        if self.returncode is None:
            code = _ask({"op": "wait", "pid": self.pid, "timeout": timeout})["code"]
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = code
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signum):
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def popen(args, cwd=None, env=None, stdout=None, stderr=None, start_new_session=False, preexec_fn=None):
    """subprocess.Popen, warm where it can be (stdout/stderr: files or None). A preexec_fn runs only in a real
    subprocess: a warm child already has SIGINT's default, which is all the tests ask of one otherwise."""
    env = dict(os.environ if env is None else env)
    argv = None if preexec_fn else warm_argv(args, env)
    if argv is None:
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session, preexec_fn=preexec_fn)
    return Popen(args, argv, cwd, env, stdout, stderr, start_new_session)


def run(args, cwd=None, env=None, timeout=None, capture_output=False, text=False, start_new_session=False,
        preexec_fn=None):
    """subprocess.run, warm where it can be."""
    env = dict(os.environ if env is None else env)
    argv = None if preexec_fn else warm_argv(args, env)
    if argv is None:
        return subprocess.run(args, cwd=cwd, env=env, timeout=timeout, capture_output=capture_output, text=text,
                              start_new_session=start_new_session, preexec_fn=preexec_fn)
    with tempfile.NamedTemporaryFile(prefix="warm-") as out, tempfile.NamedTemporaryFile(prefix="warm-") as err:
        process = Popen(args, argv, cwd, env, out if capture_output else None, err if capture_output else None,
                        start_new_session)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        outputs = []
        for f in (out, err):
            f.seek(0)
            data = f.read() if capture_output else None
            outputs.append(data.decode(errors="replace") if text and data is not None else data)
    return subprocess.CompletedProcess(args, process.returncode, *outputs)


def torchrun(nproc, argv, cwd=None, env=None, timeout=None):
    """`python -m torch.distributed.run --standalone --nproc-per-node=NPROC ARGV` (its stdout and stderr captured as
    text), the ranks started warm. As torchrun: OMP_NUM_THREADS=1 unless set; the ranks' output interleaved on one
    stdout and one stderr; when a rank fails the others get SIGTERM (SIGKILL 10 s on) and the launch answers 1. A
    timeout stops every rank and raises TimeoutExpired. Where the environment changes what an import reads, the
    real torchrun runs."""
    env = {"OMP_NUM_THREADS": "1", **(os.environ if env is None else env)}
    argv = [os.fspath(a) for a in argv]
    script = warm_argv([sys.executable, *argv], env)
    if script is None:
        return real_torchrun(nproc, argv, cwd, env, timeout)
    with socket.socket() as probe:  # a free port for rank 0's store, as --standalone picks one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.NamedTemporaryFile(prefix="warm-") as out, tempfile.NamedTemporaryFile(prefix="warm-") as err:
        ranks = [Popen(argv, script, cwd, {**env, **node, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
                       out, err, True) for r in range(nproc)]
        try:
            while None in (codes := [rank.poll() for rank in ranks]) and not any(codes):  # every rank asked
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv, timeout)
                time.sleep(0.05)
        finally:
            stop(ranks)
        failed = [(r, code) for r, code in enumerate(codes) if code]  # the cause, not the ranks stopped for it
        out.seek(0), err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    if failed:
        stderr += "".join(f"warm torchrun: rank {r} exited {code}\n" for r, code in failed)
    return subprocess.CompletedProcess(argv, 1 if failed else 0, stdout, stderr)


def real_torchrun(nproc, argv, cwd=None, env=None, timeout=None):
    """`python -m torch.distributed.run --standalone --nproc-per-node=NPROC ARGV`, its elastic agent and all."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           *map(os.fspath, argv)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def stop(ranks, grace=10.0):
    """SIGTERM to the ranks still running, SIGKILL to those alive `grace` seconds on; each waited for."""
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signal.SIGTERM)
    for rank in ranks:
        try:
            rank.wait(grace)
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()


if __name__ == "__main__":
    serve()
