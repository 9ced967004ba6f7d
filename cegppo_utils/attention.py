"""Attention that costs per sequence, not per row: what the training model runs (train.load_policy).

    from cegppo_utils import attention
    attention.use(model)        # -> "per_sequence" (registered with transformers), or "sdpa" where it cannot apply

A micro-batch holds several sequences, either packed into one row (train.pack: no attention mask, position ids
restarting at 0 for each) or padded into rows (train.collate: prompts left-padded, responses right-padded, a 2-D
mask). transformers' sdpa turns both into an [L, L] mask per row (a block-diagonal one for a packed row, where its
causal skip is off), so attention costs L^2 per row and runs no flash kernel: at the 1.5B preset a packed row of
20,480 tokens pays attention over the whole row, and a padded micro-batch of 4 builds a [4, 1, 20480, 20480] mask
(1.6 GiB). Here the tokens that attend are gathered into one stream [T, heads, head_dim] with the sequences' starts
(cu_seqlens, as varlen kernels take them) and causal attention runs within each sequence, for sum_i l_i^2:

  where the sequences are   a 2-D mask: each row's unmasked tokens are one sequence (padding takes no part);
                            no mask: a sequence starts at every row's first token and wherever the position ids
                            do not continue (position_ids[t] != position_ids[t - 1] + 1), as packed rows restart;
                            a packed row's own layout where its builder gave it (expect_layout: train.pack knows
                            the sequences' lengths), so no forward searches for them (a host sync each)
  the kernel (kernel_for)   CUDA, bf16 / fp16: torch.nn.attention.varlen.varlen_attn (PyTorch's flash or cuDNN
                            varlen kernel), else flash_attn.flash_attn_varlen_func (FlashAttention-2) where installed;
                            otherwise (CPU, fp32): causal sdpa on each sequence in turn, which on a CPU runs its flash
                            kernel and skips the masked half
  padding positions         get 0 (their outputs are never read: the loss masks them)

With a KV cache (HF generate's decoding steps, queries fewer than keys) attention is sdpa under the causal and
padding mask, as transformers' own. tests/test_logprobs.py checks packed against padded (log-probs, entropy,
gradients) through every kernel a CPU runs, and the CUDA kernels' calls against CPU stand-ins (tests/test_cuda.py).
"""

import functools
import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F

NAME = "per_sequence"  # the attn_implementation name this module registers with transformers


class Layout(NamedTuple):
    """Where the sequences of a [B, L] batch are, as the varlen kernels take them."""
    index: torch.Tensor | None  # [T] positions (b * L + t) of the tokens that attend; None: every token
    cu_seqlens: torch.Tensor  # [N + 1] int32 on the batch's device: sequence i is stream[cu[i]:cu[i + 1]]
    lengths: list[int]  # the N sequences' lengths (none empty)
    max_len: int


def layout(attention_mask, position_ids, batch: int, length: int, device) -> Layout:
    """The sequences of a batch: from the 2-D padding mask where there is one, else from the position ids."""
    if attention_mask is not None:
        keep = attention_mask[:, -length:].bool()
        index = keep.reshape(-1).nonzero().squeeze(1)
        lengths = [n for n in keep.sum(1).tolist() if n]
    else:
        starts = torch.zeros(batch, length, dtype=torch.bool, device=device)
        starts[:, 0] = True
        if position_ids is not None:
            positions = position_ids.expand(batch, length)
            starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        edges = starts.reshape(-1).nonzero().squeeze(1).tolist() + [batch * length]
        return from_lengths([b - a for a, b in zip(edges, edges[1:])], device)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return Layout(index, cu, lengths, max(lengths, default=0))


