"""train.py: the loop end to end on the tiny model, exact resume, data loaders, flags, NaN handling."""

import json
import math
import os
import shutil
import sys
from dataclasses import replace

import pytest
import torch
import warm  # train.py and the tools started warm: tests/warm.py
from conftest import ROOT, few_problems, parse_train_args, train_update

import loss as L
import train
from cegppo_utils import data, runfolder

# A few-second step: 8 prompts x 4 responses, two optimizer steps per rollout batch.
SMALL = ["--preset", "tiny", "--gen-prompts", "8", "--train-prompts", "8", "--mini-batch-prompts", "4", "--n", "4",
         "--micro-batch-size", "8", "--eval-every", "0", "--lr", "1e-4", "--no-curves"]  # the figure: 2 s a run
FIELDS = ["step", "reward_mean", "acc_mean", "entropy", "clip_frac_low_neg", "clip_frac_high_pos", "clip_frac_low_pos",
          "clip_frac_high_neg", "dual_clip_frac", "approx_kl", "grad_norm", "lr", "response_length_mean",
          "response_length_max", "truncated_frac", "kept_group_frac", "time_rollout_s", "time_reward_s",
          "time_update_s", "tokens_per_s", "reward_timeouts", "reward_parse_failures"]


def run_train(output_dir, *extra):
    out = warm.run([sys.executable, "train.py", *SMALL, "--output-dir", str(output_dir), *extra],
                   cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_state(output_dir):
    from safetensors.torch import load_file
    return load_file(os.path.join(output_dir, "final", "model.safetensors"))


@pytest.mark.slow
def test_end_to_end_and_exact_resume(tmp_path, tiny_model_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    out = run_train(straight, "--max-steps", "4", "--save-every", "2", "--log-samples-every", "2", "--curves")
    rows = read_metrics(straight)
    # what a researcher sees and keeps: the resolved flags, sample completions, curves, a summary at the end
    config = json.loads((straight / "config.json").read_text())
    assert config["preset"] == "tiny" and config["flags"]["algo"] == "ce_gppo" and config["flags"]["max_steps"] == 4
    assert config["versions"]["torch"] == torch.__version__ and "git_commit" in config
    from cegppo_utils import models
    assert config["model_sha256"] == models.weights_hash(tiny_model_path)  # which warm start the run started from
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [2, 4] and len(samples) == 2 * 2 * 4  # 2 prompts x n=4, twice
    assert all(s["reward"] in (1.0, -1.0) and isinstance(s["completion"], str) and "advantage" in s for s in samples)
    assert (straight / "curves.png").stat().st_size > 10_000
    assert "done: 4 steps" in out.stdout and "[step 2 sample]" in out.stdout
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert all(k in r for k in FIELDS), set(FIELDS) - set(r)
        # rewards come from reward.py's +1 / -1 verdicts
        assert r["reward_mean"] == pytest.approx(2 * r["acc_mean"] - 1)
    assert 0 < sum(r["acc_mean"] for r in rows) / 4 < 1
    assert sorted(os.listdir(straight / "checkpoints")) == ["step_000002", "step_000004"]
    # the policy moved away from the warm-started model
    from safetensors.torch import load_file
    start = load_file(os.path.join(tiny_model_path, "model.safetensors"))
    end = final_state(straight)
    assert max((end[k] - start[k]).abs().max().item() for k in start) > 1e-4

    # a crash after step 4 was logged but before it was checkpointed (nor final/ written), then --resume to 4
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    (resumed / "curves.png").unlink()
    run_train(resumed, "--max-steps", "4", "--save-every", "2", "--resume")
    assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3, 4]  # no duplicated rows
    assert not (resumed / "curves.png").exists()  # SMALL's --no-curves, which a resume may change
    with open(resumed / "metrics.discarded.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [3, 4]  # the orphaned rows are kept aside, not lost
    again = final_state(resumed)
    for k in end:
        torch.testing.assert_close(again[k], end[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(rows, read_metrics(resumed), strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)


@pytest.mark.slow
def test_kl_penalty_and_adaptive_entropy_run_and_resume_exactly(tmp_path, tiny_model_path):
    """--kl-coef (the frozen reference is reloaded from the starting model on resume, not from the checkpoint) and
    --adaptive-entropy (its coefficient and last entropy are loop state, checkpointed): a run killed after step 4
    was logged but before it was checkpointed resumes to the uninterrupted run's parameters and rows."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # target 1 nat: above the tiny model's entropy, so the coefficient rises by 0.005 a step from 0.01
    flags = ["--algo", "grpo", "--kl-coef", "0.04", "--adaptive-entropy", "--entropy-coef", "0.01",
             "--entropy-target", "1.0", "--max-steps", "4", "--save-every", "2", "--lr", "3e-4", "--sampler", "hf"]
    run_train(straight, *flags)
    rows = read_metrics(straight)
    # step 1 has no previous entropy (no bonus); then c_k = 0.01 + 0.005 k while entropy <= the target
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.0, 0.015, 0.02, 0.025])
    assert all(r["kl_loss"] >= 0 for r in rows) and rows[-1]["kl_loss"] > 0  # k3 >= 0, and the policy moved away
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    run_train(resumed, *flags, "--resume")
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    for a, b in zip(rows, again, strict=True):
        assert b["entropy_coef"] == a["entropy_coef"] and b["reward_mean"] == a["reward_mean"]
        assert b["kl_loss"] == pytest.approx(a["kl_loss"], rel=1e-4, abs=1e-9)
    want = final_state(straight)
    for k, v in final_state(resumed).items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6)


def test_loop_state_round_trips_and_reads_an_older_checkpoint():
    """The loop state is saved as a plain dict; a checkpoint written before the adaptive-entropy controller first
    moved (no entropy_coef / last_entropy keys) restores to the controller's start."""
    state = train.LoopState(step=7, od_state=1, initial_entropy=0.12, entropy_coef=0.005, last_entropy=0.19)
    assert train.LoopState.restored(state.saved()) == state
    assert train.LoopState.restored({"od_state": 0, "initial_entropy": None, "step": 3}) == train.LoopState(step=3)
    args = parse_train_args(["--adaptive-entropy", "--entropy-coef", "0.01"])
    assert train.step_loss_config(args.loss, train.LoopState()).entropy_coef == 0.0  # no e_{k-1} before step 1
    assert train.step_loss_config(args.loss, train.LoopState(entropy_coef=0.02, last_entropy=0.1)).entropy_coef == 0.02
    assert train.step_loss_config(args.loss, train.LoopState(last_entropy=0.1)).entropy_coef == 0.01  # c_0


def test_checkpoints_come_at_save_first_then_every_save_every_and_at_the_end():
    """The first checkpoint comes early (step 5 by default: a stop in the first minutes loses little), then every
    --save-every steps and at the last step."""
    def saved(argv):
        args = parse_train_args(argv)
        return [s for s in range(1, 101) if train.saves_at(args, s)]
    assert saved([]) == [5, 25, 50, 75, 100]
    assert saved(["--save-first", "0"]) == [25, 50, 75, 100]
    assert saved(["--save-first", "2", "--save-every", "40", "--max-steps", "90"]) == [2, 40, 80, 90]


def test_the_progress_bar_shows_the_algorithms_own_diagnostics():
    """Beside reward and entropy: CE-GPPO's beta regions, PPO-clip's clipped shares, ERC's band, M2PO's mask; nothing
    for SAPO, which does not clip (never CE-GPPO's clip_b1 / clip_b2 for another loss)."""
    shorts = {algo: [d.short for d in train.bar_diagnostics(algo)] for algo in train.L.ALGORITHMS}
    assert shorts["ce_gppo"] == ["clip_b1", "clip_b2"] and shorts["grpo"] == ["clip_lo", "clip_hi"]
    assert shorts["gppo_erc"] == ["erc_lo", "erc_hi"] and shorts["m2po"] == ["masked", "m2"] and shorts["sapo"] == []
    assert [a for a, names in shorts.items() if "clip_b1" in names] == ["ce_gppo"]


@pytest.mark.slow
def test_the_frameworks_objectives_train_on_the_tiny_preset(tmp_path, tiny_model_path, capsys):
    """`--algo luspo | vespo | gpg | dro | dppo_tv_kimi | bandpo` (gpg with --max-rl, MaxRL's advantages): two steps
    each on the tiny preset (SMALL: 8 prompts x 4 responses), in this process (one import for all six): every logged
    number finite, each algorithm's own diagnostics in metrics.jsonl, and a gradient in every step."""
    runs = {"luspo": [], "vespo": [], "gpg": ["--max-rl"], "dro": [], "dppo_tv_kimi": [], "bandpo": []}
    for algo, extra in runs.items():
        train.run([*SMALL, "--algo", algo, *extra, "--max-steps", "2", "--sampler", "hf", "--log-samples-every", "0",
                   "--output-dir", str(tmp_path / algo)])
        rows = read_metrics(tmp_path / algo)
        assert [r["step"] for r in rows] == [1, 2], algo
        numbers = [v for r in rows for v in r.values() if isinstance(v, (int, float))]
        assert all(math.isfinite(v) for v in numbers), (algo, rows)
        for d in L.diagnostics(algo):
            assert all(d.metric in r for r in rows), (algo, d.metric)
        assert all(r["grad_norm"] > 0 for r in rows), algo
    assert json.load(open(tmp_path / "gpg" / "config.json"))["flags"]["max_rl"] is True


def test_refuses_to_overwrite_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / ".ce-gppo-run").write_text("{}")  # a run's folder: its marker (a foreign folder is refused too)
    with pytest.raises(SystemExit, match="pass --resume"):
        train.main(parse_train_args(SMALL + ["--output-dir", str(tmp_path)]))


def test_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, tiny_model_path):
    real = train.L.policy_loss

    def poisoned(*args, **kwargs):  # fine in step 1, NaN from step 2 on
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if kwargs["extras"].progress > 0 else loss), metrics

    monkeypatch.setattr(train.L, "policy_loss", poisoned)
    args = parse_train_args(SMALL + ["--output-dir", str(tmp_path), "--max-steps", "3", "--save-every", "1",
                                     "--sampler", "hf"])
    with pytest.raises(FloatingPointError, match="step 2: the loss is nan"):
        train.main(args)
    assert os.listdir(tmp_path / "checkpoints") == ["step_000001"]
    state = torch.load(tmp_path / "checkpoints" / "step_000001" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    assert not os.path.exists(tmp_path / "final")


def test_help_lists_every_flag_with_its_doc(capsys):
    with pytest.raises(SystemExit):
        parse_train_args(["--help"])
    text = capsys.readouterr().out
    assert "CE-GPPO gradient scale on the left boundary" in text
    for name in ("--beta1", "--beta2", "--eps-low", "--clip-ratio-c", "--dynamic-clip", "--positive-lm-coef", "--lr",
                 "--warmup-steps", "--gen-prompts", "--mini-batch-prompts", "--micro-batch-size", "--n", "--top-p",
                 "--max-response-len", "--precision", "--gradient-checkpointing", "--resume", "--wandb"):
        assert name in text, name


def test_presets_and_overrides():
    args = parse_train_args(["--preset", "r1-distill-7b", "--beta2", "0.9"])
    assert (args.model, args.loss.beta1, args.loss.beta2) == ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 0.75, 0.9)
    assert (args.loss.positive_lm_coef, args.loss.clip_ratio_c, args.lr,
            args.gen_prompts, args.train_prompts) == (0.1, 10.0, 1e-6, 256, 128)
    assert parse_train_args(["--preset", "r1-distill-1.5b"]).loss.beta1 == 0.5


@pytest.mark.parametrize("argv, message", [
    (["--preset", "r2"], "unknown preset 'r2'"),
    (["--eps-low", "0"], "--eps-low must be in (0, 1]"),
    (["--beta1", "-0.5"], "--beta1 must be >= 0"),
    (["--train-prompts", "30", "--mini-batch-prompts", "8"], "must be a multiple of --mini-batch-prompts"),
    (["--micro-batch-size", "7"], "--micro-batch-size (7) must divide"),
    (["--train-prompts", "64", "--gen-prompts", "32"], "cannot exceed --gen-prompts"),
    (["--n", "1"], "--n must be >= 2"),
    (["--algo", "ppo"], "--algo must be one of"),
    (["--algo", "cispo", "--dynamic-clip", "id"], "--dynamic-clip does not apply"),
    (["--top-entropy-quantile", "0"], "--top-entropy-quantile must be in (0, 1], got 0"),
    (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile must be in (0, 1]"),
    (["--algo", "sapo", "--tau-neg", "-1"], "--tau-neg must be > 0 and finite, got -1"),
    (["--kl-coef", "-0.04"], "--kl-coef must be >= 0"),
    (["--kl-estimator", "k4"], "--kl-estimator must be one of ['k1', 'k2', 'k3'], got 'k4'"),
    (["--algo", "clip_cov", "--clip-cov-ratio", "0"], "--clip-cov-ratio must be in (0, 1]"),
    (["--algo", "clip_cov", "--clip-cov-lb", "6"], "--clip-cov-lb must be below clip_cov_ub = 5.0"),
    (["--algo", "kl_cov", "--kl-cov-coef", "-1"], "--kl-cov-coef must be >= 0"),
    (["--adaptive-entropy", "--entropy-target", "0"], "--entropy-target must be > 0"),
    (["--adaptive-entropy", "--entropy-coef-min", "2"], "--entropy-coef-min must be at most entropy_coef_max = 1.0"),
    (["--algo", "vespo", "--vespo-k-pos", "-1"], "--vespo-k-pos must be >= 0 and finite, got -1.0"),
    (["--algo", "vespo", "--vespo-lambda-neg", "0"],
     "--vespo-lambda-neg must be >= 1e-4 and finite (TRL raises a smaller lambda to 1e-4), got 0.0"),
    (["--algo", "dro", "--dro-beta", "0"], "--dro-beta must be > 0 and finite, got 0.0"),
    (["--algo", "dppo_tv_kimi", "--kimi-kl-tau", "-1e-3"], "--kimi-kl-tau must be >= 0 and finite, got -0.001"),
    (["--algo", "bandpo", "--band-divergence", "js"],
     "--band-divergence must be one of ['chi2', 'kl', 'tv'], got 'js'"),
    (["--algo", "bandpo", "--band-delta", "0"], "--band-delta must be > 0 and finite, got 0.0"),
    (["--algo", "bandpo", "--band-upper-max", "1"], "--band-upper-max must be > 1 and finite, got 1.0"),
    (["--band-delta", "0.1"], "--band-delta does not apply to ce_gppo (only bandpo reads it)"),
])
def test_bad_flags_are_rejected_at_start(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_train_args(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_max_rl_takes_the_success_indicator_and_leaves_scale_adv_by_std_out():
    """--max-rl: (c - p) / p per kept group on c = 1 for reward +1, 0 for -1 (the +-1 reward itself would flip sign with
    the pass rate); without it GRPO's (r - mean) / (std + 1e-6); --no-max-rl --no-scale-adv-by-std is Dr. GRPO's."""
    rewards = torch.tensor([[1.0, -1.0, -1.0, -1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, -1.0, 1.0]])
    correct = rewards == 1
    args = parse_train_args(["--n", "4", "--gen-prompts", "3"])
    assert not args.max_rl and args.scale_adv_by_std  # the defaults: GRPO's
    kept, adv = train.select_groups(rewards, correct, replace(args, max_rl=True))
    assert kept == [0, 2] and adv.tolist() == torch.tensor([[3.0, -1, -1, -1], [1 / 3, 1 / 3, -1, 1 / 3]]).tolist()
    _, grpo = train.select_groups(rewards, correct, args)
    assert grpo[0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)  # r - mean over its std, 1
    _, dr_grpo = train.select_groups(rewards, correct, replace(args, scale_adv_by_std=False))
    assert dr_grpo[0].tolist() == [1.5, -0.5, -0.5, -0.5]
    with pytest.raises(ValueError, match="max_rl needs rewards >= 0"):
        L.group_advantages(rewards.flatten(), 4, max_rl=True)


# --- data loaders ------------------------------------------------------------------------------

KLEAR_ROWS = [
    {"data_source": "math", "prompt": [{"role": "user", "content": "What is 2 + 2?"}], "ability": "math",
     "reward_model": {"ground_truth": "4", "style": "rule"}},
    {"data_source": "math", "prompt": [{"role": "user", "content": "Half of 1?"}], "ability": "math",
     "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"}},
]
PLAIN_ROWS = [{"problem": "What is 3 * 3?", "answer": "9"}, {"problem": "What is 10 - 4?", "answer": 6}]
WANT = {
    "klear": [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"},
              {"prompt": [{"role": "user", "content": "Half of 1?"}], "answer": "\\frac{1}{2}"}],
    "plain": [{"prompt": [{"role": "user", "content": "What is 3 * 3?"}], "answer": "9"},
              {"prompt": [{"role": "user", "content": "What is 10 - 4?"}], "answer": "6"}],
}


def write_rows(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import datasets
        datasets.Dataset.from_list(rows).to_parquet(str(path))


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
@pytest.mark.parametrize("kind", ["klear", "plain"])
def test_loaders_read_each_format(tmp_path, suffix, kind):
    rows = KLEAR_ROWS if kind == "klear" else [{**PLAIN_ROWS[0]}, {**PLAIN_ROWS[1], "answer": "6"}]
    path = tmp_path / f"train{suffix}"
    write_rows(path, rows)
    assert [{k: r[k] for k in ("prompt", "answer")} for r in data.load_rows(str(path))] == WANT[kind]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_loader_names_the_bad_row(tmp_path, suffix):
    path = tmp_path / f"bad{suffix}"
    write_rows(path, [PLAIN_ROWS[0], {"problem": "What is 1 + 1?", "answer": ""}, PLAIN_ROWS[0]])
    where = "line 2" if suffix == ".jsonl" else "row 1"  # jsonl errors name the line
    with pytest.raises(SystemExit, match=rf"{path.name}: {where} has no answer"):
        data.load_rows(str(path))
    write_rows(path, [{"problem": " ", "answer": "1"}])
    with pytest.raises(SystemExit, match=rf"{path.name}: "
                                         rf"{'line 1' if suffix == '.jsonl' else 'row 0'} has no question"):
        data.load_rows(str(path))


def test_loader_rejects_unknown_file_types(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("problem,answer\n1+1,2\n")
    with pytest.raises(SystemExit, match="unsupported file type '.csv'"):
        data.load_rows(str(path))


def test_prompt_stream_resumes_exactly():
    rows = list(range(10))
    a = data.PromptStream(rows, seed=3)
    first = a.next_batch(7)
    b = data.PromptStream(rows, seed=3)
    b.restore(a.state())
    assert a.next_batch(9) == b.next_batch(9)  # crosses an epoch boundary
    epoch = data.PromptStream(rows, seed=3).next_batch(10)
    assert epoch[:7] == first and sorted(epoch) == rows  # one epoch is a permutation
    assert data.PromptStream(rows, seed=4).next_batch(10) != epoch


def test_half_written_checkpoints_are_never_resumed_from(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_000002", "step_000009.tmp", "step_000003.old"):
        (root / name).mkdir(parents=True)
    assert runfolder.checkpoint_dirs(str(tmp_path)) == [str(root / "step_000002")]


def test_a_failed_write_leaves_the_previous_folder_intact(tmp_path):
    path = tmp_path / "final"
    path.mkdir()
    (path / "weights").write_text("old")

    def crash_midway(folder):
        os.makedirs(folder)
        (tmp_path / "final.tmp" / "weights").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        runfolder.write_folder_atomically(str(path), crash_midway)
    assert (path / "weights").read_text() == "old"

    def complete(folder):
        os.makedirs(folder)
        (tmp_path / "final.tmp" / "weights").write_text("new")

    runfolder.write_folder_atomically(str(path), complete)
    assert (path / "weights").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_update_skips_zero_advantage_sequences_and_keeps_the_step(tiny_model_path):
    """update_policy leaves zero-advantage sequences out of forward/backward but counts their tokens: with SGD the
    step equals the gradient of policy_loss over the whole mini-batch in one piece (token mean over all 12)."""
    import random

    from transformers import AutoModelForCausalLM
    args = parse_train_args(["--preset", "tiny", "--n", "4", "--gen-prompts", "3", "--train-prompts", "3",
                             "--mini-batch-prompts", "3", "--micro-batch-size", "2", "--grad-clip", "1e9"])
    rng = random.Random(0)
    advantages = [[0.0, 0.0, 0.0, 0.0], [0.9, -0.3, 0.0, -0.6], [1.2, -1.2, 0.5, -0.5]]
    seqs = [{"prompt_ids": [rng.randrange(5, 270) for _ in range(4)],
             "response_ids": [rng.randrange(5, 270) for _ in range(rng.randint(2, 9))],
             "advantage": a, "correct": a > 0} for group in advantages for a in group]
    calls = []
    real = train.response_logprobs

    def counting(policy, mb, *rest, **kw):
        calls.append(int((mb.response_mask.sum(-1) > 0).sum()))
        return real(policy, mb, *rest, **kw)

    def fresh():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        return model, torch.optim.SGD(model.parameters(), lr=1.0)

    model, sgd = fresh()
    train.response_logprobs = counting
    try:
        metrics = train_update(train.make_policy(args, model, sgd, 0, torch.device("cpu")), [seqs], args.loss)
    finally:
        train.response_logprobs = real
    assert sum(calls) == 7  # the 5 zero-advantage sequences were not run, and no separate old-log-prob pass
    assert metrics["optimizer_steps"] == 1

    reference, sgd = fresh()
    mb = train.collate(seqs, 0, torch.device("cpu"))
    logp, _, _ = real(train.make_policy(args, reference, sgd, 0, torch.device("cpu")), mb, grad=True)
    loss, _ = train.L.policy_loss(logp, logp.detach(), mb.advantages, mb.response_mask,
                                  train.L.loss_config("ce_gppo", clip_ratio_c=10.0))
    loss.backward()
    sgd.step()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    got, want = model.state_dict(), reference.state_dict()
    assert max((want[k] - start[k]).abs().max().item() for k in start) > 1e-3
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


# --- every loss through update_policy -------------------------------------------------------------

def fixed_groups(seed=0, groups=4, n=4):
    import random
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(5, 270) for _ in range(rng.randint(3, 6))],
             "response_ids": [rng.randrange(5, 270) for _ in range(rng.randint(2, 9))],
             "advantage": rng.choice([-1.3, -0.4, 0.6, 1.1]), "correct": rng.random() < 0.5}
            for _ in range(groups * n)]


# Their token loss picks tokens among those of one policy_loss call (Cov's means, the draw, the top-k; M2PO's mask), as
# verl's and AReaL's: split into micro-batches, the picks change, so the micro-batch losses do not add up to the
# one-piece mini-batch loss.
PICK_WITHIN_A_CALL = ("clip_cov", "kl_cov", "m2po")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(train.L.ALGORITHMS)
                         + ["ce_gppo+entropy", "ce_gppo+lm", "grpo+kl", "dapo+top_entropy"])
def test_every_loss_through_update_policy_matches_a_one_piece_computation(variant, tiny_model_path):
    """Two mini-batches, each with a group whose rewards are all equal (A = 0), split into micro-batches of 2
    (update_policy) give, with SGD, the parameters of one policy_loss call per mini-batch on the whole of it, old
    log-probs from the weights that sampled: a response train.py leaves out as A = 0 must get no gradient. A loss that
    picks tokens within each call (Clip-Cov, KL-Cov, the top-entropy mask) is compared call by call instead.
    float64, SGD at lr 0.5; with the k3 KL penalty at lr 0.005: at 0.5 the first step moves the policy far from the
    reference and k3's e^x gives the second mini-batch a gradient norm of ~5e8, so on some warm starts (one built on an
    AVX-512 BF16 CPU) float64's rounding between micro-batched and whole sums grew into parameters apart by 8e7. At
    0.005 the KL term still counts: a kl coefficient 10% off on one side moves a parameter by 6e-4."""
    from transformers import AutoModelForCausalLM
    algo, _, extra = variant.partition("+")
    flags = {"entropy": ["--entropy-coef", "0.01"], "lm": ["--positive-lm-coef", "0.1"],
             "kl": ["--kl-coef", "0.5", "--kl-estimator", "k3"],
             "top_entropy": ["--top-entropy-quantile", "0.5"]}.get(extra, [])
    args = parse_train_args(["--algo", algo, "--n", "3", "--gen-prompts", "4", "--train-prompts", "4",
                             "--mini-batch-prompts", "2", "--micro-batch-size", "2", "--grad-clip", "1e9", *flags])
    seqs = fixed_groups(n=3)
    for i, s in enumerate(seqs[3:9]):  # groups 1 and 2: all correct, then all wrong; equal rewards give A = 0
        s.update(advantage=0.0, correct=i < 3)
    # Groups of 3 in micro-batches of 2: an A = 0 response shares a micro-batch with another group's, so leaving it
    # out (an algorithm wrongly declared proportional_to_advantage) changes what a per-call loss sees.
    mini_batches = [seqs[:6], seqs[6:]]
    cpu = torch.device("cpu")

    def fresh():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64)
        return model, torch.optim.SGD(model.parameters(), lr=0.005 if extra == "kl" else 0.5)

    model, sgd = fresh()
    policy = train.make_policy(args, model, sgd, 0, cpu)
    policy.ref_model = fresh()[0].requires_grad_(False) if args.loss.kl_coef else None  # as load_policy
    torch.manual_seed(0)  # Clip-Cov's draw
    logged = train_update(policy, mini_batches, args.loss)

    reference, sgd = fresh()
    start, _ = fresh()
    per_call = algo in PICK_WITHIN_A_CALL or args.loss.top_entropy_quantile < 1
    torch.manual_seed(0)
    for mini in mini_batches:
        whole = train.collate(mini, 0, cpu)
        lengths = whole.response_mask.sum(-1)
        totals = train.L.Totals(lengths.sum(), len(mini), (lengths * whole.correct).sum())
        for mb in [train.collate(mini[j:j + 2], 0, cpu) for j in range(0, len(mini), 2)] if per_call else [whole]:
            # the sampling weights' log-probs and entropy (ERC's H_old)
            old, old_entropy, _ = train.response_logprobs(train.make_policy(args, start, sgd, 0, cpu), mb)
            logp, entropy, _ = train.response_logprobs(train.make_policy(args, reference, sgd, 0, cpu), mb, grad=True)
            extras = train.L.Extras(entropy=entropy, old_entropy=old_entropy, correct=mb.correct, ref_logp=old)
            loss, metrics = train.L.policy_loss(logp, old, mb.advantages, mb.response_mask, args.loss,
                                                totals=totals if per_call else train.L.Totals(), extras=extras)
            loss.backward()
        sgd.step()
        sgd.zero_grad()
    assert set(metrics) - {"num_tokens"} <= set(logged)  # the loss's own metrics (masked shares, ...) reach the row
    got, want, before = model.state_dict(), reference.state_dict(), start.state_dict()
    if algo != "gspo":  # GSPO's 3e-4 range clips every sequence after the first step: it may not move
        assert max((want[k] - before[k]).abs().max().item() for k in want) > 1e-4
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-9)


