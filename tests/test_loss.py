"""loss.py against closed forms derived from each paper, token by token."""

import math
import re
from dataclasses import fields, replace

import pytest
import torch

import loss as L

# Ratios chosen to land in every region for eps 0.2 / 0.28, c = 10: far below, just below, inside,
# just above 1.2, between 1.2 and 1.28, far above, and beyond the dual-clip bound.
RATIOS = [0.3, 0.75, 0.95, 1.0, 1.1, 1.24, 1.5, 12.0]


def make_batch(seed=0, batch=8, length=len(RATIOS), per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3 - 0.05
    ratios = torch.tensor(RATIOS, dtype=torch.float64)[torch.randperm(len(RATIOS), generator=g)]
    log_ratio = torch.stack([ratios.log().roll(i) for i in range(batch)])[:, :length]
    logp = (old_logp + log_ratio).clamp(max=-1e-3).requires_grad_(True)
    if per_token_adv:
        adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    else:
        adv = torch.tensor([1.5, -1.5, 0.7, -0.7, 0.0, 2.0, -2.0, 0.3], dtype=torch.float64)[:batch].unsqueeze(-1)
    mask = torch.ones(batch, length, dtype=torch.float64)
    mask[0, -2:] = 0  # padding
    mask[3, -1:] = 0
    return logp, old_logp, adv, mask


def expected_token(algo, d, a, logp, eps_low, eps_high, beta1, beta2, c):
    """(per-token loss value, d loss / d logp) for one token, written from the papers case by case."""
    if algo in ("ce_gppo", "gppo"):
        if algo == "gppo":
            beta1 = beta2 = 1.0
        if d < 1 - eps_low and a < 0:
            value, grad = -beta1 * (1 - eps_low) * a, -beta1 * (1 - eps_low) * a
        elif d > 1 + eps_high and a > 0:
            value, grad = -beta2 * (1 + eps_high) * a, -beta2 * (1 + eps_high) * a
        else:
            value, grad = -d * a, -d * a
    elif algo in ("grpo", "dapo"):
        if d < 1 - eps_low and a < 0:
            value, grad = -(1 - eps_low) * a, 0.0
        elif d > 1 + eps_high and a > 0:
            value, grad = -(1 + eps_high) * a, 0.0
        else:
            value, grad = -d * a, -d * a
    elif algo == "cispo":
        w = min(max(d, 1 - eps_low), 1 + eps_high)
        return -w * a * logp, -w * a
    else:
        raise AssertionError(algo)
    if c is not None and a < 0 and value > -a * c:  # dual clip
        value, grad = -a * c, 0.0
    return value, grad


@pytest.mark.parametrize("algo", ["ce_gppo", "gppo", "grpo", "dapo", "cispo"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_token_level_algorithms_match_closed_form(algo, per_token_adv):
    logp, old_logp, adv, mask = make_batch(per_token_adv=per_token_adv)
    beta1, beta2, c = 0.5, 1.0, 10.0
    loss, metrics = L.policy_loss(logp, old_logp, adv, mask, L.loss_config(algo, beta1=beta1, beta2=beta2,
                                  clip_ratio_c=c, loss_agg_mode="token-mean"))
    loss.backward()
    spec = L.loss_config(algo)
    n = mask.sum().item()
    adv_full = adv.expand_as(logp)
    want_value, want_grad = 0.0, torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            d = math.exp(logp[i, t].item() - old_logp[i, t].item())
            v, g = expected_token(algo, d, adv_full[i, t].item(), logp[i, t].item(),
                                  spec.eps_low, spec.eps_high, beta1, beta2, c)
            want_value += v / n
            want_grad[i, t] = g / n
    assert loss.item() == pytest.approx(want_value, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-9, atol=1e-12)


def test_batch_covers_every_region():
    logp, old_logp, adv, mask = make_batch()
    _, m = L.policy_loss(logp, old_logp, adv, mask, L.loss_config("dapo"))
    for key in ["clip_frac_low_neg", "clip_frac_high_pos", "clip_frac_low_pos", "clip_frac_high_neg", "dual_clip_frac"]:
        assert m[key] > 0, key


def test_gspo_matches_sequence_level_gradient():
    logp, old_logp, adv, mask = make_batch()
    # GSPO works at tiny ranges; move half the sequences just outside them.
    g = torch.Generator().manual_seed(1)
    small = (torch.rand(logp.shape, generator=g, dtype=torch.float64) - 0.5) * 2e-3
    logp = (old_logp + small).detach().requires_grad_(True)
    eps_low, eps_high = L.loss_config("gspo").eps_low, L.loss_config("gspo").eps_high
    loss, metrics = L.policy_loss(logp, old_logp, adv, mask, L.loss_config("gspo"))
    loss.backward()
    batch = logp.shape[0]
    want = torch.zeros_like(logp)
    want_value = 0.0
    clipped = 0
    for i in range(batch):
        length = mask[i].sum().item()
        s = math.exp(((logp[i] - old_logp[i]) * mask[i]).sum().item() / length)
        a = adv[i, 0].item()
        sc = min(max(s, 1 - eps_low), 1 + eps_high)
        want_value += max(-s * a, -sc * a) / batch
        if (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low):
            clipped += 1
            continue
        want[i] = -s * a / length / batch * mask[i]
    assert 0 < clipped < batch
    assert loss.item() == pytest.approx(want_value, rel=1e-9)
    torch.testing.assert_close(logp.grad, want, rtol=1e-9, atol=1e-12)


def _grad(algo, **kw):
    logp, old_logp, adv, mask = make_batch(seed=3, per_token_adv=True)
    loss, _ = L.policy_loss(logp, old_logp, adv, mask, L.loss_config(algo, loss_agg_mode="token-mean", **kw))
    loss.backward()
    return logp.grad


def test_beta_zero_is_ppo_clip_and_beta_one_is_gppo():
    torch.testing.assert_close(_grad("ce_gppo", beta1=0.0, beta2=0.0), _grad("grpo"))
    torch.testing.assert_close(_grad("ce_gppo", beta1=1.0, beta2=1.0), _grad("gppo"))
    assert not torch.allclose(_grad("ce_gppo", beta1=0.5, beta2=1.0), _grad("gppo"))


@pytest.mark.parametrize("algo", ["ce_gppo", "grpo"])
def test_dual_clip_zeroes_negative_tokens_beyond_c(algo):
    logp, old_logp, adv, mask = make_batch()
    loss, m = L.policy_loss(logp, old_logp, adv, mask, L.loss_config(algo, clip_ratio_c=10.0))
    loss.backward()
    ratio = (logp - old_logp).exp().detach()
    beyond = (ratio > 10.0) & (adv < 0) & mask.bool()
    assert beyond.any()
    assert (logp.grad[beyond] == 0).all()
    assert m["dual_clip_frac"].item() == pytest.approx(beyond.sum().item() / mask.sum().item())
    # without dual clip those tokens do get a gradient
    logp.grad = None
    L.policy_loss(logp, old_logp, adv, mask, L.loss_config(algo, clip_ratio_c=0))[0].backward()
    assert (logp.grad[beyond] != 0).all()


@pytest.mark.parametrize("algo", ["ce_gppo", "grpo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_the_full_batch_gradient(algo, mode):
    logp, old_logp, adv, mask = make_batch(seed=5, per_token_adv=True)
    full, _ = L.policy_loss(logp, old_logp, adv, mask, L.loss_config(algo, loss_agg_mode=mode, norm_len=32))
    full.backward()
    full_grad = logp.grad.clone()
    logp.grad = None
    total = 0.0
    for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):  # three unequal micro-batches
        part, _ = L.policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows],
                                L.loss_config(algo, loss_agg_mode=mode, norm_len=32),
                                totals=L.Totals(tokens=mask.sum(), seqs=mask.shape[0]))
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, full_grad, rtol=1e-12, atol=1e-15)


def test_naive_micro_batch_mean_differs():
    """The per-micro-batch mean (what num_tokens fixes) really is a different gradient here."""
    logp, old_logp, adv, mask = make_batch(seed=5, per_token_adv=True)
    L.policy_loss(logp, old_logp, adv, mask)[0].backward()
    full = logp.grad.clone()
    logp.grad = None
    for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):
        (L.policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows])[0] / 3).backward()
    assert not torch.allclose(logp.grad, full)


