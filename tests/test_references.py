"""The entropy-control methods against their reference implementations, in float64 on one fixed batch.

verl (volcengine/verl, core_algos.py at commit b178a3cd56f58b2d502255daba591e92833930a7): SAPO, Clip-Cov, KL-Cov, the KL
loss. Its numbers were computed once by running those functions on `batch()` and are hard-coded below (verl is not a
dependency). TRL 1.16.0 (GRPOTrainer._compute_loss): SAPO, the top-entropy mask, the k3 KL penalty, adaptive entropy.
Its numbers are hard-coded too, and where TRL is installed (requirements-bench.txt) the test also calls TRL itself.

Each case compares the loss and a fingerprint of its gradient with respect to log pi: (sum |g|, sum g * (1 + index)).
Tolerance 1e-9 where the two computations are the same math. Where verl divides each response's token sum by
(length + 1e-8) (seq-mean-token-mean), the difference is that 1e-8: relative tolerance 1e-8 there.
"""

import importlib.util
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import loss as L

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"


def batch():
    """4 responses of up to 6 tokens (two padded), ratios in exp(+-0.6), A = 1.5, -2, 0, -0.7; entropies exact in
    float32 (TRL takes its quantile in float32)."""
    i = torch.arange(24, dtype=torch.float64).view(4, 6)
    old = -(0.05 + 3.0 * (0.5 + 0.5 * torch.sin(1.7 * i + 0.3)))
    logp = old + 0.6 * torch.sin(2.3 * i + 1.1)
    adv = torch.tensor([[1.5], [-2.0], [0.0], [-0.7]], dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[0, 4:] = 0
    mask[3, 5:] = 0
    entropy = (0.1 + 2.0 * (0.5 + 0.5 * torch.cos(0.9 * i))).float().double()
    return logp, old, adv, mask, entropy


def fingerprint(loss, grad):
    weights = torch.arange(1, grad.numel() + 1, dtype=grad.dtype).view_as(grad)
    return [loss, grad.abs().sum().item(), (grad * weights).sum().item()]


def ours(cfg, *, seed=None, ref=False, entropy_grad=False):
    """(loss, gradient wrt log pi, gradient wrt the entropy) of policy_loss on batch(); ref: the KL reference is `old`
    and the policy term sees old = logp (ratio 1)."""
    logp, old, adv, mask, entropy = batch()
    logp.requires_grad_(True)
    entropy.requires_grad_(entropy_grad)
    if seed is not None:
        torch.manual_seed(seed)
    loss, metrics = L.policy_loss(logp, logp.detach() if ref else old, adv, mask, cfg,
                                  extras=L.Extras(entropy=entropy, ref_logp=old if ref else None))
    loss.backward()
    return loss.item(), logp.grad, entropy.grad


# --- verl ------------------------------------------------------------------------------------------

# name: (our config, torch seed before the call, verl's fingerprint)
VERL = {
    # compute_policy_loss_sapo (tau_pos 1.0, tau_neg 1.05; always seq-mean-token-mean, lengths + 1e-8)
    "sapo": (L.loss_config("sapo"), None, None),
    "sapo_tau": (L.loss_config("sapo", tau_pos=0.5, tau_neg=2.0), None, None),
    # compute_policy_loss_clip_cov, clip range 0.2; the default draws one token of the 21 (int(2e-4 * 21) -> 1)
    "clip_cov_default": (L.loss_config("clip_cov"), 0, None),
    "clip_cov_all": (L.loss_config("clip_cov", clip_cov_ratio=0.5, clip_cov_lb=0.0, clip_cov_ub=100.0), 0, None),
    "clip_cov_draw": (L.loss_config("clip_cov", clip_cov_ratio=0.15, clip_cov_lb=0.0, clip_cov_ub=100.0), 0, None),
    # compute_policy_loss_kl_cov with verl's yaml defaults, and a wide one
    "kl_cov_default": (L.loss_config("kl_cov", kl_cov_ratio=2e-4, kl_cov_coef=0.1), None, None),
    "kl_cov_wide": (L.loss_config("kl_cov", kl_cov_ratio=0.2, kl_cov_coef=1.0), None, None),
}
# kl_penalty(logp, ref, type) aggregated by agg_loss: verl's kl_loss (its "kl", "mse", "low_var_kl")
for _est in L.KL_ESTIMATORS:
    for _mode in ("token-mean", "seq-mean-token-mean"):
        VERL[f"kl_{_est}_{_mode}"] = (L.loss_config("grpo", kl_coef=1.0, kl_estimator=_est, loss_agg_mode=_mode),
                                      "ref", None)

VERL_NUMBERS = {}
VERL_NUMBERS.update({  # verl b178a3c, on batch()
    'clip_cov_all': [0.34920332462110515, 0.43746777684867466, 4.321403956849063],
    'clip_cov_default': [0.4900650964339787, 0.6809907033092979, 6.977699288779432],
    'clip_cov_draw': [0.6445432083904741, 0.7328076606180436, 7.654244543678935],
    'kl_cov_default': [0.4930213845303316, 1.2131439634730432, 9.447722017144718],
    'kl_cov_wide': [0.5786778580464764, 1.3131439634730433, 10.619150588573289],
    'kl_k1_seq-mean-token-mean': [0.05701595591935292, 0.9999999980416667, 12.124999977520833],
    'kl_k1_token-mean': [0.04988940426198026, 1.0, 12.619047619047617],
    'kl_k2_seq-mean-token-mean': [0.09648782769006223, 0.3997441143693279, 0.41728112127610484],
    'kl_k2_token-mean': [0.09580251777256682, 0.39845802917287687, 0.425938093874984],
    'kl_k3_seq-mean-token-mean': [0.095225922350144, 0.3984068090894236, -0.7747569253116507],
    'kl_k3_token-mean': [0.09528588459585151, 0.4004505285412815, -0.8012854042412791],
    'sapo': [0.5385627578280684, 1.1527524013237198, 7.870355923157779],
    'sapo_tau': [-0.8388290442581079, 1.06611037461365, 6.212083900077429],
})


@pytest.mark.parametrize("name", sorted(VERL))
def test_equals_verl(name):
    cfg, seed, _ = VERL[name]
    if seed == "ref":  # the KL term alone: A = 0 here makes the policy term 0 (TRL and verl add the two terms alike)
        logp, old, adv, mask, entropy = batch()
        logp.requires_grad_(True)
        loss, m = L.policy_loss(logp, logp.detach(), adv * 0, mask, cfg, extras=L.Extras(ref_logp=old))
        loss.backward()
        got = fingerprint(m["kl_loss"].item(), logp.grad)
    else:
        value, grad, _ = ours(cfg, seed=seed)
        got = fingerprint(value, grad)
    relative = 1e-8 if cfg.loss_agg_mode == "seq-mean-token-mean" else 0  # verl's length + 1e-8
    assert got == pytest.approx(VERL_NUMBERS[name], abs=1e-9, rel=relative), (name, got)


# --- TRL -------------------------------------------------------------------------------------------

def trl_loss(loss_type, *, eps=(0.2, 0.2), taus=(1.0, 1.05), beta=0.0, rho=1.0, entropy_coef=0.0, adaptive=False,
             last_entropy=math.inf):
    """TRL's GRPOTrainer._compute_loss on batch(), one process, one micro-batch per optimizer step, the model's forward
    replaced by batch()'s tensors. Returns (loss, d loss / d logp, d loss / d entropy, the trainer-like object)."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    logp, old, adv, mask, entropy = batch()
    logp.requires_grad_(True)
    entropy.requires_grad_(True)

    class OneProcess:
        num_processes, sync_gradients = 1, True
        pad_across_processes = staticmethod(lambda x, dim=0, pad_index=0: x)
        gather = gather_for_metrics = staticmethod(lambda x: x)
        reduce = staticmethod(lambda x, reduction="sum": x)

    args = SimpleNamespace(use_bias_correction_kl=False, sapo_temperature_pos=taus[0], sapo_temperature_neg=taus[1],
                           delta=None, entropy_target=0.2, entropy_coef_delta=0.005, entropy_coef_min=0.0,
                           entropy_coef_max=1.0, steps_per_generation=1)
    trainer = SimpleNamespace(
        accelerator=OneProcess(), args=args, loss_type=loss_type, beta=beta, top_entropy_quantile=rho,
        epsilon_low=eps[0], epsilon_high=eps[1], off_policy_mask_threshold=None, importance_sampling_level="token",
        use_vllm=False, aux_loss_enabled=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, entropy_coef=entropy_coef, use_adaptive_entropy=adaptive,
        _entropy_bonus_enabled=bool(entropy_coef) or adaptive, _last_world_entropy=last_entropy,
        _entropy_window_stats=None, _metrics={"train": defaultdict(list)})
    trainer.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(trainer, *a)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    inputs = {"prompt_ids": torch.zeros(4, 1, dtype=torch.long), "prompt_mask": torch.ones(4, 1, dtype=torch.long),
              "completion_ids": torch.zeros(4, 6, dtype=torch.long), "completion_mask": mask, "advantages": adv[:, 0],
              "old_per_token_logps": old if beta == 0 else logp.detach(), "ref_per_token_logps": old,
              "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.item(), logp.grad, entropy.grad, trainer


# name: (TRL's call, our config, our options); TRL_NUMBERS holds TRL 1.16.0's fingerprints (with the gradient wrt the
# entropy where there is a bonus)
TRL = {
    # TRL builds its SAPO temperatures as float32 (torch.where of two Python floats): 1.05 becomes 1.0499999523, a
    # difference of ~7e-8 in the loss here (TRL_TOLERANCE); ours are exact in the loss's dtype, as verl's. Temperatures
    # exact in float32 give the same numbers.
    "sapo": (dict(loss_type="sapo"), L.loss_config("sapo"), {}),
    "sapo_exact_taus": (dict(loss_type="sapo", taus=(1.0, 1.25)), L.loss_config("sapo", tau_neg=1.25), {}),
    # the top-entropy mask, rho = 0.2, on per-response (TRL "grpo") and token-mean (TRL "dapo", eps 0.2 / 0.28) losses
    "top_entropy_grpo": (dict(loss_type="grpo", rho=0.2), L.loss_config("grpo", top_entropy_quantile=0.2), {}),
    "top_entropy_dapo": (dict(loss_type="dapo", eps=(0.2, 0.28), rho=0.2),
                         L.loss_config("dapo", top_entropy_quantile=0.2), {}),
    "top_entropy_sapo_half": (dict(loss_type="sapo", taus=(1.0, 1.25), rho=0.5),
                              L.loss_config("sapo", tau_neg=1.25, top_entropy_quantile=0.5), {}),
    # the k3 KL penalty with the GRPO paper's beta 0.04 (the policy term at ratio 1)
    "kl_k3_grpo": (dict(loss_type="grpo", beta=0.04), L.loss_config("grpo", kl_coef=0.04), dict(ref=True)),
    # adaptive entropy: a coefficient of 0.3 applied (the last entropy 0.1 is below the 0.2 target), token-mean
    "adaptive_applied": (dict(loss_type="dapo", eps=(0.2, 0.28), entropy_coef=0.3, adaptive=True, last_entropy=0.1),
                         L.loss_config("dapo", adaptive_entropy=True, entropy_coef=0.3), dict(entropy_grad=True)),
    # ... under per-response losses too: the bonus is a plain token mean whatever the policy term's aggregation
    "adaptive_applied_grpo": (dict(loss_type="grpo", entropy_coef=0.3, adaptive=True, last_entropy=0.1),
                              L.loss_config("grpo", adaptive_entropy=True, entropy_coef=0.3), dict(entropy_grad=True)),
    "adaptive_applied_sapo": (dict(loss_type="sapo", taus=(1.0, 1.25), entropy_coef=0.3, adaptive=True,
                                   last_entropy=0.1),
                              L.loss_config("sapo", tau_neg=1.25, adaptive_entropy=True, entropy_coef=0.3),
                              dict(entropy_grad=True)),
    # ... and not applied (the last entropy 0.25 is above the target)
    "adaptive_idle": (dict(loss_type="dapo", eps=(0.2, 0.28), entropy_coef=0.3, adaptive=True, last_entropy=0.25),
                      L.loss_config("dapo", adaptive_entropy=True, entropy_coef=0.0), dict(entropy_grad=True)),
}
TRL_NUMBERS = {}
TRL_NUMBERS.update({  # TRL 1.16.0 GRPOTrainer._compute_loss, on batch()
    'adaptive_applied': [0.2464495625361251, 0.8179527620057273, 8.210357817047298, 0.3, -3.7857142857142856],
    'adaptive_applied_grpo': [0.09009276645699776, 0.7904983133132324, 7.611197137243327, 0.3, -3.7857142857142856],
    'adaptive_applied_sapo': [-0.03845754319328737, 1.1306195174494742, 7.577077630192534, 0.3, -3.7857142857142856],
    'adaptive_idle': [0.6155985837018366, 0.8179527620057273, 8.210357817047298, 0.0, 0.0],
    'kl_k3_grpo': [0.3038090369014439, 1.051063522129612, 7.456509722930282],
    'sapo': [0.5385628170073982, 1.1527524086365601, 7.870356002693207],
    'sapo_exact_taus': [0.33069147797242415, 1.1306195174494742, 7.577077630192534],
    'top_entropy_dapo': [0.0452430954923803, 0.033814524063808866, 0.7101050053399862],
    'top_entropy_grpo': [0.017671916933665988, 0.035505250266999314, 0.7456102556069856],
    'top_entropy_sapo_half': [0.19940982058424273, 0.596182515870756, 4.1904664986843825],
})
TRL_TOLERANCE = {"sapo": 2e-7}  # TRL's float32 temperature (above); 1e-9 for the rest


def our_trl_case(name):
    _, cfg, options = TRL[name]
    value, grad, entropy_grad = ours(cfg, **options)
    got = fingerprint(value, grad)
    if options.get("entropy_grad"):  # no bonus applied: no gradient reaches the entropy
        got += fingerprint(0.0, torch.zeros(4, 6, dtype=torch.float64) if entropy_grad is None else entropy_grad)[1:]
    return got


def trl_case(name):
    value, grad, entropy_grad, _ = trl_loss(**TRL[name][0])
    got = fingerprint(value, grad)
    if TRL[name][2].get("entropy_grad"):
        got += fingerprint(0.0, entropy_grad)[1:]
    return got


@pytest.mark.parametrize("name", sorted(TRL))
def test_equals_trl_numbers(name):
    assert our_trl_case(name) == pytest.approx(TRL_NUMBERS[name], abs=TRL_TOLERANCE.get(name, 1e-9), rel=0)


HAVE_TRL = importlib.util.find_spec("trl") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed (pip install -r requirements-bench.txt); "
                                         "test_equals_trl_numbers checks the same cases against TRL 1.16.0's numbers")
def test_equals_trl_itself():
    wrong = {}
    for name in TRL:
        got, want = our_trl_case(name), trl_case(name)
        if got != pytest.approx(want, abs=TRL_TOLERANCE.get(name, 1e-9), rel=0):
            wrong[name] = (got, want)
    assert not wrong, wrong
    # the controller: TRL's coefficient after a step of each entropy, against ours (c starts at 0.3)
    cfg = L.loss_config("dapo", adaptive_entropy=True)
    coef, last = 0.3, math.inf
    for step_entropy_scale in (0.05, 0.5, 0.09, 2.0, 0.1):
        _, _, _, trainer = trl_loss("dapo", entropy_coef=coef, adaptive=True, last_entropy=last)
        measured = trainer._last_world_entropy
        assert (L.adaptive_entropy_coef(cfg, coef, last) > 0) == (last <= 0.2)
        coef, last = L.next_entropy_coef(cfg, coef, measured), measured
        assert coef == pytest.approx(trainer.entropy_coef, abs=1e-12)


def test_adaptive_entropy_controller():
    """Skywork-OR1 / TRL: +delta at or below the target, -delta above it, within [min, max]; applied only when the
    previous step's entropy was at or below the target, and not before the first step."""
    cfg = L.loss_config("dapo", adaptive_entropy=True, entropy_coef_delta=0.1, entropy_coef_max=0.25)
    assert L.adaptive_entropy_coef(cfg, 0.2, None) == 0.0
    assert L.adaptive_entropy_coef(cfg, 0.2, 0.2) == 0.2 and L.adaptive_entropy_coef(cfg, 0.2, 0.21) == 0.0
    coefs, c = [], 0.0
    for entropy in (0.1, 0.2, 0.19, 0.5, 0.5, 0.5, 0.01):
        c = L.next_entropy_coef(cfg, c, entropy)
        coefs.append(round(c, 12))
    assert coefs == [0.1, 0.2, 0.25, 0.15, 0.05, 0.0, 0.1]


# --- the 2026 comparison set: ERC, DPPO, GMPO, M2PO, IcePop ------------------------------------------------------
# Each reference function was loaded out of its repository's file at the commit below (its imports stubbed) and run on
# batch(); its fingerprints are hard-coded here. Beside these fixed cases, each was compared with ours on thousands of
# random float64 batches (every region, both signs of A, padding): equal to float64 rounding once the references'
# 1e-8 guards in denominators are set to 0 (they account for the tolerances below).
ERC_COMMIT = "f1885c534f8d0dde9764ecbb6a9f259b0dd785cf"  # Kwai-Klear/ERC, verl/trainer/ppo/core_algos.py (*_erc)
VERL_PROJECT_COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"  # verl-project/verl: core_algos.py (dppo_tv, dppo_kl,
# geo_mean), rollout_corr_helper.py (compute_rollout_correction_weights with a "lower_upper" threshold: IcePop)
AREAL_COMMIT = "4aef98d8d818af55b43621aaadba047ae10f4e77"  # inclusionAI/AReaL: areal/trainer/ppo/actor.py
# (_apply_m2po_masking), areal/utils/functional/functional.py (ppo_actor_loss_fn, here with no clip: eps_clip 1e9)


def comparison_extras():
    """batch()'s old-policy entropy (H / H_old in 0.93-1.09, across ERC's band) and the sampler's log-probs
    (pi_old / q = exp(2 sin), 0.14-7.4: both sides of IcePop's [0.5, 5])."""
    i = torch.arange(24, dtype=torch.float64).view(4, 6)
    _, old, _, _, entropy = batch()
    return (entropy * (1 + 0.08 * torch.cos(1.3 * i + 0.2))).float().double(), old - 2.0 * torch.sin(0.7 * i + 0.4)


# name: (our config, the reference's fingerprint key, relative tolerance: the reference's 1e-8 guard)
COMPARISON = {
    # compute_policy_loss_{gppo,grpo}_erc with the authors' scripts' settings (masked_mean divides by tokens + 1e-8)
    "gppo_erc": (L.loss_config("gppo_erc"), 1e-8),
    "grpo_erc": (L.loss_config("grpo_erc"), 1e-8),
    "gppo_erc_narrow": (L.loss_config("gppo_erc", erc_low=0.99, erc_high=1.01), 1e-8),
    # compute_policy_loss_dppo_{tv,kl} with verl's example settings, and a truncation cap that binds (ratios to 1.82)
    "dppo_tv": (L.loss_config("dppo_tv"), 0),
    "dppo_kl": (L.loss_config("dppo_kl"), 0),
    "dppo_tv_cap": (L.loss_config("dppo_tv", clip_ratio_c=1.5, loss_agg_mode="token-mean"), 0),
    "dppo_tv_0.1": (L.loss_config("dppo_tv", dppo_mask_low=0.1, dppo_mask_high=0.1), 0),  # the defaults mask the same
    "dppo_kl_0.03": (L.loss_config("dppo_kl", dppo_mask_low=0.03, dppo_mask_high=0.03), 0),  # tokens here; these not
    # compute_policy_loss_geo_mean, clip 0.4 (divides by |y| + 1e-8)
    "gmpo": (L.loss_config("gmpo"), 1e-8),
}
COMPARISON_NUMBERS = {}
COMPARISON_NUMBERS.update({  # Kwai-Klear/ERC, verl-project/verl and AReaL at the commits above, on batch()
    'gppo_erc': [0.6270271548318238, 0.6602249590697141, 5.038768901934583],
    'grpo_erc': [0.6155985834086944, 0.5478440067422765, 4.874959378203064],
    'gppo_erc_narrow': [0.6270271548318238, 0.08794174988143158, 0.38411649997047015],
    'dppo_tv': [-0.8498384092321559, 0.8842588592554635, 7.748780637542592],
    'dppo_kl': [-0.8498384092321559, 0.8842588592554635, 7.748780637542592],
    'dppo_tv_cap': [-0.9319459391544216, 0.9536786389357945, 8.258057401144832],
    'dppo_tv_0.1': [-0.8176265491698801, 0.868214223019378, 7.443932549056968],
    'dppo_kl_0.03': [-0.7163290955583327, 0.8223947768632724, 7.077376979808124],
    'gmpo': [0.3383310524280055, 0.6867933891647215, 5.394711147457004],
    'gmpo_icepop': [1.982009654460262e-05, 1.921654884324303e-05, 0.00032970227743908437],
    'm2po': [0.27746909783895846, 0.706394680635452, 5.792252486032199],
    'm2po_kept': [0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
    'icepop': [19.2641245528434, 239.71330515498286],
})


@pytest.mark.parametrize("name", sorted(COMPARISON))
def test_equals_the_comparison_references(name):
    """DPPO judges probabilities: its cases take batch()'s log-probs lowered by 0.6, so that every p is below 1."""
    cfg, relative = COMPARISON[name]
    logp, old, adv, mask, entropy = batch()
    if name.startswith("dppo"):
        logp, old = logp - 0.6, old - 0.6
    logp.requires_grad_(True)
    value, _ = L.policy_loss(logp, old, adv, mask, cfg,
                             extras=L.Extras(entropy=entropy, old_entropy=comparison_extras()[0]))
    value.backward()
    assert fingerprint(value.item(), logp.grad) == pytest.approx(COMPARISON_NUMBERS[name], abs=1e-12, rel=relative)


def test_m2po_equals_areal_up_to_its_denominator():
    """AReaL's mask exactly; its loss divides by the tokens kept, ours (the paper's mean) by all of them."""
    logp, old, adv, mask, _ = batch()
    kept = L.second_moment_mask(logp - old, mask, 0.04)
    assert kept.long().flatten().tolist() == COMPARISON_NUMBERS["m2po_kept"]
    value, grad, _ = ours(L.loss_config("m2po"))
    scale = mask.sum().item() / kept.sum().item()
    assert 1 < scale < mask.sum().item()  # some tokens dropped, some kept
    assert fingerprint(value * scale, grad * scale) == pytest.approx(COMPARISON_NUMBERS["m2po"], abs=1e-12, rel=1e-12)


def test_icepop_equals_verl():
    from cegppo_utils import correction
    _, old, _, mask, _ = batch()
    weights, _, outside = correction.importance_weights(old, comparison_extras()[1], mask, "token-icepop", 2.0)
    assert 0 < outside.sum() < mask.sum()
    assert fingerprint(0.0, weights)[1:] == pytest.approx(COMPARISON_NUMBERS["icepop"], abs=1e-12, rel=1e-12)


def test_gmpo_with_icepop_equals_verl():
    """IcePop's weights under GMPO: their geometric mean per response (verl's geo_mean), not a weight per token. verl
    divides the mean of log(w + 1e-10) by |y| + 1e-8: a relative 23e-8 / |y| here."""
    from cegppo_utils import correction
    logp, old, adv, mask, _ = batch()
    weights, _, _ = correction.importance_weights(old, comparison_extras()[1], mask, "token-icepop", 2.0)
    logp.requires_grad_(True)
    value, _ = L.policy_loss(logp, old, adv, mask, L.loss_config("gmpo"), extras=L.Extras(weights=weights))
    value.backward()
    assert fingerprint(value.item(), logp.grad) == pytest.approx(COMPARISON_NUMBERS["gmpo_icepop"], abs=1e-14, rel=1e-7)


# --- what the frameworks ship besides: LUSPO, VESPO (TRL), GPG, DRO (verl), prime-rl's default loss, MaxRL, BandPO --
# As above: each reference function loaded out of its file at the commit below (its imports stubbed) and run once on
# these inputs; its numbers hard-coded. The diagnostics are compared where the reference computes the same quantity,
# from its own masks or terms (named per case); each reference's deviations are the tolerances below.
TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"  # huggingface/trl: trl/trainer/grpo_trainer.py (_compute_loss,
# get_gamma_weights), run through a trainer stub as trl_loss() above
PRIME_RL_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"  # PrimeIntellect-ai/prime-rl: src/prime_rl/trainer/rl/
# loss.py (default_loss_fn, per response, summed and divided by the tokens as its compute_loss),
# src/prime_rl/orchestrator/algo/max_rl.py (MaxRLAlgorithm.score_group)
BANDPO_COMMIT = "0de49cd919b4ddf3e161fbdf69abcf0527c79ac2"  # OpenMOSS/BandPO: RLtraining/verl/verl/bandpo/band/band.py
# and solver.py (band), RLtraining/verl/verl/trainer/ppo/core_algos.py (compute_policy_loss_vanilla with
# use_tokenwise_ratio_bounds, its scripts' settings); verl-project/verl at VERL_PROJECT_COMMIT for gpg and dro


def edge_batch(beyond=False):
    """5 responses of up to 4 tokens: a one-token response (A 1.2), an empty row, extreme ratios (log d = +-15, or
    +-25 past the +-20 clamp with `beyond`; the rising token from p_old e^-20 or e^-30 to e^-5, within DPPO's bound),
    a row with A = 0 (an all-equal group) whose tokens moved, and a mixed row (A -1.1)."""
    e = 25.0 if beyond else 15.0
    log_d = torch.tensor([[0.3, 0, 0, 0], [0.2, -0.1, 0, 0], [e, -e, 0.1, -0.2], [0.5, -0.5, 0.2, 0.0],
                          [-0.4, 0.7, -0.05, 0.3]], dtype=torch.float64)
    old = torch.tensor([[-0.7, -1, -1, -1], [-1.0, -2, -1, -1], [-e - 5, -1.0, -0.4, -2.5], [-1.2, -0.3, -3, -0.9],
                        [-0.2, -2.0, -0.8, -1.6]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float64)
    return old + log_d, old, torch.tensor([[1.2], [-0.5], [0.9], [0.0], [-1.1]], dtype=torch.float64), mask


def vespo_weights():
    """Rollout-correction weights on batch(): exp(0.3 sin) on its tokens, one zeroed (as IcePop would), 1 on padding."""
    _, _, _, mask, _ = batch()
    i = torch.arange(24, dtype=torch.float64).view(4, 6)
    w = torch.where(mask > 0, torch.exp(0.3 * torch.sin(1.1 * i)), torch.ones_like(mask))
    w[1, 2] = 0.0
    return w


def framework_inputs(kind):
    """(logp, old_logp, advantages, mask): batch(); lowered by 0.6 (every p below 1, for prime-rl's probabilities);
    edge_batch(); edge_batch(beyond=True)."""
    if kind in ("batch", "lowered"):
        logp, old, adv, mask, _ = batch()
        return (logp - 0.6, old - 0.6, adv, mask) if kind == "lowered" else (logp, old, adv, mask)
    return edge_batch(beyond=kind == "beyond")


_TRL, _VERL = (1e-12, 1e-12), (1e-12, 1e-12)  # the same math in float64: measured <= 6.2e-15
# prime-rl's masked shares are float32 (1/21 there is 0.047619049): 6e-8 relative on them
_PRIME = (1e-12, 6e-8)
# BandPO's masked_mean divides by tokens + 1e-8 (its pg_clipfrac, and the loss under token-mean): <= 1e-8 relative
_BAND = (1e-8, 1e-8)
# ... and its KL bounds are bisection midpoints within 2^-21 = 4.8e-7 of the root (its solver stops at a 1e-6 bracket;
# ours is solved to float64): a clipped token's value moves by |A| times that. Measured: 1.4e-7 relative on batch()
_BAND_KL = (1e-6, 1e-8)
# name: (our config, inputs, extras, our diagnostics (a+b: their sum) in the order of the numbers after the fingerprint,
# (relative tolerance on loss and gradient, on the diagnostics))
FRAMEWORKS = {
    # TRL luspo with importance_sampling_level "sequence"; TRL logs the share of responses clipped: the numbers are its
    # clip masks (coef_1 against 1 -+ eps by the sign of A) counted over each response's tokens, ours
    "luspo": (L.loss_config("luspo"), "batch", {}, ("luspo_clip_frac_low", "luspo_clip_frac_high"), _TRL),
    "luspo_wide": (L.loss_config("luspo", eps_low=0.2, eps_high=0.2), "batch", {},
                   ("luspo_clip_frac_low", "luspo_clip_frac_high"), _TRL),
    "luspo_wide_edge": (L.loss_config("luspo", eps_low=0.2, eps_high=0.2), "edge", {},
                        ("luspo_clip_frac_low", "luspo_clip_frac_high"), _TRL),
    # TRL vespo; its phi (get_gamma_weights) per response, averaged over tokens (TRL logs its mean over responses)
    "vespo": (L.loss_config("vespo"), "batch", {}, ("vespo_phi",), _TRL),
    "vespo_other": (L.loss_config("vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=0.5,
                                  vespo_lambda_neg=4.0), "batch", {}, ("vespo_phi",), _TRL),
    "vespo_weights": (L.loss_config("vespo"), "batch", {"weights": True}, ("vespo_phi",), _TRL),  # importance_sampling_
    # ratio in TRL's inputs
    "vespo_edge": (L.loss_config("vespo"), "edge", {}, ("vespo_phi",), _TRL),
    "vespo_beyond": (L.loss_config("vespo"), "beyond", {}, ("vespo_phi",), _TRL),
    # verl compute_policy_loss_gpg, token-mean; no metrics
    "gpg": (L.loss_config("gpg"), "batch", {}, (), _VERL),
    "gpg_edge": (L.loss_config("gpg"), "edge", {}, (), _VERL),
    "gpg_beyond": (L.loss_config("gpg"), "beyond", {}, (), _VERL),
    # verl compute_policy_loss_dro, token-mean; its penalty per token: its dro loss minus its gpg loss
    "dro": (L.loss_config("dro"), "batch", {}, ("dro_penalty",), _VERL),
    "dro_0.5": (L.loss_config("dro", dro_beta=0.5), "batch", {}, ("dro_penalty",), _VERL),
    "dro_edge": (L.loss_config("dro"), "edge", {}, ("dro_penalty",), _VERL),
    "dro_beyond": (L.loss_config("dro"), "beyond", {}, ("dro_penalty",), _VERL),
    # prime-rl default_loss_fn against inference log-probs = old; its is_masked_high, is_masked_low (per response,
    # weighted by length) and its loss at A = 0 (the penalty's token mean)
    "dppo_tv_kimi": (L.loss_config("dppo_tv_kimi"), "lowered", {},
                     ("dppo_masked_frac_pos", "dppo_masked_frac_neg", "kimi_kl_penalty"), _PRIME),
    "dppo_tv_kimi_other": (L.loss_config("dppo_tv_kimi", dppo_mask_low=0.1, dppo_mask_high=0.05, kimi_kl_tau=0.5),
                           "lowered", {}, ("dppo_masked_frac_pos", "dppo_masked_frac_neg", "kimi_kl_penalty"), _PRIME),
    "dppo_tv_kimi_edge": (L.loss_config("dppo_tv_kimi"), "edge", {},
                          ("dppo_masked_frac_pos", "dppo_masked_frac_neg", "kimi_kl_penalty"), _PRIME),
    # BandPO's compute_policy_loss_vanilla (relax off, upper bound 10, dual clip 10); its pg_clipfrac (the tokens whose
    # clip drops the gradient) and pg_clipfrac_lower (dual clip). On the edge batches token-mean: its
    # seq-mean-token-mean divides an empty row by 0 (NaN)
    "bandpo_kl": (L.loss_config("bandpo"), "batch", {}, ("band_clip_frac_low+band_clip_frac_high", "dual_clip_frac"),
                  _BAND_KL),
    "bandpo_tv": (L.loss_config("bandpo", band_divergence="tv"), "batch", {},
                  ("band_clip_frac_low+band_clip_frac_high", "dual_clip_frac"), _BAND),
    "bandpo_chi2": (L.loss_config("bandpo", band_divergence="chi2"), "batch", {},
                    ("band_clip_frac_low+band_clip_frac_high", "dual_clip_frac"), _BAND),
    "bandpo_kl_wide": (L.loss_config("bandpo", band_delta=0.2, band_upper_max=2.0), "batch", {},
                       ("band_clip_frac_low+band_clip_frac_high", "dual_clip_frac"), _BAND_KL),
    "bandpo_kl_edge": (L.loss_config("bandpo", loss_agg_mode="token-mean"), "edge", {},
                       ("band_clip_frac_low+band_clip_frac_high", "dual_clip_frac"), _BAND_KL),
    "bandpo_tv_edge": (L.loss_config("bandpo", band_divergence="tv", loss_agg_mode="token-mean"), "edge", {},
                       ("band_clip_frac_low+band_clip_frac_high", "dual_clip_frac"), _BAND),
    "bandpo_chi2_beyond": (L.loss_config("bandpo", band_divergence="chi2", loss_agg_mode="token-mean"), "beyond", {},
                           ("band_clip_frac_low+band_clip_frac_high", "dual_clip_frac"), _BAND),
}
FRAMEWORK_NUMBERS = {}
FRAMEWORK_NUMBERS.update({  # TRL, verl, prime-rl and BandPO at the commits above: the fingerprint, then the diagnostics
    'luspo': [2.5608114388454046, 4.064561438845405, 48.65978438735444, 0.0, 0.19047619047619047],
    'luspo_wide': [2.3022681737632857, 5.826854703927523, 44.254051224649146, 0.0, 0.0],
    'luspo_wide_edge': [0.01949036459502418, 1.7119366379158234, 11.306356838291142, 0.0, 0.08333333333333333],
    'vespo': [-1.0242040386610607, 0.9421245685421376, 10.028117674026923, 0.9096171114689229],
    'vespo_other': [0.07621894817577719, 0.6320873393522881, 3.821293008064248, 0.8243475636694714],
    'vespo_weights': [-0.23288916057318823, 0.17100575862767808, 3.450110250806146, 0.5065233902778442],
    'vespo_edge': [1.5401401022130934, 0.8310804552157316, 4.654627291499363, 1.0086635687270782],
    'vespo_beyond': [2.3570762623359696, 0.8310804552157316, 4.654627291499363, 1.0086635687270782],
    'gpg': [-0.5635356133413489, 1.0238095238095237, 8.214285714285714],
    'gpg_edge': [1.46875, 0.7666666666666668, 3.533333333333334],
    'gpg_beyond': [2.2187500000000004, 0.7666666666666668, 3.533333333333334],
    'dro': [-0.5587454874527206, 1.028036232997469, 8.235582618979464, 0.0047901258886283715],
    'dro_0.5': [-0.5156343544550656, 1.066076615688977, 8.427254761223207, 0.04790125888628338],
    'dro_edge': [2.4092135416666665, 0.7731250000000001, 3.522291666666667, 0.9404635416666665],
    'dro_beyond': [4.825880208333334, 0.8314583333333334, 3.4806250000000007, 2.607130208333334],
    'dppo_tv_kimi': [0.562817157117315, 1.032071115029116, 9.321005463170433, 0.047619047619047616,
                     0.04761904903820583, 0.00019160503554513367],
    'dppo_tv_kimi_other': [0.740909039938524, 1.211810154440348, 9.055216561492387, 0.09523809523809523,
                           0.14285714569545926, 0.09580251777256683],
    'dppo_tv_kimi_edge': [-245176.14906830955, 245176.97813269013, -2206581.056312441, 0.0, 0.08333333333333333,
                          0.037618541666666665],
    'bandpo_kl': [0.4030004123522802, 0.9505274784756241, 7.451167972080935, 0.23809523798185941, 0.0],
    'bandpo_tv': [0.4810930729840387, 0.7904983133132324, 7.611197137243327, 0.2857142855782313, 0.0],
    'bandpo_chi2': [0.43716398174911564, 0.7904983133132324, 7.611197137243327, 0.2857142855782313, 0.0],
    'bandpo_kl_wide': [0.36146057853290925, 1.0156004881150322, 8.18354124751253, 0.14285714278911565, 0.0],
    'bandpo_kl_edge': [-0.5539132039127371, 0.5398197339545059, 5.805533776107091, 0.24999999979166665, 0.0],
    'bandpo_tv_edge': [-0.5204722783263775, 0.4569319151679055, 6.717299782759695, 0.3333333330555555, 0.0],
    'bandpo_chi2_beyond': [-0.5392574698486603, 0.5398197110118319, 5.805534005533831, 0.24999999979166665, 0.0],
})


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_equals_the_frameworks_references(name):
    """Loss, gradient fingerprint and every diagnostic of the case against the reference's, within its tolerance."""
    cfg, kind, options, diagnostics, (tolerance, diagnostic_tolerance) = FRAMEWORKS[name]
    logp, old, adv, mask = framework_inputs(kind)
    logp.requires_grad_(True)
    weights = vespo_weights() if options.get("weights") else None
    value, metrics = L.policy_loss(logp, old, adv, mask, cfg, extras=L.Extras(weights=weights))
    value.backward()
    want = FRAMEWORK_NUMBERS[name]
    assert fingerprint(value.item(), logp.grad) == pytest.approx(want[:3], rel=tolerance, abs=1e-12)
    got = [sum(metrics[key].item() for key in names.split("+")) for names in diagnostics]
    assert got == pytest.approx(want[3:], rel=diagnostic_tolerance, abs=1e-12)
    assert len(want) == 3 + len(diagnostics) and set(metrics) >= {d.metric for d in L.diagnostics(cfg.algo)} - {
        "dppo_truncated_frac"}


def test_band_bounds_equal_bandpos_operator():
    """band_bounds against BandPO's band() (radius 0.05, upper bound 10, relax off) at p_old from 1e-7 to 1 - 1e-7, both
    limits included: TV and chi2 closed forms to rounding; KL's lower bound within its bisection's 2^-21."""
    want = {  # band(old_log_prob, method="band" + divergence) at BANDPO_COMMIT: (lower, upper)
        'kl': ([0.0, 0.0024971961975097656, 0.26169538497924805, 0.6915154457092285, 0.866579532623291,
                0.951229424500714],
               [10.0, 7.809846289670613, 2.4105537937575576, 1.308484330175844, 1.0763573374752426, 1.0]),
        'tv': ([0.0, 0.0, 0.3749999999999999, 0.9, 0.9444444444444444, 0.95],
               [10.0, 5.999999999999998, 1.625, 1.1, 1.0555555555555556, 1.0]),
        'chi2': ([0.0, 0.0, 0.24171245559484478, 0.7763932022500211, 0.925464400750007, 1.0],
                 [10.0, 3.2248595461286986, 1.7582875444051553, 1.223606797749979, 1.074535599249993, 1.0]),
    }
    old = torch.tensor([[math.log(p) for p in (1e-7, 0.01, 0.08, 0.5, 0.9, 1 - 1e-7)]], dtype=torch.float64)
    for divergence, (lower, upper) in want.items():
        got_lower, got_upper = L.band_bounds(old, divergence, 0.05, 10.0)
        assert got_upper[0].tolist() == pytest.approx(upper, rel=1e-11, abs=0), divergence
        assert got_lower[0].tolist() == pytest.approx(lower, rel=0, abs=2**-21 if divergence == "kl" else 1e-15), \
            divergence


def test_max_rl_equals_prime_rl():
    """MaxRL's advantage against prime-rl's MaxRLAlgorithm.score_group (float32 both), groups of 0/1 rewards: one
    success in four, half, none (no signal: 0), all (0), one of two."""
    groups = {  # prime-rl at PRIME_RL_COMMIT
        (1.0, 0.0, 0.0, 0.0): [3.0, -1.0, -1.0, -1.0],
        (1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0): [1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0],
        (0.0, 0.0, 0.0, 0.0): [0.0, 0.0, 0.0, 0.0],
        (1.0, 1.0, 1.0, 1.0): [0.0, 0.0, 0.0, 0.0],
        (1.0, 0.0): [1.0, -1.0],
    }
    for rewards, want in groups.items():
        assert L.group_advantages(torch.tensor(rewards), len(rewards), max_rl=True).tolist() == want, rewards
    # several groups at once, each by its own mean (three successes of four: 1/3 in float32)
    both = L.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 4, max_rl=True)
    assert both.tolist() == torch.tensor([3.0, -1.0, -1.0, -1.0, 1 / 3, 1 / 3, -1.0, 1 / 3]).tolist()


@pytest.mark.parametrize("algo", ["luspo", "vespo", "gpg", "dro", "dppo_tv_kimi", "bandpo"])
def test_an_empty_mask_gives_a_zero_loss_without_nan(algo):
    """No response token in the call: loss 0, gradient 0, finite metrics. TRL's luspo and vespo give 0 too; verl's
    token-mean (gpg, dro), prime-rl's division by the step's tokens and BandPO's aggregations give 0 / 0 = NaN."""
    logp, old, adv, mask = edge_batch()
    logp.requires_grad_(True)
    value, metrics = L.policy_loss(logp, old, adv, torch.zeros_like(mask), L.loss_config(algo))
    value.backward()
    assert value.item() == 0.0 and (logp.grad == 0).all() and all(torch.isfinite(v) for v in metrics.values())