PACKED_VARIANTS = {"grpo": [], "dapo+sum-norm": ["--loss-agg-mode", "seq-mean-token-sum-norm"],  # token-mean below
                   "ce_gppo+terms+correction": ["--entropy-coef", "0.01", "--positive-lm-coef", "0.1",
                                                "--rollout-correction", "token-tis", "--top-p", "0.9"]}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(PACKED_VARIANTS))
def test_packed_micro_batches_update_like_padded_ones(variant, tiny_model_path):
    """--micro-batch-tokens: rows of at most 40 tokens (several sequences each, mixed lengths) give the metrics and,
    with SGD, the parameters of padded micro-batches of 2, for each way of aggregating and with the extra terms."""
    import random

    from transformers import AutoModelForCausalLM
    common = ["--algo", variant.split("+")[0], "--n", "4", "--gen-prompts", "4",
              "--train-prompts", "4", "--mini-batch-prompts",
              "2", "--grad-clip", "1e9", "--max-prompt-len", "6", "--max-response-len", "12",
              *PACKED_VARIANTS[variant]]
    seqs, rng = fixed_groups(seed=1), random.Random(1)
    for s in seqs:  # the sampler's log-probs, for the rollout correction
        s["sampler_logprobs"] = [-rng.random() * 3 for _ in s["response_ids"]]
    results = {}
    for budget in (0, 40):
        size = ["--micro-batch-size", "2"] if budget == 0 else []  # read only by padded micro-batches
        args = parse_train_args(common + ["--micro-batch-tokens", str(budget), *size])
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        policy = train.make_policy(args, model, torch.optim.SGD(model.parameters(), lr=0.5), 0, torch.device("cpu"))
        minis = train.make_mini_batches(policy, [seqs[:8], seqs[8:]], args.loss)
        metrics = train.old_logprobs(policy, minis, args.rollout_correction, args.rollout_correction_threshold)
        metrics.update(train.update_policy(policy, minis, args.loss))
        results[budget] = metrics, model.state_dict(), [len(m.micro) for m in minis]
    (padded, want, padded_calls), (packed, got, packed_calls) = results[0], results[40]
    assert padded_calls == [4, 4] and 2 <= min(packed_calls) and max(packed_calls) < 4  # fewer, fuller micro-batches
    assert packed.keys() == padded.keys()
    for k, v in padded.items():
        assert packed[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    # float32 rounding in another summation order, grown through two SGD steps: measured at most 5.3e-6 on the
    # default kernels' warm start (1e-6 on AVX2's); a wrong token count or weight is off by a sizeable part of the move
    start = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).state_dict()
    moved = max((want[k] - start[k]).abs().max().item() for k in want)
    assert moved > 1e-3  # the update did something
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4 * moved, msg=lambda m: f"{k}: {m}")


