"""tests/warm.py, which the suite's train.py and tool runs go through: a warm run answers as a subprocess would (exit
codes, signals, output, environment, working folder), ranks rendezvous as under torchrun, and what it cannot honour goes
to a real subprocess."""

import os
import signal
import sys
import time

import warm


def run(code, **kw):
    return warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, **kw)


def test_a_warm_run_answers_as_a_subprocess_would(tmp_path):
    done = run("import os, sys; print(os.environ['ASKED'], os.getcwd(), 'torch' in sys.modules); "
               "sys.stderr.write('said'); sys.exit(3)", env={**os.environ, "ASKED": "yes"}, cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (3, f"yes {tmp_path} True\n", "said")  # True: warm
    assert run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").returncode == -signal.SIGKILL
    interrupted = run("raise KeyboardInterrupt")
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in interrupted.stderr
    failed = run("1 / 0")
    assert failed.returncode == 1 and "ZeroDivisionError" in failed.stderr
    assert run("import sys; sys.exit('a message')").stderr == "a message\n"
    alone = run("import os; print(os.getsid(0) == os.getpid())", start_new_session=True)
    assert alone.stdout == "True\n"


def test_what_is_read_at_import_or_run_before_the_script_goes_to_a_real_subprocess():
    fresh = "import sys; print('torch' in sys.modules)"
    assert run(fresh, env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout == "False\n"  # torch reads it at import
    assert run(fresh, preexec_fn=lambda: None).stdout == "False\n"
    assert warm.warm_argv(["python3", "-c", "pass"], dict(os.environ)) is None  # another interpreter


def test_a_warm_popen_can_be_signalled_and_waited_for(tmp_path):
    with open(tmp_path / "out", "w+") as out:
        process = warm.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=out, stderr=out)
        deadline = time.monotonic() + 60
        while (tmp_path / "out").read_text() != "up\n" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None  # asleep
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == -signal.SIGTERM
        out.seek(0)
        assert out.read() == "up\n"


RANK = r'''
import os, sys, time
warm = "torch" in sys.modules
import torch
import torch.distributed as dist
import helper  # from PYTHONPATH, after the script's folder
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
said = (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"],
        int(total.item()), helper.NAME, warm)
os.write(1, (" ".join(map(str, said)) + "\n").encode())  # one write: the ranks share one stdout
if sys.argv[1] == "fail":
    if dist.get_rank() == 1:
        sys.exit(3)
    time.sleep(120)  # rank 0 would wait for ever: the launch stops it
dist.destroy_process_group()
'''


def test_warm_ranks_rendezvous_as_torchrun_starts_them_and_one_failing_stops_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # as under -n 2: nothing to change
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper.py").write_text("NAME = 'helper'\n")
    (tmp_path / "rank.py").write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    done = warm.torchrun(3, [tmp_path / "rank.py", "pass"], env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"{r} {r} 3 3 6 helper True" for r in range(3)], \
        done.stderr[-3000:]  # 1 + 2 + 3 on each
    start = time.monotonic()
    failed = warm.torchrun(2, [tmp_path / "rank.py", "fail"], env=env, timeout=120)
    assert failed.returncode == 1 and "rank 1 exited 3" in failed.stderr, failed.stderr
    assert time.monotonic() - start < 60, failed.stderr[-3000:]  # rank 0 was stopped, not waited for
    (tmp_path / "fresh.py").write_text("import sys, os; print('torch' in sys.modules, os.environ['WORLD_SIZE'])")
    fresh = warm.torchrun(2, [tmp_path / "fresh.py"], env={**env, "OMP_NUM_THREADS": "2"}, timeout=120)
    assert fresh.stdout == "False 2\n" * 2, fresh.stderr[-3000:]  # the real torchrun: an import would read the env


def test_a_pythonpath_that_shadows_an_imported_library_goes_to_a_real_subprocess(tmp_path):
    (tmp_path / "stand-ins" / "torch").mkdir(parents=True)
    (tmp_path / "stand-ins" / "torch" / "__init__.py").write_text("raise ImportError('the stand-in')\n")
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "mine.py").write_text("NAME = 'mine'\n")
    code = "import sys, mine; print(mine.NAME, 'torch' in sys.modules); import torch"
    warm_run = run(code, env={**os.environ, "PYTHONPATH": str(tmp_path / "own")})
    assert (warm_run.returncode, warm_run.stdout) == (0, "mine True\n")
    both = os.pathsep.join([str(tmp_path / "stand-ins"), str(tmp_path / "own")])
    shadowed = run(code, env={**os.environ, "PYTHONPATH": both})
    assert shadowed.stdout == "mine False\n" and "the stand-in" in shadowed.stderr
