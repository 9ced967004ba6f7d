"""The CE-GPPO objective and its family of policy-gradient losses for RL on LLMs.

Read this file beside the papers:
  CE-GPPO  Su et al., "CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping
           Policy Optimization", arXiv 2509.20712 (Eq. 8-10).
  GPPO     Su et al., "Klear-Reasoner", arXiv 2508.07629 (CE-GPPO with beta1 = beta2 = 1).
  GRPO     Shao et al., "DeepSeekMath", arXiv 2402.03300 (PPO-clip with group advantages).
  DAPO     Yu et al., arXiv 2503.14476 (clip-higher, token-mean).
  CISPO    MiniMax, "MiniMax-M1", arXiv 2506.13585 (clipped, detached IS weight).
  GSPO     Zheng et al., arXiv 2507.18071 (sequence-level ratio).
  Dynamic clipping: "Flexible Entropy Control in RLVR with a Gradient-Preserving
           Perspective", arXiv 2602.09782.
  SAPO     Gao et al., "Soft Adaptive Policy Optimization", arXiv 2511.20347 (sigmoid gate for the clip).
  Clip-Cov, KL-Cov  Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617.
  ERC      Su et al., "Entropy Ratio Clipping as a Soft Global Constraint", arXiv 2512.05591 (on GPPO or PPO-clip).
  DPPO     Qi et al., "Rethinking the Trust Region in LLM RL", arXiv 2602.04879 (binary TV and KL masks).
  GMPO     Zhao et al., "Geometric-Mean Policy Optimization", arXiv 2507.20673.
  M2PO     Zheng et al., "Prosperity before Collapse", arXiv 2510.01161 (second-moment mask).
  (IcePop, arXiv 2510.18855, masks on the sampler/trainer ratio: cegppo_utils/correction.py.)
  What TRL, verl and prime-rl ship besides (docs/framework-objectives.md):
  LUSPO    Liu et al., arXiv 2602.05261 (GSPO with each response's loss times its length; TRL).
  VESPO    arXiv 2602.10693 (a smooth weight on the whole response's ratio in place of a clip; TRL).
  GPG      arXiv 2504.02546 (the plain policy gradient; verl). DRO: verl's dro (a quadratic log-ratio penalty).
  prime-rl's default loss: DPPO-Binary-TV's mask plus Kimi-K2.5's squared log-ratio (arXiv 2602.02276).
  BandPO   Li et al., arXiv 2603.04918 (clip bounds from an f-divergence trust region on the token's probability).
  MaxRL    Tajwar et al., arXiv 2602.02710 (the advantage divided by the group's mean: section 5; prime-rl).
  Options usable with every algorithm:
    top-entropy tokens  Wang et al., "Beyond the 80/20 Rule", arXiv 2506.01939 (train on the top-rho entropy tokens).
    adaptive entropy    He et al., "Skywork Open Reasoner 1", arXiv 2505.22312 (the entropy coefficient
                        driven toward a target entropy; the controller is in section 8, its state in train.py).
    KL to a reference   Shao et al., arXiv 2402.03300 Eq. 4 (k3), estimators after Schulman, "Approximating KL
                        divergence" (2020).

Notation. For response token t of response i:
  d = pi_theta(y_t) / pi_old(y_t)   the importance ratio ("r" in most papers)
  A                                  the advantage (one GRPO value per response, broadcast)
  sg(x)                              stop-gradient, x.detach()
  eps_low, eps_high                  the clip range: the interval is [1 - eps_low, 1 + eps_high]

  pi_old is the trainer's own recomputation at the weights the step starts from (train.py, stage 5), never the
  sampler's log-probs q. Samples one step stale (train.py --off-policy-steps 1) come from the weights before the
  previous update: pi_old stays the ratio's reference (decoupled PPO's proximal policy, verl's decoupled mode), and the
  gap pi_old / q is the rollout correction's detached weight on each token's loss (cegppo_utils/correction.py). Every
  objective here therefore judges its clip, mask or weight on d alone, at any staleness (docs/training.md, "One step
  off-policy"); prime-rl instead takes q as pi_old, so that there d carries the staleness too.

CE-GPPO (paper Eq. 8): per-token objective l, maximised; the loss here is -l.

  | region                      | l                               | d l / d log pi      |
  |-----------------------------|---------------------------------|---------------------|
  | d < 1 - eps_low  and A < 0  | beta1 * (1 - eps_low)/sg(d) d A | beta1 (1-eps_low) A |
  | d > 1 + eps_high and A > 0  | beta2 * (1 + eps_high)/sg(d) d A| beta2 (1+eps_high) A|
  | everything else             | d A                             | d A                 |

  In the two clipped regions the value is beta * (1 -+ eps) * A (Eq. 9-10): PPO-clip's value
  (1 -+ eps) * A scaled by beta, so only at beta = 1 do the two values agree. What matters is the
  gradient: PPO-clip drops it there, CE-GPPO keeps it, scaled by beta.
  beta1 = beta2 = 0 is PPO-clip's gradient; beta1 = beta2 = 1 is GPPO.

  A mechanism arm, not a method of the paper (beta1_weight = "ratio"): in the beta1 region the weight
  falls with the ratio instead of staying at the boundary's value,

  | d < 1 - eps_low  and A < 0  | beta1 * d A  (= beta1 sg(d)/sg(d) d A) | beta1 d A           |

  equal to the constant weight at the boundary d = 1 - eps_low and smaller the further below it a
  token sits; at beta1 = 0 both are CE-GPPO (0, beta2). It asks whether the collapse at large beta1
  comes from a constant-weight push on tokens that are already far below the interval.

  The beta1 dose (metric beta1_dose): the beta1 region's gradient weight summed over its tokens, per
  response token of the step, i.e. beta1 (1 - eps_low) x the region's share of tokens under the
  constant weight.

Which beta moves entropy which way (paper §5.1-5.2): the beta1 region holds mostly negative
low-probability tokens; pushing them down further sharpens the distribution, so a larger
beta1 lowers entropy faster. The beta2 region holds mostly positive low-probability tokens;
raising them flattens the distribution, so a larger beta2 keeps entropy higher.
Recommended: (beta1, beta2) = (0.5, 1) for 1.5B models, (0.75, 1) for 7B; (1, 0.5) collapses.
Whether the regions hold low- or high-probability tokens is an assumption the paper makes; the
metrics below report the E1-E4 split that decides it.

Where the official code (Kwai-Klear/CE-GPPO, a verl fork) differs from the paper text:
  - dual clip: for A < 0 the per-token loss is min(-A * c, loss) with c = 10, so tokens with
    A < 0 and d > c get no gradient. Implemented here (clip_ratio_c; 0 turns it off).
  - a positive-example LM loss 0.1 * NLL(correct responses) is added (positive_lm_coef).
  - the token mean is taken per micro-batch and re-weighted by sequence count, which only
    approximates the mini-batch token mean. Here the mean is exact (Totals).
  - the official code does not clamp log(d) before exp; here it is clamped to [-20, 20] as verl's
    PPO loss does, so a runaway ratio cannot overflow (a token-level ratio gets no gradient beyond the
    clamp; the sequence-level losses weight log pi by detached ratios, so there it changes only the value).

Use:
  cfg = loss_config("ce_gppo", beta1=0.5)       # the algorithm's defaults, then your overrides
  loss, metrics = policy_loss(logp, old_logp, advantages, mask, cfg)
  loss.backward()
To add a method: write its per-token loss function (section 3) and one ALGORITHMS entry (section 4); a new
hyperparameter is one LossConfig field with its Rule (section 9; train.py turns it into a flag, checked by the rule).

Sections: 1. the objective, CE-GPPO's per-token loss; 2. policy_loss, the entry point; 3. the family's other
per-token losses; 4. the registry; 5. group advantages; 6. dynamic clipping; 7. the positive-example LM term;
8. options for every algorithm; 9. the settings (LossConfig) and the checks of their values.
"""

from __future__ import annotations  # the objective comes first; the settings it reads (LossConfig), in section 9

import difflib
import math
import struct
from dataclasses import dataclass, field, fields, replace
from typing import Callable, NamedTuple

from cegppo_utils import lazy

# torch itself, loaded when a function below first uses it: train.py's command line reads LossConfig and the registry
# from this file, and answers a mistyped flag or --help before torch's import (cegppo_utils/lazy.py)
torch = lazy.module("torch", globals())

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: large enough never to bind in practice, small enough not to overflow


# ---------------------------------------------------------------------------------------------
# 1. The objective: CE-GPPO's per-token loss
# ---------------------------------------------------------------------------------------------
# Each takes (t: Tokens, cfg: LossConfig) and returns (loss [B, T] to be minimised, the ratio the clip regions
# are judged on [B, T] detached, its own metrics {name: [B, T] bool or float tensor}, reported as token means).
# cfg holds every hyperparameter (beta1, beta2, eps_low, ...): LossConfig, section 9, one field (and flag) each.

class Tokens(NamedTuple):
    """What a per-token loss sees: [B, T] tensors of one micro-batch."""
    logp: torch.Tensor  # log pi_theta(y_t), with grad
    log_ratio: torch.Tensor  # log d = logp - old_logp, clamped to +-LOG_RATIO_CLAMP
    adv: torch.Tensor  # advantage, [B, 1] (broadcasts) or [B, T]
    mask: torch.Tensor  # 1 on response tokens, 0 on padding
    eps_low: float | torch.Tensor  # clip range; [B, T] tensors under dynamic clipping
    eps_high: float | torch.Tensor
    old_logp: torch.Tensor | None = None  # log pi_old(y_t), unclamped (DPPO judges probabilities, not the ratio)
    entropy: torch.Tensor | None = None  # the current policy's per-token entropy, where policy_loss was given it
    old_entropy: torch.Tensor | None = None  # the old policy's (ERC's entropy ratio H / H_old)
    weights: torch.Tensor | None = None  # policy_loss's per-token weights, for a loss that applies them itself (GMPO)


def ce_gppo_token_loss(t: Tokens, cfg: LossConfig):
    """CE-GPPO, paper Eq. 8 (gradient Eq. 9-10), then the official code's dual clip."""
    ratio = torch.exp(t.log_ratio)
    r = ratio.detach()
    in_beta1 = (r < 1 - t.eps_low) & (t.adv < 0)  # left boundary: negative, pushed-down tokens
    in_beta2 = (r > 1 + t.eps_high) & (t.adv > 0)  # right boundary: positive, pushed-up tokens
    # The gradient weight F on A * grad log pi: beta1 (1 - eps_low), beta2 (1 + eps_high), or d itself.
    # F / sg(d) * d has value F and gradient F * grad log pi (Eq. 9-10).
    # beta1_weight "ratio" (the mechanism arm above): beta1 d, which falls with d below the interval
    low_weight = cfg.beta1 * r if cfg.beta1_weight == "ratio" else cfg.beta1 * (1 - t.eps_low)
    weight = torch.where(in_beta1, low_weight, torch.where(in_beta2, cfg.beta2 * (1 + t.eps_high), r))
    loss, extra = _dual_clip(-(weight / r) * ratio * t.adv, t.adv, cfg.clip_ratio_c)
    extra["beta1_dose"] = torch.where(in_beta1, weight, 0.0)  # its token mean: the beta1 region's weight per token
    return loss, r, extra


def _dual_clip(loss, adv, clip_ratio_c):
    """Dual-clip PPO (Ye et al. 2020, as verl): for A < 0, loss = min(loss, -A * c)."""
    if not clip_ratio_c:
        return loss, {}
    cap = -adv * clip_ratio_c
    dual = (adv < 0) & (loss > cap)
    return torch.where(dual, cap, loss), {"dual_clip_frac": dual}


# ---------------------------------------------------------------------------------------------
# 2. The entry point: one call per micro-batch
# ---------------------------------------------------------------------------------------------

class Totals(NamedTuple):
    """Counts over the whole mini-batch, when a call sees one micro-batch of it: the means stay exact."""
    tokens: float | torch.Tensor | None = None  # response tokens
    seqs: float | None = None  # responses
    correct_tokens: float | torch.Tensor | None = None  # tokens of correct responses (positive-example LM term)


class Extras(NamedTuple):
    """The inputs of policy_loss that only some settings read, each None (or 0) where not given: [B, T] tensors of the
    micro-batch, detached unless said."""
    entropy: torch.Tensor | None = None  # the current policy's per-token entropy: the E1-E4 split of the metrics;
    # with grad for entropy_coef (the bonus -entropy_coef * mean(entropy) joins the loss); the tokens that
    # top_entropy_quantile < 1 trains on; ERC's H (needs_current_entropy says when it must be the current policy's)
    old_entropy: torch.Tensor | None = None  # the old policy's per-token entropy: ERC's H_old
    correct: torch.Tensor | None = None  # [B] bool, the response scored +1: positive_lm_coef's NLL(correct responses)
    weights: torch.Tensor | None = None  # per-token weights on the policy term (an importance weight: correction.py)
    ref_logp: torch.Tensor | None = None  # log pi_ref of the same tokens: kl_coef's + kl_coef * mean(KL estimate)
    progress: float = 0.0  # training progress k / T in [0, 1]: dynamic_clip's schedule
    od_state: int = 0  # the oscillatory-decay state (oscillatory_decay_state): dynamic_clip od


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: LossConfig | None = None, totals: Totals | None = None, extras: Extras = Extras()):
    """The loss of cfg.algo (minimised) with its extra terms, and its diagnostics.

    logp       [B, T] log pi_theta of the sampled tokens (with grad), e.g. from logprobs.model_logprobs
    old_logp   [B, T] log pi_old of the same tokens (no grad)
    advantages [B, 1] or [B, T]
    mask       [B, T] 1 on response tokens, 0 on padding
    cfg        the hyperparameters (loss_config(algo, ...) fills in the algorithm's defaults); None: LossConfig()
    totals     the mini-batch's counts when this call sees one micro-batch (exact means); None: this call's own
    extras     what the options and some algorithms read besides (Extras: entropies, correct, weights, ref_logp,
               the dynamic clip's progress)

    Returns (loss, metrics); metrics are detached 0-d tensors, token means over this call's response tokens
    (pg_loss and the extra terms: their values as aggregated).
    """
    cfg, totals = cfg or LossConfig(), totals or Totals()
    tokens, token_loss, ratio, extra = _policy_term(logp, old_logp, advantages, mask, cfg, extras)
    mask, entropy = tokens.mask, extras.entropy
    pg_loss = aggregate(token_loss, mask, cfg.loss_agg_mode, totals, cfg.norm_len)
    loss, terms = _extra_terms(pg_loss, logp, mask, cfg, totals, entropy, extras.correct, extras.ref_logp)
    metrics = {k: v.detach() for k, v in terms.items()}
    with torch.no_grad():
        metrics.update(_metrics(logp, tokens.log_ratio, tokens.adv, mask, ratio, extra, entropy,
                                (tokens.eps_low, tokens.eps_high) if ALGORITHMS[cfg.algo].regions else None))
    return loss, metrics


