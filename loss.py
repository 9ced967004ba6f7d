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

Notation. For response token t of response i:
  d = pi_theta(y_t) / pi_old(y_t)   the importance ratio ("r" in most papers)
  A                                  the advantage (one GRPO value per response, broadcast)
  sg(x)                              stop-gradient, x.detach()
  eps_low, eps_high                  the clip range: the interval is [1 - eps_low, 1 + eps_high]

CE-GPPO (paper Eq. 8): per-token objective l, maximised; the loss here is -l.

  | region                      | l                               | d l / d log pi     |
  |-----------------------------|---------------------------------|--------------------|
  | d < 1 - eps_low  and A < 0  | beta1 * (1 - eps_low)/sg(d) d A | beta1 (1-eps_low) A |
  | d > 1 + eps_high and A > 0  | beta2 * (1 + eps_high)/sg(d) d A| beta2 (1+eps_high) A|
  | everything else             | d A                             | d A                |

  The forward value in the two clipped regions equals PPO-clip's, beta * (1 +- eps) * A
  (Eq. 9-10), but the gradient is kept, scaled by beta instead of zeroed.
  beta1 = beta2 = 0 is PPO-clip's gradient; beta1 = beta2 = 1 is GPPO.

Which beta moves entropy which way (paper §5.1-5.2): the beta1 region holds mostly negative
low-probability tokens; pushing them down further sharpens the distribution, so a larger
beta1 lowers entropy faster. The beta2 region holds mostly positive low-probability tokens;
raising them flattens the distribution, so a larger beta2 keeps entropy higher.
Recommended: (beta1, beta2) = (0.5, 1) for 1.5B models, (0.75, 1) for 7B; (1, 0.5) collapses.

Where the official code (Kwai-Klear/CE-GPPO, a verl fork) differs from the paper text:
  - dual clip: for A < 0 the per-token loss is min(-A * c, loss) with c = 10, so tokens with
    A < 0 and d > c get no gradient. Implemented here (clip_ratio_c; None turns it off).
  - a positive-example LM loss 0.1 * NLL(correct responses) is added: positive_example_lm_loss().
  - the token mean is taken per micro-batch and re-weighted by sequence count, which only
    approximates the mini-batch token mean. Here the mean is exact (num_tokens).
  - the official code does not clamp log(d) before exp; here it is clamped to [-20, 20] as verl's
    PPO loss does, so a runaway ratio cannot overflow (no gradient flows beyond the clamp).
