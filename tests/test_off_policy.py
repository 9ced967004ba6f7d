"""--off-policy-steps 1: the next batch sampled while this one trains. The sampler process gives the numbers of the
one-process emulation (--no-sampler-process) step for step; a run killed mid-update resumes to the uninterrupted
numbers (the batch in flight is in the checkpoint); SIGTERM and Ctrl-C leave nothing running; the bad inputs are one
line and exit code 2, before torch loads."""

import json
import os
import signal
import sys
import time

import pytest
import torch
import warm
from conftest import ROOT, vllm_or_skip
from test_train import SMALL, final_state, read_metrics

from cegppo_utils import flags, sampler_process

# three steps, checkpoints at 2 (holding step 3's batch, sampled during step 2's update) and 3
OFF = SMALL + ["--max-steps", "3", "--save-every", "2", "--log-samples-every", "0", "--off-policy-steps", "1"]
CLOCKS = ("time_rollout_s", "time_reward_s", "time_update_s", "time_sampler_s", "tokens_per_s")  # differ run to run


def train(output_dir, *extra, env=None, expect=0):
    """train.py on OFF's flags in a session of its own (a Ctrl-C reaches it and its children only): the finished
    process (its pid is the session's id, to look for anything it left running). Its output goes to files, not pipes:
    a process it left running would hold a pipe open, and reading it would wait for that process too."""
    with open(f"{output_dir}.out", "w+") as out, open(f"{output_dir}.err", "w+") as err:
        process = warm.popen([sys.executable, "train.py", *OFF, "--output-dir", str(output_dir), *extra],
                             cwd=ROOT, stdout=out, stderr=err, env={**os.environ, **(env or {})},
                             start_new_session=True)  # a warm child has SIGINT's default (tests/warm.py)
        process.wait(timeout=900)
        out.seek(0), err.seek(0)
        process.stdout_text, process.stderr_text = out.read(), err.read()
    assert process.returncode == expect, (process.returncode, process.stderr_text[-3000:])
    return process