REGION_PARTS = ("low_neg", "high_pos")  # region_terms' parts: CE-GPPO's beta1 and beta2 regions


def region_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 cfg: LossConfig, totals: Totals | None = None, extras: Extras = Extras()) -> dict:
    """policy_loss's policy term split by where each token sits: {"low_neg": the part from the tokens with d < 1 -
    eps_low and A < 0 (CE-GPPO's beta1 region), "high_pos": from d > 1 + eps_high and A > 0 (the beta2 region)}, each
    aggregated as the whole term is (the same denominators), with grad. The whole loss minus the two is the rest: the
    tokens inside the interval, the two pessimistic regions and the extra terms. {} for an algorithm without clip
    regions. train.py takes each part's gradient norm (--region-grad-norms)."""
    if not ALGORITHMS[cfg.algo].regions:
        return {}
    totals = totals or Totals()
    tokens, token_loss, ratio, _ = _policy_term(logp, old_logp, advantages, mask, cfg, extras)
    below, above = ratio < 1 - tokens.eps_low, ratio > 1 + tokens.eps_high
    valid = tokens.mask > 0
    regions = {"low_neg": below & (tokens.adv < 0) & valid, "high_pos": above & (tokens.adv > 0) & valid}
    return {name: aggregate(token_loss * where, tokens.mask, cfg.loss_agg_mode, totals, cfg.norm_len)
            for name, where in regions.items() if where.any()}