"""

from dataclasses import dataclass
from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: large enough never to bind in practice, small enough not to overflow


# ---------------------------------------------------------------------------------------------
# 1. Token log-probs and entropy from logits, chunked
# ---------------------------------------------------------------------------------------------
# A naive log_softmax(logits.float()) materialises [batch, T, vocab] in fp32 (2.5 GB for 4,096
# tokens at Qwen's 151,936 vocabulary) and keeps it for backward. Here each chunk of tokens is
# upcast to fp32 (bf16 logsumexp loses precision), reduced to one number per token, and freed;
# backward recomputes the chunk's softmax. Extra memory stays near one fp32 chunk.

def _token_chunks(batch: int, length: int, chunk_tokens: int):
    """Yield (row slice, column slice) blocks of at most ~chunk_tokens tokens, as views."""
    if length >= chunk_tokens:
        for b in range(batch):
            for t in range(0, length, chunk_tokens):
                yield slice(b, b + 1), slice(t, t + chunk_tokens)
    else:
        rows = max(1, chunk_tokens // max(length, 1))
        for b in range(0, batch, rows):
            yield slice(b, b + rows), slice(None)


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log softmax(logits / T)[target] per token, forward and backward chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_tokens, with_entropy):
        batch, length, _ = logits.shape
        logp = torch.empty(batch, length, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for rows, cols in _token_chunks(batch, length, chunk_tokens):
            z = logits[rows, cols].to(torch.float32, copy=True)  # the fp32 chunk: the one vocab-sized buffer
            if temperature != 1.0:
                z.div_(temperature)
            # logsumexp by hand, in place, so the chunk costs two fp32 buffers (z and its exp), not four
            z_max = z.amax(dim=-1, keepdim=True)
            z.sub_(z_max)
            probs = z.exp()
            sum_exp = probs.sum(dim=-1, keepdim=True)
            z.sub_(sum_exp.log())  # z is now log softmax
            lse[rows, cols] = (z_max + sum_exp.log()).squeeze(-1)
            logp[rows, cols] = z.gather(-1, targets[rows, cols].unsqueeze(-1)).squeeze(-1)
            if with_entropy:  # H = -sum_v p_v log p_v
                entropy[rows, cols] = -probs.div_(sum_exp).mul_(z).sum(-1)
            del z, probs
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        if entropy is None:
            return logp
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, *unused_grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        batch, length, _ = logits.shape
        for rows, cols in _token_chunks(batch, length, ctx.chunk_tokens):
            g = grad_logp[rows, cols].unsqueeze(-1)
            z = logits[rows, cols].to(torch.float32, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            # d log p_y / d z_v = 1[v = y] - p_v ;  d z / d logits = 1 / temperature
            p = z.sub_(lse[rows, cols].unsqueeze(-1)).exp_()
            p.mul_(-g).scatter_add_(-1, targets[rows, cols].unsqueeze(-1), g)
            if temperature != 1.0:
                p.div_(temperature)
            grad_logits[rows, cols] = p
        return grad_logits, None, None, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_elements: int = 2**25,
):
    """Log-probs of `targets` under softmax(logits / temperature), and the entropy of that distribution.

    logits [batch, T, vocab] (any float dtype; already aligned so logits[:, t] predicts targets[:, t]),
    targets [batch, T] int64. Returns (logp [batch, T] fp32 with grad, entropy [batch, T] fp32 detached
    or None). Divide by the sampling temperature so log-probs match the distribution that was sampled.
    chunk_elements bounds the fp32 work buffer (2**25 floats = 128 MiB, ~220 tokens at vocab 151,936).
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [batch, T, vocab] and targets [batch, T]; got {tuple(logits.shape)} and {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk_tokens = max(1, chunk_elements // logits.shape[-1])
    out = _ChunkedTokenLogprob.apply(logits, targets.long(), float(temperature), chunk_tokens, with_entropy)
    return out if with_entropy else (out, None)


# ---------------------------------------------------------------------------------------------
# 2. Group-relative advantages
# ---------------------------------------------------------------------------------------------

def group_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6):
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-6), unbiased std as the official code.

    rewards [num_groups * group_size], the responses of one prompt contiguous. scale_by_std=False gives
    Dr. GRPO (arXiv 2503.20783): A_i = r_i - mean(r_group). Returns one advantage per response.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=True) + eps)
    return adv.view(-1)


# ---------------------------------------------------------------------------------------------
# 3. Dynamic clipping ("Flexible Entropy Control", arXiv 2602.09782)
# ---------------------------------------------------------------------------------------------
# The clip thresholds become functions of the token's current probability p = pi_theta(y_t)
# (detached): an upper threshold H(p) and a lower threshold M(p), each linear in p and clamped,
# looser for low-probability tokens. A schedule over training progress k/T mixes them with the
# standard eps_std. The paper's authors released no code; the slopes, intercepts and clamp below
# come from a third-party summary and are UNVERIFIED defaults, to be tuned.

@dataclass
class DynamicClip:
    """Dynamic clip thresholds and their schedule. Values marked unverified are not from the paper's code."""
    schedule: str = "id"  # "id" increase-then-decrease, "did" decrease-increase-decrease, "od" oscillatory decay
    eps_std: float = 0.2  # the standard clip range the schedules fall back to
    upper_slope: float = -0.25  # H(p) = clamp(upper_slope * p + upper_intercept)  (unverified)
    upper_intercept: float = 0.5  # (unverified)
    lower_slope: float = -0.13  # M(p) = clamp(lower_slope * p + lower_intercept)  (unverified)
    lower_intercept: float = 0.3  # (unverified)
    min_eps: float = 0.05  # clamp range of H(p) and M(p)  (unverified)
    max_eps: float = 0.6  # (unverified)
    od_floor: float = 0.2  # oscillatory decay: H_min = od_floor * initial entropy


DYNAMIC_SCHEDULES = ("id", "did", "od")


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