def test_micro_batch_tokens_must_hold_the_longest_sequence(capsys):
    with pytest.raises(SystemExit) as e:
        parse_train_args(["--micro-batch-tokens", "100"])  # tiny: 64 + 48 tokens
    assert e.value.code == 2 and "--micro-batch-tokens (100) must hold the longest sequence" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_acc_is_what_evaluate_py_reports(tmp_path, tiny_model_path):
    """train.py's eval_acc: the problems, k, sampling and scoring of `evaluate.py --benchmarks FILE` (same seed)."""
    problems = few_problems(tmp_path, 8)
    run_train(tmp_path / "run", "--max-steps", "1", "--eval-every", "1", "--no-eval-before-train", "--sampler", "hf",
              "--eval-data", str(problems))
    row = read_metrics(tmp_path / "run")[0]
    out = tmp_path / "eval.json"
    done = warm.run([sys.executable, "evaluate.py", "--model", str(tmp_path / "run" / "final"), "--benchmarks",
                     str(problems), "--sampler", "hf", "--seed", str(row["eval_seed"]), "--output", str(out)],
                    cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())["benchmarks"][str(problems)]
    assert result["k"] == 8 and len(result["problems"]) == len(data.load_benchmark(str(problems)))
    assert row["eval_acc"] == pytest.approx(result["avg@k"], abs=1e-12)


