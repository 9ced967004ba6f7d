"""Per-token log-probs and entropy of the response tokens, without ever holding [tokens, vocab].

    logp, entropy = model_logprobs(model, input_ids, attention_mask, position_ids, response_ids,
                                   temperature=T, autocast_dtype=torch.bfloat16)

For a token with logits l over the vocabulary, z = l / T (T: the sampling temperature) and
    log p_v = z_v - lse,   lse = log sum_v exp(z_v)
    logp    = log p_y                        (y: the token that was sampled)
    H       = -sum_v p_v log p_v             (the entropy; carries gradient, for an entropy bonus)
and their gradients with respect to z, which both backward passes below form tile by tile:
    d logp / d z_v = 1[v = y] - p_v
    d H    / d z_v = -p_v (log p_v + H)
    d z    / d l   = 1 / T

At the 1.5B preset (16,384-token responses, vocabulary 151,936) the logits of one sequence are 5 GB in bf16 and
their gradient as much again. Three entry points, from the general to the memory-optimal:
  1. token_logprobs_and_entropy(logits, ...)        from logits you already hold; fp32 work one chunk of tokens
                                                    at a time
  2. hidden_logprobs_and_entropy(hidden, weight, ...) from the final hidden states and the LM head: the logits exist one
                                                       [tokens x vocab block] tile at a time, forward and backward
  3. model_logprobs(model, ...)                      the HF-model wrapper train.py calls (fused=True uses 2,
                                                     fused=False 1)
Both kernels can also return, without gradient, what the sampler's top-k / top-p truncation keeps (section 4), for
correcting the sampler/trainer mismatch.
"""

import math
from typing import NamedTuple

import torch

# Tiles of the fused kernel are [token chunk x vocab block] with at most chunk_elements fp32 entries. The vocabulary is
# split first (a vocab block of at least this many entries keeps the GEMMs wide); tokens only once a block of this width
# over all tokens would exceed the budget.
MIN_VOCAB_BLOCK = 1024
# A vocab block narrower than the whole vocabulary is a multiple of this: bf16 GEMMs whose leading dimension is not
# aligned leave Hopper's kernels for older ones (a block of 2**25 // 20,480 tokens = 1,638 did, on an H200).
VOCAB_ALIGN = 128
# Default tile budget. CPU: 2**22 (16 MiB): at the 1.5B head's shape the extra memory is then ~4% of the full-logits
# path's, and larger tiles were no faster on a 2-core EPYC. GPU: 2**25 (128 MiB): a tile costs ~50 kernel launches, and
# at 2**22 (148 tiles for 4,096 tokens) launching would take about as long as computing.
DEFAULT_TILE = {"cpu": 2**22}
DEFAULT_TILE_OTHER = 2**25
# The truncation statistics sort whole rows: sorted values, int64 order, probabilities, masks ~ 6x an fp32 row.
TRUNCATION_COST = 6


class Truncation(NamedTuple):
    """What the sampler's top-k / top-p keeps, under the trainer's distribution, per token."""
    log_kept_mass: torch.Tensor  # [..., T] log sum_{v kept} p_v   (0 when nothing is truncated)
    inside: torch.Tensor  # [..., T] bool: the target token is in the kept set


def truncated_logprobs(logp: torch.Tensor, trunc: Truncation) -> torch.Tensor:
    """log p(y) under the truncated, renormalised distribution: logp - log_kept_mass inside the kept set, -inf
    outside."""
    return torch.where(trunc.inside, logp - trunc.log_kept_mass, torch.full_like(logp, -math.inf))


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32  # fp32 softmax; fp64 inputs stay fp64 (tests)


def _check(temperature, truncation, *inputs):
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if truncation is not None:
        top_p, top_k = truncation
        if not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"truncation must be (top_p in (0, 1], top_k >= 0); got {truncation}")
        if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs):
            raise ValueError("truncation statistics carry no gradient: compute them under torch.no_grad()")


