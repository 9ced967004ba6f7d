"""Rollout correction: the sampler is not the trainer. Every trainer-side piece of it lives here; train.py calls
correct() once per step (stage 5), after the old log-probs, and the loss applies the weights it leaves.

The sampler (vLLM, bf16 kernels) and the trainer (the training model) give the same token slightly different
probabilities, so "on-policy" samples come from q != pi_old. With rho_t = pi_old(y_t) / q(y_t), each per-token
loss l_t is multiplied by a detached weight w_t(rho): E_{y~q}[w l] then estimates E_{y~pi_old}[l] (Yao et al.,
"Your efficient RL framework secretly brings you off-policy RL training", 2025; TRL and verl use the same forms).
In CE-GPPO it enters as w_t * l_t(theta) for every region of Eq. 8: the regions are still judged on
d = pi_theta / pi_old (the trainer's own ratio, which the clip is about), and a clipped token's gradient becomes
w_t * beta * (1 -+ eps) * A * grad log pi. The correction fixes which distribution the tokens came from; the clip
still bounds how far one update moves from pi_old.

Under top-p / top-k the sampler's log-prob is over the tokens it kept, renormalised, so pi_old must be taken over
the same support (logprobs.py computes the trainer's kept mass in the same pass as the log-probs): otherwise rho
carries the kept mass and is < 1 even when both sides compute identical numbers.
"""

import math

import torch

from cegppo_utils import distributed as D
from cegppo_utils import logprobs
from loss import LOG_RATIO_CLAMP, quantile

MODES = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis", "token-icepop")
ICEPOP_BAND = (0.5, 5.0)  # IcePop's [alpha, beta] (Ring-1T, arXiv 2510.18855; verl's decoupled_token_icepop)


def correct(micro_batches, mode: str, threshold: float, device, band=ICEPOP_BAND) -> dict:
    """The entry point. Each micro-batch (train.MicroBatch) holds the trainer's old log-probs (old_logp), what the
    sampler's truncation keeps under the trainer's distribution (kept, a logprobs.Truncation) and the sampler's own
    log-probs (sampler_logp); each gets its weights (weights, for loss.policy_loss). Returns the step's metrics,
    over every rank's tokens. band: token-icepop's [alpha, beta]. mode "none": the gap measured, no weights set
    (train.py --off-policy-steps logs it either way: there q is also one update older than pi_old)."""
    log_rhos, corrected = [], []
    for mbs in micro_batches:
        for mb in mbs:
            trainer_logp = logprobs.truncated_logprobs(mb.old_logp, mb.kept)
            if mode == "none":
                valid = mb.response_mask > 0
                log_rho = (trainer_logp - mb.sampler_logp)[valid].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                flags = torch.zeros(0, dtype=torch.bool)
            else:
                mb.weights, log_rho, flags = importance_weights(trainer_logp, mb.sampler_logp, mb.response_mask, mode,
                                                                threshold, band)
            log_rhos.append(log_rho), corrected.append(flags)
    return {**reduced_metrics(log_rhos, corrected, device), **outside_kept_set(micro_batches, device)}