def in_session(session: int) -> list[str]:
    """The command lines of the processes still in that session."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            if int(fields[3]) == session:  # state ppid pgrp session ...
                found.append(open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip())
        except (OSError, IndexError):
            continue  # gone meanwhile
    return found


def left_running(session: int, seconds=30) -> list[str]:
    """What is still in the session after up to `seconds` (a process on its way out is given the time)."""
    deadline = time.monotonic() + seconds
    while in_session(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    return in_session(session)


def sampler_pid(process) -> int:
    line = next(line for line in process.stdout_text.splitlines() if line.startswith("sampler: "))
    assert "in a process of its own (pid " in line, line
    return int(line.split("(pid ")[1].split(",")[0])


def rows(output_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in CLOCKS} for r in read_metrics(output_dir)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_path):
    """Three steps one step off-policy with a sampler process, uninterrupted."""
    vllm_or_skip()
    out = tmp_path_factory.mktemp("off-policy") / "run"
    train(out)
    return out


@pytest.mark.slow
def test_the_sampler_process_gives_the_one_process_emulations_numbers_step_for_step(tmp_path, uninterrupted):
    """The same steps with the stale batch sampled in this process (--no-sampler-process): every logged number but the
    clocks equal, the sync check's gap included, and the final weights bit for bit. Step 1 samples from the starting
    weights (staleness 0: the sampler and trainer agree to rounding), steps 2-3 one update behind."""
    emulated = tmp_path / "emulated"
    train(emulated, "--no-sampler-process")
    want, got = rows(uninterrupted), rows(emulated)
    assert [r["step"] for r in want] == [1, 2, 3] and [r["staleness"] for r in want] == [0, 1, 1]
    assert want == got
    assert want[0]["rollout_kl_k3"] < 1e-9 < want[1]["rollout_kl_k3"]  # the behaviour gap: one update's
    assert all(r["sync_logprob_gap"] < 1e-3 for r in want)
    a, b = final_state(uninterrupted), final_state(emulated)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_run_killed_mid_update_resumes_to_the_uninterrupted_numbers_and_its_sampler_dies_with_it(tmp_path,
                                                                                                    uninterrupted):
    """kill -9 in step 3's update: the sampler process ends with the trainer (nothing left in the session); the
    checkpoint of step 2 holds step 3's batch, sampled from the weights after step 1 (version 1), so --resume trains
    step 3 on it and ends with the uninterrupted run's rows and weights."""
    out = tmp_path / "run"
    killed = train(out, env={"TRAIN_CRASH_AT": "update:3"}, expect=-signal.SIGKILL)
    assert sampler_pid(killed) and left_running(killed.pid) == []
    state = torch.load(out / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True)
    assert state["ahead"]["step"] == 2 and state["ahead"]["version"] == 1
    resumed = train(out, "--resume")
    assert "resumed from" in resumed.stdout_text
    assert rows(out) == rows(uninterrupted)
    a, b = final_state(uninterrupted), final_state(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("how, said", [("TRAIN_TERMINATE_AT", "train.py: terminated (SIGTERM)"),
                                       ("TRAIN_CTRL_C_AT", "train.py: interrupted")])
def test_sigterm_and_ctrl_c_stop_both_processes(tmp_path, tiny_model_path, how, said):
    """SIGTERM to the trainer (kill, a scheduler), or SIGINT to the whole process group (a terminal's Ctrl-C), in step
    2's update while the sampler samples step 3's batch: one line, exit code 1, and nothing of the run left running
    (the sampler, the reward workers)."""
    vllm_or_skip()
    stopped = train(tmp_path / "run", env={how: "update:2"}, expect=1)
    lines = [line for line in stopped.stderr_text.splitlines() if line.strip() and not line.startswith("train:")]
    assert lines[-1].startswith(said) and "Traceback" not in stopped.stderr_text, stopped.stderr_text[-3000:]
    assert sampler_pid(stopped) and left_running(stopped.pid) == []


# --- fast: no model -----------------------------------------------------------------------------------------------

def test_the_cores_split_in_two_and_the_sampler_takes_the_larger_half():
    assert sampler_process.split_cores([1, 0]) == ([0], [1])
    assert sampler_process.split_cores([4, 2, 3]) == ([2], [3, 4])
    assert sampler_process.split_cores(list(range(8))) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert sampler_process.split_cores([5]) == ([5], [])


def test_the_weight_buffer_is_shared_memory():
    """What the trainer writes into the buffer, another mapping of the same memory reads (the sampler's side)."""
    import mmap
    named = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7)), ("c", torch.arange(4, dtype=torch.int64))]
    entries, size = sampler_process.layout(named)
    assert all(offset % sampler_process.ALIGN == 0 for *_, offset in entries)
    fd = os.memfd_create("test")
    os.ftruncate(fd, size)
    ours, theirs = mmap.mmap(fd, size), mmap.mmap(os.dup(fd), size)
    written, read = sampler_process.views(ours, entries), sampler_process.views(theirs, entries)
    for name, t in named:
        written[name].copy_(t)
    assert all(torch.equal(read[name], t) for name, t in named)


def test_the_gap_to_the_sampler_is_measured_without_weights_when_not_corrected():
    """correction.correct with mode none (train.py --off-policy-steps without --rollout-correction): the metrics of
    log(pi_old / q), no weights set, nothing counted as corrected."""
    from types import SimpleNamespace

    from cegppo_utils import correction, logprobs
    old = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    mb = SimpleNamespace(old_logp=old, sampler_logp=old - torch.tensor([[0.1, -0.2, 0.0]]),
                         response_mask=torch.tensor([[1.0, 1.0, 0.0]]), weights=None,
                         kept=logprobs.Truncation(torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool)))
    m = correction.correct([[mb]], "none", 2.0, torch.device("cpu"))
    rho = torch.tensor([0.1, -0.2], dtype=torch.float64).exp()
    assert mb.weights is None and m["rollout_corrected_frac"] == 0.0
    assert m["rollout_ratio_mean"] == pytest.approx(rho.mean().item())
    assert m["rollout_kl_k3"] == pytest.approx((rho - 1 - rho.log()).mean().item())