def _policy_term(logp, old_logp, advantages, mask, cfg: LossConfig, extras: Extras):
    """The checked inputs as Tokens, the policy term's per-token loss [B, T] (the algorithm's, then the top-entropy
    mask and the per-token weights), the ratio its regions are judged on, and the loss's own per-token metrics."""
    entropy, old_entropy, correct, weights, ref_logp, progress, od_state = extras
    problems = _checked(cfg)
    if problems:
        raise ValueError(problems[0][1])
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp and mask must all be [batch, T]; got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.shape not in ((logp.shape[0], 1), logp.shape):
        raise ValueError(f"advantages must be [batch, 1] or [batch, T] = {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    eps_low, eps_high = clip_range(cfg, logp, progress, od_state)
    mask = mask.to(logp.dtype)
    # 0 on padding: its ratio is exactly 1 there (inside every interval, never dual-clipped), so the metrics need no
    # masking; the loss is masked in aggregate() anyway.
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask
    if ALGORITHMS[cfg.algo].needs_entropy and (entropy is None or old_entropy is None):
        raise ValueError(f"{cfg.algo} needs the current and the old policy's per-token entropy "
                         "(Extras(entropy=..., old_entropy=...))")
    tokens = Tokens(logp, log_ratio, advantages.to(logp.dtype), mask, eps_low, eps_high, old_logp, entropy,
                    old_entropy, weights)
    token_loss, ratio, extra = ALGORITHMS[cfg.algo].token_loss(tokens, cfg)
    if cfg.top_entropy_quantile < 1.0:  # "Beyond the 80/20 rule": the policy term on high-entropy tokens only
        if entropy is None:
            raise ValueError("top_entropy_quantile needs the per-token entropy (Extras(entropy=...))")
        forking = high_entropy_tokens(entropy.detach(), mask, cfg.top_entropy_quantile)
        token_loss, extra = token_loss * forking, {**extra, "entropy_kept_frac": forking}
    if weights is not None and not ALGORITHMS[cfg.algo].applies_weights:  # a detached weight per token on the policy
        token_loss = token_loss * weights  # term (sampler/trainer mismatch)
    return tokens, token_loss, ratio, extra


def clip_range(cfg: LossConfig, logp: torch.Tensor, progress: float = 0.0, od_state: int = 0):
    """(eps_low, eps_high): cfg's, or with dynamic clipping [B, T] tensors from the tokens' probabilities."""
    if cfg.dynamic_clip == "none":
        return cfg.eps_low, cfg.eps_high
    return dynamic_clip_eps(logp.detach().exp(), DynamicClip(schedule=cfg.dynamic_clip), progress, od_state)


def _extra_terms(pg_loss, logp, mask, cfg, totals, entropy, correct, ref_logp):
    """The policy term plus the terms that are not about the ratio: (loss, {term name: its value})."""
    loss, terms = pg_loss, {"pg_loss": pg_loss}
    if cfg.entropy_coef:  # entropy regularisation (the paper's §4 baseline): maximise the mean entropy
        if entropy is None or not entropy.requires_grad:
            raise ValueError("entropy_coef needs the per-token entropy with its gradient (Extras(entropy=...))")
        # verl aggregates the bonus like the policy term; Skywork-OR1's adaptive control (and TRL's) takes a plain
        # token mean whatever the loss type, the same mean its controller measures
        mode = "token-mean" if cfg.adaptive_entropy else cfg.loss_agg_mode
        bonus = aggregate(entropy, mask, mode, totals, cfg.norm_len)
        loss, terms["entropy_bonus"] = loss - cfg.entropy_coef * bonus, bonus
    if cfg.positive_lm_coef:
        if correct is None:
            raise ValueError("positive_lm_coef needs which responses are correct (Extras(correct=...))")
        lm = positive_example_lm_loss(logp, mask, correct, num_tokens=totals.correct_tokens)
        loss, terms["positive_lm_loss"] = loss + cfg.positive_lm_coef * lm, lm
    if cfg.kl_coef:  # GRPO Eq. 3: - beta D_KL(pi_theta || pi_ref), aggregated like the policy term (verl's kl_loss)
        if ref_logp is None or ref_logp.shape != logp.shape:
            raise ValueError("kl_coef needs the reference model's log-probs of the same tokens (Extras(ref_logp=...))")
        per_token = kl_estimate(logp, ref_logp, cfg.kl_estimator, mask)
        kl = aggregate(per_token, mask, cfg.loss_agg_mode, totals, cfg.norm_len)
        loss, terms["kl_loss"] = loss + cfg.kl_coef * kl, kl
    return loss, terms


def aggregate(token_loss, mask, mode="token-mean", totals: Totals = Totals(), norm_len=0):
    """Reduce a [B, T] per-token loss to a scalar.

    token-mean               sum_it loss / tokens                  (DAPO, CE-GPPO; tokens = all response tokens
                                                                   of the mini-batch)
    seq-mean-token-mean      sum_i (sum_t loss / |y_i|) / seqs     (GRPO, GSPO)
    seq-mean-token-sum-norm  sum_it loss / (seqs * norm_len)       (Dr. GRPO; norm_len a constant, e.g. the
                                                                   max response length; 0 = this batch's width)
    Pass the mini-batch's Totals when the mini-batch is split into micro-batches: the micro-batch losses then
    sum to the mini-batch loss exactly, and so do their gradients.
    """
    mask = mask.to(token_loss.dtype)
    summed = token_loss * mask
    if mode == "token-mean":
        denom = mask.sum() if totals.tokens is None else totals.tokens
        return summed.sum() / torch.as_tensor(denom, dtype=token_loss.dtype).clamp(min=1)
    seqs = mask.shape[0] if totals.seqs is None else totals.seqs
    if mode == "seq-mean-token-mean":
        per_seq = summed.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(seqs, 1)
    if mode == "seq-mean-token-sum-norm":
        return summed.sum() / (max(seqs, 1) * (norm_len or mask.shape[-1]))
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def _metrics(logp, log_ratio, adv, mask, ratio, extra, entropy, clip_range):
    """The diagnostics (called under no_grad): the token ratio's mean and KL estimate, the loss's own metrics, the
    E1-E4 split where the entropy was given, and with clip_range = (eps_low, eps_high) the four clip regions, for an
    algorithm that judges tokens against that interval (Algorithm.regions)."""
    # log_ratio is 0 on padding, so the ratio is 1 there: no mask is needed below but in the E1-E4 split. Each [B, T]
    # temporary costs an allocation and a pass; this is what keeps the diagnostics cheap next to the loss itself.
    tokens = mask.sum()
    n = tokens.clamp(min=1)
    m = {"approx_kl": (ratio - log_ratio - 1).sum() / n,  # k3 estimate of KL(pi_old || pi_theta); 0 on padding
         "ratio_mean": (ratio.sum() - (ratio.numel() - tokens)) / n,  # padding adds 1 per position to the sum
         "num_tokens": n}
    if clip_range is not None:
        eps_low, eps_high = clip_range
        rows_below = torch.count_nonzero(ratio < 1 - eps_low, dim=-1)
        rows_above = torch.count_nonzero(ratio > 1 + eps_high, dim=-1)
        if adv.shape[-1] == 1:  # one advantage per response: the counts per row, by the row's sign
            neg, pos = adv[:, 0] < 0, adv[:, 0] > 0
            low_neg, high_pos = rows_below[neg].sum(), rows_above[pos].sum()
            low_pos, high_neg = rows_below[pos].sum(), rows_above[neg].sum()
        else:
            below, above = ratio < 1 - eps_low, ratio > 1 + eps_high
            low_neg, high_pos = torch.count_nonzero(below & (adv < 0)), torch.count_nonzero(above & (adv > 0))
            low_pos, high_neg = torch.count_nonzero(below & (adv > 0)), torch.count_nonzero(above & (adv < 0))
        m.update(clip_frac_low_neg=low_neg / n, clip_frac_high_pos=high_pos / n,  # CE-GPPO's beta1 and beta2 regions
                 clip_frac_low_pos=low_pos / n, clip_frac_high_neg=high_neg / n)
    for name, value in extra.items():  # the loss's own metrics, as token means
        m[name] = (torch.count_nonzero(value) if value.dtype == torch.bool else (value * mask).sum()) / n
    if entropy is not None:  # the four entropy-sensitive regions of arXiv 2602.09782
        valid = mask > 0
        surprising = (-logp.detach() > entropy.detach()) & valid  # -log pi > H: a low-probability token
        likely = ~surprising & valid
        neg, pos = adv < 0, adv > 0
        m["entropy_region_e1"] = torch.count_nonzero(likely & pos) / n  # lowers entropy
        m["entropy_region_e2"] = torch.count_nonzero(surprising & pos) / n  # raises entropy
        m["entropy_region_e3"] = torch.count_nonzero(likely & neg) / n  # raises entropy
        m["entropy_region_e4"] = torch.count_nonzero(surprising & neg) / n  # lowers entropy
    return m


# What the clip regions hold, token by token (train.py logs it every step, for every algorithm with clip regions):
# whether the beta1 region (d < 1 - eps_low, A < 0) and the beta2 region (d > 1 + eps_high, A > 0) hold end-of-sequence
# tokens, low-probability tokens, tokens late in their response, and how far outside the interval, against the tokens
# inside the interval.
EVIDENCE_REGIONS = ("low_neg", "high_pos", "inside")
LATE = 0.9  # a token is late when its position (from 1) exceeds this fraction of its response's length: the last 10%


def region_evidence(logp, old_logp, advantages, mask, eps_low, eps_high, finished) -> dict:
    """{region: (sums, ratios)} of one call, for each of EVIDENCE_REGIONS: sums = float64 [tokens, end-of-sequence
    tokens, late tokens, sum of log pi_old] (they add over calls and ranks), ratios = the region's d (their percentiles
    do not add). finished [B] bool: the response ended at its EOS token, which is then its last token (rollout.py)."""
    with torch.no_grad():
        log_ratio = (logp.detach() - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio, valid = torch.exp(log_ratio), mask > 0
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        length = mask.sum(-1, keepdim=True)
        position = torch.arange(1, mask.shape[-1] + 1, device=mask.device).unsqueeze(0)  # from 1
        eos = finished.unsqueeze(-1) & (position == length) & valid
        late = (position > LATE * length) & valid
        below, above = ratio < 1 - eps_low, ratio > 1 + eps_high
        regions = {"low_neg": below & (adv < 0) & valid, "high_pos": above & (adv > 0) & valid,
                   "inside": ~below & ~above & valid}
        # every sum in float64 itself: stacking int64 counts with an fp32 sum would promote them all to fp32
        return {name: (torch.stack([where.sum(dtype=torch.float64), (where & eos).sum(dtype=torch.float64),
                                    (where & late).sum(dtype=torch.float64), old_logp[where].double().sum()]),
                       ratio[where].float())
                for name, where in regions.items()}


def evidence_row(sums: dict, ratios: dict) -> dict:
    """A step's per-token evidence from its summed counts and its ratios ({region: ...}, as region_evidence's, summed
    and joined over the step's calls): per region, the share of its tokens that end their sequence (`_eos_share`) and
    that sit in the last 10% of their response (`_late_share`), their mean log pi_old (`_old_logp_mean`), and the 10th
    and 50th percentiles of their d (`_ratio_p10`, `_ratio_p50`). A region with no token that step logs nothing."""
    row = {}
    for name in EVIDENCE_REGIONS:
        tokens, eos, late, old_logp = (float(v) for v in sums[name])
        if not tokens:
            continue
        row.update({f"{name}_eos_share": eos / tokens, f"{name}_late_share": late / tokens,
                    f"{name}_old_logp_mean": old_logp / tokens,
                    f"{name}_ratio_p10": quantile(ratios[name], 0.1).item(),
                    f"{name}_ratio_p50": quantile(ratios[name], 0.5).item()})
    return row


# ---------------------------------------------------------------------------------------------
# 3. The family: the other per-token losses
# ---------------------------------------------------------------------------------------------

def gppo_token_loss(t: Tokens, cfg: LossConfig):
    """GPPO (Klear-Reasoner Eq. 7): CE-GPPO with beta1 = beta2 = 1, whatever beta1/beta2 are set to."""
    return ce_gppo_token_loss(t, replace(cfg, beta1=1.0, beta2=1.0, beta1_weight="constant"))


def ppo_clip_token_loss(t: Tokens, cfg: LossConfig):
    """PPO-clip (GRPO, DAPO): loss = max(-d A, -clip(d, 1 - eps_low, 1 + eps_high) A), then dual clip.

    Gradient: -d A * grad log pi, except zero where d < 1 - eps_low, A < 0 or d > 1 + eps_high, A > 0.
    """
    ratio = torch.exp(t.log_ratio)
    clipped = torch.clamp(ratio, 1 - t.eps_low, 1 + t.eps_high)
    loss, extra = _dual_clip(torch.maximum(-t.adv * ratio, -t.adv * clipped), t.adv, cfg.clip_ratio_c)
    return loss, ratio.detach(), extra


def cispo_token_loss(t: Tokens, cfg: LossConfig):
    """CISPO (MiniMax-M1 Eq. 4): loss = -sg(clip(d, 1 - eps_low, 1 + eps_high)) * A * log pi.

    Every token keeps a gradient, weighted by the clipped, detached IS ratio. MiniMax-M1 sets no lower bound
    (eps_low = 1 here) and tunes only the upper one. Here the cap is 1 + eps_high (relative, like the other
    losses); TRL's CISPO takes its epsilon_high as the absolute cap (recommending 5.0 there).
    """
    ratio = torch.exp(t.log_ratio.detach())
    weight = torch.clamp(ratio, 1 - t.eps_low, 1 + t.eps_high)
    valid = t.mask > 0
    extra = {"cispo_capped_frac": (ratio > 1 + t.eps_high) & valid}
    if t.eps_low < 1:  # a lower bound in effect (MiniMax-M1 sets none)
        extra["cispo_raised_frac"] = (ratio < 1 - t.eps_low) & valid
    return -weight * t.adv * t.logp, ratio, extra


def gspo_token_loss(t: Tokens, cfg: LossConfig):
    """GSPO-token (GSPO Eq. 13-14): s_i = exp(mean_t log d_it) per response, and per token
    s_it = sg(s_i) * pi(y_t) / sg(pi(y_t)); loss = max(-s_it A, -clip(s_it, 1 - eps_low, 1 + eps_high) A).

    With one advantage per response and seq-mean-token-mean this is GSPO's sequence objective exactly:
    the gradient on log pi(y_t) is s_i A / |y_i|, and zero when s_i is clipped.
    """
    n = t.mask.sum(-1).clamp(min=1)
    seq_log_ratio = (t.log_ratio.detach() * t.mask).sum(-1) / n
    s = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).unsqueeze(-1)
    s_tok = s * torch.exp(t.logp - t.logp.detach())
    clipped = s_tok.clamp(1 - t.eps_low, 1 + t.eps_high)
    loss = torch.maximum(-t.adv * s_tok, -t.adv * clipped)
    valid = t.mask > 0  # the clip acts on whole sequences: its shares, counted over their tokens
    extra = {"gspo_clip_frac_low": (s < 1 - t.eps_low) & (t.adv < 0) & valid,
             "gspo_clip_frac_high": (s > 1 + t.eps_high) & (t.adv > 0) & valid}
    return loss, torch.exp(t.log_ratio.detach()), extra  # the token ratio: its mean and KL estimate


def sapo_token_loss(t: Tokens, cfg: LossConfig):
    """SAPO (arXiv 2511.20347): the hard clip becomes a soft gate on the ratio,
      f(d) = sigmoid(tau (d - 1)) * 4 / tau,  loss = -f(d) A,  tau = tau_pos if A > 0 else tau_neg.

    Gradient: -4 sigmoid(tau (d - 1)) (1 - sigmoid(tau (d - 1))) d A * grad log pi, i.e. d A at d = 1, decaying smoothly
    as d leaves 1 instead of dropping to 0 at the clip boundary. tau_neg > tau_pos makes the gate on negative
    tokens decay faster (the paper: negative updates spread over the vocabulary and destabilise training).
    """
    ratio = torch.exp(t.log_ratio)
    # tau in the loss's dtype: 1.05 is not a float32
    tau = torch.where(t.adv > 0, ratio.new_tensor(cfg.tau_pos), ratio.new_tensor(cfg.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    return -gate * t.adv, ratio.detach(), {}


def _token_covariance(t: Tokens):
    """Cov(y_t) = (log pi(y_t) - mean log pi) (A_t - mean A), the means over this call's response tokens (Clip-Cov and
    KL-Cov, arXiv 2505.22617 §4-5), detached: it only selects tokens."""
    logp, mask = t.logp.detach(), t.mask
    adv = t.adv.expand_as(logp)
    n = mask.sum().clamp(min=1)
    return (adv - (adv * mask).sum() / n) * (logp - (logp * mask).sum() / n)


def clip_cov_token_loss(t: Tokens, cfg: LossConfig):
    """Clip-Cov (arXiv 2505.22617 §5): PPO-clip, and no gradient for clip_cov_ratio * N tokens drawn at random from
      I = {t : clip_cov_lb < Cov(y_t) < clip_cov_ub, y_t not already clipped by PPO},  N = this call's response tokens
    (at least one token when I is not empty). As verl's clip_cov: no dual clip; the draw uses torch's global
    generator (torch.randperm over I in row-major order), so a seeded run draws the same tokens.
    """
    ratio = torch.exp(t.log_ratio)
    unclipped, clipped = -t.adv * ratio, -t.adv * torch.clamp(ratio, 1 - t.eps_low, 1 + t.eps_high)
    valid = t.mask > 0
    cov = _token_covariance(t)
    candidates = torch.nonzero(valid & ~(clipped > unclipped) & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub))
    count = max(int(cfg.clip_cov_ratio * valid.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates))[:count]] if len(candidates) else candidates
    stopped = torch.zeros_like(valid)
    stopped[chosen[:, 0], chosen[:, 1]] = True
    loss = torch.maximum(unclipped, clipped).masked_fill(stopped, 0.0)  # value and gradient 0, as verl's corr = 0
    return loss, ratio.detach(), {"cov_stopped_frac": stopped}


def kl_cov_token_loss(t: Tokens, cfg: LossConfig):
    """KL-Cov (arXiv 2505.22617 §5): no clip; the max(1, int(kl_cov_ratio * N)) tokens with the largest Cov(y_t)
    get a KL penalty on the ratio,
      loss = -d A + kl_cov_coef * |log d|   on those tokens,   -d A   elsewhere.
    The top-k is taken over this call's response tokens in row-major order, as verl's kl_cov does.
    """
    ratio = torch.exp(t.log_ratio)
    loss = -t.adv * ratio
    valid = t.mask > 0
    penalised = torch.zeros_like(valid)
    n = int(valid.sum().item())
    if n:
        top = torch.topk(_token_covariance(t)[valid], max(1, int(n * cfg.kl_cov_ratio))).indices
        penalised.view(-1)[torch.nonzero(valid.view(-1))[top, 0]] = True
    loss = torch.where(penalised, loss + cfg.kl_cov_coef * t.log_ratio.abs(), loss)
    return loss, ratio.detach(), {"cov_kl_frac": penalised}


# The 2026 comparison set: ERC, DPPO, GMPO, M2PO (IcePop, a mask on the sampler/trainer ratio, is in correction.py).

def _entropy_ratio_clip(t: Tokens, cfg: LossConfig, loss, ratio, extra):
    """ERC (arXiv 2512.05591): the per-token entropy ratio rho_H = H_theta(y_t) / H_old(y_t) between the current
    and the old policy's distributions at the token's position; outside the band (erc_low, erc_high) the token's loss
    keeps its value but loses its gradient. A constraint on the whole distribution's change, beside the clip on the
    sampled token's ratio. As the authors' code (Kwai-Klear/ERC, core_algos.py): rho_H = (H + 1e-8) / (H_old + 1e-8),
    the band open at both ends, applied after the clip and dual clip; both entropies at the sampling temperature. The
    paper's equations were not available here (its abstract and the authors' README, which shows this code, were):
    the code is what this follows."""
    entropy_ratio = (t.entropy.detach() + 1e-8) / (t.old_entropy.detach() + 1e-8)
    below, above = entropy_ratio <= cfg.erc_low, entropy_ratio >= cfg.erc_high
    valid = t.mask > 0
    loss = torch.where(below | above, loss.detach(), loss)
    return loss, ratio, {**extra, "erc_below_frac": below & valid, "erc_above_frac": above & valid}


def gppo_erc_token_loss(t: Tokens, cfg: LossConfig):
    """ERC on GPPO (the authors' `gppo_erc`): gppo's loss, then no gradient where H / H_old leaves the band."""
    return _entropy_ratio_clip(t, cfg, *gppo_token_loss(t, cfg))


def grpo_erc_token_loss(t: Tokens, cfg: LossConfig):
    """ERC on PPO-clip (the authors' `grpo_erc`, run with DAPO's settings): PPO-clip with dual clip, then no gradient
    where H / H_old leaves the band."""
    return _entropy_ratio_clip(t, cfg, *ppo_clip_token_loss(t, cfg))


def _dppo_loss(t: Tokens, cfg: LossConfig, within_up, within_down):
    """DPPO's policy term (arXiv 2602.04879): a token whose probability moved past the trust region in the direction
    its advantage pushes (up for A > 0, down for A <= 0) is masked, value and gradient; the others get
      loss = -A * sg(min(d, clip_ratio_c)) * log pi,
    whose gradient is d A grad log pi, the unclipped ratio's (clip_ratio_c > 0 truncates the weight; 0: none).

    The paper's own code (sail-sg/Stable-RL, "dppo_binary_tv") and prime-rl's default loss take the divergence and the
    ratio against the sampler's log-probs; verl's dppo_tv / dppo_kl (verl-project/verl, core_algos.py) take them
    against the recomputed old log-probs, which this follows (Stable-RL's "..._recompute" variant takes only its mask
    against them, its ratio still against the sampler's): pi_old here is the trainer's own, and the sampler/trainer gap
    is the rollout correction's (--rollout-correction)."""
    ratio = torch.exp(t.log_ratio.detach())
    weight = ratio.clamp(max=cfg.clip_ratio_c) if cfg.clip_ratio_c else ratio
    masked = ~torch.where(t.adv > 0, within_up, within_down)  # as verl: a NaN divergence (p > 1) is not within
    loss = -t.adv * weight * t.logp * ~masked
    valid = t.mask > 0
    extra = {"dppo_masked_frac_pos": masked & (t.adv > 0) & valid, "dppo_masked_frac_neg": masked & (t.adv < 0) & valid}
    if cfg.clip_ratio_c:
        extra["dppo_truncated_frac"] = (ratio > cfg.clip_ratio_c) & ~masked & valid
    return loss, ratio, extra


def dppo_tv_token_loss(t: Tokens, cfg: LossConfig):
    """DPPO-Binary-TV: the total variation between the old and the current policy's binary distributions {y_t, not
    y_t} is |p - p_old|; masked where p - p_old > dppo_mask_high (A > 0) or p - p_old < -dppo_mask_low (A <= 0)."""
    prob, old_prob = t.logp.detach().exp(), t.old_logp.exp()
    return _dppo_loss(t, cfg, prob - old_prob <= cfg.dppo_mask_high, prob - old_prob >= -cfg.dppo_mask_low)


def dppo_kl_token_loss(t: Tokens, cfg: LossConfig):
    """DPPO-Binary-KL: KL(Bernoulli(p_old) || Bernoulli(p)) = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) /
    (1 - p)), with verl's 1e-8 in the second term (p = 1); masked where it exceeds dppo_mask_high while p rose (A > 0)
    or dppo_mask_low while p fell (A <= 0)."""
    logp = t.logp.detach()
    prob, old_prob = logp.exp(), t.old_logp.exp()
    binary_kl = old_prob * (t.old_logp - logp) + (1 - old_prob) * torch.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
    return _dppo_loss(t, cfg, (binary_kl <= cfg.dppo_mask_high) | (prob <= old_prob),
                      (binary_kl <= cfg.dppo_mask_low) | (prob >= old_prob))


def gmpo_token_loss(t: Tokens, cfg: LossConfig):
    """GMPO (arXiv 2507.20673): one ratio per response, the geometric mean of its token ratios, each clipped in log
    space on the side its advantage would exploit:
      log d~_t = min(log d_t, eps_high) if A > 0,  max(log d_t, -eps_low) if A < 0,  0 if A = 0
      loss_i = -A_i * exp(mean_t log d~_t),  A_i the mean advantage over the response.
    The gradient on log pi(y_t) is -A_i exp(mean_t log d~_t) / |y_i| where the token is not clipped, 0 where it is.
    loss_i is put on each token of the response, so seq-mean-token-mean averages it over responses (as verl's
    geo_mean, whose mean is per micro-batch; exact over the mini-batch here); unlike verl's geo_mean, which ignores
    loss_agg_mode, another --loss-agg-mode applies here. verl divides by |y_i| + 1e-8 (here |y_i|): a relative gap of
    about (|mean_t log d| + 1) 1e-8 / |y_i| in the value (2.8e-5 absolute at log d = 6 on a loss of 403)
    and leaves log d unclamped (here clamped to +-20, as every loss here). The authors' example in verl (their
    official implementation, examples/gmpo_trainer) clips at (e^-0.4, e^0.4); they advise less for MoE models.
    A rollout correction's per-token weights w_t enter as verl's: their geometric mean over the response,
    exp(mean_t log(w_t + 1e-10)), scales loss_i (each token IcePop zeroes multiplies it by 1e-10^(1 / |y_i|)).
    """
    log_ratio = t.log_ratio
    clipped = torch.where(t.adv > 0, log_ratio.clamp(max=t.eps_high),
                          torch.where(t.adv < 0, log_ratio.clamp(min=-t.eps_low), torch.zeros_like(log_ratio)))
    n = t.mask.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp((clipped * t.mask).sum(-1, keepdim=True) / n)
    seq_adv = (t.adv.expand_as(log_ratio) * t.mask).sum(-1, keepdim=True) / n
    loss = -seq_adv * seq_ratio
    if t.weights is not None:
        loss = loss * torch.exp((torch.log(t.weights + 1e-10) * t.mask).sum(-1, keepdim=True) / n)
    loss = loss.expand_as(log_ratio)
    valid = t.mask > 0
    extra = {"gmpo_clip_frac_high": (t.adv > 0) & (log_ratio.detach() > t.eps_high) & valid,
             "gmpo_clip_frac_low": (t.adv < 0) & (log_ratio.detach() < -t.eps_low) & valid}
    return loss, torch.exp(log_ratio.detach()), extra


def second_moment_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's mask: with the response tokens' M2_t = (log d_t)^2 sorted from the largest, drop the fewest largest ones
    whose removal leaves the mean of the rest below `threshold` (all but the smallest if no count does). True on the
    tokens kept, False on the dropped ones and on padding. Ties are broken by position (a stable sort)."""
    valid = mask > 0
    kept = valid.clone()
    m2 = log_ratio.detach()[valid].square()
    if m2.numel() == 0:
        return kept
    largest_first = torch.sort(m2, descending=True, stable=True)
    # mean of each suffix of the sorted values, summed from the smallest: what is left after dropping the first k
    counts = torch.arange(m2.numel(), 0, -1, dtype=m2.dtype, device=m2.device)
    rest_mean = largest_first.values.flip(0).cumsum(0).flip(0) / counts
    below = torch.nonzero(rest_mean < threshold)
    drop = int(below[0]) if len(below) else m2.numel() - 1
    kept_flat = torch.ones_like(m2, dtype=torch.bool)
    kept_flat[largest_first.indices[:drop]] = False
    kept[valid] = kept_flat
    return kept


def m2po_token_loss(t: Tokens, cfg: LossConfig):
    """M2PO (arXiv 2510.01161): no clip; the policy term -d A on every response token but those second_moment_mask
    drops, so that the second moment of log d over the tokens kept is below m2_threshold:
      loss = -M_t d A,  M_t in {0, 1}, token-mean over every response token (the paper's 1 / sum_i |o_i|).
    The mask is taken over the tokens of one policy_loss call, as AReaL (its loss function sees one micro-batch).
    Where AReaL differs: it takes M2 between the sampler's and the recomputed old log-probs (its decoupled loss, whose
    staleness is up to hundreds of updates); here pi_old is the trainer's recomputation at the step's starting weights
    (the sampling weights, or one update after them under --off-policy-steps 1, whose gap is the rollout correction's)
    and the staleness M2 sees is within the step (mini-batches, --ppo-epochs), so M2 is taken on d = pi_theta /
    pi_old, as the paper's r = pi_theta / pi_behav. And AReaL divides each call's sum by the tokens kept; the paper's
    mean, followed here, divides by all of them (AReaL's is larger by N / N_kept)."""
    ratio = torch.exp(t.log_ratio)
    kept = second_moment_mask(t.log_ratio, t.mask, cfg.m2_threshold)
    valid = t.mask > 0
    extra = {"m2po_masked_frac": valid & ~kept, "m2po_second_moment": t.log_ratio.detach().square() * t.mask}
    return -t.adv * ratio * kept, ratio.detach(), extra


# What the frameworks ship besides (2026): TRL's LUSPO and VESPO, verl's GPG and DRO, prime-rl's default loss, BandPO.
# MaxRL, an advantage rule, is in section 5.

def luspo_token_loss(t: Tokens, cfg: LossConfig):
    """LUSPO (arXiv 2602.05261): GSPO with each response's loss scaled by its length,
      J = 1/G sum_i |y_i| min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),  s_i = exp(mean_t log d_it),
    so that a long response weighs what its tokens weigh: the gradient on log pi(y_t) is s_i A_i / G where s_i is not
    clipped (GSPO's is s_i A_i / (G |y_i|)). As TRL's loss_type "luspo" (importance_sampling_level "sequence"): the
    GSPO-token loss below times |y_i|, put on each token and averaged per response (seq-mean-token-mean) is TRL's mean
    over responses of |y_i| l_i."""
    loss, ratio, extra = gspo_token_loss(t, cfg)
    length = t.mask.sum(-1, keepdim=True)
    return loss * length, ratio, {"luspo_clip_frac_low": extra["gspo_clip_frac_low"],
                                  "luspo_clip_frac_high": extra["gspo_clip_frac_high"]}


VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's lower clamp of log W (the VESPO authors' code, TRL says)


def vespo_token_loss(t: Tokens, cfg: LossConfig):
    """VESPO (arXiv 2602.10693): a smooth, asymmetric weight on the whole response's ratio in place of a clip,
      W = pi_theta(y) / pi_old(y) = exp(sum_t log d_t),  phi(W) = W^k exp(lambda (1 - W)),  loss = -sg(phi(W)) A log pi,
    (k, lambda) = (vespo_k_pos, vespo_lambda_pos) for A >= 0, (vespo_k_neg, vespo_lambda_neg) for A < 0. phi(1) = 1 and
    phi peaks at W = k / lambda: W^k damps responses the policy has moved away from, exp(-lambda W) those it has moved
    toward. As TRL's get_gamma_weights: log W is the sum of the clamped token log-ratios (a product of ratios, not
    GSPO's geometric mean), clamped to [log 1e-8, 20]; phi is computed in log space, lambda + k log W - lambda W, and
    an overflow counts as 0. A rollout correction's weights w_t enter W as TRL folds in vLLM's importance ratio:
    log W += sum_t clamp(log w_t, log 1e-8, 20), and they do not multiply the token loss (applies_weights)."""
    log_w = (t.log_ratio.detach() * t.mask).sum(-1, keepdim=True)
    if t.weights is not None:
        log_w = log_w + (torch.log(t.weights).clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP) * t.mask).sum(-1, keepdim=True)
    log_w = log_w.clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    positive = t.adv >= 0
    k = torch.where(positive, log_w.new_tensor(cfg.vespo_k_pos), log_w.new_tensor(cfg.vespo_k_neg))
    lam = torch.where(positive, log_w.new_tensor(cfg.vespo_lambda_pos), log_w.new_tensor(cfg.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    phi = phi.expand_as(t.logp)  # [B, 1] with one advantage per response; [B, T] with one per token
    return -phi * t.adv * t.logp, torch.exp(t.log_ratio.detach()), {"vespo_phi": phi * t.mask}


def gpg_token_loss(t: Tokens, cfg: LossConfig):
    """GPG (arXiv 2504.02546): the plain policy gradient, loss = -A log pi, no ratio, clip or KL term (verl's gpg: one
    optimizer step per batch makes d = 1). GPG's own advantage (verl's gpg estimator) is alpha (r - mean(r_group)) with
    alpha = responses / responses with a non-zero reward: 1 under this project's +-1 rewards, so --no-scale-adv-by-std
    gives it."""
    return -t.adv * t.logp, torch.exp(t.log_ratio.detach()), {}


def _log_ratio_unclamped(t: Tokens):
    """log d without the +-20 clamp (0 on padding): a quadratic penalty on it cannot overflow, and beyond the clamp it
    is what pulls a runaway token back."""
    return (t.logp - t.old_logp) * t.mask


def dro_token_loss(t: Tokens, cfg: LossConfig):
    """DRO, Direct Reward Optimization (verl's dro; docs/algo/dro.md): the policy gradient with a quadratic penalty on
    the log-ratio to the sampling policy,
      loss = -(A log pi - dro_beta / 2 (log d)^2),   gradient -(A - dro_beta log d) grad log pi,
    which pulls every token back toward pi_old in proportion to how far it moved, whatever its A."""
    log_ratio = _log_ratio_unclamped(t)
    penalty = 0.5 * cfg.dro_beta * log_ratio.square()
    return -(t.adv * t.logp - penalty), torch.exp(t.log_ratio.detach()), {"dro_penalty": penalty.detach()}


def dppo_tv_kimi_token_loss(t: Tokens, cfg: LossConfig):
    """prime-rl's default loss (src/prime_rl/trainer/rl/loss.py, default_loss_fn): DPPO-Binary-TV's mask (arXiv
    2602.04879; bounds dppo_mask_low, dppo_mask_high) on the policy term -A d, plus Kimi-K2.5's squared log-ratio
    (arXiv 2602.02276) on every response token, masked or not:
      loss = -M A d + kimi_kl_tau (log d)^2,   M = 0 where p - p_old > dppo_mask_high (A > 0) or < -dppo_mask_low
    (A <= 0). Not dppo_tv plus --kl-coef: its penalty is on the ratio to the sampling policy, not a KL to a frozen
    reference, and its value is -A d where dppo_tv's is -A sg(d) log pi (the same gradient, d A grad log pi). prime-rl
    takes d and the mask against the sampler's log-probs; here against pi_old, as dppo_tv (see _dppo_loss)."""
    prob, old_prob = t.logp.detach().exp(), t.old_logp.exp()
    masked = ~torch.where(t.adv > 0, prob - old_prob <= cfg.dppo_mask_high, prob - old_prob >= -cfg.dppo_mask_low)
    ratio = torch.exp(t.log_ratio)
    penalty = cfg.kimi_kl_tau * _log_ratio_unclamped(t).square()
    valid = t.mask > 0
    extra = {"dppo_masked_frac_pos": masked & (t.adv > 0) & valid, "dppo_masked_frac_neg": masked & (t.adv < 0) & valid,
             "kimi_kl_penalty": penalty.detach()}
    return -t.adv * ratio * ~masked + penalty, ratio.detach(), extra


BAND_DIVERGENCES = ("kl", "tv", "chi2")
BAND_EDGE = 1e-6  # the reference's limits: p_old within this of 0 or 1 takes the bounds' limiting values


def band_bounds(old_logp: torch.Tensor, divergence: str, delta: float, upper_max: float):
    """BandPO's Band operator (arXiv 2603.04918; OpenMOSS/BandPO band.py): the clip bounds [lower, upper] on d for a
    token of old probability p, the ratios r = p' / p at which the f-divergence between the binary distributions
    {y_t, not y_t} under p and p' = r p reaches delta,
      D_f(p, r) = p f(r) + (1 - p) f((1 - r p) / (1 - p)) = delta,   lower in [0, 1], upper in [1, 1 / p],
    tv: f(u) = |u - 1| / 2, so r = 1 -+ delta / p;  chi2: f(u) = (u - 1)^2, r = 1 -+ sqrt(delta (1 - p) / p);
    kl: f(u) = u - 1 - log u, D_f = KL(Bernoulli(p) || Bernoulli(r p)) (DPPO-Binary-KL's divergence), no closed form:
    solved by bisection to float64 rounding (the reference's bisection stops within 1e-6). A bound that no r reaches
    within [0, 1 / p] is the simplex's end. As the reference: p within 1e-6 of 1 takes the limits (lower, upper) =
    (r*, 1), r* = e^-delta (kl), 1 - delta (tv), 1 (chi2); p below 1e-6 takes (0, 1 / p); then upper <= upper_max
    (its scripts: 10). Low-probability tokens get room to rise (kl, delta 0.05: upper 7.8 at p = 0.01, against PPO's
    1.2), likely ones less than PPO's (1.08 at p = 0.9). Detached, in float64; [B, T] each, in old_logp's dtype."""
    with torch.no_grad():
        p = old_logp.detach().double().clamp(-700.0, 0.0).exp()  # as the reference: p > 0 in float64
        if divergence == "tv":
            lower, upper = 1 - delta / p, 1 + delta / p
        elif divergence == "chi2":
            spread = torch.sqrt(delta * (1 - p) / p)
            lower, upper = 1 - spread, 1 + spread
        elif divergence == "kl":
            lower, upper = _band_kl_lower(p, delta), _band_kl_upper(p, delta, upper_max)
        else:
            raise ValueError(f"band_divergence must be one of {BAND_DIVERGENCES}, got {divergence!r}")
        limit = {"kl": math.exp(-delta), "tv": max(1 - delta, 0.0), "chi2": 1.0}[divergence]
        near_one, near_zero = p > 1 - BAND_EDGE, p < BAND_EDGE
        lower = torch.where(near_one, limit, torch.where(near_zero, 0.0, lower)).clamp(0.0, 1.0)
        upper = torch.minimum(upper, 1 / p)  # the simplex: p' = r p <= 1
        upper = torch.where(near_one, 1.0, torch.where(near_zero, 1 / p.clamp(min=1e-12), upper))
        return lower.to(old_logp.dtype), upper.clamp(1.0, upper_max).to(old_logp.dtype)


BISECTIONS = 64  # halvings of the bracket: to 5e-20 of its width (1, or at most band_upper_max - 1)


def _binary_kl(p, q):
    """KL(Bernoulli(p) || Bernoulli(q)) for 0 < p < 1, q in [0, 1] (inf at q = 0 or 1)."""
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def _band_kl_upper(p, delta, upper_max):
    """The r in [1, min(1 / p, upper_max)] where KL(p || r p) = delta (increasing in r), or that interval's end."""
    low, high = torch.ones_like(p), torch.minimum(1 / p, torch.full_like(p, upper_max))
    reached = _binary_kl(p, high * p) >= delta
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        inside = _binary_kl(p, mid * p) < delta
        low, high = torch.where(inside, mid, low), torch.where(inside, high, mid)
    return torch.where(reached, (low + high) / 2, torch.minimum(1 / p, torch.full_like(p, upper_max)))


def _band_kl_lower(p, delta):
    """The r in [0, 1] where KL(p || r p) = delta (decreasing in r; infinite at r = 0, so always reached)."""
    low, high = torch.zeros_like(p), torch.ones_like(p)
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        inside = _binary_kl(p, mid * p) < delta
        low, high = torch.where(inside, low, mid), torch.where(inside, mid, high)
    return (low + high) / 2


def bandpo_token_loss(t: Tokens, cfg: LossConfig):
    """BandPO (arXiv 2603.04918): PPO-clip whose interval comes from a trust region on each token's probability instead
    of fixed eps: loss = max(-d A, -clip(d, lower, upper) A), then dual clip, with (lower, upper) = band_bounds(p_old).
    As the authors' verl fork (compute_policy_loss_vanilla with use_tokenwise_ratio_bounds): the bounds from the old
    log-probs, the hard clip, dual clip 10, seq-mean-token-mean; its "relax" option (the band widened to at least PPO's
    [1 - eps_low, 1 + eps_high]; off in its main scripts) is not here, so eps_low and eps_high are not read."""
    ratio = torch.exp(t.log_ratio)
    lower, upper = band_bounds(t.old_logp, cfg.band_divergence, cfg.band_delta, cfg.band_upper_max)
    clipped = torch.clamp(ratio, lower, upper)
    loss, extra = _dual_clip(torch.maximum(-t.adv * ratio, -t.adv * clipped), t.adv, cfg.clip_ratio_c)
    r, valid = ratio.detach(), t.mask > 0
    extra.update(band_clip_frac_low=(r < lower) & (t.adv < 0) & valid,
                 band_clip_frac_high=(r > upper) & (t.adv > 0) & valid)
    return loss, r, extra


# ---------------------------------------------------------------------------------------------
# 4. The registry: each algorithm's loss and its own defaults
# ---------------------------------------------------------------------------------------------

class Diagnostic(NamedTuple):
    """A metric that means something for an algorithm: curves.png draws it (cegppo_utils/plot.py), and train.py's
    progress bar shows it where it has a short name."""
    metric: str  # a key of policy_loss's metrics: a share of the response tokens unless the label says otherwise
    label: str  # its panel's title: what it counts, and what the loss does there
    short: str = ""  # its name on the progress bar ("": not shown there)


# The four clip regions policy_loss counts (clip_frac_*: where d sits against [1 - eps_low, 1 + eps_high], by the sign
# of A), labelled by what each kind of clip does to the gradient there. A loss that does not judge tokens against that
# interval has none: they are not counted for it, and no figure shows them.
_AS_INSIDE = (Diagnostic("clip_frac_low_pos", "d < 1 - eps_low, A > 0 (gradient d A, as inside)"),
              Diagnostic("clip_frac_high_neg", "d > 1 + eps_high, A < 0 (gradient d A, as inside)"))
BETA_REGIONS = (  # CE-GPPO: the gradient outside the interval kept, scaled by beta
    Diagnostic("clip_frac_low_neg", "beta1 region: d < 1 - eps_low, A < 0 (gradient beta1 (1 - eps_low) A)", "clip_b1"),
    Diagnostic("clip_frac_high_pos", "beta2 region: d > 1 + eps_high, A > 0 (gradient beta2 (1 + eps_high) A)",
               "clip_b2"), *_AS_INSIDE)
KEPT_REGIONS = (  # GPPO: kept as they are at the boundary (beta = 1)
    Diagnostic("clip_frac_low_neg", "d < 1 - eps_low, A < 0 (gradient (1 - eps_low) A, kept)", "clip_lo"),
    Diagnostic("clip_frac_high_pos", "d > 1 + eps_high, A > 0 (gradient (1 + eps_high) A, kept)", "clip_hi"),
    *_AS_INSIDE)
CLIPPED_REGIONS = (  # PPO-clip: no gradient
    Diagnostic("clip_frac_low_neg", "clipped: d < 1 - eps_low, A < 0 (no gradient)", "clip_lo"),
    Diagnostic("clip_frac_high_pos", "clipped: d > 1 + eps_high, A > 0 (no gradient)", "clip_hi"), *_AS_INSIDE)
DUAL_CLIP = (Diagnostic("dual_clip_frac", "dual clip: A < 0, d > clip_ratio_c (no gradient)"),)
BETA1_DOSE = (Diagnostic("beta1_dose", "beta1 dose: the beta1 region's gradient weight per token (beta1 (1 - eps_low) "
                                       "x its share; not a share)"),)
LOW_DOSE = (Diagnostic("beta1_dose", "d < 1 - eps_low, A < 0: its gradient weight per token ((1 - eps_low) x its "
                                     "share; not a share)"),)
ERC_BAND = (Diagnostic("erc_below_frac", "ERC: H / H_old <= erc_low (no gradient)", "erc_lo"),
            Diagnostic("erc_above_frac", "ERC: H / H_old >= erc_high (no gradient)", "erc_hi"))
DPPO_MASKS = (Diagnostic("dppo_masked_frac_pos", "masked: A > 0, p rose past dppo_mask_high (no gradient)", "mask_pos"),
              Diagnostic("dppo_masked_frac_neg", "masked: A < 0, p fell past dppo_mask_low (no gradient)", "mask_neg"),
              Diagnostic("dppo_truncated_frac", "ratio weight truncated at clip_ratio_c"))


@dataclass(frozen=True)
class Algorithm:
    """How one algorithm plugs into policy_loss(), and its row of README's table (algorithm_table())."""
    token_loss: Callable  # per-token loss function, as above
    defaults: dict  # LossConfig fields this algorithm sets (applied before the user's values)
    reads: tuple  # the LossConfig fields its token loss uses (train.py shows the others as not applying)
    paper: str  # where it comes from
    objective: str  # its per-token loss, in a line
    dynamic_clip: bool = True  # whether dynamic clip thresholds apply
    # Only an algorithm whose per-token loss is proportional to A may set this: train.py then skips its A = 0 responses.
    proportional_to_advantage: bool = False
    needs_entropy: bool = False  # its token loss reads the current and the old per-token entropy (ERC)
    applies_weights: bool = False  # its token loss applies policy_loss's per-token weights itself (GMPO, per response)
    regions: tuple = ()  # the four clip regions, labelled for this loss; () = not counted (it does not clip tokens)
    diagnostics: tuple = ()  # its token loss's own metrics, labelled (Diagnostic); () = none


_CLIP = ("eps_low", "eps_high", "loss_agg_mode")
# Add a new algorithm here: one per-token loss function and one entry.
ALGORITHMS = {
    # CE-GPPO: symmetric 0.2 (no clip-higher), dual clip 10, token-mean, the paper's recommended (0.5, 1) for 1.5B
    "ce_gppo": Algorithm(
        ce_gppo_token_loss,
        dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=10.0, loss_agg_mode="token-mean", beta1=0.5, beta2=1.0),
        reads=_CLIP + ("beta1", "beta2", "clip_ratio_c", "beta1_weight"),
        paper="arXiv 2509.20712 Eq. 8", objective="the table above, then dual clip", proportional_to_advantage=True,
        regions=BETA_REGIONS, diagnostics=DUAL_CLIP + BETA1_DOSE),
    "gppo": Algorithm(
        gppo_token_loss, dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=10.0, loss_agg_mode="token-mean"),
        reads=_CLIP + ("clip_ratio_c",),
        paper="arXiv 2508.07629", objective="`ce_gppo` with `beta1 = beta2 = 1`", proportional_to_advantage=True,
        regions=KEPT_REGIONS, diagnostics=DUAL_CLIP + LOW_DOSE),
    # GRPO Eq. 3 averages per response
    "grpo": Algorithm(
        ppo_clip_token_loss, dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=10.0, loss_agg_mode="seq-mean-token-mean"),
        reads=_CLIP + ("clip_ratio_c",),
        paper="arXiv 2402.03300 Eq. 3", objective="PPO-clip `max(-d A, -clip(d) A)`, then dual clip",
        proportional_to_advantage=True, regions=CLIPPED_REGIONS, diagnostics=DUAL_CLIP),
    # DAPO: clip-higher + token-mean
    "dapo": Algorithm(
        ppo_clip_token_loss, dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean"),
        reads=_CLIP + ("clip_ratio_c",),
        paper="arXiv 2503.14476", objective="PPO-clip with clip-higher, then dual clip",
        proportional_to_advantage=True, regions=CLIPPED_REGIONS, diagnostics=DUAL_CLIP),
    # CISPO: no lower bound; 0.28 is a common upper choice (MiniMax did not publish theirs; unverified for the paper)
    "cispo": Algorithm(
        cispo_token_loss, dict(eps_low=1.0, eps_high=0.28, clip_ratio_c=0.0, loss_agg_mode="token-mean"),
        reads=_CLIP,
        paper="arXiv 2506.13585", objective="`-sg(clip(d, 1 - eps_low, 1 + eps_high)) A log pi`",
        dynamic_clip=False, proportional_to_advantage=True,
        diagnostics=(Diagnostic("cispo_capped_frac", "IS weight capped: d > 1 + eps_high (weight 1 + eps_high)",
                                "capped"),
                     Diagnostic("cispo_raised_frac", "IS weight raised: d < 1 - eps_low (weight 1 - eps_low; none at "
                                "eps_low 1)"))),
    # GSPO paper (v2) §5.1 ranges, sequence-level
    "gspo": Algorithm(
        gspo_token_loss, dict(eps_low=3e-4, eps_high=4e-4, clip_ratio_c=0.0, loss_agg_mode="seq-mean-token-mean"),
        reads=_CLIP,
        paper="arXiv 2507.18071",
        objective="GSPO-token: sequence ratio `s = exp(mean_t log d)`, clipped per sequence",
        dynamic_clip=False, proportional_to_advantage=True,
        diagnostics=(Diagnostic("gspo_clip_frac_low", "sequence clipped: s < 1 - eps_low, A < 0 (no gradient)",
                                "clip_lo"),
                     Diagnostic("gspo_clip_frac_high", "sequence clipped: s > 1 + eps_high, A > 0 (no gradient)",
                                "clip_hi"))),
    # SAPO: verl and TRL aggregate per response (seq-mean-token-mean) and apply no clip and no dual clip
    "sapo": Algorithm(
        sapo_token_loss, dict(clip_ratio_c=0.0, loss_agg_mode="seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05),
        reads=("loss_agg_mode", "tau_pos", "tau_neg"),
        paper="arXiv 2511.20347",
        objective="`-sigmoid(tau (d - 1)) 4 / tau * A`, `tau = tau_pos` if `A > 0` else `tau_neg`",
        dynamic_clip=False, proportional_to_advantage=True),
    # Clip-Cov: the paper's and verl's r = 2e-4, bounds (1, 5), PPO-clip range 0.2, token-mean, no dual clip
    "clip_cov": Algorithm(
        clip_cov_token_loss,
        dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=0.0, loss_agg_mode="token-mean", clip_cov_ratio=2e-4,
             clip_cov_lb=1.0, clip_cov_ub=5.0),
        reads=_CLIP + ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
        paper="arXiv 2505.22617 (Clip-Cov)",
        objective="PPO-clip; no gradient for `clip_cov_ratio` of the tokens with `Cov` in `(lb, ub)`, drawn at random",
        dynamic_clip=False, regions=CLIPPED_REGIONS,
        diagnostics=(Diagnostic("cov_stopped_frac", "Clip-Cov: gradient stopped (drawn among Cov in (lb, ub))",
                                "cov_stop"),)),
    # KL-Cov: the paper's 7B run (k = 2e-3, coefficient 1); verl's yaml defaults are 2e-4 and 0.1
    "kl_cov": Algorithm(
        kl_cov_token_loss, dict(clip_ratio_c=0.0, loss_agg_mode="token-mean", kl_cov_ratio=2e-3, kl_cov_coef=1.0),
        reads=("loss_agg_mode", "kl_cov_ratio", "kl_cov_coef"),
        paper="arXiv 2505.22617 (KL-Cov)",
        objective="`-d A`, plus `kl_cov_coef * abs(log d)` on the `kl_cov_ratio` of tokens with the largest `Cov`",
        dynamic_clip=False,
        diagnostics=(Diagnostic("cov_kl_frac", "KL-Cov: kl_cov_coef |log d| added (the largest Cov)", "cov_kl"),)),
    # ERC: the authors' scripts (Kwai-Klear/ERC recipe/dapo/*_erc_1_05.sh): band (0.95, 1.05), dual clip 10,
    # token-mean; gppo_erc with eps 0.2 / 0.2, grpo_erc with DAPO's 0.2 / 0.28. ERC exists only on these two.
    "gppo_erc": Algorithm(
        gppo_erc_token_loss,
        dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=10.0, loss_agg_mode="token-mean", erc_low=0.95, erc_high=1.05),
        reads=_CLIP + ("clip_ratio_c", "erc_low", "erc_high"),
        paper="arXiv 2512.05591 (ERC)",
        objective="`gppo`; no gradient where `H / H_old` is outside `(erc_low, erc_high)`",
        dynamic_clip=False, proportional_to_advantage=True, needs_entropy=True, regions=KEPT_REGIONS,
        diagnostics=ERC_BAND + DUAL_CLIP + LOW_DOSE),
    "grpo_erc": Algorithm(
        grpo_erc_token_loss,
        dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean", erc_low=0.95, erc_high=1.05),
        reads=_CLIP + ("clip_ratio_c", "erc_low", "erc_high"),
        paper="arXiv 2512.05591 (ERC)",
        objective="PPO-clip, dual clip; no gradient where `H / H_old` is outside `(erc_low, erc_high)`",
        dynamic_clip=False, proportional_to_advantage=True, needs_entropy=True, regions=CLIPPED_REGIONS,
        diagnostics=ERC_BAND + DUAL_CLIP),
    # DPPO: verl's example script (examples/dppo_trainer): TV bound 0.15, KL bound 0.05, seq-mean-token-sum-norm, and
    # a truncation cap of 10000 (paper §5.4: a large one), which binds only on rare tokens (p_old 1e-6 -> p 0.05 stays
    # unmasked with d = 5e4); none here (clip_ratio_c 0), as prime-rl
    "dppo_tv": Algorithm(
        dppo_tv_token_loss,
        dict(clip_ratio_c=0.0, loss_agg_mode="seq-mean-token-sum-norm", dppo_mask_low=0.15, dppo_mask_high=0.15),
        reads=("loss_agg_mode", "clip_ratio_c", "dppo_mask_low", "dppo_mask_high"),
        paper="arXiv 2602.04879 (DPPO-Binary-TV)",
        objective="`-sg(d) A log pi`, masked where `p - p_old > dppo_mask_high` (A > 0) or `< -dppo_mask_low` (A <= 0)",
        dynamic_clip=False, proportional_to_advantage=True, diagnostics=DPPO_MASKS),
    "dppo_kl": Algorithm(
        dppo_kl_token_loss,
        dict(clip_ratio_c=0.0, loss_agg_mode="seq-mean-token-sum-norm", dppo_mask_low=0.05, dppo_mask_high=0.05),
        reads=("loss_agg_mode", "clip_ratio_c", "dppo_mask_low", "dppo_mask_high"),
        paper="arXiv 2602.04879 (DPPO-Binary-KL)",
        objective="`dppo_tv` with the binary KL `KL(p_old, p)` as the divergence, in the direction `A` pushes",
        dynamic_clip=False, proportional_to_advantage=True, diagnostics=DPPO_MASKS),
    # GMPO: the authors' example in verl (examples/gmpo_trainer): clip 0.4 in log space, (e^-0.4, e^0.4); one loss per
    # response
    "gmpo": Algorithm(
        gmpo_token_loss, dict(eps_low=0.4, eps_high=0.4, clip_ratio_c=0.0, loss_agg_mode="seq-mean-token-mean"),
        reads=_CLIP,
        paper="arXiv 2507.20673",
        objective="`-A exp(mean_t log d~)`, `log d` clipped to `eps_high` (A > 0) or `-eps_low` (A < 0)",
        dynamic_clip=False, proportional_to_advantage=True, applies_weights=True,
        diagnostics=(Diagnostic("gmpo_clip_frac_high", "clipped in log space: log d > eps_high, A > 0 (no gradient)",
                                "clip_hi"),
                     Diagnostic("gmpo_clip_frac_low", "clipped in log space: log d < -eps_low, A < 0 (no gradient)",
                                "clip_lo"))),
    # M2PO: AReaL's example and the authors' scripts: threshold 0.04; token-mean, no clip; the mask sees the whole call
    "m2po": Algorithm(
        m2po_token_loss, dict(clip_ratio_c=0.0, loss_agg_mode="token-mean", m2_threshold=0.04),
        reads=("loss_agg_mode", "m2_threshold"),
        paper="arXiv 2510.01161",
        objective="`-d A`, masked on the tokens with the largest `(log d)^2` until their mean is below `m2_threshold`",
        dynamic_clip=False,
        diagnostics=(Diagnostic("m2po_masked_frac", "masked: the largest (log d)^2 (no gradient)", "masked"),
                     Diagnostic("m2po_second_moment", "mean (log d)^2 over every token, before the mask", "m2"))),
    # LUSPO: TRL's paper index (the paper's §5.1): eps 2e-3 / 2.5e-3; TRL's luspo averages |y_i| l_i over responses
    "luspo": Algorithm(
        luspo_token_loss,
        dict(eps_low=2e-3, eps_high=2.5e-3, clip_ratio_c=0.0, loss_agg_mode="seq-mean-token-mean"),
        reads=_CLIP,
        paper="arXiv 2602.05261",
        objective="`gspo` with each response's loss times its length",
        dynamic_clip=False, proportional_to_advantage=True,
        diagnostics=(Diagnostic("luspo_clip_frac_low", "sequence clipped: s < 1 - eps_low, A < 0 (no gradient)",
                                "clip_lo"),
                     Diagnostic("luspo_clip_frac_high", "sequence clipped: s > 1 + eps_high, A > 0 (no gradient)",
                                "clip_hi"))),
    # VESPO: TRL's vespo_k_pos 2, vespo_lambda_pos 3, vespo_k_neg 3, vespo_lambda_neg 2; TRL divides by the tokens
    "vespo": Algorithm(
        vespo_token_loss,
        dict(clip_ratio_c=0.0, loss_agg_mode="token-mean", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
             vespo_lambda_neg=2.0),
        reads=("loss_agg_mode", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
        paper="arXiv 2602.10693",
        objective="`-sg(phi(W)) A log pi`, `phi(W) = W^k exp(lambda (1 - W))`, `W` the response's ratio `prod_t d`",
        dynamic_clip=False, proportional_to_advantage=True, applies_weights=True,
        diagnostics=(Diagnostic("vespo_phi", "mean weight phi(W) per token (1 on-policy; not a share)", "phi"),)),
    # GPG: verl's gpg, token-mean (verl's loss_agg_mode default)
    "gpg": Algorithm(
        gpg_token_loss, dict(clip_ratio_c=0.0, loss_agg_mode="token-mean"),
        reads=("loss_agg_mode",),
        paper="arXiv 2504.02546", objective="`-A log pi`",
        dynamic_clip=False, proportional_to_advantage=True),
    # DRO: verl's dro; its config has no default dro_beta (it must be set): 0.05 is its PR's example (#7245) and test
    "dro": Algorithm(
        dro_token_loss, dict(clip_ratio_c=0.0, loss_agg_mode="token-mean", dro_beta=0.05),
        reads=("loss_agg_mode", "dro_beta"),
        paper="verl `dro`",
        objective="`-(A log pi - dro_beta / 2 (log d)^2)`",
        dynamic_clip=False,
        diagnostics=(Diagnostic("dro_penalty", "mean penalty dro_beta / 2 (log d)^2 per token (not a share)",
                                "pen"),)),
    # prime-rl's default loss: its DefaultLossConfig (dppo_mask_low 0.2, dppo_mask_high 0.2, kl_tau 1e-3); the summed
    # loss divided by the step's tokens (token-mean)
    "dppo_tv_kimi": Algorithm(
        dppo_tv_kimi_token_loss,
        dict(clip_ratio_c=0.0, loss_agg_mode="token-mean", dppo_mask_low=0.2, dppo_mask_high=0.2, kimi_kl_tau=1e-3),
        reads=("loss_agg_mode", "dppo_mask_low", "dppo_mask_high", "kimi_kl_tau"),
        paper="arXiv 2602.04879 + 2602.02276 (prime-rl's default)",
        objective="`-A d`, masked as `dppo_tv`, plus `kimi_kl_tau (log d)^2` on every token",
        dynamic_clip=False, diagnostics=DPPO_MASKS[:2] + (
            Diagnostic("kimi_kl_penalty", "mean penalty kimi_kl_tau (log d)^2 per token (not a share)", "pen"),)),
    # BandPO: the authors' scripts (RLtraining/verl/baselinescripts/*/bandpo__grpo_plus_ray_bandkl005.sh): KL band,
    # radius 0.05, upper bound at most 10, dual clip 10, seq-mean-token-mean
    "bandpo": Algorithm(
        bandpo_token_loss,
        dict(clip_ratio_c=10.0, loss_agg_mode="seq-mean-token-mean", band_divergence="kl", band_delta=0.05,
             band_upper_max=10.0),
        reads=("loss_agg_mode", "clip_ratio_c", "band_divergence", "band_delta", "band_upper_max"),
        paper="arXiv 2603.04918",
        objective="PPO-clip on `[lower(p_old), upper(p_old)]`, where the binary f-divergence reaches `band_delta`; "
                  "dual clip",
        dynamic_clip=False, proportional_to_advantage=True,
        diagnostics=(Diagnostic("band_clip_frac_low", "clipped: d < lower(p_old), A < 0 (no gradient)", "clip_lo"),
                     Diagnostic("band_clip_frac_high", "clipped: d > upper(p_old), A > 0 (no gradient)", "clip_hi"),
                     *DUAL_CLIP)),
}

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
BETA1_WEIGHTS = ("constant", "ratio")
DYNAMIC_SCHEDULES = ("id", "did", "od")
DYNAMIC_CLIPS = ("none",) + DYNAMIC_SCHEDULES
KL_ESTIMATORS = ("k1", "k2", "k3")
SWITCH = (False, True)
# Fields every algorithm reads: the terms added to the policy loss, and how it is weighted.
COMMON_FIELDS = ("norm_len", "entropy_coef", "positive_lm_coef", "dynamic_clip", "od_initial_entropy",
                 "top_entropy_quantile", "kl_coef", "kl_estimator", "adaptive_entropy", "entropy_target",
                 "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")