def test_region_fractions_on_hand_built_input():
    # one token per case, eps 0.2: ratios and advantages set by hand
    ratio = torch.tensor([[0.5, 0.5, 1.5, 1.5, 1.0, 20.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.float64)
    old_logp = torch.full_like(ratio, -2.0)
    logp = old_logp + ratio.log()
    _, m = L.policy_loss(logp, old_logp, adv, mask, L.loss_config("ce_gppo", clip_ratio_c=10.0))
    n = 7
    assert m["clip_frac_low_neg"].item() == pytest.approx(1 / n)
    assert m["clip_frac_high_pos"].item() == pytest.approx(1 / n)
    assert m["clip_frac_low_pos"].item() == pytest.approx(1 / n)
    assert m["clip_frac_high_neg"].item() == pytest.approx(2 / n)  # 1.5 and 20, both with A < 0
    assert m["dual_clip_frac"].item() == pytest.approx(1 / n)
    assert m["ratio_mean"].item() == pytest.approx((0.5 + 0.5 + 1.5 + 1.5 + 1.0 + 20.0 + 1.0) / n)
    k3 = sum(r - 1 - math.log(r) for r in [0.5, 0.5, 1.5, 1.5, 1.0, 20.0, 1.0]) / n
    assert m["approx_kl"].item() == pytest.approx(k3)
    assert m["num_tokens"].item() == n


def test_region_evidence_on_hand_built_input():
    """What each region holds (loss.region_evidence -> evidence_row): the beta1 region's tokens here are one EOS token
    (the last of a finished response), one late token and one early token; the beta2 region one token; the rest inside
    the interval. Shares, the mean old log-prob and the ratio percentiles are those counted by hand."""
    # response 0: 10 tokens, finished; response 1: 4 tokens, truncated (its last token is no EOS); 6 padding positions
    ratio = torch.ones(2, 10, dtype=torch.float64)
    ratio[0, 9], ratio[0, 1], ratio[1, 3], ratio[1, 0] = 0.5, 0.7, 0.6, 1.5  # A < 0 on response 0, A > 0 on response 1
    ratio[0, 5] = 1.1
    old_logp = -torch.arange(20, dtype=torch.float64).view(2, 10) / 10
    logp = old_logp + ratio.log()
    mask = torch.zeros(2, 10, dtype=torch.float64)
    mask[0], mask[1, :4] = 1, 1
    adv = torch.tensor([[-1.0], [1.0]], dtype=torch.float64)
    parts = L.region_evidence(logp, old_logp, adv, mask, 0.2, 0.2, torch.tensor([True, False]))
    sums = {k: v[0].tolist() for k, v in parts.items()}
    assert sums["low_neg"] == pytest.approx([2, 1, 1, -0.9 - 0.1])  # positions 10 (EOS, late) and 2 of response 0
    assert sums["high_pos"] == pytest.approx([1, 0, 0, -1.0])  # response 1's first token
    # inside: response 0's other 8 tokens, response 1's tokens 2 and 3 (0.6 < 0.8 has A > 0: not a beta region, not
    # inside); late: position 4 of 4 (0.6: outside) and none other of response 1's, response 0's 10 only
    assert sums["inside"] == pytest.approx([10, 0, 0, -sum(range(10)) / 10 + 0.9 + 0.1 - 1.1 - 1.2])
    row = L.evidence_row({k: v[0] for k, v in parts.items()}, {k: v[1] for k, v in parts.items()})
    assert row["low_neg_eos_share"] == 0.5 and row["low_neg_late_share"] == 0.5
    assert row["low_neg_old_logp_mean"] == pytest.approx(-0.5)
    assert row["low_neg_ratio_p50"] == pytest.approx(0.6) and row["low_neg_ratio_p10"] == pytest.approx(0.52)
    assert row["high_pos_ratio_p10"] == pytest.approx(1.5) and row["high_pos_eos_share"] == 0
    assert row["inside_ratio_p50"] == pytest.approx(1.0) and row["inside_ratio_p10"] == pytest.approx(1.0)
    empty = L.region_evidence(logp, old_logp, adv, mask * 0, 0.2, 0.2, torch.tensor([True, False]))
    assert L.evidence_row({k: v[0] for k, v in empty.items()}, {k: v[1] for k, v in empty.items()}) == {}


def test_region_evidence_sums_fp32_input_in_float64():
    """The sums are float64 sums, not fp32 sums cast: 2**24 + 1 (a count of log pi_old) is no float32 number, so fp32
    log-probs of -2**24 and -1 in one region sum to -2**24 in float32 and to -(2**24 + 1) here."""
    old_logp = torch.tensor([[-2.0**24, -1.0]])
    parts = L.region_evidence(old_logp, old_logp, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2, torch.tensor([True]))
    sums = parts["inside"][0]
    assert sums.dtype == torch.float64 and sums.tolist() == [2, 1, 1, -(2.0**24 + 1)]


def test_entropy_regions():
    logp = torch.log(torch.tensor([[0.9, 0.05, 0.9, 0.05]]))
    entropy = torch.full_like(logp, 1.0)  # -log 0.9 = 0.1 < 1 < -log 0.05 = 3.0
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    _, m = L.policy_loss(logp, logp, adv, torch.ones_like(logp), extras=L.Extras(entropy=entropy))
    assert [m[f"entropy_region_e{k}"].item() for k in (1, 2, 3, 4)] == [0.25] * 4


def test_log_ratio_overflow_is_guarded():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old_logp = torch.tensor([[-200.0, -1.0]])
    entropy = torch.tensor([[0.5, 1.0]])  # for ERC: H / H_old outside its band on one token
    for algo in L.ALGORITHMS:
        loss, m = L.policy_loss(logp, old_logp, torch.tensor([[-1.0]]), torch.ones(1, 2), L.loss_config(algo),
                                extras=L.Extras(entropy=entropy, old_entropy=torch.ones(1, 2)))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), algo
        assert all(torch.isfinite(v) for v in m.values()), algo
        logp.grad = None



# --- the 2026 comparison set: ERC, DPPO, GMPO, M2PO, IcePop ---------------------------------------------------

def hand_built(ratios, advs, probs=None, pad=1):
    """One response per token (so each token carries its own advantage), plus `pad` padding positions on every row
    (ratio 50, never counted): [len(ratios), 1 + pad] tensors in float64, logp with grad."""
    n = len(ratios)
    old = torch.log(torch.tensor(probs if probs else [0.3] * n, dtype=torch.float64)).unsqueeze(-1)
    logp = old + torch.log(torch.tensor(ratios, dtype=torch.float64)).unsqueeze(-1)
    old, logp = torch.cat([old, old.expand(n, pad)], -1), torch.cat([logp, old.expand(n, pad) + math.log(50)], -1)
    mask = torch.cat([torch.ones(n, 1), torch.zeros(n, pad)], -1).to(torch.float64)
    return logp.requires_grad_(True), old, torch.tensor(advs, dtype=torch.float64).unsqueeze(-1), mask


@pytest.mark.parametrize("algo, base", [("gppo_erc", "gppo"), ("grpo_erc", "dapo")])
def test_erc_stops_the_gradient_where_the_entropy_ratio_leaves_its_band(algo, base):
    """Each PPO region (below, inside and above the clip interval, past the dual-clip bound), with A > 0, A < 0 and
    A = 0, at an entropy ratio H / H_old below (0.9), inside (1.0, 1.04) and above (1.1) the band (0.95, 1.05): the
    loss's value is the base algorithm's everywhere, and its gradient too, except out of the band, where it is 0. The
    token mean keeps every token (masked ones included) in its denominator."""
    ratios = [0.5, 0.95, 1.1, 1.5, 12.0] * 3
    advs = [1.0] * 5 + [-1.0] * 5 + [0.0] * 5
    entropy_ratios = [0.9, 1.0, 1.04, 1.1, 1.0, 1.0, 0.9, 1.1, 1.04, 0.9, 1.1, 0.9, 1.0, 1.0, 1.04]
    logp, old, adv, mask = hand_built(ratios, advs)
    old_entropy = torch.full_like(logp, 0.7)
    entropy = old_entropy * torch.tensor(entropy_ratios, dtype=torch.float64).unsqueeze(-1)
    entropy[:, 1:] = 3.0  # padding: far out of the band, never counted
    loss, m = L.policy_loss(logp, old, adv, mask, L.loss_config(algo),
                              extras=L.Extras(entropy=entropy, old_entropy=old_entropy))
    loss.backward()
    got = logp.grad.clone()
    logp.grad = None
    want, _ = L.policy_loss(logp, old, adv, mask, L.loss_config(base, eps_high=L.loss_config(algo).eps_high))
    want.backward()
    out = torch.tensor([r <= 0.95 or r >= 1.05 for r in entropy_ratios]).unsqueeze(-1) & mask[:, :1].bool()
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    assert (got[:, :1][out] == 0).all()
    torch.testing.assert_close(got[:, :1][~out], logp.grad[:, :1][~out], rtol=1e-12, atol=0)
    assert (got[:, 0][~out[:, 0]] != 0).sum() >= 3  # inside the band, where the base algorithm has one: a gradient
    assert m["erc_below_frac"].item() == pytest.approx(4 / 15) and m["erc_above_frac"].item() == pytest.approx(3 / 15)
    with pytest.raises(ValueError, match="needs the current and the old policy's per-token entropy"):
        L.policy_loss(logp, old, adv, mask, L.loss_config(algo), extras=L.Extras(entropy=entropy))


def test_dppo_masks_the_tokens_that_moved_too_far_in_the_advantages_direction():
    """DPPO-Binary-TV (bounds 0.15) and -KL (0.05) on hand-built probabilities: a token is masked (value and gradient 0)
    only when its probability moved past the bound in the direction A pushes it; elsewhere the gradient is d A, the
    unclipped ratio's, also where PPO-clip would drop it (under TV, a low-probability token whose ratio is 10). The
    default aggregation is verl's seq-mean-token-sum-norm: sum / (responses x norm_len)."""
    #       (p_old, p, A): TV masked?  KL masked?
    cases = [(0.5, 0.7, 1.0, True, True),    # rose 0.2 with A > 0: past both (KL 0.087)
             (0.5, 0.55, 1.0, False, False),  # rose 0.05 (KL 0.005): inside
             (0.5, 0.63, 1.0, False, False),  # rose 0.13 (KL 0.035): inside both
             (0.6, 0.2, 1.0, False, False),   # fell with A > 0: the direction A does not push, never masked
             (0.01, 0.1, 1.0, False, True),   # ratio 10, rose 0.09: inside TV's 0.15 (PPO-clip drops it), KL 0.071
             (0.5, 0.3, -1.0, True, True),    # fell 0.2 with A < 0 (KL 0.087): past both
             (0.5, 0.45, -1.0, False, False),  # fell 0.05: inside
             (0.2, 0.8, -1.0, False, False),  # rose with A < 0: never masked
             (0.5, 0.3, 0.0, True, True)]     # A = 0: masked like A < 0, and no gradient either way
    probs, news, advs = [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]
    logp, old, adv, mask = hand_built([n / p for p, n in zip(probs, news)], advs, probs)
    for algo, column in (("dppo_tv", 3), ("dppo_kl", 4)):
        logp.grad = None
        masked = torch.tensor([c[column] for c in cases])
        loss, m = L.policy_loss(logp, old, adv, mask, L.loss_config(algo, norm_len=4))
        loss.backward()
        d = torch.tensor(news, dtype=torch.float64) / torch.tensor(probs, dtype=torch.float64)
        a = torch.tensor(advs, dtype=torch.float64)
        denom = len(cases) * 4  # responses x norm_len
        want_grad = torch.where(masked, 0.0, -a * d / denom)
        torch.testing.assert_close(logp.grad[:, 0], want_grad.to(torch.float64), rtol=1e-12, atol=1e-15)
        assert (logp.grad[:, 1:] == 0).all()
        want = (torch.where(masked, 0.0, -a * d * logp[:, 0].detach())).sum() / denom
        assert loss.item() == pytest.approx(want.item(), rel=1e-12)
        assert m["dppo_masked_frac_pos"].item() == pytest.approx(sum(masked[:5].tolist()) / 9)
        assert m["dppo_masked_frac_neg"].item() == pytest.approx(sum(masked[5:8].tolist()) / 9)
    # clip_ratio_c truncates the detached weight: the ratio-10 token's gradient weight becomes 3
    logp.grad = None
    loss, m = L.policy_loss(logp, old, adv, mask, L.loss_config("dppo_tv", norm_len=4, clip_ratio_c=3.0))
    loss.backward()
    assert logp.grad[4, 0].item() == pytest.approx(-3.0 / (9 * 4), rel=1e-12)
    assert logp.grad[3, 0].item() == pytest.approx(-(0.2 / 0.6) / (9 * 4), rel=1e-12)  # below the cap: d
    assert m["dppo_truncated_frac"].item() == pytest.approx(2 / 9)  # ratio 10 and ratio 4 (A < 0, rose: kept)


def test_gmpo_clips_each_token_in_log_space_on_its_advantages_side_and_averages_responses():
    """GMPO, eps 0.4 in log space: a response's loss is -A exp(mean_t log d~); log d is capped at 0.4 for A > 0 (not
    floored), floored at -0.4 for A < 0 (not capped). The gradient on a token is -A exp(mean log d~) / |y| / responses
    where it is not clipped, 0 where it is; A = 0 gives 0; padding counts nowhere."""
    rows = [([0.1, 0.6, -0.7], 1.5), ([-0.6, 0.5, 0.0], -1.0), ([0.9, -0.9, 0.2], 0.0), ([0.3, -0.2], 2.0)]
    width = 4
    logp = torch.full((len(rows), width), -1.0, dtype=torch.float64)
    old = logp.clone()
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, (log_ratios, _) in enumerate(rows):
        logp[i, :len(log_ratios)] = -1.0 + torch.tensor(log_ratios, dtype=torch.float64)
        mask[i, :len(log_ratios)] = 1
    logp[:, -1] += 5.0  # padding with a large ratio
    logp.requires_grad_(True)
    adv = torch.tensor([[a] for _, a in rows], dtype=torch.float64)
    loss, m = L.policy_loss(logp, old, adv, mask, L.loss_config("gmpo"))
    loss.backward()
    want_loss, want_grad = 0.0, torch.zeros(len(rows), width, dtype=torch.float64)
    for i, (log_ratios, a) in enumerate(rows):
        clipped = [min(x, 0.4) if a > 0 else max(x, -0.4) if a < 0 else 0.0 for x in log_ratios]
        ratio = math.exp(sum(clipped) / len(clipped))
        want_loss += -a * ratio / len(rows)
        for t, (x, c) in enumerate(zip(log_ratios, clipped)):
            want_grad[i, t] = 0.0 if x != c else -a * ratio / len(log_ratios) / len(rows)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-12, atol=1e-15)
    assert (logp.grad[0, 1] == 0) and (logp.grad[0, 2] != 0) and (logp.grad[1, 0] == 0) and (logp.grad[1, 1] != 0)
    assert m["gmpo_clip_frac_high"].item() == pytest.approx(1 / 11)  # 0.6 with A > 0
    assert m["gmpo_clip_frac_low"].item() == pytest.approx(1 / 11)  # -0.6 with A < 0


