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
        part, _ = L.policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows], L.loss_config(algo, loss_agg_mode=mode, norm_len=32),
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


def test_entropy_regions():
    logp = torch.log(torch.tensor([[0.9, 0.05, 0.9, 0.05]]))
    entropy = torch.full_like(logp, 1.0)  # -log 0.9 = 0.1 < 1 < -log 0.05 = 3.0
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    _, m = L.policy_loss(logp, logp, adv, torch.ones_like(logp), entropy=entropy)
    assert [m[f"entropy_region_e{k}"].item() for k in (1, 2, 3, 4)] == [0.25] * 4


def test_log_ratio_overflow_is_guarded():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old_logp = torch.tensor([[-200.0, -1.0]])
    for algo in L.ALGORITHMS:
        loss, m = L.policy_loss(logp, old_logp, torch.tensor([[-1.0]]), torch.ones(1, 2), L.loss_config(algo))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), algo
        assert all(torch.isfinite(v) for v in m.values()), algo
        logp.grad = None


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(algo="ppo2"), "algo must be one of ['ce_gppo'"),
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
        L.policy_loss(logp, old_logp, adv, mask, L.LossConfig(**kwargs), progress=progress)


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
    torch.testing.assert_close(L.group_advantages(rewards, 4, scale_by_std=False)[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]))
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
    s = L.oscillatory_decay_state(s, 1.0, 0.5, h0, dc); assert s == 0  # between the thresholds: keep
    s = L.oscillatory_decay_state(s, 0.4, 0.5, h0, dc); assert s == 1  # hit the floor: raise entropy
    s = L.oscillatory_decay_state(s, 1.0, 0.5, h0, dc); assert s == 1  # 1.0 <= tau_high = 1.2: keep raising
    s = L.oscillatory_decay_state(s, 1.3, 0.5, h0, dc); assert s == 0  # above tau_high: decay again
    s = L.oscillatory_decay_state(1, 0.5, 1.0, h0, dc); assert s == 0  # tau_high(1) = H_min
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
    loss, m = L.policy_loss(logp, old_logp, torch.tensor([[1.0]], dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                            L.loss_config(algo, beta2=0.5, dynamic_clip="id"), progress=0.0)
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
    assert L.algorithm_table() in readme, "README's algorithm table differs from loss.algorithm_table():\n" + L.algorithm_table()


def test_every_field_has_a_rule_and_bad_values_name_the_field():
    """A new LossConfig field must declare its rule (config_problems checks every field by it)."""
    for f in L.fields(L.LossConfig):
        rule = f.metadata.get("rule")
        assert isinstance(rule, L.Rule), f.name
        bad = "not an option" if rule.choices else -1.0
        problems = L.config_problems(L.replace(L.LossConfig(), **{f.name: bad}))
        assert problems and problems[0][0] == f.name and problems[0][1].startswith(f"{f.name} must be"), (f.name, problems)


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
    ratio too lands on both sides), tokens with A < 0 past the dual-clip bound (ratios up to ~16), unequal lengths."""
    g = torch.Generator().manual_seed(7)
    old_logp = -torch.rand(8, 10, generator=g, dtype=torch.float64) * 4 - 0.05
    shift = torch.tensor([-1.5, -1.5, -0.5, -0.5, 0.5, 0.5, 1.5, 1.5], dtype=torch.float64).unsqueeze(-1)
    logp = (old_logp + shift + 1.5 * torch.randn(8, 10, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.tensor([-1.3, 0.8, -0.6, 1.1, -0.9, 0.5, -1.7, 1.4], dtype=torch.float64).unsqueeze(-1)
    mask = (torch.arange(10) < torch.tensor([10, 7, 9, 4, 10, 6, 8, 5]).unsqueeze(-1)).to(torch.float64)
    return logp, old_logp, adv, mask


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
    """Another valid value of a field in `reads` moves policy_loss; of one outside `reads` and COMMON_FIELDS, not."""
    logp, old_logp, adv, mask = every_region_batch()
    base = L.loss_config(algo)

    def value(cfg):
        # Clip-Cov draws at random: the same seed for every call, so a field it does not read leaves the draw (and the
        # value) bit-identical, and its bounds move the value through which candidates the draw sees
        torch.manual_seed(0)
        return L.policy_loss(logp, old_logp, adv, mask, cfg)[0].item()

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
                problems.append(f"{f.name} is in reads, but {before!r} -> {other!r} leaves the loss at {want!r}")
            elif f.name not in reads and value(cfg) != want:
                problems.append(f"{f.name} is not in reads, but {before!r} -> {other!r} moves the loss")
    assert not problems, f"{algo}: " + "; ".join(problems)