def _grad_logits(z, lse, entropy, g_logp, g_ent, y, temperature, in_block=None):
    """d loss / d logits for one tile, in place on z (the tile's logits / T, fp32).

    dL/dz_v = g_logp (1[v = y] - p_v) - g_H p_v (log p_v + H)
            = -p_v (g_logp + g_H (log p_v + H)) + g_logp 1[v = y]
    y: [..., 1] target index within the tile; in_block: whether it lies in this vocab block (None: always).
    """
    log_p = z.sub_(lse.unsqueeze(-1))
    p = log_p.exp()
    if g_ent is not None:
        coef = log_p.add_(entropy.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1))  # g_H (log p_v + H)
        if g_logp is not None:
            coef.add_(g_logp.unsqueeze(-1))
        grad = p.mul_(coef).neg_()
    else:
        grad = p.mul_(g_logp.neg().unsqueeze(-1))
    del log_p
    if g_logp is not None:
        src = g_logp if in_block is None else g_logp * in_block
        grad.scatter_add_(-1, y, src.unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


# ---------------------------------------------------------------------------------------------
# 1. From logits, chunked over tokens
# ---------------------------------------------------------------------------------------------
# A naive log_softmax(logits.float()) materialises [batch, T, vocab] in fp32 (2.5 GB for 4,096 tokens at Qwen's
# 151,936 vocabulary) and keeps it for backward. Here each chunk of tokens is upcast to fp32 (bf16 logsumexp loses
# precision), reduced to a few numbers per token, and freed; backward recomputes the chunk's softmax. Extra memory
# stays near one fp32 chunk, beyond the logits' gradient that backward has to return.

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


def _logits_forward(logits, targets, temperature, chunk_tokens, with_entropy, truncation):
    batch, length, _ = logits.shape
    acc = _acc_dtype(logits.dtype)
    logp = torch.empty(batch, length, dtype=acc, device=logits.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    if truncation is not None:
        trunc = Truncation(torch.empty_like(logp), torch.empty(batch, length, dtype=torch.bool, device=logits.device))
        chunk_tokens = max(1, chunk_tokens // TRUNCATION_COST)
    for rows, cols in _token_chunks(batch, length, chunk_tokens):
        z = logits[rows, cols].to(acc, copy=True)  # the fp32 chunk: the one vocab-sized buffer
        if temperature != 1.0:
            z.div_(temperature)
        # logsumexp by hand, in place, so the chunk costs two fp32 buffers (z and its exp), not four
        z_max = z.amax(dim=-1, keepdim=True)
        z.sub_(z_max)
        probs = z.exp()
        sum_exp = probs.sum(dim=-1, keepdim=True)
        z.sub_(sum_exp.log())  # z is now log softmax
        lse[rows, cols] = (z_max + sum_exp.log()).squeeze(-1)
        y = targets[rows, cols].unsqueeze(-1)
        logp[rows, cols] = z.gather(-1, y).squeeze(-1)
        if with_entropy:  # H = -sum_v p_v log p_v
            entropy[rows, cols] = -probs.div_(sum_exp).mul_(z).sum(-1)
        del probs
        if truncation is not None:  # z is normalised already: lse 0
            mass, inside = _truncation(z, 0.0, y, *truncation)
            trunc.log_kept_mass[rows, cols], trunc.inside[rows, cols] = mass, inside
        del z
    return logp, entropy, lse, (trunc if truncation is not None else None)


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log softmax(logits / T)[target] and the entropy per token, forward and backward chunk by chunk."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_tokens, with_entropy):
        logp, entropy, lse, _ = _logits_forward(logits, targets, temperature, chunk_tokens, with_entropy, None)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, and its terms are skipped
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        if g_logp is None and g_ent is None:
            return (None,) * 5
        logits, targets, lse, entropy = ctx.saved_tensors
        acc = _acc_dtype(logits.dtype)
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        batch, length, _ = logits.shape
        for rows, cols in _token_chunks(batch, length, ctx.chunk_tokens):
            z = logits[rows, cols].to(acc, copy=True)
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            grad_logits[rows, cols] = _grad_logits(
                z, lse[rows, cols], None if g_ent is None else entropy[rows, cols],
                None if g_logp is None else g_logp[rows, cols], None if g_ent is None else g_ent[rows, cols],
                targets[rows, cols].unsqueeze(-1), ctx.temperature)
        return grad_logits, None, None, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_elements: int = 2**25,
    truncation: tuple[float, int] | None = None,
):
    """Log-probs of `targets` under softmax(logits / temperature), and the entropy of that distribution.

    logits [batch, T, vocab] (any float dtype; already aligned so logits[:, t] predicts targets[:, t]),
    targets [batch, T] int64. Returns (logp [batch, T] fp32, entropy [batch, T] fp32 or None), both with gradient;
    with truncation=(top_p, top_k) (no-grad only) a third item, a Truncation (section 4).
    chunk_elements bounds the fp32 work buffer (2**25 floats = 128 MiB, ~220 tokens at vocab 151,936).
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [batch, T, vocab] and targets [batch, T]; got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    _check(temperature, truncation, logits)
    chunk_tokens = max(1, chunk_elements // logits.shape[-1])
    if truncation is not None:
        logp, entropy, _, trunc = _logits_forward(logits, targets.long(), float(temperature), chunk_tokens,
                                                  with_entropy, truncation)
        return logp, entropy, trunc
    out = _ChunkedTokenLogprob.apply(logits, targets.long(), float(temperature), chunk_tokens, with_entropy)
    return out if with_entropy else (out, None)


# ---------------------------------------------------------------------------------------------
# 2. From hidden states and the LM head, fused: logits exist one tile at a time
# ---------------------------------------------------------------------------------------------
# logits = hidden @ weight.T (+ bias) is computed per [token chunk x vocab block] tile, in the autocast dtype when
# autocast is on (bf16), otherwise in the inputs' dtype; the tile is upcast to fp32 and folded into running per-token
# statistics, then freed.
# What it promises under autocast, on every device (GPU, CPUs with or without native bf16): the logits are those
# autocast's own linear returns, bf16 operands with an fp32 accumulator rounded once to bf16 (bias included), and the
# softmax, log-probs and entropy are fp32 functions of those bf16 logits; backward feeds bf16-rounded dL/dlogits and
# bf16 operands to its GEMMs and accumulates in fp32. So the fused head equals the unfused path under autocast (and
# one device equals another) up to fp32 summation order, not up to bf16 rounding. The vocabulary is the outer loop, so
# that the weight is read (and cast) once per call and no weight-sized temporary exists; the log-sum-exp and the entropy
# are merged across vocab blocks online:
#   per token keep m (max of z so far), s = sum exp(z - m), u = sum exp(z - m) (z - m); a block (m_b, s_b, u_b)
#   merges as m' = max(m, m_b), a = exp(m - m'), c = exp(m_b - m'),
#   s' = a s + c s_b,   u' = a (u + s (m - m')) + c (u_b + s_b (m_b - m'))
#   and at the end lse = m + log s, H = log s - u / s  (as -sum p log p with log p = z - m - log s).
# Backward recomputes each tile's logits from the saved hidden states and weight (one GEMM more than holding them:
# the price of never holding [tokens, vocab]), forms dL/dz in fp32 and accumulates, in fp32,
#   grad_hidden[chunk] += G @ weight[block]      (over vocab blocks)
#   grad_weight[block] += G.T @ hidden[chunk]     (over token chunks; one GEMM when one chunk holds all tokens)
# The [tokens, hidden] and [vocab block, hidden] accumulators are the only buffers beyond the tile.

# Torch's CPU GEMM in bf16/fp16 without AVX512-BF16 or AMX is 10-100x slower than in fp32 (0.3-4 vs 25-32 GFLOP/s
# measured on a 2-core AVX2 EPYC). There the operands, rounded to the half dtype as autocast would, run as an fp32 GEMM:
# the products of half-precision numbers are exact in fp32 and the GEMM accumulates in fp32 either way; only the
# the fp32 output tile is then rounded to bf16, as a bf16 GEMM rounds its accumulator, so both give the same logits.
_CPU_HALF_GEMM = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                      or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _gemm_dtype(dtype, device):
    if dtype in (torch.bfloat16, torch.float16) and device.type == "cpu" and not _CPU_HALF_GEMM:
        return torch.float32
    return dtype


def _operand(x, dtype, gemm):
    """x rounded to the compute dtype, held in the GEMM dtype (a no-op when both match x)."""
    return x.to(dtype).to(gemm)


def _gemm_into(out, a, b, accumulate):
    """out (+)= a @ b, with out in fp32: in place when the GEMM runs in fp32, else via one product buffer."""
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


def _tile(tokens, vocab, chunk_elements, full_rows):
    """(token chunk, vocab block) sizes, tokens x block <= chunk_elements."""
    if full_rows:  # truncation sorts whole rows
        return max(1, chunk_elements // (vocab * TRUNCATION_COST)), vocab
    block = min(vocab, max(MIN_VOCAB_BLOCK, chunk_elements // max(tokens, 1) // VOCAB_ALIGN * VOCAB_ALIGN))
    return min(max(tokens, 1), max(1, chunk_elements // block)), block


def _round_(x, dtype):
    """x rounded to `dtype` in place (x stays fp32), a slice at a time: no tile-sized temporary."""
    if x.dtype != dtype:
        for part in x.view(-1).split(1 << 18):
            part.copy_(part.to(dtype))
    return x


def _tile_logits(h, w, b, temperature, acc, dtype):
    z = h @ w.T if b is None else torch.addmm(b, h, w.T)  # [chunk, block]; b in the GEMM dtype, added before rounding
    # rounded once to the compute dtype on every device (the promise above): a half GEMM's output already is; an fp32
    # GEMM on half operands is rounded here, as that GEMM would round its accumulator
    z = z.to(acc) if z.dtype != acc else _round_(z, dtype if dtype in (torch.bfloat16, torch.float16) else acc)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _tile_targets(targets, v0, v1):
    """Target indices within vocab block [v0, v1) (clamped, so always valid) and whether the target lies in it."""
    y = targets - v0
    in_block = (y >= 0) & (y < v1 - v0)
    return y.clamp(0, v1 - v0 - 1).unsqueeze(-1), in_block


def _fused_forward(hidden, weight, bias, targets, temperature, dtype, chunk_elements, with_entropy, truncation):
    """hidden [N, H], weight [V, H], bias [V] | None, targets [N] -> logp, entropy | None, lse, Truncation | None."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc, gemm = _acc_dtype(dtype), _gemm_dtype(dtype, hidden.device)
    h = _operand(hidden, dtype, gemm)
    chunk, block = _tile(n, vocab, chunk_elements, truncation is not None)
    m, s, u, z_y = (torch.zeros(n, dtype=acc, device=hidden.device) for _ in range(4))
    if truncation is not None:
        trunc = Truncation(torch.empty_like(m), torch.empty(n, dtype=torch.bool, device=hidden.device))
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        w = _operand(weight[v0:v1], dtype, gemm)
        b = None if bias is None else _operand(bias[v0:v1], dtype, gemm)
        for n0 in range(0, n, chunk):
            rows = slice(n0, min(n0 + chunk, n))
            z = _tile_logits(h[rows], w, b, temperature, acc, dtype)
            y, in_block = _tile_targets(targets[rows], v0, v1)
            m_b = z.amax(dim=-1, keepdim=True)
            z.sub_(m_b)  # z - m_b <= 0: exp cannot overflow
            z_y[rows] = torch.where(in_block, z.gather(-1, y).squeeze(-1) + m_b.squeeze(-1), z_y[rows])
            e = z.exp() if with_entropy or truncation is not None else z.exp_()
            s_b = e.sum(-1)
            u_b = e.mul_(z).sum(-1) if with_entropy else None  # sum exp(z - m_b) (z - m_b)
            del e
            if truncation is not None:  # whole rows here: log s_b is the row's lse relative to m_b
                trunc.log_kept_mass[rows], trunc.inside[rows] = _truncation(z, s_b.log(), y, *truncation)
            del z
            m_b = m_b.squeeze(-1)
            if v0 == 0:
                m[rows], s[rows] = m_b, s_b
                if with_entropy:
                    u[rows] = u_b
                continue
            m_old = m[rows]
            m_new = torch.maximum(m_old, m_b)
            a, c = (m_old - m_new).exp(), (m_b - m_new).exp()
            if with_entropy:
                u[rows] = a * (u[rows] + s[rows] * (m_old - m_new)) + c * (u_b + s_b * (m_b - m_new))
            s[rows] = a * s[rows] + c * s_b
            m[rows] = m_new
    log_s = s.log()
    lse = m + log_s
    entropy = log_s - u / s if with_entropy else None
    return z_y - lse, entropy, lse, (trunc if truncation is not None else None)


def _fused_backward(hidden, weight, bias, targets, lse, entropy, g_logp, g_ent, temperature, dtype, chunk_elements,
                    needs):
    need_h, need_w, need_b = needs
    n, vocab = hidden.shape[0], weight.shape[0]
    acc, gemm = _acc_dtype(dtype), _gemm_dtype(dtype, hidden.device)
    h = _operand(hidden, dtype, gemm)
    chunk, block = _tile(n, vocab, chunk_elements, False)
    grad_h = torch.empty(n, hidden.shape[1], dtype=acc, device=hidden.device) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = torch.zeros(vocab, dtype=acc, device=hidden.device) if need_b else None
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        w = _operand(weight[v0:v1], dtype, gemm)
        b = None if bias is None else _operand(bias[v0:v1], dtype, gemm)
        # grad_weight's block accumulates in fp32: in the result itself when that is fp32
        gw = (grad_w[v0:v1] if grad_w.dtype == acc else torch.empty(v1 - v0, weight.shape[1], dtype=acc,
                                                                    device=weight.device)) if need_w else None
        for n0 in range(0, n, chunk):
            rows = slice(n0, min(n0 + chunk, n))
            z = _tile_logits(h[rows], w, b, temperature, acc, dtype)
            y, in_block = _tile_targets(targets[rows], v0, v1)
            grad = _grad_logits(z, lse[rows], None if g_ent is None else entropy[rows],
                                None if g_logp is None else g_logp[rows], None if g_ent is None else g_ent[rows],
                                y, temperature, in_block)
            # bf16 dL/dlogits under autocast, as autocast's linear receives it (in place where the GEMM runs in fp32)
            g = (grad.to(gemm) if gemm != grad.dtype
                 else _round_(grad, dtype if dtype in (torch.bfloat16, torch.float16) else gemm))
            if need_h:
                _gemm_into(grad_h[rows], g, w, accumulate=v0 > 0)
            if need_w:
                _gemm_into(gw, g.T, h[rows], accumulate=n0 > 0)
            if need_b:
                grad_b[v0:v1] += grad.sum(0)
            del z, grad, g
        if need_w and gw.dtype != grad_w.dtype:
            grad_w[v0:v1] = gw
    return (None if grad_h is None else grad_h.to(hidden.dtype), grad_w,
            None if grad_b is None else grad_b.to(bias.dtype))


class _FusedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, dtype, chunk_elements, with_entropy):
        with torch.autocast(hidden.device.type, enabled=False):  # casts are explicit in here
            logp, entropy, lse, _ = _fused_forward(hidden, weight, bias, targets, temperature, dtype, chunk_elements,
                                                   with_entropy, None)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.args = temperature, dtype, chunk_elements
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, and its terms are skipped
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        if g_logp is None and g_ent is None:
            return (None,) * 8
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _fused_backward(hidden, weight, bias, targets, lse, entropy, g_logp, g_ent, *ctx.args, needs)
        return (*grads, None, None, None, None, None)


def hidden_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    with_entropy: bool = True,
    chunk_elements: int | None = None,
    truncation: tuple[float, int] | None = None,
):
    """token_logprobs_and_entropy(hidden @ weight.T + bias, targets, ...) without the [tokens, vocab] logits.

    hidden [..., H] (the final hidden states, aligned so hidden[..., t, :] predicts targets[..., t]), weight [V, H] (the
    LM head; tied or not), targets [...] int64. The GEMMs run in the autocast dtype when autocast is on, else in the
    inputs' dtype; the softmax in fp32. Returns (logp [...] fp32, entropy [...] fp32 or None) with gradient to hidden,
    weight and bias; with truncation=(top_p, top_k) (no-grad only) a third item, a Truncation (section 4).
    chunk_elements bounds one fp32 logits tile; None: DEFAULT_TILE for the device (CPU 2**22 = 16 MiB, all of 4,096
    tokens x a 1,024-entry vocab block; GPU 2**25).
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or targets.shape != hidden.shape[:-1]:
        raise ValueError(f"need hidden [..., H], weight [V, H], targets [...]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    _check(temperature, truncation, hidden, weight, bias)
    device = hidden.device.type
    chunk_elements = chunk_elements or DEFAULT_TILE.get(device, DEFAULT_TILE_OTHER)
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    lead = targets.shape
    h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).long()
    if truncation is not None:
        with torch.autocast(device, enabled=False):
            logp, entropy, _, trunc = _fused_forward(h, weight, bias, y, float(temperature), dtype, chunk_elements,
                                                     with_entropy, truncation)
        return (logp.view(lead), None if entropy is None else entropy.view(lead),
                Truncation(trunc.log_kept_mass.view(lead), trunc.inside.view(lead)))
    out = _FusedHeadLogprob.apply(h, weight, bias, y, float(temperature), dtype, chunk_elements, with_entropy)
    logp, entropy = out if with_entropy else (out, None)
    return logp.view(lead), None if entropy is None else entropy.view(lead)


# ---------------------------------------------------------------------------------------------
# 3. On an HF causal LM: what train.py calls
# ---------------------------------------------------------------------------------------------
# Fused, the model still runs its own forward (model(..., logits_to_keep=R + 1)): only its LM head's forward is swapped,
# for this one call, for a function that receives the hidden states HF would turn into logits (Qwen2ForCausalLM.forward
# does exactly `logits = self.lm_head(hidden_states[:, -(R + 1):, :])`, nothing after) and returns the log-probs in
# their place. Under FSDP2 the root unit (embeddings, final norm, LM head) has its parameters gathered only during the
# root module's forward, and reduce-scatters their gradients from its own backward hooks; swapping the head's forward
# keeps both: the weight the kernel uses is the gathered one (gathered once per call, not per tile), and autograd
# accumulates the kernel's weight gradient into that very tensor, where FSDP's hooks expect it.
# Models that post-process the logits (softcapping, a logit scale) would silently lose it: check_fused() tells.
# Packed rows (packed=Packing): several sequences in one row [1, L], position ids restarting at 0 for each, no attention
# mask, and logits_to_keep the 1-D tensor of the positions that predict response tokens (HF indexes the hidden states
# with it). Attention must not cross sequences: the training model runs cegppo_utils/attention.py, which finds the
# sequences from the restarting position ids and attends within each (varlen kernels on a GPU); under transformers'
# own sdpa / eager a block-diagonal causal mask over the whole row does the same at L^2 cost. tests/test_logprobs.py
# checks that a packed row gives what separate padded rows give, through either.

class Packing(NamedTuple):
    """Where the response tokens of a packed row are (train.pack): sequences concatenated into input_ids [1, L],
    position ids restarting at 0 for each, no attention mask. N response tokens in all, returned in the [S, R] layout of
    response_ids (S sequences, responses right-padded to R)."""
    positions: torch.Tensor  # [N] long: the row position whose hidden state predicts each response token
    seqs: torch.Tensor  # [N] long: the token's sequence (its row in [S, R])
    cols: torch.Tensor  # [N] long: its index within that response (its column in [S, R])
    layout: object = None  # attention.Layout of the row's sequences (train.pack), so no forward searches for them


def model_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    response_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    autocast_dtype: torch.dtype | None = None,
    with_entropy: bool = True,
    fused: bool = True,
    truncation: tuple[float, int] | None = None,
    chunk_elements: int | None = None,
    packed: Packing | None = None,
):
    """Log-probs [B, R] fp32 (and entropy [B, R] fp32, or None) of response_ids under softmax(logits / temperature).

    The batch layout of train.collate: input_ids [B, P + R] with prompts left-padded into the first P columns and the
    responses (response_ids [B, R]) right-padded in the last R. autocast_dtype: None (no autocast) or torch.bfloat16.
    fused=False is the reference: full logits of the last R + 1 positions, then token_logprobs_and_entropy.
    With truncation=(top_p, top_k) (under no_grad) a Truncation comes third.
    packed: train.pack's layout instead (input_ids [1, L], attention_mask None; see Packing); the results come back
    [B, R] all the same, 0 on padding (log_kept_mass 0, inside True).
    """
    device = input_ids.device.type
    autocast = torch.autocast(device, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None)
    if packed is None:
        keep, targets = response_ids.shape[1] + 1, response_ids
    else:  # only the hidden states that predict a response token reach the head (HF indexes them by a tensor)
        keep, targets = packed.positions, response_ids[packed.seqs, packed.cols].unsqueeze(0)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  logits_to_keep=keep, use_cache=False)
    if packed is not None and packed.layout is not None:
        _expect_packed_layout(model, inputs, packed.layout)
    options = dict(temperature=temperature, with_entropy=with_entropy, truncation=truncation)
    if chunk_elements is not None:
        options["chunk_elements"] = chunk_elements
    if not fused:
        with autocast:
            logits = model(**inputs).logits
        out = token_logprobs_and_entropy(logits if packed is not None else logits[:, :-1], targets, **options)
    else:
        out = _fused_model_logprobs(model, inputs, autocast, targets, packed is None, options)
    return out if packed is None else _unpack(out, packed, response_ids.shape)


def _expect_packed_layout(model, inputs, layout):
    """A packed row whose sequences its builder gave: under attention.py's per-sequence attention, every forward reads
    them from there (attention.expect_layout) and transformers builds no mask (a mapping of each layer type to None,
    which the model families with layer types take as built; its search of the position ids for packed sequences is
    a host sync). Under any other attention the model finds the sequences itself, as before."""
    from cegppo_utils import attention
    if model.config._attn_implementation != attention.NAME:
        return
    attention.expect_layout(inputs["position_ids"], layout)
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types:
        inputs["attention_mask"] = dict.fromkeys(layer_types)


def _fused_model_logprobs(model, inputs, autocast, targets, drop_last, options):
    """model_logprobs(fused=True): the model's forward with its LM head swapped for the fused kernel."""
    head = model.get_output_embeddings()
    result, width = [], targets.shape[1] + drop_last

    def fused_head(hidden):  # hidden [B, R + 1, H] (packed: [1, N, H]): the positions that predict the responses
        if hidden.shape[1] != width:
            raise RuntimeError(f"the LM head got {hidden.shape[1]} positions, expected {width} (logits_to_keep)")
        out = hidden_logprobs_and_entropy(hidden[:, :-1] if drop_last else hidden, head.weight, targets, bias=head.bias,
                                          **options)
        result.append(out)
        return out[0].clone()  # logp stands in for the logits (a copy: FSDP hooks want no view), in the graph

    own_forward = head.__dict__.get("forward")
    head.forward = fused_head
    try:
        with autocast:
            logp = model(**inputs).logits
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
    if len(result) != 1:
        raise RuntimeError(f"the model called its output embedding {len(result)} times; fused=False is the way")
    return (logp, *result[0][1:])