def test_m2po_drops_the_largest_second_moments_until_the_rest_is_below_the_threshold():
    """M2PO, threshold 0.04: (log d)^2 = 0.25, 0.16, 0.01, 0.0025, 0 sorts to suffix means 0.0845, 0.0431, 0.0042: the
    two largest are dropped (value and gradient 0), whatever the sign of their advantage; the others get -d A, the
    unclipped gradient, in a token mean over all five. A = 0 tokens take part in the mask, so M2PO keeps them."""
    log_ratios, advs = [0.5, -0.4, 0.1, 0.05, 0.0], [1.0, -1.0, 1.0, -1.0, 0.0]
    logp, old, adv, mask = hand_built([math.exp(x) for x in log_ratios], advs)
    loss, m = L.policy_loss(logp, old, adv, mask, L.loss_config("m2po"))
    loss.backward()
    d, a = torch.tensor(log_ratios, dtype=torch.float64).exp(), torch.tensor(advs, dtype=torch.float64)
    kept = torch.tensor([False, False, True, True, True])
    torch.testing.assert_close(logp.grad[:, 0], torch.where(kept, -a * d / 5, 0.0), rtol=1e-12, atol=0)
    assert loss.item() == pytest.approx((torch.where(kept, -a * d, 0.0).sum() / 5).item(), rel=1e-12)
    assert m["m2po_masked_frac"].item() == pytest.approx(2 / 5)
    assert m["m2po_second_moment"].item() == pytest.approx((0.25 + 0.16 + 0.01 + 0.0025) / 5)
    assert not L.skips_zero_advantage(L.loss_config("m2po"))
    # the mask itself: no token dropped at ratio 1 (the first mini-batch), all but the smallest when no count suffices
    ones = torch.ones(2, 3, dtype=torch.float64)
    assert L.second_moment_mask(torch.zeros(2, 3, dtype=torch.float64), ones, 0.04).all()
    spread = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float64)
    assert L.second_moment_mask(spread, mask, 0.1).tolist() == [[False, False, False], [True, False, False]]
    assert L.second_moment_mask(spread, mask, 1e-3).tolist() == [[False, False, False], [True, False, False]]