def from_lengths(lengths: list[int], device) -> Layout:
    """The layout of sequences of these lengths laid end to end (a packed row, or several rows' worth), built on the
    host, so no forward reads the device for it. Its one device copy, cu_seqlens from pageable host memory, is a
    blocking host-to-device copy: the host waits until the stream has run everything queued before it (a host sync,
    which CUDA's sync-debug mode reports). train.pack builds every row's layout when the update's micro-batches are
    made, before their forwards are queued, so the stream has little or nothing to finish then."""
    cu = torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return Layout(None, cu, list(lengths), max(lengths, default=0))


# Every decoder layer of a forward sees the same mask and position ids (and gradient checkpointing's recomputation
# sees them again): the layout is found once per forward, keyed on those very tensor objects.
_last: list = [None, None, None, None]  # [attention_mask, position_ids, (batch, length), Layout]


def expect_layout(position_ids, lay: Layout):
    """The layout of the next forwards that get these very position ids and no mask (a packed row, [1, L]), given by
    whoever built the row, so that no forward searches for it (nonzero and tolist: a host sync each)."""
    _last[:] = [None, position_ids, tuple(position_ids.shape), lay]


def _cached_layout(attention_mask, position_ids, batch, length, device) -> Layout:
    mask, positions, shape, found = _last
    if found is None or mask is not attention_mask or positions is not position_ids or shape != (batch, length):
        found = layout(attention_mask, position_ids, batch, length, device)
        _last[:] = [attention_mask, position_ids, (batch, length), found]
    return found


# --- the kernels: (q [T, H, D], k and v [T, H_kv, D], layout, scale) -> [T, H, D] --------------------------------

def sdpa_per_sequence(q, k, v, lay: Layout, scale):
    """Causal sdpa on each sequence in turn: any device and dtype; the reference the others are tested against."""
    out, start = [], 0
    for n in lay.lengths:
        part = [x[start:start + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, heads, n, head_dim]
        out.append(sdpa(*part, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])[0].transpose(0, 1))
        start += n
    return torch.cat(out) if len(out) > 1 else out[0]


def sdpa(q, k, v, **options):
    """F.scaled_dot_product_attention, except for bf16 on a CPU whose kernels are not AVX-512 (an AVX2-only CPU, or
    ATEN_CPU_CAPABILITY=avx2/default): there torch's CPU flash kernel stops ("pack_vnni2 is only supported when avx512
    is supported", torch 2.13), so q, k and v are taken to fp32 for it and the output back to bf16, as that kernel
    accumulates in fp32 (the math backend in bf16 would round its softmax to bf16). CPU autocast is held off for that
    call: it would cast them back to bf16."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and "AVX512" not in torch.backends.cpu.get_cpu_capability():
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **options).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **options)


@functools.cache
def torch_varlen():
    """torch.nn.attention.varlen.varlen_attn, or None where this PyTorch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def flash_attn_varlen():
    """flash_attn.flash_attn_varlen_func (FlashAttention-2), or None where it is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _repeat_kv(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def varlen_attn(q, k, v, lay: Layout, scale):
    """PyTorch's varlen kernel. Its signature moved between releases: causal is window_size=(-1, 0) where that
    argument exists (2.13 on), is_causal=True before; scale and enable_gqa exist only in the later ones."""
    fn = torch_varlen()
    params = inspect.signature(fn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12 * scale:
        raise ValueError(f"this PyTorch's varlen_attn takes no scale; the model's is {scale}, not 1/sqrt(head_dim)")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, q.shape[1] // k.shape[1]), _repeat_kv(v, q.shape[1] // k.shape[1])
    return fn(q, k, v, lay.cu_seqlens, lay.cu_seqlens, lay.max_len, lay.max_len, **kwargs)


def flash_attn(q, k, v, lay: Layout, scale):
    """FlashAttention-2's varlen kernel (grouped-query attention native)."""
    return flash_attn_varlen()(q, k, v, lay.cu_seqlens, lay.cu_seqlens, lay.max_len, lay.max_len,
                               softmax_scale=scale, causal=True)


KERNELS = {"varlen_attn": varlen_attn, "flash_attn": flash_attn, "sdpa_per_sequence": sdpa_per_sequence}


