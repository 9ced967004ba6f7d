"""mechanism.py: the first-order entropy prediction against a real gradient step on a softmax, the interval
statistics, and a short paired run that reproduces itself with its sanity lines at exactly 0."""

import gzip
import json
import math
import sys

import pytest
import torch
import warm
from conftest import ROOT

from tools import mechanism as M
from tools import stats


@pytest.mark.parametrize("target", ["likely", "unlikely"])
@pytest.mark.parametrize("g", [1.0, -1.0])  # A < 0 pushes the token down (g > 0), A > 0 lifts it
def test_first_order_entropy_change_matches_a_small_step(target, g):
    torch.manual_seed(0)
    z = (torch.randn(50, dtype=torch.float64) * 2).requires_grad_(True)
    a = int(z.argmax()) if target == "likely" else int(z.argmin())

    def entropy(z):
        logpi = z.log_softmax(-1)
        return -(logpi.exp() * logpi).sum()

    (g * z.log_softmax(-1)[a]).backward()  # loss whose gradient w.r.t. log pi(a) is g
    eta = 1e-4
    measured = entropy(z.detach() - eta * z.grad) - entropy(z.detach())
    kappa, logpi_a, H = M.entropy_sensitivity(z.detach().log_softmax(-1), torch.tensor(a))
    assert measured.item() == pytest.approx(eta * g * kappa.item(), rel=1e-3)
    # the sign rule the docs rely on: pushing down (g > 0) an unlikely token lowers entropy, a likely one raises it
    low = (-logpi_a > H).item()
    assert (kappa.item() < 0) == low and (target == "unlikely") == low


def test_interval_statistics():
    assert stats.t_quantile(0.975, 29) == pytest.approx(2.0452, abs=1e-3)
    assert stats.t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-3)
    mean, (lo, hi) = stats.mean_ci([1.0, 2.0, 3.0])
    assert (mean == 2.0 and hi - mean == pytest.approx(4.3027 * 1.0 / math.sqrt(3), abs=1e-3)
            and lo == pytest.approx(4 - hi))
    assert stats.pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(0.9934, abs=1e-4)


@pytest.mark.slow
def test_a_short_paired_run_reproduces_itself(tmp_path, tiny_model_path):
    """Two runs, the second with fewer configs: every config's numbers are a function of the batch and the seeds
    alone, not of which other configs ran beside it. lr 0.01 with mini-batches of 2 prompts: the first AdamW step moves
    every weight by about lr, so the later mini-batches' ratios leave the clip interval whatever the warm start."""
    outputs, printed = [], []
    # train.py flags; HF generate, since the pairing and its bookkeeping are tested here, not the engine
    train_flags = ["--gen-prompts", "6", "--train-prompts", "6", "--mini-batch-prompts", "2",
                   "--micro-batch-size", "16", "--lr", "0.01", "--sampler", "hf"]
    for i, configs in enumerate(("ppo_clip,ppo_clip_repeat,ce_gppo_1_1,gppo,entropy_0.003,grpo,adaptive_entropy,"
                                 "grpo_kl_0.04,dapo,top_entropy_0.2", "ppo_clip,gppo")):
        out = tmp_path / ("run0.json", "run1.json.gz")[i]  # the second packed, as the committed ones are
        done = warm.run([sys.executable, "-m", "tools.mechanism", "--preset", "tiny", "--batches", "2",
                         "--probe-prompts", "2", "--fresh-prompts", "2", "--configs", configs,
                         "--output", str(out), *train_flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(json.loads(gzip.decompress(out.read_bytes()) if i else out.read_text()))
        printed.append(done.stdout)
        assert (tmp_path / f"run{i}.png").exists()
    first, second = outputs
    assert "ppo_clip_repeat - ppo_clip = 0.0 (must be 0); gppo - ce_gppo_1_1 = 0.0 (must be 0)" in printed[0]
    assert first["sanity"] == {"ppo_clip_repeat_minus_ppo_clip_max_abs": 0.0, "gppo_minus_ce_gppo_1_1_max_abs": 0.0}
    for a, b in zip(first["records"], second["records"], strict=True):  # the seeds fix every sample and step
        assert (a["kept_groups"], a["response_length"]) == (b["kept_groups"], b["response_length"])
        assert a["configs"]["ppo_clip"] == b["configs"]["ppo_clip"] and a["configs"]["gppo"] == b["configs"]["gppo"]
    assert all(r["kept_groups"] > 0 and r["configs"]["ce_gppo_1_1"]["optimizer_steps"] > 0 for r in first["records"])
    # CE-GPPO (1, 1) makes PPO-clip's step exactly until a token falls in a beta region, and another step once one does
    beta_regions = ("b1_low", "b1_high", "b2_low", "b2_high")
    clipped = [sum(r["configs"]["ce_gppo_1_1"]["region_frac"][k] for k in beta_regions) > 0 for r in first["records"]]
    for r, any_clipped in zip(first["records"], clipped):
        assert (r["configs"]["ce_gppo_1_1"]["dH"] != r["configs"]["ppo_clip"]["dH"]) == any_clipped, r["batch"]
    assert any(clipped)  # by construction (lr 0.01, several mini-batches): the test sees both losses act
    result = first["ppo_clip_repeat"]
    assert result["n"] == 2 and result["dH_vs_ppo_mean"] == 0.0 and result["dH_vs_ppo_ci95"] == [0.0, 0.0]
    assert set(first["gppo"]) >= {"dH_mean", "dH_vs_ppo_mean", "dH_vs_ppo_ci95", "n"}
    assert first["settings"]["train_flags"] == train_flags
    assert first["entropy_0.003"]["predicted_by_region_mean"]["entropy_bonus"] != 0.0  # the bonus path ran
    # the other papers' methods: the KL penalty gets its frozen reference, and adaptive entropy's first step has no
    # previous entropy, so no bonus: it equals GRPO exactly; each is also paired against its base algorithm
    assert (first["adaptive_entropy"]["dH_vs_grpo"] == [0.0, [0.0, 0.0]]
            and first["grpo"]["dH_vs_grpo"] == [0.0, [0.0, 0.0]])
    assert "dH_vs_dapo" in first["top_entropy_0.2"] and "dH_vs_dapo" not in second["gppo"]
    assert all(r["configs"][c]["optimizer_steps"] > 0
               for r in first["records"] for c in ("grpo_kl_0.04", "top_entropy_0.2"))
    assert any(r["configs"]["top_entropy_0.2"]["dH"] != r["configs"]["dapo"]["dH"] for r in first["records"])
    assert "dH - grpo [95% CI]: ppo_clip" in printed[0] and "dH - grpo" not in printed[1]



def test_the_figure_is_never_written_through_a_link(tmp_path):
    """Issue 59: matplotlib's savefig follows a link planted at the figure's name; the figure replaces the link."""
    import os
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file\n")
    os.symlink(mine, tmp_path / "m.png")
    configs = ["ppo_clip", "ce_gppo_1_1"]
    summary = {c: {"dH_vs_ppo_mean": 0.001, "dH_vs_ppo_ci95": [0.0, 0.002]} for c in configs}
    records = [{"configs": {c: {"predicted": 0.1 * b, "dH": 0.01 * b} for c in configs}} for b in range(3)]
    M.draw(summary, records, configs, M.figure_path(str(tmp_path / "m.json.gz")), "a title")
    assert mine.read_text() == "a user's file\n" and (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