def test_icepop_zeroes_the_weight_outside_its_band_with_any_loss():
    """--rollout-correction token-icepop: w = rho = pi_old / q inside [0.5, 5], 0 outside (the bounds included);
    padding 0. The weight multiplies any loss's per-token loss; a masked token keeps its place in the token mean."""
    from cegppo_utils import correction
    rho = torch.tensor([[0.3, 0.6, 1.0, 4.0, 4.9, 7.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.float64)
    trainer = torch.full_like(rho, -1.0)
    sampler = trainer - rho.log()
    weights, log_rho, outside = correction.importance_weights(trainer, sampler, mask, "token-icepop", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.6, 1.0, 4.0, 4.9, 0.0, 0.0]], dtype=torch.float64))
    assert outside.tolist() == [True, False, False, False, False, True]
    assert correction.metrics(log_rho, outside)["rollout_corrected_frac"] == pytest.approx(2 / 6)
    exact = (trainer - sampler).exp()[0]  # the band's edges on two tokens' own rho: both kept
    edges, _, _ = correction.importance_weights(trainer, sampler, mask, "token-icepop", 2.0, (exact[1], exact[3]))
    assert (edges[0] != 0).tolist() == [False, True, True, True, False, False, False]
    adv = torch.tensor([[1.0]], dtype=torch.float64)
    for algo in ("grpo", "m2po", "dppo_tv"):  # token losses: no gradient where the weight is 0
        logp = torch.full_like(rho, -0.9).requires_grad_(True)
        L.policy_loss(logp, trainer, adv, mask, L.loss_config(algo), extras=L.Extras(weights=weights))[0].backward()
        assert (logp.grad[0, [0, 5]] == 0).all() and (logp.grad[0, 1:5] != 0).all(), algo
    # GMPO's one loss per response takes the weights' geometric mean (as verl's geo_mean): each zero scales the
    # response by 1e-10^(1 / |y|), here two of six tokens: 1e-10^(1/3)
    logp = torch.full_like(rho, -0.9)
    plain = L.policy_loss(logp, trainer, adv, mask, L.loss_config("gmpo"))[0]
    weighted = L.policy_loss(logp, trainer, adv, mask, L.loss_config("gmpo"), extras=L.Extras(weights=weights))[0]
    geometric = math.exp((2 * math.log(1e-10) + math.log(0.6 * 1.0 * 4.0 * 4.9)) / 6)
    assert weighted.item() == pytest.approx(plain.item() * geometric, rel=1e-9)
    assert abs(weighted.item()) < abs(plain.item()) / 1000


# --- what the frameworks ship besides: LUSPO, VESPO, GPG, DRO, prime-rl's default, BandPO ----------------------------

def _loss_and_grad(algo, logp, old, adv, mask, **kw):
    logp = logp.detach().clone().requires_grad_(True)
    loss, metrics = L.policy_loss(logp, old, adv, mask, L.loss_config(algo, **kw))
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_luspo_is_gspo_with_each_responses_loss_times_its_length():
    """Per response: value |y_i| times GSPO's; gradient s_i A_i / G on each token, GSPO's s_i A_i / (G |y_i|)."""
    logp, old, adv, mask = make_batch()
    scale = torch.linspace(-0.03, 0.03, 8, dtype=torch.float64).unsqueeze(-1)  # s_i - 1 from -0.6% to +0.6%
    logp = (old + (logp - old) * scale).detach()
    luspo, luspo_grad, m = _loss_and_grad("luspo", logp, old, adv, mask)
    gspo, gspo_grad, g = _loss_and_grad("gspo", logp, old, adv, mask, eps_low=2e-3, eps_high=2.5e-3)
    lengths = mask.sum(-1, keepdim=True)
    torch.testing.assert_close(luspo_grad, gspo_grad * lengths, rtol=1e-12, atol=0)
    summed = L.loss_config("gspo", eps_low=2e-3, eps_high=2.5e-3, loss_agg_mode="seq-mean-token-sum-norm", norm_len=1)
    per_response = L.policy_loss(logp, old, adv, mask, summed)
    assert luspo == pytest.approx(per_response[0].item(), rel=1e-12) and luspo != pytest.approx(gspo, rel=1e-3)
    assert m["luspo_clip_frac_high"] > 0 and m["luspo_clip_frac_low"] > 0 and (luspo_grad != 0).any()
    assert (m["luspo_clip_frac_low"], m["luspo_clip_frac_high"]) == (g["gspo_clip_frac_low"], g["gspo_clip_frac_high"])