def oscillatory_decay_state(state: int, entropy: float, progress: float, initial_entropy: float, dc: DynamicClip) -> int:
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
# 4. Per-token losses, one function per algorithm
# ---------------------------------------------------------------------------------------------
# Each takes the same keywords and returns (loss [B, T] to be minimised, the ratio that the clip
# regions are judged on [B, T], the tokens removed by dual clip [B, T] bool). log_ratio is
# log pi_theta - log pi_old, clamped to +-LOG_RATIO_CLAMP; eps_* are floats or [B, T] tensors
# (dynamic clipping).


def _dual_clip(loss, adv, clip_ratio_c):
    """Dual-clip PPO (Ye et al. 2020, as verl): for A < 0, loss = min(loss, -A * c)."""
    if clip_ratio_c is None:
        return loss, torch.zeros_like(loss, dtype=torch.bool)
    cap = -adv * clip_ratio_c
    dual = (adv < 0) & (loss > cap)
    return torch.where(dual, cap, loss), dual


def ce_gppo_token_loss(*, log_ratio, adv, eps_low, eps_high, beta1, beta2, clip_ratio_c, **_):
    """CE-GPPO, paper Eq. 8 (gradient Eq. 9-10), then the official code's dual clip."""
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    in_beta1 = (r < 1 - eps_low) & (adv < 0)  # left boundary: negative, pushed-down tokens
    in_beta2 = (r > 1 + eps_high) & (adv > 0)  # right boundary: positive, pushed-up tokens
    # The gradient weight F on A * grad log pi: beta1 (1 - eps_low), beta2 (1 + eps_high), or d itself.
    # F / sg(d) * d has value F and gradient F * grad log pi (Eq. 9-10).
    weight = torch.where(in_beta1, beta1 * (1 - eps_low), torch.where(in_beta2, beta2 * (1 + eps_high), r))
    loss, dual = _dual_clip(-(weight / r) * ratio * adv, adv, clip_ratio_c)
    return loss, r, dual


def gppo_token_loss(**kw):
    """GPPO (Klear-Reasoner Eq. 7): CE-GPPO with beta1 = beta2 = 1, whatever beta1/beta2 are passed."""
    return ce_gppo_token_loss(**{**kw, "beta1": 1.0, "beta2": 1.0})


def ppo_clip_token_loss(*, log_ratio, adv, eps_low, eps_high, clip_ratio_c, **_):
    """PPO-clip (GRPO, DAPO): loss = max(-d A, -clip(d, 1 - eps_low, 1 + eps_high) A), then dual clip.

    Gradient: -d A * grad log pi, except zero where d < 1 - eps_low, A < 0 or d > 1 + eps_high, A > 0.
    """
    ratio = torch.exp(log_ratio)
    lo = 1 - eps_low
    hi = 1 + eps_high
    if not torch.is_tensor(lo):
        lo, hi = torch.tensor(lo, dtype=ratio.dtype, device=ratio.device), torch.tensor(hi, dtype=ratio.dtype, device=ratio.device)
    clipped = torch.minimum(torch.maximum(ratio, lo), hi)
    loss, dual = _dual_clip(torch.maximum(-adv * ratio, -adv * clipped), adv, clip_ratio_c)
    return loss, ratio.detach(), dual


def cispo_token_loss(*, logp, log_ratio, adv, eps_low, eps_high, **_):
    """CISPO (MiniMax-M1 Eq. 4): loss = -sg(clip(d, 1 - eps_low, 1 + eps_high)) * A * log pi.

    Every token keeps a gradient, weighted by the clipped, detached IS ratio. MiniMax-M1 sets no lower
    bound (eps_low = 1 here) and tunes only eps_high.
    """
    ratio = torch.exp(log_ratio.detach())
    weight = ratio.clamp(min=1 - eps_low, max=1 + eps_high)
    return -weight * adv * logp, ratio, torch.zeros_like(ratio, dtype=torch.bool)