@pytest.mark.slow
def test_rollout_correction_in_a_run_logs_the_mismatch(tmp_path, tiny_model_path):
    """--rollout-correction on a real run: the weights apply, and the metrics from the raw ratios are logged; the
    fp32 sampler and trainer agree, so the ratio is ~1 even under top-p (taken over the sampler's support)."""
    run_train(tmp_path, "--max-steps", "1", "--top-p", "0.9", "--temperature", "1.2",
              "--rollout-correction", "token-tis",
              "--min-response-len", "8", "--gen-prompts", "16")  # 16 sampled: some group's rewards vary on any CPU
    row = read_metrics(tmp_path)[0]
    assert row["kept_group_frac"] > 0  # a step that trains nothing has no tokens to measure (AVX2's warm start, 8)
    for key in ("rollout_kl_k3", "rollout_ratio_min", "rollout_ratio_mean", "rollout_ratio_max",
                "rollout_abs_log_ratio_p99", "rollout_corrected_frac"):
        assert key in row, key
    assert row["rollout_ratio_mean"] == pytest.approx(1.0, abs=0.02) and row["rollout_abs_log_ratio_p99"] < 0.05
    assert row["response_length_mean"] >= 8  # --min-response-len: no EOS before 8 tokens


# --- the command line a researcher types --------------------------------------------------------