def test_vespo_weighs_each_response_by_phi_of_its_whole_ratio():
    """phi(W) = W^k e^(lambda (1 - W)), W = prod_t d: on-policy phi = 1 (the plain policy gradient -A grad log pi);
    off-policy every token of response i gets -phi(W_i) A_i, with (k, lambda) by the sign of A."""
    logp, old, adv, mask = make_batch()
    logp = (old + (logp - old) * 0.05).detach()
    value, grad, m = _loss_and_grad("vespo", old, old, adv, mask)
    torch.testing.assert_close(grad, -adv.expand_as(grad) * mask / mask.sum(), rtol=1e-12, atol=0)
    assert m["vespo_phi"].item() == pytest.approx(1.0, rel=1e-12)
    value, grad, m = _loss_and_grad("vespo", logp, old, adv, mask)
    w = ((logp - old) * mask).sum(-1, keepdim=True).exp()
    k, lam = torch.where(adv >= 0, 2.0, 3.0), torch.where(adv >= 0, 3.0, 2.0)
    phi = w ** k * torch.exp(lam * (1 - w))
    torch.testing.assert_close(grad, -phi * adv * mask / mask.sum(), rtol=1e-12, atol=1e-15)
    assert m["vespo_phi"].item() == pytest.approx(((phi * mask).sum() / mask.sum()).item(), rel=1e-12)
    peak = torch.tensor([[math.log(2 / 3)]], dtype=torch.float64)  # W = k / lambda = 2 / 3 for A > 0
    one = torch.ones(1, 1, dtype=torch.float64)
    heights = [_loss_and_grad("vespo", peak + x, one * 0, one, one)[2]["vespo_phi"].item() for x in (-0.1, 0, 0.1)]
    assert heights[1] > max(heights[0], heights[2]) and heights[1] == pytest.approx(math.e * 4 / 9, rel=1e-12)


def test_gpg_dro_and_prime_rls_default_have_their_closed_form_gradients():
    """GPG -A; DRO -(A - beta log d), also at A = 0 and past the +-20 clamp (its penalty pulls a runaway back);
    dppo_tv_kimi -M A d + 2 tau log d, the penalty on masked tokens too (per token, token-mean)."""
    ratios = [0.5, 0.95, 1.3, 1.4, math.exp(25.0), 2 / 3]
    probs = [0.3, 0.3, 0.3, 0.3, 1e-12, 0.9]
    advs = [1.0, -1.0, 1.0, 0.0, 1.0, -1.0]
    logp, old, adv, mask = hand_built(ratios, advs, probs)
    n, log_d, a = 6, torch.log(torch.tensor(ratios, dtype=torch.float64)), torch.tensor(advs, dtype=torch.float64)
    _, grad, _ = _loss_and_grad("gpg", logp, old, adv, mask)
    torch.testing.assert_close(grad[:, 0], -a / n, rtol=1e-12, atol=0)
    _, grad, m = _loss_and_grad("dro", logp, old, adv, mask, dro_beta=0.5)
    torch.testing.assert_close(grad[:, 0], -(a - 0.5 * log_d) / n, rtol=1e-12, atol=0)
    assert grad[3, 0] > 0 and grad[4, 0] > 0  # A = 0 but moved up: pulled back; log d = 25: pulled back, hard
    assert m["dro_penalty"].item() == pytest.approx((0.25 * log_d.square()).mean().item(), rel=1e-12)
    _, grad, m = _loss_and_grad("dppo_tv_kimi", logp, old, adv, mask, kimi_kl_tau=0.01)
    new = torch.tensor(probs, dtype=torch.float64) * torch.tensor(ratios, dtype=torch.float64)
    moved = new - torch.tensor(probs, dtype=torch.float64)
    masked = torch.where(a > 0, moved > 0.2, moved < -0.2)  # 0.3 -> 0.39 stays; 0.9 -> 0.6 fell past 0.2
    assert masked.tolist() == [False] * 5 + [True]
    d = torch.tensor(ratios, dtype=torch.float64).clamp(max=math.exp(20))
    want = (-a * d * ~masked * (log_d.abs() <= 20) + 2 * 0.01 * log_d) / n  # no gradient through d past the clamp
    torch.testing.assert_close(grad[:, 0], want, rtol=1e-12, atol=0)
    assert m["dppo_masked_frac_neg"].item() == pytest.approx(masked[5].item() / 6)


def test_band_bounds_are_where_the_binary_divergence_reaches_delta():
    """Inside (p not within 1e-6 of 0 or 1, bounds not capped): tv |r p - p| = delta; chi2 p (r - 1)^2 / (1 - p) =
    delta; kl KL(Bernoulli(p) || Bernoulli(r p)) = delta, each at both bounds; the upper capped at band_upper_max and
    never above 1 / p. BandPO drops the gradient past them by the sign of A (and not where PPO's 1 -+ 0.2 would)."""
    p = torch.tensor([[0.05, 0.2, 0.5, 0.7, 0.95]], dtype=torch.float64)
    for divergence, reached in (("tv", lambda r: (r * p - p).abs()), ("chi2", lambda r: p * (r - 1) ** 2 / (1 - p)),
                                ("kl", lambda r: p * torch.log(1 / r) + (1 - p) * torch.log((1 - p) / (1 - r * p)))):
        lower, upper = L.band_bounds(p.log(), divergence, 0.05, 100.0)
        inside = (lower > 0) & (upper < 1 / p)
        assert inside.sum() >= 3, divergence
        for bound in (lower, upper):
            torch.testing.assert_close(reached(bound)[inside], torch.full_like(bound[inside], 0.05), rtol=1e-12, atol=0)
        assert (L.band_bounds(p.log(), divergence, 0.05, 1.5)[1] <= 1.5).all()
    with pytest.raises(ValueError, match="band_divergence must be one of"):
        L.band_bounds(p.log(), "js", 0.05, 10.0)
    # p = 0.05: kl's upper bound is 2.98; p = 0.7: 1.18. A > 0 tokens at d = 2.5 and 1.25: PPO's 1.2 would drop both,
    # BandPO drops only the likely one
    logp, old, adv, mask = hand_built([2.5, 1.25, 0.5], [1.0, 1.0, -1.0], [0.05, 0.7, 0.7])
    _, grad, m = _loss_and_grad("bandpo", logp, old, adv, mask, loss_agg_mode="token-mean")
    assert grad[0, 0] != 0 and grad[1, 0] == 0 and grad[2, 0] == 0  # 0.5 below 0.7's lower bound 0.78, A < 0
    assert (m["band_clip_frac_high"].item(), m["band_clip_frac_low"].item()) == pytest.approx((1 / 3, 1 / 3))


def test_icepop_flags_and_their_rules():
    from cegppo_utils import flags
    args = flags.resolve("tiny", {"rollout_correction": "token-icepop"})
    assert (args.icepop_low, args.icepop_high) == (0.5, 5.0)
    assert dict(L.field_problems(L.replace(args, icepop_low=1.5, icepop_high=0.9))) == {
        "icepop_low": "icepop_low must be in (0, 1], got 1.5",
        "icepop_high": "icepop_high must be >= 1 and finite, got 0.9"}


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(algo="ppo2"), "algo must be one of ['bandpo', 'ce_gppo'"),
    (dict(eps_low=0.0), "eps_low must be in (0, 1], got 0.0"),
    (dict(eps_high=-0.1), "eps_high must be > 0 and finite"),
    (dict(beta1=-0.5), "beta1 must be >= 0 and finite"),
    (dict(clip_ratio_c=1.1), "clip_ratio_c must exceed"),
    (dict(loss_agg_mode="sum"), "loss_agg_mode must be one of"),
    (dict(algo="cispo", dynamic_clip="id"), "dynamic clipping applies to"),
    (dict(dynamic_clip="zigzag"), "dynamic_clip must be one of"),
    (dict(dynamic_clip="id", progress=1.5), "progress must be in [0, 1]"),
])
def test_bad_arguments_are_rejected_with_a_message(kwargs, message):
    logp, old_logp, adv, mask = make_batch()
    with pytest.raises(ValueError, match=re.escape(message)):
        progress = kwargs.pop("progress", 0.0)
        L.policy_loss(logp, old_logp, adv, mask, L.LossConfig(**kwargs), extras=L.Extras(progress=progress))