def gspo_token_loss(*, logp, log_ratio, adv, mask, eps_low, eps_high, **_):
    """GSPO-token (GSPO Eq. 13-14): s_i = exp(mean_t log d_it) per response, and per token
    s_it = sg(s_i) * pi(y_t) / sg(pi(y_t)); loss = max(-s_it A, -clip(s_it, 1 - eps_low, 1 + eps_high) A).

    With one advantage per response and seq-mean-token-mean this is GSPO's sequence objective exactly:
    the gradient on log pi(y_t) is s_i A / |y_i|, and zero when s_i is clipped.
    """
    n = mask.sum(-1).clamp(min=1)
    seq_log_ratio = (log_ratio.detach() * mask).sum(-1) / n
    s = torch.exp(seq_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).unsqueeze(-1)
    s_tok = s * torch.exp(logp - logp.detach())
    clipped = s_tok.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(-adv * s_tok, -adv * clipped)
    return loss, s.expand_as(logp), torch.zeros_like(logp, dtype=torch.bool)


@dataclass(frozen=True)
class Algorithm:
    """How one algorithm plugs into policy_loss()."""
    token_loss: Callable  # per-token loss function, as above
    eps_low: float  # default lower clip range
    eps_high: float  # default upper clip range
    loss_agg_mode: str  # default aggregation
    dynamic_clip: bool  # whether dynamic clip thresholds apply


# Add a new algorithm here: one per-token loss function and one line.
ALGORITHMS = {
    "ce_gppo": Algorithm(ce_gppo_token_loss, 0.2, 0.2, "token-mean", True),  # CE-GPPO: symmetric 0.2, no clip-higher
    "gppo": Algorithm(gppo_token_loss, 0.2, 0.2, "token-mean", True),
    "grpo": Algorithm(ppo_clip_token_loss, 0.2, 0.2, "seq-mean-token-mean", True),  # GRPO Eq. 3 averages per response
    "dapo": Algorithm(ppo_clip_token_loss, 0.2, 0.28, "token-mean", True),  # DAPO: clip-higher + token-mean
    "cispo": Algorithm(cispo_token_loss, 1.0, 0.28, "token-mean", False),  # eps_high 0.28 is a common choice (unverified for the paper)
    "gspo": Algorithm(gspo_token_loss, 3e-4, 4e-4, "seq-mean-token-mean", False),  # GSPO paper's ranges
}

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------------------------
# 5. Aggregation
# ---------------------------------------------------------------------------------------------

def aggregate(token_loss, mask, mode="token-mean", *, num_tokens=None, num_seqs=None, norm_len=None):
    """Reduce a [B, T] per-token loss to a scalar.

    token-mean               sum_it loss / num_tokens             (DAPO, CE-GPPO; num_tokens = all
                                                                  response tokens of the mini-batch)
    seq-mean-token-mean      sum_i (sum_t loss / |y_i|) / num_seqs (GRPO, GSPO)
    seq-mean-token-sum-norm  sum_it loss / (num_seqs * norm_len)  (Dr. GRPO; norm_len a constant, e.g.
                                                                  the max response length)
    Pass the mini-batch's num_tokens / num_seqs when the mini-batch is split into micro-batches: the
    micro-batch losses then sum to the mini-batch loss exactly, and so do their gradients.
    """
    mask = mask.to(token_loss.dtype)
    summed = token_loss * mask
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return summed.sum() / torch.as_tensor(denom, dtype=token_loss.dtype).clamp(min=1)
    seqs = mask.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        per_seq = summed.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum-norm":
        length = mask.shape[-1] if norm_len is None else norm_len
        return summed.sum() / (seqs * length)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


# ---------------------------------------------------------------------------------------------
# 6. The entry point
# ---------------------------------------------------------------------------------------------