def algorithm_table() -> str:
    """README's table of the family, from the registry (a test keeps README equal to it)."""
    lines = ["| `--algo` | source | per-token loss | defaults |", "|---|---|---|---|"]
    for name, a in ALGORITHMS.items():
        defaults = ", ".join(f"{k} {v}" for k, v in a.defaults.items())
        lines.append(f"| `{name}` | {a.paper} | {a.objective} | {defaults} |")
    return "\n".join(lines)


def ignored_fields(cfg: LossConfig) -> list[str]:
    """LossConfig fields `cfg.algo` does not read (so setting them changes nothing)."""
    reads = set(ALGORITHMS[cfg.algo].reads) | set(COMMON_FIELDS) | {"algo"}
    return [f.name for f in fields(LossConfig) if f.name not in reads]


def diagnostics(algo: str) -> tuple:
    """What means something for `algo` (Diagnostic): its clip regions, where it judges tokens against the clip
    interval, then its token loss's own metrics. curves.png draws these beside the panels every run has."""
    return ALGORITHMS[algo].regions + ALGORITHMS[algo].diagnostics


def needs_current_entropy(cfg: LossConfig) -> bool:
    """Whether policy_loss must see the current policy's entropy (entropy=...): for the entropy bonus (with its
    gradient), the top-entropy mask and ERC's ratio. Otherwise the old policy's serves its metrics."""
    return bool(cfg.entropy_coef) or cfg.top_entropy_quantile < 1 or ALGORITHMS[cfg.algo].needs_entropy