def test_bad_shapes_are_rejected():
    logp, old_logp, adv, mask = make_batch()
    with pytest.raises(ValueError, match="advantages must be"):
        L.policy_loss(logp, old_logp, torch.zeros(3, 2), mask)
    with pytest.raises(ValueError, match="must all be"):
        L.policy_loss(logp, old_logp[:, :3], adv, mask)


# --- group advantages ------------------------------------------------------------------------

def test_group_advantages_unbiased_std_and_dr_grpo():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    adv = L.group_advantages(rewards, 4)
    std = math.sqrt(((1 + 0.5) ** 2 + 3 * (-1 + 0.5) ** 2) / 3)  # unbiased: divide by n - 1
    torch.testing.assert_close(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]) / (std + 1e-6))
    torch.testing.assert_close(adv[4:], torch.zeros(4))  # a zero-variance group carries no signal
    torch.testing.assert_close(L.group_advantages(rewards, 4, scale_by_std=False)[:4],
                               torch.tensor([1.5, -0.5, -0.5, -0.5]))
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        L.group_advantages(rewards, 3)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        L.group_advantages(rewards, 1)


# --- dynamic clipping ------------------------------------------------------------------------

def test_dynamic_threshold_functions():
    dc = L.DynamicClip()
    p = torch.tensor([0.0, 0.4, 1.0])
    torch.testing.assert_close(L.upper_threshold(p, dc), torch.tensor([0.5, 0.4, 0.25]))
    torch.testing.assert_close(L.lower_threshold(p, dc), torch.tensor([0.3, 0.248, 0.17]))
    steep = L.DynamicClip(upper_slope=-1.0, upper_intercept=0.9, lower_slope=2.0, lower_intercept=0.0)
    torch.testing.assert_close(L.upper_threshold(p, steep), torch.tensor([0.6, 0.5, 0.05]))  # clamped both ends
    torch.testing.assert_close(L.lower_threshold(p, steep), torch.tensor([0.05, 0.6, 0.6]))


@pytest.mark.parametrize("schedule, progress, want_low, want_high", [
    # p = 0.4: H = 0.4, M = 0.248, eps_std = 0.2
    ("id", 0.0, 0.2, 0.4),
    ("id", 0.1, 0.2, 0.8 * 0.4 + 0.2 * 0.2),
    ("id", 0.5, 0.2, 0.2),
    ("id", 0.75, 0.5 * 0.248 + 0.5 * 0.2, 0.2),
    ("id", 1.0, 0.2, 0.2),
    ("did", 0.0, 0.2, 0.2),
    ("did", 0.1, 0.2, 0.8 * 0.2 + 0.2 * 0.4),
    ("did", 0.5, 0.2, 0.4),
    ("did", 0.75, 0.5 * 0.248 + 0.5 * 0.2, 0.4),
    ("did", 1.0, 0.2, 0.4),
])
def test_dynamic_schedules_at_chosen_steps(schedule, progress, want_low, want_high):
    dc = L.DynamicClip(schedule=schedule)
    low, high = L.dynamic_clip_eps(torch.tensor([0.4]), dc, progress)
    assert low.item() == pytest.approx(want_low, abs=1e-6)
    assert high.item() == pytest.approx(want_high, abs=1e-6)


def test_oscillatory_decay_hysteresis():
    dc = L.DynamicClip(schedule="od")
    h0 = 2.0  # H_min = 0.4; tau_high(progress) = 0.4 + 1.6 (1 - progress)
    s = 0
    s = L.oscillatory_decay_state(s, 1.0, 0.5, h0, dc)
    assert s == 0  # between the thresholds: keep
    s = L.oscillatory_decay_state(s, 0.4, 0.5, h0, dc)
    assert s == 1  # hit the floor: raise entropy
    s = L.oscillatory_decay_state(s, 1.0, 0.5, h0, dc)
    assert s == 1  # 1.0 <= tau_high = 1.2: keep raising
    s = L.oscillatory_decay_state(s, 1.3, 0.5, h0, dc)
    assert s == 0  # above tau_high: decay again
    s = L.oscillatory_decay_state(1, 0.5, 1.0, h0, dc)
    assert s == 0  # tau_high(1) = H_min
    p = torch.tensor([0.4])
    low, high = L.dynamic_clip_eps(p, dc, 0.3, od_state=1)
    assert (low.item(), high.item()) == pytest.approx((0.2, 0.4))
    low, high = L.dynamic_clip_eps(p, dc, 0.3, od_state=0)
    assert (low.item(), high.item()) == pytest.approx((0.248, 0.2))


@pytest.mark.parametrize("algo", ["ce_gppo", "grpo", "dapo"])
def test_dynamic_clip_thresholds_follow_token_probability(algo):
    # Two tokens with ratio 1.3 and A > 0: at progress 0 of "id", eps_high = H(p) = 0.5 - 0.25 p.
    # The low-probability token (p = 0.05, eps_high ~0.49) stays inside; the likely one (p = 0.9, 0.275) is clipped.
    logp = torch.log(torch.tensor([[0.05, 0.9]], dtype=torch.float64)).requires_grad_(True)
    old_logp = logp.detach() - math.log(1.3)
    loss, m = L.policy_loss(logp, old_logp, torch.tensor([[1.0]], dtype=torch.float64),
                            torch.ones(1, 2, dtype=torch.float64), L.loss_config(algo, beta2=0.5, dynamic_clip="id"),
                            extras=L.Extras(progress=0.0))
    loss.backward()
    assert m["clip_frac_high_pos"].item() == pytest.approx(0.5)
    assert logp.grad[0, 0].item() == pytest.approx(-1.3 / 2)  # inside: weight d
    high_p_weight = {"ce_gppo": 0.5 * (1 + (0.5 - 0.25 * 0.9)), "grpo": 0.0, "dapo": 0.0}[algo]
    assert logp.grad[0, 1].item() == pytest.approx(-high_p_weight / 2)


# --- positive-example LM term -----------------------------------------------------------------

def test_positive_example_lm_loss():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0], [-4.0, -4.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    correct = torch.tensor([True, True, False])
    loss = L.positive_example_lm_loss(logp, mask, correct)
    assert loss.item() == pytest.approx((1 + 2 + 0.5 + 0.5 + 9) / 5)
    loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]) / 5)
    # micro-batches with the mini-batch's count add up to the same value
    parts = [L.positive_example_lm_loss(logp[r], mask[r], correct[r], num_tokens=5) for r in (slice(0, 1), slice(1, 3))]
    assert sum(p.item() for p in parts) == pytest.approx(loss.item())
    none = L.positive_example_lm_loss(logp, mask, torch.zeros(3, dtype=torch.bool))
    assert none.item() == 0.0


# --- the registry is the one list ------------------------------------------------------------------

def test_readme_algorithm_table_is_the_registry():
    """README's table of the family is loss.algorithm_table(): adding a loss without its row fails here."""
    import os
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    assert L.algorithm_table() in readme, ("README's algorithm table differs from loss.algorithm_table():\n"
                                           + L.algorithm_table())


def test_every_field_has_a_rule_and_bad_values_name_the_field():
    """A new LossConfig field must declare its rule (config_problems checks every field by it)."""
    for f in L.fields(L.LossConfig):
        rule = f.metadata.get("rule")
        assert isinstance(rule, L.Rule), f.name
        bad = "not an option" if rule.choices else -1.0
        problems = L.config_problems(L.replace(L.LossConfig(), **{f.name: bad}))
        assert problems and problems[0][0] == f.name and problems[0][1].startswith(f"{f.name} must be"), (
            f.name, problems)