def _unpack(out, packed: Packing, shape):
    """[1, N] results of a packed row -> [S, R] (index_put keeps the gradient)."""
    where = (packed.seqs, packed.cols)

    def place(x, fill=0):
        return None if x is None else x.new_full(shape, fill).index_put(where, x[0])
    items = [place(out[0]), place(out[1])]
    if len(out) > 2:
        items.append(Truncation(place(out[2].log_kept_mass), place(out[2].inside, True)))
    return tuple(items)


# Config fields by which transformers' causal LMs post-process logits after the LM head: Gemma 2/3 and others
# (softcapping), Cohere (logit_scale), Granite (logits_scaling). The numeric check below catches the rest.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_fused(model, *, autocast_dtype: torch.dtype | None = None, tokens: int = 4) -> bool:
    """True when model_logprobs(fused=True) computes what fused=False does for this model. Cheap; call once at start
    (under FSDP on every rank: it runs two forwards). False for a head that is not a plain [V, H] weight, a config that
    names a logit post-processing step, or log-probs/entropies that differ on a small padded batch."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    config = getattr(model, "config", None)
    for name in _LOGIT_POSTPROCESSING:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            return False
    device = next(model.parameters()).device
    vocab = weight.shape[0]
    # two sequences, the first prompt left-padded by one, the second response right-padded by one
    ids = (torch.arange(2 * (2 * tokens + 1), device=device).view(2, -1) * 7919 + 11) % vocab
    attention = torch.ones_like(ids)
    attention[0, 0] = 0
    attention[1, -1] = 0
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    response = ids[:, tokens + 1:]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
                logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids,
                               logits_to_keep=tokens + 1, use_cache=False).logits
            want = token_logprobs_and_entropy(logits[:, :-1], response)
            got = model_logprobs(model, ids, attention, position_ids, response, autocast_dtype=autocast_dtype)
    except (RuntimeError, TypeError, AttributeError):
        return False
    finally:
        model.train(was_training)
        if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters gathered after a forward with no backward;
            model.reshard()  # an optimizer built now must see the sharded ones
    # the dtype the model computed its logits in (autocast, or FSDP's bf16 parameters): bf16 logits near 30 are rounded
    # by up to 0.06, so allow 0.25 there; a softcap or a logit scale moves them by more
    tol = 0.25 if logits.dtype in (torch.bfloat16, torch.float16) else 1e-3
    return all(torch.allclose(g, w, rtol=0, atol=tol) for g, w in zip(got, want))


# ---------------------------------------------------------------------------------------------
# 4. What the sampler's top-k / top-p truncation keeps
# ---------------------------------------------------------------------------------------------
# vLLM (v1, apply_top_k_top_p_pytorch / apply_top_k_only: the native and CPU path) on z = logits / T in fp32:
#   top-k, k in [1, V): the threshold is the k-th largest value; tokens with z < threshold are removed. Ties with the
#     threshold all stay, so more than k tokens can survive. k = 0 (or >= V) is off.
#   then top-p, p < 1: over the survivors only (softmax renormalised over them), sort ascending and take the cumulative
#     sum from the smallest; tokens whose cumulative sum is <= 1 - p (1 - p in fp32) are removed, the largest token is
#     always kept. So the boundary token (the first whose cumulative sum passes 1 - p) is kept and the kept mass is
#     >= p; tokens tied in value are ordered by torch.sort, which decides which of them straddle the boundary.
# The kept set is evaluated on THIS (the trainer's) distribution; log_kept_mass is the log of its untruncated mass.
# Sorting needs whole rows, so with truncation the fused kernel's tiles are [a few tokens x the whole vocabulary] and
# the LM head is cast to the compute dtype once per call (a weight-sized temporary when the dtypes differ; no-grad
# only, e.g. for the old log-probs).

def _truncation(z, lse, y, top_p, top_k):
    """z [..., V] logits / T (any shift, with lse the log-sum-exp of that shifted row), y [..., 1] target index."""
    vocab = z.shape[-1]
    k = top_k if 0 < top_k < vocab else 0
    if top_p >= 1.0 and not k:
        return torch.zeros(z.shape[:-1], dtype=z.dtype, device=z.device), torch.ones(z.shape[:-1], dtype=torch.bool,
                                                                                      device=z.device)
    if top_p >= 1.0:  # top-k alone: no sort (vLLM's apply_top_k_only)
        removed = z < z.topk(k, dim=-1).values[..., -1:]
        inside = ~removed.gather(-1, y).squeeze(-1)
        return z.masked_fill(removed, -math.inf).logsumexp(-1) - lse, inside
    z_sorted, order = z.sort(dim=-1)  # ascending, as vLLM sorts
    if k:
        z_sorted.masked_fill_(z_sorted < z_sorted[..., vocab - k:vocab - k + 1], -math.inf)
    cumulative = z_sorted.softmax(dim=-1).cumsum_(dim=-1)
    removed = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32)
    del cumulative
    removed[..., -1] = False
    z_sorted.masked_fill_(removed, -math.inf)
    kept_sorted = z_sorted > -math.inf
    kept = torch.empty_like(kept_sorted).scatter_(-1, order, kept_sorted)  # back to vocabulary order
    return z_sorted.logsumexp(-1) - lse, kept.gather(-1, y).squeeze(-1)