def test_a_rollout_in_flight_round_trips_through_a_checkpoint():
    """saved_sampling keeps a finished batch as plain values and tensors (weights_only loads them);
    restored_sampling draws its rows again from where they were drawn and gives back the same completions."""
    import train
    from cegppo_utils import data

    class Tokenizer:  # the chat template as token ids: one per character of the question
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return [ord(ch) for ch in messages[-1]["content"]]

    args = flags.parse_args(["--gen-prompts", "2", "--n", "2", "--train-prompts", "2", "--eval-every", "0"])
    stream = data.PromptStream([{"prompt": f"q{i}", "answer": str(i)} for i in range(5)], seed=0)
    stream.next_batch(3)
    before = stream.state()
    batch = stream.next_batch(2)
    import rollout
    groups = {i: train.Group(row, [ord(ch) for ch in row["prompt"]],
                             [rollout.Completion([7, i, j], f"t{i}{j}", j == 0, [-0.5 - i, -0.25, -1e-3 * j])
                              for j in range(2)]) for i, row in enumerate(batch)}
    sampling = train.Sampling(4, batch, before, 3, groups, 1.5e-7, 2.0)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ahead-{os.getpid()}.pt")
    torch.save(train.saved_sampling(sampling), path)
    try:
        saved = torch.load(path, weights_only=True)
    finally:
        os.remove(path)
    after = stream.state()
    stream.restore({"epoch": 0, "index": 0})
    back = train.restored_sampling(saved, stream, Tokenizer(), args)
    assert stream.state() == after and back.batch == batch and (back.step, back.version) == (4, 3)
    assert back.groups == groups and (back.sync_gap, back.sampler_s) == (1.5e-7, 2.0)


def parse_error(argv, capsys, env=None, monkeypatch=None) -> str:
    with pytest.raises(SystemExit) as stopped:
        flags.parse_args(argv)
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_what_cannot_run_one_step_off_policy_is_one_line_before_torch_loads(tmp_path, capsys, monkeypatch):
    """Each refused in one line with exit code 2 by the flags alone: a depth other than 0 or 1; torchrun's ranks; HF
    generate in a process of its own; a process on one core; and
    --off-policy-steps typed beside --resume of a synchronous run (a run resumes with its own settings). Either
    --sampler-process or --no-sampler-process is taken on a synchronous run, which samples in its own process."""
    run = ["--output-dir", str(tmp_path / "new"), "--off-policy-steps", "1"]
    assert "--off-policy-steps must be 0 (synchronous) or 1, got 2" in parse_error(run + ["--off-policy-steps", "2"],
                                                                                    capsys)
    assert "--sampler hf: HF generate samples from the training model itself" in parse_error(run + ["--sampler", "hf"],
                                                                                             capsys)
    for switch in ("--sampler-process", "--no-sampler-process"):  # a synchronous run samples in its own process:
        assert flags.parse_args(["--output-dir", str(tmp_path / "new"), switch]).off_policy_steps == 0  # either agrees
    with monkeypatch.context() as patch:
        patch.setattr(os, "sched_getaffinity", lambda pid: {0})
        assert "the sampler process needs a core of its own" in parse_error(run, capsys)
        flags.parse_args(run + ["--no-sampler-process"])  # the emulation needs none
    with monkeypatch.context() as patch:
        patch.setenv("WORLD_SIZE", "2")
        patch.setenv("RANK", "0")  # rank 0 says it; every other rank ends alike, silent
        assert "not supported under torchrun (2 ranks here)" in parse_error(run, capsys)
        patch.setenv("RANK", "1")
        with pytest.raises(SystemExit) as stopped:
            flags.parse_args(run)
        assert stopped.value.code == 2 and capsys.readouterr().err == ""
    assert flags.parse_args(run + ["--sampler", "hf", "--no-sampler-process"]).off_policy_steps == 1
    synchronous = tmp_path / "sync"  # a synchronous run's folder: its marker and config.json
    synchronous.mkdir()
    (synchronous / ".ce-gppo-run").write_text("{}")
    (synchronous / "metrics.jsonl").write_text('{"step": 1}\n')
    (synchronous / "config.json").write_text(json.dumps(
        {"preset": "tiny", "flags": flags.flat_flags(flags.resolve("tiny", {"output_dir": str(synchronous)}))}))
    said = parse_error(["--resume", str(synchronous), "--off-policy-steps", "1"], capsys)
    assert "--off-policy-steps 1 (the run's: 0); a run resumes with its own settings" in said