def kernel_for(q) -> str:
    """The fastest kernel that runs q's device and dtype: the varlen flash kernels need CUDA and a half dtype."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        if torch_varlen() is not None:
            return "varlen_attn"
        if flash_attn_varlen() is not None:
            return "flash_attn"
    return "sdpa_per_sequence"


# --- what transformers calls --------------------------------------------------------------------------------------

def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      **kwargs):
    """transformers' attention interface: query [B, H, L, D], key and value [B, H_kv, L_kv, D], attention_mask
    what padding_mask() returned; -> ([B, L, H, D], None)."""
    if dropout or sliding_window:
        raise ValueError(f"attn_implementation={NAME!r} runs no attention dropout or sliding window "
                         f"(got dropout {dropout}, sliding_window {sliding_window}); use 'sdpa' for this model")
    batch, heads, length, head_dim = query.shape
    scale = head_dim ** -0.5 if scaling is None else scaling
    if key.shape[2] != length:  # decoding with a KV cache
        return _cached_sdpa(query, key, value, attention_mask, scale), None
    lay = _cached_layout(attention_mask, kwargs.get("position_ids"), batch, length, query.device)
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], head_dim) for x in (query, key, value))
    if lay.index is not None:
        q, k, v = q[lay.index], k[lay.index], v[lay.index]
    out = KERNELS[kernel_for(q)](q, k, v, lay, scale)
    if lay.index is not None:
        out = out.new_zeros(batch * length, heads, head_dim).index_copy(0, lay.index, out)
    return out.view(batch, length, heads, head_dim), None


def _cached_sdpa(query, key, value, attention_mask, scale):
    """Queries at the end of a longer key sequence (a KV cache): the causal mask shifted by the cached length, and
    the padding mask."""
    length, kv_length = query.shape[2], key.shape[2]
    rows = torch.arange(length, device=query.device)[:, None] + (kv_length - length)
    allowed = torch.arange(kv_length, device=query.device)[None, :] <= rows  # [L, L_kv]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -kv_length:].bool()  # [B, 1, L, L_kv]
    out = sdpa(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def padding_mask(batch_size, q_length, kv_length, attention_mask=None, **kwargs):
    """transformers' mask interface for NAME: what attention_forward receives as its attention_mask, the 2-D padding
    mask [B, L_kv] (bool), or None where nothing is padded. No [L, L] mask is ever built."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    return None if attention_mask.shape[1] == kv_length and bool(attention_mask.all()) else attention_mask.bool()


_untraced = [False]  # set for good once a model's layers are compiled: the registration is process-wide


def register(untraced: bool = False):
    """Make NAME an attn_implementation transformers knows (idempotent); untraced: torch.compile leaves the attention
    out of the graphs it captures (models.compile_layers), a graph break around it. The registration is transformers'
    one mapping for the process, so once untraced it stays so: a model set up later (train.py's KL reference, a test's
    reference model) must not put the traced function back under layers compiled before it, where dynamo would trace
    into the layout search (nonzero, tolist: a graph break each). Untraced costs an eager model nothing."""
    from transformers import AttentionInterface, AttentionMaskInterface
    _untraced[0] = _untraced[0] or untraced
    AttentionInterface.register(NAME, torch.compiler.disable(attention_forward) if _untraced[0] else attention_forward)
    AttentionMaskInterface.register(NAME, padding_mask)


def applies(model) -> bool:
    """Whether this model can run NAME: its attention goes through transformers' attention interface, with no
    sliding-window layers."""
    config = model.config
    return bool(getattr(model, "_supports_attention_backend", False)) and \
        "sliding_attention" not in (getattr(config, "layer_types", None) or [])


def use(model) -> str:
    """Switch model (and its submodels) to NAME where it applies; returns the attn_implementation it runs."""
    if applies(model):
        register()
        model.set_attn_implementation(NAME)
    return model.config._attn_implementation