def test_config_file_under_the_command_line(tmp_path, capsys):
    """--config: JSON or YAML values (underscore or dash names), a run's own config.json, the command line on top;
    mistakes are one line with the closest valid name."""
    (tmp_path / "c.json").write_text('{"max_steps": 7, "algo": "grpo", "gen-prompts": 8, "beta1": 0.25}')
    args = parse_train_args(["--config", str(tmp_path / "c.json"), "--max-steps", "9"])
    assert (args.max_steps, args.loss.algo, args.gen_prompts,
            args.train_prompts, args.loss.beta1) == (9, "grpo", 8, 8, 0.25)
    (tmp_path / "c.yaml").write_text("preset: sums\nlr: 0.001\n")
    args = parse_train_args(["--config", str(tmp_path / "c.yaml")])
    assert (args.preset, args.lr, args.train_data) == ("sums", 0.001, "sums")
    saved = {"preset": "tiny", "flags": dict(train.flags.flat_flags(parse_train_args(["--lr", "0.002", "--n", "4",
                                                                                      "--micro-batch-size", "16"])))}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    again = parse_train_args(["--config", str(tmp_path / "config.json")])
    assert (again.lr, again.n) == (0.002, 4) and train.flags.flat_flags(again) == saved["flags"]
    for text, message in (('{"max_step": 3}', "unknown flag 'max_step'; did you mean 'max_steps'?"),
                          ('{"lr": "fast"}', "lr must be a float, got 'fast'"), ("[1, 2]", "must hold a mapping")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(SystemExit):
            parse_train_args(["--config", str(tmp_path / "bad.json")])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--max-step", "3"], "did you mean: --max-step -> --max-steps"),
    (["--algo", "ce-gppo"], "did you mean 'ce_gppo'?"),
    (["--sampler", "vlm"], "did you mean 'vllm'?"),
    (["--train-data", "nope.jsonl"], "--train-data nope.jsonl: no such file"),
])
def test_mistakes_get_the_closest_name_and_the_first_real_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_train_args(argv)
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    if "nope.jsonl" in argv:
        assert err.index("no such file") < len(err) and "--eval-every" not in err.split(";")[0]


def test_underscore_spellings_and_derived_train_prompts():
    args = parse_train_args(["--max_steps", "3", "--mini_batch_prompts=2", "--preset", "sums", "--gen-prompts", "6"])
    assert (args.max_steps, args.mini_batch_prompts, args.train_prompts) == (3, 2, 6)
    assert parse_train_args(["--preset", "sums", "--gen-prompts", "7",
                             "--mini-batch-prompts", "2"]).train_prompts == 6  # whole mini-batches of 2
    assert parse_train_args(["--gen-prompts", "64"]).train_prompts == 32  # the preset's own count is the most