def importance_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       threshold: float, band=ICEPOP_BAND):
    """Detached per-token weights [B, T] for policy_loss(weights=...), the raw log-ratios of the response tokens
    (flattened, for metrics()) and which tokens (token modes) or responses (seq modes) were truncated or
    masked.

    trainer_logp: log pi_old(y_t) over the sampler's support; sampler_logp: log q(y_t), the sampler's own value.
      token-tis     w_t = min(rho_t, C)                 truncated importance sampling
      token-mis     w_t = rho_t if rho_t <= C, else 0    masked importance sampling
      seq-tis       w_t = min(rho_i, C), rho_i = prod_t rho_t over response i
      seq-mis       w_t = rho_i if rho_i <= C, else 0
      token-icepop  w_t = rho_t if alpha <= rho_t <= beta, else 0   (band = (alpha, beta); IcePop, arXiv 2510.18855)
    IcePop as verl's rollout correction (a "lower_upper" threshold): both bounds inclusive, a masked token's weight 0
    while it still counts in the loss's mean; with any loss, as the other modes. The paper masks the token's gradient
    the same way (its M(k) is k inside [alpha, beta], 0 outside).
    """
    if mode not in MODES[1:]:
        raise ValueError(f"rollout correction mode must be one of {MODES[1:]}, got {mode!r}")
    with torch.no_grad():
        valid = mask > 0
        log_rho = torch.where(valid, trainer_logp - sampler_logp, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if mode.startswith("seq"):
            log_rho_unit = log_rho.sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            corrected = (log_rho_unit.squeeze(-1) > math.log(threshold))[valid.any(-1)]
            rho = log_rho_unit.exp().expand_as(log_rho)
        else:
            rho = log_rho.exp()
        outside = (rho < band[0]) | (rho > band[1]) if mode == "token-icepop" else rho > threshold
        if not mode.startswith("seq"):
            corrected = outside[valid]
        weights = rho.clamp(max=threshold) if mode.endswith("tis") else torch.where(outside, 0.0, rho)
        return torch.where(valid, weights, 0.0), log_rho[valid], corrected


def metrics(log_rho: torch.Tensor, corrected: torch.Tensor) -> dict:
    """From the raw per-token log-ratios log(pi_old / q) of a step (before truncation): the k3 estimate of
    KL(q || pi_old) = E_q[rho - 1 - log rho], rho's min / mean / max, the p99 of |log rho|, and the fraction of
    tokens or responses the correction truncated or masked."""
    if log_rho.numel() == 0:
        return {}
    rho = log_rho.double().exp()
    return {"rollout_kl_k3": (rho - 1 - log_rho.double()).mean().item(), "rollout_ratio_min": rho.min().item(),
            "rollout_ratio_mean": rho.mean().item(), "rollout_ratio_max": rho.max().item(),
            "rollout_abs_log_ratio_p99": quantile(log_rho.abs().float(), 0.99).item(),
            "rollout_corrected_frac": corrected.float().mean().item() if corrected.numel() else 0.0}


def reduced_metrics(log_rhos, corrected, device) -> dict:
    """metrics() over this step's tokens; under torchrun, means are token-weighted over the ranks, min / max are
    global, and the p99 is the largest rank's."""
    log_rho = torch.cat(log_rhos) if log_rhos else torch.zeros(0)
    flags = torch.cat(corrected) if corrected else torch.zeros(0, dtype=torch.bool)
    m = metrics(log_rho, flags)
    if D.world_size() == 1 or not m:
        return m
    count, units = D.all_reduce([log_rho.numel(), flags.numel()], device)
    means = D.all_reduce([m["rollout_kl_k3"] * log_rho.numel(), m["rollout_ratio_mean"] * log_rho.numel(),
                          m["rollout_corrected_frac"] * flags.numel()], device)
    m.update(rollout_kl_k3=means[0] / count, rollout_ratio_mean=means[1] / count,
             rollout_corrected_frac=means[2] / max(units, 1),
             rollout_ratio_min=D.all_reduce([m["rollout_ratio_min"]], device, op="min")[0],
             rollout_ratio_max=D.all_reduce([m["rollout_ratio_max"]], device, op="max")[0],
             rollout_abs_log_ratio_p99=D.all_reduce([m["rollout_abs_log_ratio_p99"]], device, op="max")[0])
    return m


def outside_kept_set(micro_batches, device) -> dict:
    """Sampled tokens that the trainer's kept set (logprobs.Truncation, vLLM's top-k / top-p rule on the trainer's
    distribution) leaves out, over every rank's response tokens. Their trainer log-prob over the sampler's support is
    -inf, so their weight is ~0 (log rho clamped at -LOG_RATIO_CLAMP; under seq-* their response's): logged, never
    silent. On CUDA vLLM finds its top-k / top-p cut-off with a Triton kernel (a bisection on the threshold, not the
    sort rule logprobs mirrors), so a token on the boundary can be kept by the sampler and not by the trainer: this
    counts how often."""
    outside = total = 0
    for mbs in micro_batches:
        for mb in mbs:
            valid = mb.response_mask > 0
            outside += (valid & ~mb.kept.inside).sum().item()
            total += valid.sum().item()
    outside, total = D.all_reduce([outside, total], device)
    return {"rollout_outside_kept_tokens": int(outside), "rollout_outside_kept_frac": outside / max(total, 1)}