def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    algo: str = "ce_gppo",
    eps_low: float | None = None,
    eps_high: float | None = None,
    beta1: float = 0.5,
    beta2: float = 1.0,
    clip_ratio_c: float | None = 10.0,
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | None = None,
    loss_agg_mode: str | None = None,
    norm_len: int | None = None,
    dynamic_clip: DynamicClip | None = None,
    progress: float = 0.0,
    od_state: int = 0,
    entropy: torch.Tensor | None = None,
):
    """The policy-gradient loss of `algo` (minimised) and its diagnostics.

    logp       [B, T] log pi_theta of the sampled tokens (with grad), e.g. from token_logprobs_and_entropy
    old_logp   [B, T] log pi_old of the same tokens (no grad)
    advantages [B, 1] or [B, T]
    mask       [B, T] 1 on response tokens, 0 on padding
    eps_low / eps_high: clip range; None takes the algorithm's default (ALGORITHMS).
    beta1 / beta2: CE-GPPO's gradient scales on the left / right boundary (ignored by other algorithms).
    clip_ratio_c: dual-clip bound for A < 0 (ce_gppo, gppo, grpo, dapo); None disables it.
    num_tokens / num_seqs: the mini-batch's totals when this call sees one micro-batch (exact means).
    loss_agg_mode: None takes the algorithm's default; see aggregate().
    dynamic_clip, progress, od_state: replace eps_low / eps_high by the dynamic thresholds at
        training progress k/T (ce_gppo, gppo, grpo, dapo).
    entropy    [B, T] optional per-token entropy, to report the four entropy-sensitive regions.

    Returns (loss, metrics); metrics are detached 0-d tensors over this call's response tokens.
    """
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown algo {algo!r}; choose one of {sorted(ALGORITHMS)}")
    spec = ALGORITHMS[algo]
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp and mask must all be [batch, T]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.shape not in ((logp.shape[0], 1), logp.shape):
        raise ValueError(f"advantages must be [batch, 1] or [batch, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    eps_low = spec.eps_low if eps_low is None else eps_low
    eps_high = spec.eps_high if eps_high is None else eps_high
    if eps_low <= 0 or eps_high <= 0:
        raise ValueError(f"eps_low and eps_high must be > 0, got {eps_low} and {eps_high}")
    if beta1 < 0 or beta2 < 0:
        raise ValueError(f"beta1 and beta2 must be >= 0, got {beta1} and {beta2}")
    if clip_ratio_c is not None and clip_ratio_c <= 1 + eps_high:
        raise ValueError(f"clip_ratio_c must exceed 1 + eps_high = {1 + eps_high}, got {clip_ratio_c}")
    mode = spec.loss_agg_mode if loss_agg_mode is None else loss_agg_mode
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if dynamic_clip is not None:
        if not spec.dynamic_clip:
            raise ValueError(f"dynamic clipping applies to {[a for a, s in ALGORITHMS.items() if s.dynamic_clip]}, not {algo!r}")
        eps_low, eps_high = dynamic_clip_eps(logp.detach().exp(), dynamic_clip, progress, od_state)

    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).expand_as(logp)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_loss, ratio, dual = spec.token_loss(
        logp=logp, log_ratio=log_ratio, adv=adv, mask=mask, eps_low=eps_low, eps_high=eps_high,
        beta1=beta1, beta2=beta2, clip_ratio_c=clip_ratio_c,
    )
    loss = aggregate(token_loss, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    return loss, _metrics(logp, log_ratio.detach(), adv, mask, ratio, dual, eps_low, eps_high, entropy)


@torch.no_grad()
def _metrics(logp, log_ratio, adv, mask, ratio, dual, eps_low, eps_high, entropy):
    valid = mask > 0
    n = valid.sum().clamp(min=1)

    def frac(region):  # count_nonzero on bool is several times faster than sum()
        return torch.count_nonzero(region & valid) / n

    below, above = ratio < 1 - eps_low, ratio > 1 + eps_high
    neg, pos = adv < 0, adv > 0
    m = {
        "clip_frac_low_neg": frac(below & neg),  # the beta1 region
        "clip_frac_high_pos": frac(above & pos),  # the beta2 region
        "clip_frac_low_pos": frac(below & pos),
        "clip_frac_high_neg": frac(above & neg),
        "dual_clip_frac": frac(dual),
        "approx_kl": ((log_ratio.exp() - 1 - log_ratio) * mask).sum() / n,  # k3 estimate of KL(pi_old || pi_theta)
        "ratio_mean": (ratio * mask).sum() / n,
        "num_tokens": n,
    }
    if entropy is not None:  # the four entropy-sensitive regions of arXiv 2602.09782
        surprising = -logp.detach() > entropy  # -log pi > H: a low-probability token
        m["entropy_region_e1"] = frac(pos & ~surprising)  # lowers entropy
        m["entropy_region_e2"] = frac(pos & surprising)  # raises entropy
        m["entropy_region_e3"] = frac(neg & ~surprising)  # raises entropy
        m["entropy_region_e4"] = frac(neg & surprising)  # lowers entropy
    return m


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