@pytest.mark.slow
def test_evaluation_from_step_0_and_checkpoints_evaluable_as_they_are(tmp_path, tiny_model_path):
    """--eval-before-train logs the starting weights' avg@k as step 0; every evaluation's generations land in eval/;
    a checkpoint folder is a --model for evaluate.py (exported once into its hf/ folder) and for runfolder.py export."""
    out = run_train(tmp_path / "run", "--max-steps", "2", "--save-every", "2", "--eval-every", "2",
                    "--eval-before-train", "--eval-data", str(few_problems(tmp_path)),
                    "--sampler", "hf")  # bookkeeping; vLLM: test_distributed
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2] and set(rows[0]) == {"step", "eval_acc", "eval_seed", "time_eval_s"}
    assert "eval_acc" in rows[2] and "held-out avg@k: step 0" in out.stdout
    for step in (0, 2):  # each evaluation's score on the screen as it ends
        assert f"step {step}: held-out avg@" in out.stdout
        assert (f"% ({rows[step]['time_eval_s']:.0f} s)"
                in out.stdout.split(f"step {step}: held-out avg@")[1].split("\n")[0])
        assert (f" {100 * rows[step]['eval_acc']:.1f}% ("
                in out.stdout.split(f"step {step}: held-out avg@")[1].split("\n")[0])
        records = [json.loads(line)
                   for line in (tmp_path / "run" / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(records) > 0 and all(len(r["responses"]) == len(r["correct"]) for r in records)
        assert sum(sum(r["correct"]) / len(r["correct"])
                   for r in records) / len(records) == pytest.approx(rows[step]["eval_acc"])
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    done = warm.run([sys.executable, "evaluate.py", "--model", str(checkpoint), "--benchmarks", "arith",
                     "--k", "1",
                     "--limit", "4", "--max-tokens", "24", "--sampler", "hf",
                     "--output", str(tmp_path / "r.json")],
                    cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    from safetensors.torch import load_file
    exported, final = load_file(checkpoint / "hf" / "model.safetensors"), final_state(tmp_path / "run")
    for k in final:
        torch.testing.assert_close(exported[k], final[k])
    again = warm.run([sys.executable, "evaluate.py", "--model", "tiny", "--benchmarks", "arith", "--k", "1",
                      "--output", str(tmp_path / "r.json")],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr


STALE = {  # a weight sync made to fail on purpose: the vLLM engine ignores it; HF samples from a copy never synced
    "vllm": "rollout.VLLMSampler.load_weights = lambda self, named: None",
    "hf": "real = rollout.make_sampler\n"
          "rollout.make_sampler = lambda b, p, model=None, tokenizer=None, **k: real(b, p, model=copy.deepcopy(model), "
          "tokenizer=tokenizer)",
}


@pytest.mark.slow
@pytest.mark.parametrize("sampler", sorted(STALE))
def test_a_stale_sampler_stops_the_run_with_one_line(sampler, tmp_path, tiny_model_path):
    """Step 1 samples from the loaded weights (in sync); after its update the sampler keeps the old ones, and a later
    step's check stops the run: exit code 1, one line naming the problem, the earlier steps' checkpoints and metrics
    intact. vLLM's engine tensors are compared exactly, so it stops at step 2; HF's copy only by the probe."""
    if sampler == "vllm":
        from conftest import vllm_or_skip
        vllm_or_skip()
    code = (f"import copy, sys\nimport rollout\n{STALE[sampler]}\nimport train\n"
            f"train.run(sys.argv[1:])")
    out = warm.run([sys.executable, "-c", code, *SMALL, "--sampler", sampler, "--max-steps", "3",
                    "--save-every", "1",
                    "--log-samples-every", "0", "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                   text=True, timeout=600)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1, out.stderr[-3000:]
    stopped = int(last.split()[2].rstrip(":"))  # caught once the policy drifted past the tolerance: step 2 or 3
    assert last.startswith(f"train.py: step {stopped}: the sampler (") and "does not hold the trainer's weights" in last
    assert stopped in (2, 3) and "Traceback" not in out.stderr
    if sampler == "vllm":  # the exact check: the engine's tensors differ from the trainer's right after step 1's update
        assert stopped == 2 and "its model.embed_tokens.weight, " in last and "differ from the trainer's" in last
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, stopped))  # the steps before it are intact
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == f"step_{stopped - 1:06d}"


@pytest.mark.slow
def test_the_quick_command_tells_the_objectives_apart(tiny_model_path):
    """README's quick run (`--gen-prompts 8 --max-steps 25`) keeps the preset's optimizer steps per rollout batch:
    mini-batches of 1 prompt, so after the first the update is off-policy and GRPO, GSPO, SAPO and CE-GPPO move the
    weights differently (with one on-policy mini-batch they share a gradient, and their runs were bit-identical)."""
    import random

    from transformers import AutoModelForCausalLM
    quick = parse_train_args(["--gen-prompts", "8", "--max-steps", "25"])
    assert (quick.gen_prompts, quick.train_prompts, quick.mini_batch_prompts, quick.micro_batch_size) == (8, 8, 1, 8)
    assert parse_train_args(["--preset", "sums", "--gen-prompts", "8"]).mini_batch_prompts == 1  # 2 x 8 / 32 -> 1
    rng = random.Random(0)
    groups = [[{"prompt_ids": [rng.randrange(5, 270) for _ in range(6)],
                "response_ids": [rng.randrange(5, 270) for _ in range(12)],
                "advantage": rng.gauss(0, 1), "correct": rng.random() < 0.5} for _ in range(quick.n)] for _ in range(3)]
    moved = {}
    for algo in ("grpo", "gspo", "sapo", "ce_gppo"):
        args = parse_train_args(["--gen-prompts", "8", "--max-steps", "25", "--algo", algo])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        policy = train.make_policy(args, model, optimizer, 0, torch.device("cpu"))
        metrics = train_update(policy, [groups[0], groups[1], groups[2]], args.loss)  # 3 kept groups: 3 mini-batches
        assert metrics["optimizer_steps"] == 3
        moved[algo] = torch.cat([p.detach().flatten() for p in model.parameters()])
    for a in moved:
        for b in moved:
            if a < b:
                assert not torch.equal(moved[a], moved[b]), (a, b)


def test_od_initial_entropy_is_fixed_or_measured():
    """--dynamic-clip od's H_init: 0.5 nats by default (the public defaults), so its floor 0.1 is reached at entropy
    0.1; with --od-initial-entropy 0 the first step's entropy, the floor 0.2 x that."""
    fixed = train.LoopState()
    cfg = parse_train_args(["--algo", "grpo", "--dynamic-clip", "od"]).loss
    assert [train.advance_od_state(fixed, cfg, h, 0.5) for h in (0.18, 0.11, 0.09, 0.2, 0.31)] == [0, 0, 1, 1, 0]
    assert fixed.initial_entropy == 0.5  # tau_high at half-way: 0.1 + 0.4 x 0.5 = 0.3
    measured = train.LoopState()
    cfg = parse_train_args(["--algo", "grpo", "--dynamic-clip", "od", "--od-initial-entropy", "0"]).loss
    assert [train.advance_od_state(measured, cfg, h, 0.5) for h in (0.18, 0.1, 0.03, 0.1, 0.111)] == [0, 0, 1, 1, 0]
    assert measured.initial_entropy == 0.18  # floor 0.036, tau_high 0.036 + 0.144 x 0.5 = 0.108


def test_on_policy_the_betas_do_nothing(tiny_model_path):
    """The negative control of the beta code path: with one mini-batch per step and one pass, every ratio is exactly 1
    (the old log-probs are the update's own first forward), so no token is outside the clip interval and CE-GPPO
    (1, 1), (0.5, 1), (1, 0.5) and token-mean PPO-clip (CE-GPPO (0, 0)) take the same steps, bit for bit, over several
    steps whose data and advantages differ; approx_kl and every clip fraction are exactly 0, and every trained token
    sits inside the interval with ratio 1."""
    import random

    from transformers import AutoModelForCausalLM
    rng = random.Random(1)
    steps = [[[{"prompt_ids": [rng.randrange(5, 270) for _ in range(5)],
                "response_ids": [rng.randrange(5, 270) for _ in range(rng.randrange(3, 14))],
                "advantage": rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5), "correct": rng.random() < 0.5,
                "finished": rng.random() < 0.8} for _ in range(8)]] for _ in range(3)]  # one mini-batch per step
    weights = {}
    for betas in [("1", "1"), ("0.5", "1"), ("1", "0.5"), ("0", "0")]:
        args = parse_train_args(["--algo", "ce_gppo", "--beta1", betas[0], "--beta2", betas[1], "--lr", "3e-3",
                                 "--warmup-steps", "0", "--micro-batch-size", "4"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        policy = train.make_policy(args, model, optimizer, 0, torch.device("cpu"))
        start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        for seqs in steps:
            m = train_update(policy, seqs, args.loss)
            assert m["optimizer_steps"] == 1 and m["approx_kl"] == 0.0 and m["ratio_mean"] == 1.0
            assert all(m[k] == 0.0 for k in m if "clip_frac" in k) and "dual_clip_frac" in m
            assert not any(k.startswith(("low_neg_", "high_pos_")) for k in m)  # no token in either beta region
            assert m["inside_ratio_p10"] == m["inside_ratio_p50"] == 1.0
        weights[betas] = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert (weights[betas] - start).abs().max() > 1e-3  # the steps moved the weights
    assert all(torch.equal(w, weights[("0", "0")]) for w in weights.values())


def test_ppo_epochs_repeat_the_passes_against_the_sampling_policy(tiny_model_path):
    """--ppo-epochs E: E passes over the step's mini-batches, each ratio taken against the policy that sampled. One pass
    is the loop as it was (optimizer_step per mini-batch, bit for bit); two passes are that, then the same mini-batches
    again with the same pi_old, so from the second pass on even the first mini-batch is off-policy."""
    import random

    from transformers import AutoModelForCausalLM
    rng = random.Random(0)
    groups = [[{"prompt_ids": [rng.randrange(5, 270) for _ in range(6)],
                "response_ids": [rng.randrange(5, 270) for _ in range(12)],
                "advantage": rng.gauss(0, 1), "correct": rng.random() < 0.5} for _ in range(4)] for _ in range(2)]

    def policy_and_minis(epochs):
        args = parse_train_args(["--n", "4", "--gen-prompts", "2", "--mini-batch-prompts", "1",
                                 "--micro-batch-size", "4", "--lr", "1e-3",
                                 "--ppo-epochs", str(epochs)])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        policy = train.make_policy(args, model, optimizer, 0, torch.device("cpu"))
        minis = train.make_mini_batches(policy, groups, args.loss)
        train.old_logprobs(policy, minis)
        return args, policy, minis

    def weights(policy):
        return torch.cat([p.detach().flatten() for p in policy.model.parameters()])

    assert parse_train_args([]).ppo_epochs == 1
    args, policy, minis = policy_and_minis(1)
    one = train.update_policy(policy, minis, args.loss, epochs=args.ppo_epochs)
    _, by_hand, hand_minis = policy_and_minis(1)
    for mini in hand_minis:  # the update before --ppo-epochs existed
        train.optimizer_step(by_hand, mini, args.loss)
    assert torch.equal(weights(policy), weights(by_hand)) and one["optimizer_steps"] == 2
    first = minis[0].micro[0]
    assert not torch.equal(train.response_logprobs(policy, first)[0], first.old_logp)  # pi_old is the sampling policy
    # a second pass over the same mini-batches, pi_old kept: the ratio of the first mini-batch now differs from 1
    again = train.update_policy(policy, minis, args.loss)
    assert again["ratio_mean"] != 1.0 and again["approx_kl"] > 0
    args2, twice, minis2 = policy_and_minis(2)
    two = train.update_policy(twice, minis2, args2.loss, epochs=args2.ppo_epochs)
    assert torch.equal(weights(twice), weights(policy)) and two["optimizer_steps"] == 4
    assert two["ratio_mean"] != one["ratio_mean"]


def test_a_step_that_trains_no_token_logs_no_token_means(tiny_model_path):
    """Every response of the step scored alike, so every advantage is 0 and no token trains (the loss skips A = 0
    responses): the step's entropy, ratio and clip shares are undefined and absent from its row, as on a step that
    keeps no group under dynamic sampling, never logged as 0; its loss, gradient norm and optimizer steps stay."""
    from transformers import AutoModelForCausalLM
    groups = [[{"prompt_ids": [7, 8, 9], "response_ids": [10, 11], "advantage": 0.0, "correct": False}] * 4] * 2
    args = parse_train_args(["--n", "4", "--gen-prompts", "2", "--mini-batch-prompts", "1", "--micro-batch-size", "4"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    policy = train.make_policy(args, model, optimizer, 0, torch.device("cpu"))
    minis = train.make_mini_batches(policy, groups, args.loss)
    train.old_logprobs(policy, minis)
    row = train.update_policy(policy, minis, args.loss)
    assert not {"entropy", "ratio_mean", "approx_kl", "clip_frac_low_neg", "beta1_dose"} & set(row), sorted(row)
    assert row["optimizer_steps"] == 2 and row["pg_loss"] == 0.0 and row["grad_norm"] == 0.0


@pytest.mark.slow
def test_a_run_killed_during_an_evaluation_evaluates_that_step_on_resume(tmp_path, tiny_model_path):
    """Step 2's checkpoint is written before its evaluation: killed during that evaluation (kill -9), the resumed run
    evaluates step 2 from the checkpoint and logs its row once, with the eval_acc an uninterrupted run logs."""
    problems = few_problems(tmp_path)
    two = ["--sampler", "hf", "--max-steps", "2", "--save-every", "2", "--eval-every", "2", "--no-eval-before-train",
           "--eval-data", str(problems),
           "--log-samples-every", "0"]
    run_train(tmp_path / "straight", *two)
    env = {**os.environ, "TRAIN_CRASH_AT": "evaluation:2"}
    killed = warm.run([sys.executable, "train.py", *SMALL, *two, "--output-dir", str(tmp_path / "killed")],
                      cwd=ROOT,
                      capture_output=True, text=True, timeout=600, env=env)
    assert killed.returncode == -9 and [r["step"] for r in read_metrics(tmp_path / "killed")] == [1]
    run_train(tmp_path / "killed", *two, "--resume")
    want, got = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "killed")
    assert [r["step"] for r in got] == [1, 2] and "eval_lost" not in got[1]
    assert got[1]["eval_acc"] == want[1]["eval_acc"] and got[1]["reward_mean"] == want[1]["reward_mean"]


# --- issue 57: what the bar and the printed sample show; the evaluation seed evaluate.py reuses ----------------------

def test_the_bar_shows_shares_in_percent_with_the_digits_that_matter():
    """A share was a 4-decimal fraction (mostly clip_b1=0.0000): now percent, two significant digits, 0% only when
    none; a metric that is not a share keeps three significant digits."""
    shown = [train.bar_value("clip_frac_low_neg", v) for v in (0.0, 1.2e-5, 0.0037, 0.0116, 0.123, 0.00999, 1.0)]
    assert shown == ["0%", "0.0012%", "0.37%", "1.2%", "12%", "1.0%", "100%"]
    assert train.bar_value("m2po_masked_frac", 0.25) == "25%" and train.bar_value("m2po_second_moment", 0.0412345) == \
        "0.0412"


def test_samples_come_from_groups_that_trained_first():
    """Most printed samples came from dropped groups (A = 0 throughout); the groups that trained come first, and the
    printed line is one of theirs."""
    from rollout import Completion
    groups = {i: train.Group({"prompt": [{"role": "user", "content": f"Compute {i}."}], "answer": str(i)}, [1],
                             [Completion([5, 6], f"answer {i}.{j}", True, None) for j in range(2)]) for i in range(4)}
    rewards = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, -1.0], [-1.0, 1.0]])
    advantages = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
    step = train.Step(0, {}, [g.row for g in groups.values()], groups, rewards, advantages, [1, 3])
    records = train.sample_records(step)
    assert [r["prompt"] for r in records] == ["Compute 1."] * 2 + ["Compute 3."] * 2
    assert all(r["kept"] for r in records) and [r["advantage"] for r in records] == [1.0, -1.0, -1.0, 1.0]


def test_an_evaluations_seed_is_the_one_evaluate_py_reuses(monkeypatch):
    """train.py evaluates step N with heldout.eval_seed(seed, N) (logged as eval_seed); evaluate.py --seed-of RUN N
    computes the same where the row is gone."""
    from cegppo_utils import heldout
    seen = []

    def sample_and_score(sampler, tokenizer, problems, **kw):
        seen.append(kw["seed"])
        return [[]], [[True, False]]

    class Sampler:
        def wake_up(self): pass
        def load_weights(self, named): list(named)
        def sleep(self): pass

    monkeypatch.setattr(train.heldout, "sample_and_score", sample_and_score)
    args = parse_train_args(["--seed", "7"])
    model = torch.nn.Linear(1, 1)
    run = train.Run(train.Policy(model, None, None, torch.device("cpu"), 0, 1.0, 1.0, 0, False, False, 1, 1.0), None,
                    Sampler(), None, [{"id": 0, "answer": "1", "prompt": "p"}], None, [], train.tqdm(disable=True),
                    torch.device("cpu"), "", print, 0, {"k": 2, "max_tokens": 4, "temperature": 0.6, "top_p": 0.95})
    monkeypatch.setattr(train.RF, "write_jsonl", lambda *a: None)
    for step in (0, 1, 25):
        row = train.evaluation_row(run, args, step)
        assert row["eval_seed"] == seen[-1] == heldout.eval_seed(7, step) and row["eval_acc"] == 0.5


@pytest.mark.parametrize("algo_flags", [["--algo", "ce_gppo", "--beta1", "1", "--beta2", "0.5"],
                                        ["--algo", "ce_gppo", "--beta1", "0.5", "--beta1-weight", "ratio"],
                                        ["--algo", "grpo"]])
def test_region_grad_norms_are_the_parts_of_the_gradient_and_leave_the_update_alone(tiny_model_path, algo_flags):
    """--region-grad-norms: the logged norms are those of the mini-batch gradient's parts from the beta1 region's
    tokens, the beta2 region's and the rest, each found here by another route (the whole gradient minus the one with
    that region's advantages set to 0, which leaves its tokens no gradient); the three parts sum to the whole gradient;
    and the update is bit for bit that of a step without them. GRPO clips both regions: their parts are 0."""
    import random

    from transformers import AutoModelForCausalLM
    rng = random.Random(3)
    seqs = [{"prompt_ids": [rng.randrange(5, 270) for _ in range(5)],
             "response_ids": [rng.randrange(5, 270) for _ in range(rng.randrange(4, 14))],
             "advantage": rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 1.5), "correct": rng.random() < 0.5}
            for _ in range(8)]
    args = parse_train_args([*algo_flags, "--micro-batch-size", "4", "--region-grad-norms", "all"])
    cfg = args.loss

    def fresh():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        policy = train.make_policy(args, model, torch.optim.SGD(model.parameters(), lr=0.1), 0, torch.device("cpu"))
        mini = train.make_mini_batches(policy, [seqs], cfg)[0]
        g = torch.Generator().manual_seed(5)
        for mb in mini.micro:  # an old policy ratios away from this one, so that both regions hold tokens
            logp, mb.old_entropy, _ = train.response_logprobs(policy, mb)
            mb.old_logp = logp + 0.6 * torch.randn(logp.shape, generator=g) * mb.response_mask
        return policy, mini

    policy, mini = fresh()
    assert policy.region_grad_norms == "all"
    _, _, logged = train.optimizer_step(policy, mini, cfg, measure=True)
    plain, plain_mini = fresh()
    train.optimizer_step(plain, plain_mini, cfg)
    assert all(torch.equal(a, b) for a, b in zip(policy.model.parameters(), plain.model.parameters()))

    by_hand, hand_mini = fresh()
    params = list(by_hand.model.parameters())

    def gradient(zeroed: set) -> list:  # the mini-batch's gradient with the named regions' advantages set to 0
        total = [torch.zeros_like(p) for p in params]
        for mb in hand_mini.micro:
            logp = train.response_logprobs(by_hand, mb, grad=True)[0]
            adv = mb.advantages.expand_as(logp).clone()
            d = (logp - mb.old_logp).exp().detach()
            regions = {"low_neg": (d < 1 - cfg.eps_low) & (adv < 0), "high_pos": (d > 1 + cfg.eps_high) & (adv > 0)}
            for name in zeroed:
                adv[regions[name] & (mb.response_mask > 0)] = 0.0
            loss = L.policy_loss(logp, mb.old_logp, adv, mb.response_mask, cfg, totals=hand_mini.totals)[0]
            for t, g in zip(total, torch.autograd.grad(loss, params)):
                t += g
        return total

    def norm(tensors):
        return torch.sqrt(sum(t.double().square().sum() for t in tensors)).item()

    whole, rest = gradient(set()), gradient({"low_neg", "high_pos"})
    low = [w - g for w, g in zip(whole, gradient({"low_neg"}))]
    high = [w - g for w, g in zip(whole, gradient({"high_pos"}))]
    for s, w in zip([a + b + c for a, b, c in zip(low, high, rest)], whole):
        torch.testing.assert_close(s, w, rtol=1e-5, atol=1e-7)  # the three parts sum to the whole
    for name, part in [("low_neg", low), ("high_pos", high), ("rest", rest)]:
        assert logged[f"grad_norm_{name}"] == pytest.approx(norm(part), rel=1e-4, abs=1e-7), name
    dot = sum((a.double() * b.double()).sum() for a, b in zip(low, rest)).item()
    if algo_flags[1] == "grpo":
        assert logged["grad_norm_low_neg"] == logged["grad_norm_high_pos"] == 0.0 == logged["grad_cos_low_neg_rest"]
    else:
        assert logged["grad_norm_low_neg"] > 1e-3 and logged["grad_norm_high_pos"] > 1e-3
        assert logged["grad_cos_low_neg_rest"] == pytest.approx(dot / norm(low) / norm(rest), rel=1e-4)


def test_region_grad_norms_are_logged_for_the_last_mini_batch_unless_asked_otherwise(tiny_model_path):
    """The default measures the step's last mini-batch only (the first is on-policy: d = 1, both regions empty); "all"
    every one (their mean), "off" none; an algorithm without clip regions or a sharded model logs none."""
    assert parse_train_args([]).region_grad_norms == "last"
    assert parse_train_args(["--precision", "bf16"]).region_grad_norms == "last"  # not typed: not refused
    from cegppo_utils import flags
    with pytest.raises(SystemExit):
        flags.parse_args(["--precision", "bf16", "--region-grad-norms", "all"], train.__doc__)
    with pytest.raises(SystemExit):
        flags.parse_args(["--algo", "cispo", "--region-grad-norms", "all"], train.__doc__)