def test_every_loss_field_is_read_by_an_algorithm_or_by_all():
    """A new LossConfig field must be in some algorithm's `reads` or in COMMON_FIELDS: otherwise --help marks it
    "[not used by ...]" under every algorithm and the property test below never looks at it."""
    registered = {"algo", *L.COMMON_FIELDS, *(name for a in L.ALGORITHMS.values() for name in a.reads)}
    assert [f.name for f in L.fields(L.LossConfig) if f.name not in registered] == []


def test_args_and_loss_fields_are_checked_by_one_mechanism():
    """train.py's Args declare their ranges as LossConfig does (a Rule beside the field): every number and choice flag
    has one, field_problems checks both dataclasses alike, and a choice's hint is the same closest-name search."""
    from cegppo_utils import flags
    args = flags.resolve("tiny", {})
    for f in L.fields(flags.Args):
        if f.name != "loss" and flags.field_type(f) in (int, float) or f.name in ("precision", "sampler"):
            assert isinstance(f.metadata.get("rule"), L.Rule), f.name
    assert L.field_problems(args) == [] and L.config_problems(args.loss) == []
    bad = L.replace(args, lr=0.0, top_k=-1, sampler="vlm", gen_prompts=2**40)
    assert dict(L.field_problems(bad)) == {
        "sampler": "sampler must be one of ['auto', 'hf', 'vllm'], got 'vlm'; did you mean 'vllm'?",
        "top_k": "top_k must be an integer >= 0, got -1",
        "lr": "lr must be > 0 and at most 1 (an AdamW step moves a weight by about lr), got 0.0",
        "gen_prompts": "gen_prompts must be below 2**31, got 1099511627776"}
    assert L.field_problems(L.replace(L.LossConfig(), beta1=150.0)) == [
        ("beta1", "beta1 must be at most 100 (it scales the loss's gradient; the paper uses 0.5 to 1), got 150.0")]
    assert L.field_problems(L.replace(L.LossConfig(), tau_pos=1e-46))[0][1].startswith("tau_pos 1e-46 is 0 in float32")