def test_the_stale_comparison_shows_each_arm_and_the_paired_differences(tmp_path, capsys):
    """tools/study_stale.py from a study's JSON alone: the four arms of configs.STALE_ARMS, collapses by the third
    study's rule, and stale minus synchronous per seed; unfinished runs left out."""
    from tools import configs, study_stale

    def run(acc, entropy, low_neg, final, gap=None, steps=20):
        rows = [{"step": s, "acc_mean": acc, "entropy": entropy, "clip_frac_low_neg": low_neg,
                 "clip_frac_high_pos": 0.001, **({"rollout_kl_k3": gap} if gap else {})} for s in range(1, steps + 1)]
        rows[-1]["eval_acc"] = final  # the last step's held-out avg@8, logged in its row
        return {"steps_done": steps, "steps": rows}
    sync_tm, stale_tm, sync_ce, stale_ce = configs.STALE_ARMS
    study = {sync_tm: {"30": run(0.5, 0.20, 0.004, 0.60), "31": run(0.4, 0.21, 0.006, 0.50)},
             stale_tm: {"30": run(0.5, 0.19, 0.005, 0.55, 1e-3), "31": run(0.02, 0.10, 0.002, 0.05, 2e-3)},
             sync_ce: {"30": run(0.5, 0.22, 0.004, 0.62)},
             stale_ce: {"30": run(0.5, 0.20, 0.004, 0.64, 1e-3), "31": run(0.5, 0.2, 0.004, 0.6, 1e-3, steps=5)}}
    path = tmp_path / "stale.json"
    path.write_text(json.dumps(study))
    study_stale.main(["--json", str(path), "--out", str(tmp_path / "stale.md"), "--steps", "20"])
    text = (tmp_path / "stale.md").read_text()
    assert text == capsys.readouterr().out
    assert f"| `{stale_tm}` | 2 | 1 | 30.0 | 26.0 | 0.35 | 0.10 | 0.145 | 1.50e-03 |" in text  # seed 31 collapsed
    assert f"| `{sync_tm}` | 2 | 0 | 55.0 | 45.0 | 0.50 | 0.10 | 0.205 | n/a |" in text
    assert f"| `{stale_ce}` | 1 | 0 | 64.0 |" in text  # its seed 31 stopped at step 5
    assert "| token-mean PPO-clip | final avg@8 (%) | 30: -5.0, 31: -45.0 | -25.0 |" in text
    assert "| CE-GPPO (0.5, 1) | entropy (nats) | 30: -0.020 | -0.020 |" in text
    # the synchronous arms read from another study's JSON (the fifth study's cell A): the same tables
    (tmp_path / "sync.json").write_text(json.dumps({sync_tm: study.pop(sync_tm), sync_ce: study.pop(sync_ce)}))
    path.write_text(json.dumps(study))
    study_stale.main(["--json", str(path), "--synchronous", str(tmp_path / "sync.json"), "--out",
                      str(tmp_path / "apart.md"), "--steps", "20"])
    apart = (tmp_path / "apart.md").read_text()
    assert "The synchronous arms are read from sync.json." in apart
    assert apart.split("\n\n")[2:] == text.split("\n\n")[2:]  # below the first paragraph, the same page