def skips_zero_advantage(cfg: LossConfig) -> bool:
    """Whether a response with A = 0 gets no gradient under cfg, so that train.py need not run it: only where the
    algorithm declares its per-token loss proportional to A (Algorithm.proportional_to_advantage; an undeclared one
    keeps every response), and false as soon as a term that is not proportional to A is on (an entropy bonus, fixed or
    adaptive; the positive-example LM loss; the KL to the reference). Also false under the top-entropy mask: its
    quantile is taken over every token of the call, as TRL's, so leaving responses out would move it."""
    return (ALGORITHMS[cfg.algo].proportional_to_advantage and not cfg.entropy_coef and not cfg.adaptive_entropy
            and not cfg.positive_lm_coef and not cfg.kl_coef and cfg.top_entropy_quantile == 1.0)


# ---------------------------------------------------------------------------------------------
# 5. Group-relative advantages
# ---------------------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, max_rl: bool = False,
                     eps: float = 1e-6):
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-6), unbiased std as the official code.

    rewards [num_groups * group_size], the responses of one prompt contiguous. scale_by_std=False gives
    Dr. GRPO (arXiv 2503.20783): A_i = r_i - mean(r_group). Returns one advantage per response.

    max_rl=True gives MaxRL's (arXiv 2602.02710; prime-rl algo.type "max_rl"): A_i = (r_i - mean(r_group)) /
    mean(r_group), the centred reward divided by the group's mean instead of its std, and 0 for a group whose mean is
    not above 0; scale_by_std is then not used. For rewards in {0, 1} (success) the mean is the group's pass rate p and
    sum_i A_i grad log pi(y_i) estimates grad log p: the gradient of the likelihood of success, which weighs a hard
    prompt by 1 / p where GRPO's weighs it by about 1 / sqrt(p (1 - p)). Rewards must not be negative (train.py passes
    the success indicator, not the +-1 reward).
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if max_rl:
        if (r < 0).any():
            raise ValueError("max_rl needs rewards >= 0 (the success indicator 1 / 0); got a negative reward")
        return (adv / torch.where(mean > 0, mean, 1.0) * (mean > 0)).view(-1)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    return adv.view(-1)