def every_region_batch():
    """One fixed batch on which every read field of every loss moves the value: per-response advantages of both signs,
    each sign on rows whose ratios sit mostly well below, around and well above the clip ranges (so GSPO's sequence
    ratio too lands on both sides), tokens with A < 0 past the dual-clip bound (ratios up to ~16), unequal lengths;
    entropy ratios H / H_old spread over 0.8-1.2, across ERC's band; one A > 0 token whose probability rose
    0.5 -> 0.63 (TV 0.13, binary KL 0.035: between DPPO's bounds and half of them); and one A > 0 token whose
    probability rose 0.005 -> 0.045 (d = 9: inside BandPO's upper bound there, 13.2 capped at 10, past a lower cap)."""
    g = torch.Generator().manual_seed(7)
    old_logp = -torch.rand(8, 10, generator=g, dtype=torch.float64) * 4 - 0.05
    shift = torch.tensor([-1.5, -1.5, -0.5, -0.5, 0.5, 0.5, 1.5, 1.5], dtype=torch.float64).unsqueeze(-1)
    logp = (old_logp + shift + 1.5 * torch.randn(8, 10, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    old_logp[7, 0], logp[7, 0] = math.log(0.5), math.log(0.63)
    old_logp[5, 1], logp[5, 1] = math.log(0.005), math.log(0.045)
    adv = torch.tensor([-1.3, 0.8, -0.6, 1.1, -0.9, 0.5, -1.7, 1.4], dtype=torch.float64).unsqueeze(-1)
    mask = (torch.arange(10) < torch.tensor([10, 7, 9, 4, 10, 6, 8, 5]).unsqueeze(-1)).to(torch.float64)
    old_entropy = torch.rand(8, 10, generator=g, dtype=torch.float64) * 2 + 0.1
    entropy = old_entropy * (0.8 + 0.4 * torch.rand(8, 10, generator=g, dtype=torch.float64))
    return logp, old_logp, adv, mask, entropy, old_entropy


def other_values(rule, value):
    """Valid values other than `value`, from the field's own Rule: every other choice; or a point inside the range:
    halfway up to a finite upper bound (back down from it when at it), else halfway down to the lower bound (a field
    at its lower bound and unbounded above: 10 more, clear of clip_ratio_c > 1 + eps_high)."""
    if rule.choices:
        return [o for o in rule.options() if o != value]
    low = value - 10 if rule.low is None else rule.low
    if rule.high is not None:
        other = (value + rule.high) / 2 if value < rule.high else (low + rule.high) / 2
    else:
        other = (value + low) / 2 if value > low else low + 10
    return [round(other) if rule.integer else other]


@pytest.mark.parametrize("algo", sorted(L.ALGORITHMS))
def test_registry_reads_are_exactly_the_fields_that_move_the_loss(algo):
    """Another valid value of a field in `reads` moves policy_loss (its value or its gradient: ERC's band moves only
    the gradient); of one outside `reads` and COMMON_FIELDS, neither."""
    logp, old_logp, adv, mask, entropy, old_entropy = every_region_batch()
    base = L.loss_config(algo)

    def value(cfg):
        # Clip-Cov draws at random: the same seed for every call, so a field it does not read leaves the draw (and the
        # value) bit-identical, and its bounds move the value through which candidates the draw sees
        torch.manual_seed(0)
        x = logp.clone().requires_grad_(True)
        loss = L.policy_loss(x, old_logp, adv, mask, cfg, extras=L.Extras(entropy=entropy, old_entropy=old_entropy))[0]
        loss.backward()
        return loss.item(), tuple(x.grad.flatten().tolist())

    want = value(base)
    reads = set(L.ALGORITHMS[algo].reads)
    problems = []
    for f in fields(L.LossConfig):
        if f.name == "algo" or f.name in L.COMMON_FIELDS:
            continue
        before = getattr(base, f.name)
        for other in other_values(f.metadata["rule"], before):
            cfg = replace(base, **{f.name: other})
            invalid = L.config_problems(cfg)
            if invalid:
                problems.append(f"{f.name} -> {other!r} is not a valid value to try: {invalid[0][1]}")
            elif f.name in reads and value(cfg) == want:
                problems.append(f"{f.name} is in reads, but {before!r} -> {other!r} leaves the loss ({want[0]!r}) "
                                "and its gradient as they were")
            elif f.name not in reads and value(cfg) != want:
                problems.append(f"{f.name} is not in reads, but {before!r} -> {other!r} moves the loss")
    assert not problems, f"{algo}: " + "; ".join(problems)


# --- diagnostics that belong to the algorithm ------------------------------------------------------------

REGIONS = {"clip_frac_low_neg", "clip_frac_high_pos", "clip_frac_low_pos", "clip_frac_high_neg"}
SHARED = {"pg_loss", "approx_kl", "ratio_mean", "num_tokens", "entropy_region_e1", "entropy_region_e2",
          "entropy_region_e3", "entropy_region_e4"}


@pytest.mark.parametrize("algo", sorted(L.ALGORITHMS))
def test_each_algorithm_reports_the_diagnostics_its_entry_names(algo):
    """What policy_loss reports beside the shared metrics is what the registry names for the algorithm: the clip
    regions only for a loss that judges tokens against the clip interval, its own metrics labelled; CE-GPPO's beta
    region labels on CE-GPPO alone. Every region and own metric is present on a batch that lands in each region."""
    logp, old_logp, adv, mask = make_batch(seed=4)
    entropy = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    cfg = L.loss_config(algo, eps_low=0.5) if algo == "cispo" else L.loss_config(algo)  # CISPO's lower side in use
    _, m = L.policy_loss(logp, old_logp, adv, mask, cfg, extras=L.Extras(entropy=entropy, old_entropy=entropy * 0.9))
    named = {d.metric for d in L.diagnostics(algo)}
    reported = set(m) - SHARED
    assert reported <= named, f"{algo} reports {reported - named} without naming them"
    assert (REGIONS <= reported) == bool(L.ALGORITHMS[algo].regions) and (REGIONS & reported in (set(), REGIONS))
    missing = named - reported - {"dppo_truncated_frac"}  # DPPO's truncation needs clip_ratio_c > 0 (0 by default)
    assert not missing, f"{algo} names {missing} but did not report them"
    labels = " ".join(d.label for d in L.diagnostics(algo))
    assert ("beta1 region" in labels) == (algo == "ce_gppo") and ("beta2 region" in labels) == (algo == "ce_gppo")
    assert all(d.label and d.metric for d in L.diagnostics(algo)) and len(named) == len(L.diagnostics(algo))


def test_a_loss_that_does_not_clip_tokens_reports_no_clip_regions():
    logp, old_logp, adv, mask = make_batch()
    # the registry says which losses judge tokens against the clip interval (Algorithm.regions); a new loss that clips
    # nothing declares no regions, and nothing here needs to name it
    unclipped = [a for a, spec in L.ALGORITHMS.items() if not spec.regions]
    assert unclipped and len(unclipped) < len(L.ALGORITHMS) and {"gspo", "cispo"} <= set(unclipped)
    for algo in unclipped:
        _, m = L.policy_loss(logp, old_logp, adv, mask, L.loss_config(algo))
        assert not REGIONS & set(m), algo
    # GSPO's clip acts on whole sequences: its own shares; its approx_kl is the token ratio's, as every loss's
    _, m = L.policy_loss(logp, old_logp, adv, mask, L.loss_config("gspo"))
    _, clip = L.policy_loss(logp, old_logp, adv, mask, L.loss_config("grpo"))
    assert m["approx_kl"].item() == pytest.approx(clip["approx_kl"].item(), rel=1e-12)
    # three sequences of 2 tokens: s = e^-0.1 with A < 0 (clipped below), e^0.1 with A > 0 (above), e^0.1 with A < 0
    old = torch.full((3, 2), -1.0, dtype=torch.float64)
    moved = (old + torch.tensor([[-0.1], [0.1], [0.1]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[-1.0], [1.0], [-1.0]], dtype=torch.float64)
    _, m = L.policy_loss(moved, old, adv, torch.ones(3, 2, dtype=torch.float64), L.loss_config("gspo"))
    assert (m["gspo_clip_frac_low"].item(), m["gspo_clip_frac_high"].item()) == pytest.approx((1 / 3, 1 / 3))


# --- the ratio-aware beta1 (a mechanism arm) and the beta1 dose -----------------------------------------------------

@pytest.mark.parametrize("per_token_adv", [False, True])
def test_ratio_aware_beta1_weighs_the_beta1_region_by_d(per_token_adv):
    """beta1_weight "ratio": in the beta1 region (d < 1 - eps_low, A < 0) the per-token loss is -beta1 d A and its
    gradient on log pi is -beta1 d A; everywhere else CE-GPPO's table (then dual clip). The dose is the token mean of
    the region's weight, beta1 d there."""
    logp, old_logp, adv, mask = make_batch(per_token_adv=per_token_adv)
    beta1, beta2, eps = 0.7, 1.0, 0.2
    loss, m = L.policy_loss(logp, old_logp, adv, mask, L.loss_config("ce_gppo", beta1=beta1, beta2=beta2,
                                                                     beta1_weight="ratio"))
    loss.backward()
    n = mask.sum().item()
    adv_full = adv.expand_as(logp)
    want_value, want_grad, dose, in_region = 0.0, torch.zeros_like(logp), 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            d, a = math.exp(logp[i, t].item() - old_logp[i, t].item()), adv_full[i, t].item()
            if d < 1 - eps and a < 0:
                v, g = -beta1 * d * a, -beta1 * d * a
                dose, in_region = dose + beta1 * d / n, in_region + 1
            else:
                v, g = expected_token("ce_gppo", d, a, None, eps, eps, beta1, beta2, 10.0)
            want_value += v / n
            want_grad[i, t] = g / n
    assert in_region >= 3
    assert loss.item() == pytest.approx(want_value, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-9, atol=1e-12)
    assert m["beta1_dose"].item() == pytest.approx(dose, rel=1e-12)
    # the constant weight's dose: beta1 (1 - eps_low) x the region's share
    _, constant = L.policy_loss(logp, old_logp, adv, mask, L.loss_config("ce_gppo", beta1=beta1, beta2=beta2))
    assert constant["beta1_dose"].item() == pytest.approx(beta1 * (1 - eps) * in_region / n, rel=1e-12)
    assert constant["clip_frac_low_neg"].item() == pytest.approx(in_region / n, rel=1e-12)


def test_ratio_aware_beta1_at_zero_is_ce_gppo_zero_beta2_and_matches_at_the_boundary():
    """At beta1 = 0 the ratio-aware weight is CE-GPPO (0, beta2), value and gradient; at d = 1 - eps_low (just below)
    the two weights agree to first order, and further below the ratio-aware one is smaller."""
    for beta2 in (0.5, 1.0):
        torch.testing.assert_close(_grad("ce_gppo", beta1=0.0, beta2=beta2, beta1_weight="ratio"),
                                   _grad("ce_gppo", beta1=0.0, beta2=beta2))
    old = torch.full((1, 2), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor([[math.log(0.8 - 1e-9), math.log(0.3)]], dtype=torch.float64)).requires_grad_(True)
    adv, mask = torch.tensor([[-1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    grads = {}
    for weight in L.BETA1_WEIGHTS:
        x = logp.detach().clone().requires_grad_(True)
        L.policy_loss(x, old, adv, mask, L.loss_config("ce_gppo", beta1=1.0, beta1_weight=weight))[0].backward()
        grads[weight] = x.grad[0]
    assert grads["ratio"][0].item() == pytest.approx(grads["constant"][0].item(), rel=1e-8)  # 0.8 / 2 at the bound
    assert grads["ratio"][1].item() == pytest.approx(0.3 / 2) and grads["constant"][1].item() == pytest.approx(0.4)
    # GPPO is GPPO whatever beta1_weight says
    torch.testing.assert_close(_grad("gppo"), _grad("ce_gppo", beta1=1.0, beta2=1.0))


def test_region_terms_are_the_policy_terms_parts_by_region():
    """loss.region_terms: the beta1 and beta2 regions' parts of the aggregated policy term, for each aggregation: their
    gradients on log pi are the whole term's on those tokens and zero elsewhere; a region with no token is absent, and
    an algorithm without clip regions has none."""
    logp, old_logp, adv, mask = make_batch()
    for mode in L.LOSS_AGG_MODES:
        cfg = L.loss_config("ce_gppo", loss_agg_mode=mode, clip_ratio_c=0.0)
        whole = torch.autograd.grad(L.policy_loss(logp, old_logp, adv, mask, cfg)[0], logp)[0]
        parts = L.region_terms(logp, old_logp, adv, mask, cfg)
        assert set(parts) == {"low_neg", "high_pos"}
        d = (logp - old_logp).exp().detach()
        where = {"low_neg": (d < 0.8) & (adv < 0) & (mask > 0), "high_pos": (d > 1.2) & (adv > 0) & (mask > 0)}
        for name, part in parts.items():
            g = torch.autograd.grad(part, logp, retain_graph=True)[0]
            torch.testing.assert_close(g, torch.where(where[name], whole, 0.0), rtol=1e-12, atol=0)
    only_inside = old_logp.clone().requires_grad_(True)
    assert L.region_terms(only_inside, old_logp, adv, mask, L.loss_config("ce_gppo")) == {}
    assert L.region_terms(logp, old_logp, adv, mask, L.loss_config("cispo")) == {}
