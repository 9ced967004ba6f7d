"""tests/warm.py, which the suite's train.py and tool runs go through: a warm run answers as a subprocess would (exit
codes, signals, output, environment, working folder), and what it cannot honour goes to a real subprocess."""

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