# ---------------------------------------------------------------------------------------------
# 6. Dynamic clipping ("Flexible Entropy Control", arXiv 2602.09782)
# ---------------------------------------------------------------------------------------------
# The clip thresholds become functions of the token's current probability p = pi_theta(y_t)
# (detached): an upper threshold H(p) and a lower threshold M(p), each linear in p and clamped,
# looser for low-probability tokens (the first author's write-up of the method, §4.1-4.2). A schedule
# over training progress k/T mixes them with the standard eps_std (its §5). The paper's text gives the
# forms, not the numbers: the slopes, intercepts and clamp are a third-party implementation's defaults,
# and no value of eps_std was found (docs/entropy-control.md lists the source of each).

@dataclass
class DynamicClip:
    """Dynamic clip thresholds and their schedule. Values marked (third party) are not given by the paper."""
    schedule: str = "id"  # "id" increase-then-decrease, "did" decrease-increase-decrease, "od" oscillatory decay
    eps_std: float = 0.2  # the standard clip range the schedules fall back to (no value in any source found)
    upper_slope: float = -0.25  # H(p) = clamp(upper_slope * p + upper_intercept), form §4.1  (third party)
    upper_intercept: float = 0.5  # (third party)
    lower_slope: float = -0.13  # M(p) = clamp(lower_slope * p + lower_intercept), form §4.2  (third party)
    lower_intercept: float = 0.3  # (third party)
    min_eps: float = 0.05  # clamp range of H(p) and M(p); never binds for p in [0, 1]  (third party)
    max_eps: float = 0.6  # (third party)
    od_floor: float = 0.2  # oscillatory decay: H_min = od_floor * initial entropy


def upper_threshold(prob: torch.Tensor, dc: DynamicClip) -> torch.Tensor:
    """H(p): the dynamic eps_high, larger for low-probability tokens (upper_slope < 0)."""
    return (dc.upper_slope * prob + dc.upper_intercept).clamp(dc.min_eps, dc.max_eps)


def lower_threshold(prob: torch.Tensor, dc: DynamicClip) -> torch.Tensor:
    """M(p): the dynamic eps_low, tighter for high-probability tokens (lower_slope < 0)."""
    return (dc.lower_slope * prob + dc.lower_intercept).clamp(dc.min_eps, dc.max_eps)


def dynamic_clip_eps(prob: torch.Tensor, dc: DynamicClip, progress: float, od_state: int = 0):
    """(eps_low, eps_high) per token at training progress k/T in [0, 1].

    lambda_k = 1 - 2k/T. With E+ = eps_high, E- = eps_low:
      id,  k <= T/2: E+ = lambda H(p) + (1 - lambda) eps_std,  E- = eps_std
           k >  T/2: E+ = eps_std,  E- = (1 + lambda) M(p) - lambda eps_std
      did, k <= T/2: E+ = lambda eps_std + (1 - lambda) H(p),  E- = eps_std
           k >  T/2: E+ = H(p),     E- = (1 + lambda) M(p) - lambda eps_std
      od:  state 1 (entropy fell to the floor): (E+, E-) = (H(p), eps_std), raising entropy;
           state 0: (E+, E-) = (eps_std, M(p)), letting it decay. See oscillatory_decay_state().
    """
    if dc.schedule not in DYNAMIC_SCHEDULES:
        raise ValueError(f"dynamic clip schedule must be one of {DYNAMIC_SCHEDULES}, got {dc.schedule!r}")
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress must be in [0, 1], got {progress}")
    prob = prob.detach()
    std = torch.full_like(prob, dc.eps_std)
    lam = 1.0 - 2.0 * progress
    if dc.schedule == "od":
        return (std, upper_threshold(prob, dc)) if od_state == 1 else (lower_threshold(prob, dc), std)
    first_half = progress <= 0.5
    if dc.schedule == "id":
        if first_half:
            return std, lam * upper_threshold(prob, dc) + (1 - lam) * dc.eps_std
        return (1 + lam) * lower_threshold(prob, dc) - lam * dc.eps_std, std
    # did
    if first_half:
        return std, lam * dc.eps_std + (1 - lam) * upper_threshold(prob, dc)
    return (1 + lam) * lower_threshold(prob, dc) - lam * dc.eps_std, upper_threshold(prob, dc)


def oscillatory_decay_state(state: int, entropy: float, progress: float, initial_entropy: float,
                            dc: DynamicClip) -> int:
    """Hysteresis switch of the oscillatory-decay schedule; call once per step with the current entropy.

    H_min = od_floor * H_init, tau_high(k) = H_min + (H_init - H_min)(1 - k/T): switch to state 1
    (raise entropy) when entropy <= H_min, back to 0 (decay) when entropy > tau_high(k), else keep.
    Start in state 0.
    """
    floor = dc.od_floor * initial_entropy
    tau_high = floor + (initial_entropy - floor) * (1.0 - progress)
    if entropy <= floor:
        return 1
    if entropy > tau_high:
        return 0
    return state


# ---------------------------------------------------------------------------------------------
# 7. The positive-example LM term of the official scripts
# ---------------------------------------------------------------------------------------------

def positive_example_lm_loss(logp: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor, *, num_tokens=None):
    """NLL on the tokens of correct responses, token-mean (Klear-Reasoner Eq. 13-14; absent from the
    CE-GPPO paper). The official scripts minimise pg_loss + 0.1 * this.

    correct [B] bool. num_tokens: the mini-batch's count of correct-response tokens, for micro-batches.
    Zero (with a zero gradient) when no response is correct.
    """
    selected = mask.to(logp.dtype) * correct.to(logp.dtype).unsqueeze(-1)
    denom = selected.sum() if num_tokens is None else num_tokens
    return -(logp * selected).sum() / torch.as_tensor(denom, dtype=logp.dtype).clamp(min=1)


# ---------------------------------------------------------------------------------------------
# 8. Options for every algorithm: top-entropy tokens, the KL to a reference, adaptive entropy
# ---------------------------------------------------------------------------------------------

def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """"Beyond the 80/20 rule" (arXiv 2506.01939): 1 on the response tokens whose entropy is at least the
    (1 - rho) quantile of this call's response-token entropies (the "forking" tokens), 0 elsewhere.

    The quantile interpolates linearly (torch.quantile's rule, through quantile() below), as TRL's
    get_high_entropy_mask. The masked-out tokens still count in the token mean (TRL multiplies the per-token loss by
    the mask; the denominator keeps every token).
    """
    valid = mask > 0
    if not valid.any():
        return torch.zeros_like(mask)
    threshold = quantile(entropy[valid], 1.0 - rho)
    return ((entropy >= threshold) & valid).to(mask.dtype)


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(x, q) of a 1-D tensor without NaN, bit for bit, at any size: torch.quantile refuses more than
    2^24 elements, the most response tokens one step of the 1.5B preset holds (128 prompts x 8 x 16,384), so any
    larger --n, --train-prompts or --max-response-len would exceed it. Its rule: rank r = q (n - 1) in x's dtype, the
    value lerp(x_(floor r), x_(ceil r), r - floor r) with x_(i) the i-th smallest (from 0), here found by kthvalue."""
    rank = torch.tensor(q, dtype=x.dtype) * (x.numel() - 1)
    below = int(rank)
    low = torch.kthvalue(x, below + 1).values
    high = torch.kthvalue(x, below + 2).values if rank > below else low
    return torch.lerp(low, high, rank - below)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3", mask: torch.Tensor | None = None):
    """Per-token estimate of KL(pi_theta || pi_ref) from the sampled token, x = log(pi_ref / pi_theta):
      k1 = -x            (verl "kl")
      k2 = x^2 / 2       (verl "mse")
      k3 = e^x - x - 1   (GRPO Eq. 4; verl "low_var_kl"; TRL's per_token_kl): unbiased, >= 0
    x is clamped to +-LOG_RATIO_CLAMP (so e^x cannot overflow) and set to 0 on padding. verl also clamps k3 to
    [-10, 10]; here it is not (TRL does not either): a token whose k3 exceeds 10 keeps its gradient.
    """
    x = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if mask is not None:
        x = x * mask
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.exp(x) - x - 1
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


# Adaptive entropy control (Skywork-OR1, arXiv 2505.22312): the entropy bonus -alpha_k H with
#   alpha_k = c_k * 1[e_{k-1} <= target],   c_{k+1} = clip(c_k + delta if e_k <= target else c_k - delta, min, max),
# c_0 = entropy_coef, e_k the mean token entropy of step k. The coefficient is applied only while entropy is at or
# below the target, and the controller keeps moving either way. e_{k-1}: the entropy of the previous step, as TRL
# (use_adaptive_entropy) measures it; none before the first step, so step 1 applies no bonus. State between steps:
# (c_k, e_{k-1}), held in train.py's loop state and checkpointed.

def adaptive_entropy_coef(cfg: LossConfig, coef: float, last_entropy: float | None) -> float:
    """alpha_k: the coefficient to apply this step, from the controller's state."""
    return coef if last_entropy is not None and last_entropy <= cfg.entropy_target else 0.0


def next_entropy_coef(cfg: LossConfig, coef: float, entropy: float) -> float:
    """c_{k+1} from c_k and this step's mean token entropy e_k."""
    if entropy <= cfg.entropy_target:
        return min(coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
    return max(coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)


# ---------------------------------------------------------------------------------------------
# 9. The settings: LossConfig, every field checked by its rule
# ---------------------------------------------------------------------------------------------
# Every hyperparameter is one field of LossConfig, declared with its default and its Rule: the rule is its check
# (one error line naming the flag), the comment beside it its --help line. Args (cegppo_utils/flags.py) declares
# the run's other settings the same way, and field_problems() checks both alike.

class Rule(NamedTuple):
    """What values a field takes: declared beside the field (LossConfig's below, train.py's Args in
    cegppo_utils/flags.py) and checked by field_problems() for every field alike, so a new setting brings its own
    check and its own error line."""
    low: float | None = None  # lower bound
    high: float | None = None  # upper bound
    low_open: bool = False  # the lower bound excluded: > low instead of >= low
    high_open: bool = False  # the upper bound excluded: < high instead of <= high
    integer: bool = False  # whole numbers only, and below 2**31 (what torch and the samplers take) unless high says
    choices: tuple | dict | None = None  # the allowed values (of a dict: its keys)
    also: tuple = ()  # values allowed outside the range (temperature 0: greedy)
    says: str = ""  # the range in words, where the bounds alone would not say why
    cap: float | None = None  # a sanity limit above an open-ended range, said with its reason:
    cap_says: str = ""  # "at most {cap} ({cap_says})"

    def options(self) -> list:
        """The allowed values of a choice field, from its registry (empty for a numeric field)."""
        return sorted(self.choices, key=str) if self.choices is not None else []

    def text(self) -> str:
        if self.says or self.choices is not None:
            return self.says or f"one of {self.options()}"
        low = f"{'>' if self.low_open else '>='} {self.low:g}" if self.low is not None else ""
        if self.high is None:
            return f"an integer {low}" if self.integer else f"{low} and finite"
        if not low:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def problem(self, name: str, value) -> str | None:
        """"{name} must be ..., got {value}" where value breaks the rule, else None; a number of any size is compared
        exactly (a 401-digit integer is refused, not an OverflowError), and one beyond a float's range is said so."""
        if self.choices is not None:
            return None if value in self.options() else f"{name} must be {self.text()}, got {shown(value)}" + \
                did_you_mean(value, self.options())
        whole = isinstance(value, int) and not isinstance(value, bool)
        number = whole or (isinstance(value, float) and math.isfinite(value))
        if number and value in self.also:
            return None
        if (not number or (self.integer and not whole)
                or (self.low is not None and (value < self.low or (self.low_open and value == self.low)))
                or (self.high is not None and (value > self.high or (self.high_open and value == self.high)))):
            return f"{name} must be {self.text()}, got {shown(value)}"
        if self.cap is not None and value > self.cap:
            return f"{name} must be at most {self.cap:g} ({self.cap_says}), got {shown(value)}"
        if self.integer and self.high is None and value >= 2**31:
            return f"{name} must be below 2**31, got {shown(value)}"
        return None if self.integer else number_problem(name, value)


def number_problem(name: str, value, integer: bool = False) -> str | None:
    """The one check of a number given to a setting, whatever its size (a flag, a config value): for an integer
    setting an int (not a bool); for any other an int or a float, finite, that a float holds (an int of 401 digits is
    beyond it). "{name} ..." where it fails, else None."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if integer:
        return None if whole else f"{name} must be an integer, got {shown(value)}"
    if whole:
        try:
            float(value)
        except OverflowError:
            return f"{name} {shown(value)} is beyond a float's range"
        return None
    if not isinstance(value, float) or not math.isfinite(value):
        return f"{name} must be a finite number, got {shown(value)}"
    return None


def shown(value) -> str:
    """A value for a message, an int of any size included (its digits past 60 counted, not printed: past 4,300
    Python will not even write them)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        digits = len(str(abs(value))) if value.bit_length() < 14000 else int(value.bit_length() * 0.30103) + 1
        return f"{str(value)[:20] if value.bit_length() < 14000 else ''}... (an integer of {digits} digits)"
    return repr(value)


def parse_int(text: str) -> int:
    """A whole number typed on a command line (argparse's type for every integer flag): int(text), whatever its size
    (Python refuses more than 4,300 digits; said as argparse says a bad int)."""
    return int(text)


def parse_float(text: str) -> float:
    """A number typed on a command line (argparse's type for every float flag): float(text), where a value beyond a
    float's range (1e400, 401 digits) is said so rather than read as inf."""
    value = float(text)
    if math.isinf(value) and "inf" not in text.lower():
        import argparse
        raise argparse.ArgumentTypeError(f"{text} is beyond a float's range")
    return value


parse_int.__name__, parse_float.__name__ = "int", "float"  # argparse names the type in "invalid int value: 'x'"


def option(default, rule: Rule):
    """A settings field with its rule (LossConfig's here, Args' in cegppo_utils/flags.py)."""
    return field(default=default, metadata={"rule": rule})


BETA_CAP = "it scales the loss's gradient; the paper uses 0.5 to 1"  # beta1, beta2: at most 100
VESPO_LAMBDA = Rule(1e-4, says=">= 1e-4 and finite (TRL raises a smaller lambda to 1e-4)")


@dataclass(frozen=True)
class LossConfig:
    """Every hyperparameter of the objectives. Each field is also a train.py flag (--eps-low, ...), checked by its rule.
    An algorithm reads only the fields its token loss uses; its own defaults are in ALGORITHMS[algo].defaults."""
    algo: str = option("ce_gppo", Rule(choices=ALGORITHMS))  # the objective: one of loss.ALGORITHMS
                                                             # (README's table of the family)
    eps_low: float = option(0.2, Rule(0, 1, low_open=True))  # lower clip range: the interval is
                                                             # [1 - eps_low, 1 + eps_high]; 1 = no lower bound
    eps_high: float = option(0.2, Rule(0, low_open=True))  # upper clip range
    beta1: float = option(0.5, Rule(0, cap=100, cap_says=BETA_CAP))  # CE-GPPO gradient scale on the left boundary
                                                                     # (d < 1-eps, A < 0); larger lowers entropy
    beta2: float = option(1.0, Rule(0, cap=100, cap_says=BETA_CAP))  # CE-GPPO gradient scale on the right boundary
                                                                     # (d > 1+eps, A > 0); larger keeps entropy up
    beta1_weight: str = option("constant", Rule(choices=BETA1_WEIGHTS))  # CE-GPPO's beta1 region: the paper's
                                                                        # constant beta1 (1 - eps_low), or "ratio":
                                                                        # beta1 d, a mechanism arm (section 1)
    clip_ratio_c: float = option(10.0, Rule(0))  # dual-clip bound for A < 0 (official scripts: 10); 0 disables;
                                                 # DPPO: the cap on its detached ratio (verl's truncation)
    loss_agg_mode: str = option("token-mean", Rule(choices=LOSS_AGG_MODES))  # how token losses become one number
    norm_len: int = option(0, Rule(0, integer=True))  # seq-mean-token-sum-norm's constant length
                                                      # (Dr. GRPO); 0 = the max response length
    entropy_coef: float = option(0.0, Rule(0))  # entropy bonus: loss -= coef * mean token
                                                # entropy (paper §4 baseline: 0.001, 0.003)
    positive_lm_coef: float = option(0.0, Rule(0))  # weight of the NLL on correct responses
                                                    # (official scripts: 0.1; not in the paper)
    dynamic_clip: str = option("none", Rule(choices=DYNAMIC_CLIPS))  # probability-dependent clip
                                                                     # schedule (arXiv 2602.09782)
    od_initial_entropy: float = option(0.5, Rule(0))  # --dynamic-clip od: H_init in nats, its floor 0.2 H_init
                                                      # (public FlexEC defaults: 0.5; the paper: the initial
                                                      # entropy); 0 = the first step's measured mean entropy
    tau_pos: float = option(1.0, Rule(0, low_open=True))  # SAPO gate temperature for A > 0 (SAPO paper,
                                                          # verl tau_pos, TRL sapo_temperature_pos: 1.0)
    tau_neg: float = option(1.05, Rule(0, low_open=True))  # SAPO gate temperature for A <= 0 (SAPO paper,
                                                           # verl tau_neg, TRL sapo_temperature_neg: 1.05)
    clip_cov_ratio: float = option(2e-4, Rule(0, 1, low_open=True))  # Clip-Cov: share of a call's tokens whose gradient
                                                                     # is stopped (arXiv 2505.22617 §5, verl: 2e-4)
    clip_cov_lb: float = option(1.0, Rule(0))  # Clip-Cov: only tokens with covariance in
                                               # (lb, ub) are candidates (paper, verl: 1)
    clip_cov_ub: float = option(5.0, Rule(0))  # Clip-Cov: upper covariance bound (paper, verl: 5)
    kl_cov_ratio: float = option(2e-3, Rule(0, 1, low_open=True))  # KL-Cov: share of a call's tokens with the
                                                                   # largest covariance that get the KL term
                                                                   # (paper 7B run: 2e-3; verl default 2e-4)
    kl_cov_coef: float = option(1.0, Rule(0))  # KL-Cov: weight of |log d| on those tokens
                                               # (paper: 1; verl's yaml default 0.1)
    top_entropy_quantile: float = option(1.0, Rule(0, 1, low_open=True))  # rho: train only on the top-rho
                                                                          # share of tokens by entropy (arXiv
                                                                          # 2506.01939 recommends 0.2; TRL
                                                                          # top_entropy_quantile); 1 = all
    kl_coef: float = option(0.0, Rule(0))  # KL penalty to the frozen initial model (GRPO paper: 0.04; verl kl_loss_coef
                                           # 0.001; official CE-GPPO scripts: none); 0 = no reference model
    kl_estimator: str = option("k3", Rule(choices=KL_ESTIMATORS))  # k1 log(pi/ref), k2 (log(pi/ref))^2 / 2,
                                                                   # k3 ref/pi - log(ref/pi) - 1 (GRPO Eq. 4; verl
                                                                   # low_var_kl)
    adaptive_entropy: bool = option(False, Rule(choices=SWITCH))  # Skywork-OR1 adaptive entropy control:
                                                                  # entropy_coef becomes the controller's
                                                                  # start value (TRL use_adaptive_entropy)
    entropy_target: float = option(0.2, Rule(0, low_open=True))  # adaptive entropy: target mean token entropy in nats
                                                                 # (Skywork-OR1 tgt-ent 0.2; TRL entropy_target 0.2)
    entropy_coef_delta: float = option(0.005, Rule(0, low_open=True))  # adaptive entropy: step of the coefficient
                                                                       # per training step (Skywork-OR1, TRL
                                                                       # entropy_coef_delta: 0.005)
    entropy_coef_min: float = option(0.0, Rule(0))  # adaptive entropy: lower bound of the
                                                    # coefficient (TRL entropy_coef_min: 0)
    entropy_coef_max: float = option(1.0, Rule(0))  # adaptive entropy: upper bound of the
                                                    # coefficient (TRL entropy_coef_max: 1)
    erc_low: float = option(0.95, Rule(0, 1, high_open=True))  # ERC: no gradient where H / H_old <=
                                                               # erc_low (the authors' scripts: 0.95)
    erc_high: float = option(1.05, Rule(1, low_open=True))  # ERC: no gradient where H / H_old >=
                                                            # erc_high (the authors' scripts: 1.05)
    dppo_mask_low: float = option(0.15, Rule(0))  # DPPO: mask A <= 0 tokens whose probability fell
                                                  # past this divergence (verl: TV 0.15, KL 0.05)
    dppo_mask_high: float = option(0.15, Rule(0))  # DPPO: mask A > 0 tokens whose probability rose
                                                   # past this divergence (verl: TV 0.15, KL 0.05)
    m2_threshold: float = option(0.04, Rule(0, low_open=True))  # M2PO: mask the largest (log d)^2 until the
                                                                # rest's mean is below this (paper, AReaL: 0.04)
    vespo_k_pos: float = option(2.0, Rule(0))  # VESPO: the power k of W^k for A >= 0, how hard a response the
                                               # policy moved away from (W < 1) is damped (TRL: 2)
    vespo_lambda_pos: float = option(3.0, VESPO_LAMBDA)  # VESPO: the rate lambda of exp(lambda (1 - W)) for A >= 0,
                                                         # how hard a response it moved toward (W > 1) is damped
                                                         # (TRL: 3)
    vespo_k_neg: float = option(3.0, Rule(0))  # VESPO: k for A < 0 (TRL: 3)
    vespo_lambda_neg: float = option(2.0, VESPO_LAMBDA)  # VESPO: lambda for A < 0 (TRL: 2)
    dro_beta: float = option(0.05, Rule(0, low_open=True))  # DRO: weight of (log d)^2 / 2 (verl requires one > 0; its
                                                            # PR's example: 0.05)
    kimi_kl_tau: float = option(1e-3, Rule(0))  # dppo_tv_kimi: weight of (log d)^2 on every token
                                                # (prime-rl kl_tau: 1e-3)
    band_divergence: str = option("kl", Rule(choices=BAND_DIVERGENCES))  # BandPO: the f-divergence of its trust
                                                                         # region (the authors' main scripts: kl)
    band_delta: float = option(0.05, Rule(0, low_open=True))  # BandPO: the trust region's radius (the authors'
                                                              # scripts: 0.05)
    band_upper_max: float = option(10.0, Rule(1, low_open=True))  # BandPO: the largest upper bound on d (the
                                                                  # authors' scripts: 10)


def loss_config(algo: str = "ce_gppo", **overrides) -> LossConfig:
    """The LossConfig that runs `algo` with its own defaults, then `overrides`; checked (ValueError if not valid)."""
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown algo {algo!r}; choose one of {sorted(ALGORITHMS)}")
    cfg = LossConfig(**{**ALGORITHMS[algo].defaults, **overrides, "algo": algo})
    problems = config_problems(cfg)
    if problems:
        raise ValueError(problems[0][1])
    return cfg


def config_problems(cfg: LossConfig) -> list[tuple[str, str]]:
    """(field, message) for every value out of range, each message starting with the field's name; [] if valid.
    Each field's own rule first (field_problems), then the rules that relate two fields."""
    problems = field_problems(cfg)
    bad = {name for name, _ in problems}
    if not bad & {"clip_ratio_c", "eps_high"} and cfg.clip_ratio_c and cfg.clip_ratio_c <= 1 + cfg.eps_high:
        problems.append(("clip_ratio_c", f"clip_ratio_c must exceed 1 + eps_high = {1 + cfg.eps_high} (or be 0 to "
                                         f"disable), got {cfg.clip_ratio_c!r}"))
    if not bad & {"algo", "dynamic_clip"} and cfg.dynamic_clip != "none" and not ALGORITHMS[cfg.algo].dynamic_clip:
        problems.append(("dynamic_clip", f"dynamic_clip does not apply to {cfg.algo}: dynamic clipping applies to "
                                         f"{[a for a, s in ALGORITHMS.items() if s.dynamic_clip]}"))
    if not bad & {"clip_cov_lb", "clip_cov_ub"} and cfg.clip_cov_lb >= cfg.clip_cov_ub:
        problems.append(("clip_cov_lb", f"clip_cov_lb must be below clip_cov_ub = {cfg.clip_cov_ub}, "
                                        f"got {cfg.clip_cov_lb!r}"))
    if not bad & {"entropy_coef_min", "entropy_coef_max"} and cfg.entropy_coef_min > cfg.entropy_coef_max:
        problems.append(("entropy_coef_min", f"entropy_coef_min must be at most entropy_coef_max = "
                                             f"{cfg.entropy_coef_max}, got {cfg.entropy_coef_min!r}"))
    return problems


def field_problems(settings) -> list[tuple[str, str]]:
    """(field, message) for every field of a settings dataclass whose value its Rule refuses, and for every float
    that float32, the dtype a run computes in, would turn into 0 or inf (--tau-pos 1e-46 would silently be another
    setting); each message starts with the field's name. Fields without a Rule (paths, names, switches) pass."""
    problems = []
    for f in fields(settings):
        value, rule = getattr(settings, f.name), f.metadata.get("rule")
        message = rule.problem(f.name, value) if rule is not None else None
        if message is None and isinstance(value, float) and math.isfinite(value) and value != 0:
            single = _as_float32(value)
            if single == 0 or math.isinf(single):
                message = (f"{f.name} {value} is {'0' if single == 0 else 'inf'} in float32, the dtype the run "
                           "computes in (it holds sizes from 1.4e-45 to 3.4e38)")
        if message is not None:
            problems.append((f.name, message))
    return problems


def _as_float32(value: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


_valid_configs = set()


def _checked(cfg):
    """config_problems(cfg), remembered for valid configs (policy_loss runs once per micro-batch)."""
    if cfg in _valid_configs:
        return []
    problems = config_problems(cfg)
    if not problems:
        _valid_configs.add(cfg)
    return problems


def closest(value, options) -> str | None:
    """The option a mistyped value most likely means, by spelling, or None: the one closest-name hint for every
    choice, preset, flag and config key."""
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(value, options) -> str:
    """"; did you mean X?" for closest(value, options), or ""."""
    close = closest(value, options)
    return f"; did you mean {close!r}?" if close else ""
