"""The GPU paths. On any machine: the code only CUDA runs, through CPU stand-ins (the varlen attention kernels' calls,
the engine's level-2 sleep), and what only the paper's scale reaches (a quantile over more than 2^24 tokens, a
sampled token outside the trainer's kept set). On a CUDA device also: the fused log-probs against the full-logits
reference (fp32 and bf16 autocast, where the GEMMs are real bf16 tensor-core GEMMs, unlike on a CPU), the varlen
kernels themselves, one update through either path, and a short train.py run with rollout correction; those skip
without a CUDA device (CI has none)."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from test_logprobs import (
    LENGTHS,
    assert_same_run,
    packed_batch,
    padded_batch,
    run_model,
    test_bf16_precision_hands_attention_bf16_q_k_v,
    tiny_qwen2,
)
from test_train import read_metrics, run_train

import loss as L
import rollout
from cegppo_utils import attention, correction
from cegppo_utils import logprobs as LP

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


# --- the varlen attention kernels' calls, on CPU stand-ins -------------------------------------------------------

def reference_attention(q, k, v, cu_seqlens, scale):
    """Causal attention within each sequence of a [T, heads, head_dim] stream, written out (softmax(q k^T) v)."""
    out, bounds = [], cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        groups = q.shape[1] // k.shape[1]
        keys, values = k[a:b].repeat_interleave(groups, 1), v[a:b].repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b], keys) * scale
        scores = scores.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(out)


def check_stream(q, k, cu_seq_q, cu_seq_k, max_q, max_k):
    """What every varlen kernel needs: [T, heads, head_dim] tokens, int32 sequence starts on their device."""
    assert q.dim() == k.dim() == 3 and q.shape[0] == k.shape[0] == int(cu_seq_q[-1])
    assert cu_seq_q.dtype == torch.int32 and cu_seq_q.device == q.device and torch.equal(cu_seq_q, cu_seq_k)
    assert max_q == max_k == int(cu_seq_q.diff().max()) and int(cu_seq_q.diff().min()) > 0


def torch_varlen_now(calls):
    """PyTorch's varlen_attn as 2.13 declares it (causal as window_size=(-1, 0); scale; grouped heads)."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        check_stream(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
        assert window_size == (-1, 0) and enable_gqa == (key.shape[1] < query.shape[1]) and scale is not None
        calls.append(cu_seq_q.diff().tolist())
        return reference_attention(query, key, value, cu_seq_q, scale)
    return varlen_attn


def torch_varlen_before(calls):
    """PyTorch's varlen_attn before 2.13: is_causal, no scale (1/sqrt(head_dim)), as many key heads as query heads."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        check_stream(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
        assert is_causal and key.shape[1] == query.shape[1]
        calls.append(cu_seq_q.diff().tolist())
        return reference_attention(query, key, value, cu_seq_q, query.shape[-1] ** -0.5)
    return varlen_attn


def flash_attn_2(calls):
    """flash_attn.flash_attn_varlen_func (FlashAttention-2)."""
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, **kwargs):
        check_stream(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        assert causal and dropout_p == 0 and softmax_scale is not None
        calls.append(cu_seqlens_q.diff().tolist())
        return reference_attention(q, k, v, cu_seqlens_q, softmax_scale)
    return flash_attn_varlen_func


@pytest.mark.parametrize("kernel, loader, stand_in", [("varlen_attn", "torch_varlen", torch_varlen_now),
                                                      ("varlen_attn", "torch_varlen", torch_varlen_before),
                                                      ("flash_attn", "flash_attn_varlen", flash_attn_2)])
def test_varlen_kernels_are_called_as_they_expect(monkeypatch, kernel, loader, stand_in):
    """The CUDA kernels' calls, each answered by a written-out attention on the CPU: a packed row and the padded batch
    give the sdpa reference's log-probs, entropies and gradients, with one call per layer and pass, and the kernel
    sees the sequences' own lengths (the padding left out)."""
    calls = []
    monkeypatch.setattr(attention, "kernel_for", lambda q: kernel)
    monkeypatch.setattr(attention, loader, lambda: stand_in(calls))
    want = run_model(tiny_qwen2(tied=False, seed=4), padded_batch(seed=4, **LENGTHS), fused=False)
    model = tiny_qwen2(tied=False, seed=4)
    attention.use(model)
    lengths = [p + r for p, r in zip(*LENGTHS.values())]
    for batch in (packed_batch(seed=4, **LENGTHS), padded_batch(seed=4, **LENGTHS)):
        calls.clear()
        assert_same_run(run_model(model, batch, fused=True), want, tol=2e-5)
        assert calls == [lengths] * model.config.num_hidden_layers  # forward; backward goes through autograd


def test_kernel_for_picks_a_varlen_kernel_for_half_precision_on_cuda(monkeypatch):
    def on(device, dtype):
        return SimpleNamespace(device=torch.device(device), dtype=dtype)
    monkeypatch.setattr(attention, "torch_varlen", lambda: torch_varlen_now([]))
    monkeypatch.setattr(attention, "flash_attn_varlen", lambda: flash_attn_2([]))
    assert attention.kernel_for(on("cuda", torch.bfloat16)) == "varlen_attn"
    assert attention.kernel_for(on("cuda", torch.float32)) == "sdpa_per_sequence"  # the flash kernels take half only
    assert attention.kernel_for(on("cpu", torch.bfloat16)) == "sdpa_per_sequence"
    monkeypatch.setattr(attention, "torch_varlen", lambda: None)  # a PyTorch without it
    assert attention.kernel_for(on("cuda", torch.float16)) == "flash_attn"
    monkeypatch.setattr(attention, "flash_attn_varlen", lambda: None)
    assert attention.kernel_for(on("cuda", torch.bfloat16)) == "sdpa_per_sequence"


# --- Liger's kernels: the call, on a stand-in module ---------------------------------------------------------------

def test_liger_is_applied_on_cuda_only_and_never_its_cross_entropy(monkeypatch):
    """models.use_liger: on CUDA it patches the model's RMSNorm, RoPE and SwiGLU through Liger's function for the model
    type, its cross-entropy kernels off (the loss needs per-token log-probs and entropy: logprobs.py's fused head), and
    pins its RoPE to Triton's kernel through the dispatcher's per-op variable (liger-kernel 0.8.5 would pick CuTe DSL's
    at the 1.5B preset's shape where `cutlass` imports), naming the kernel its dispatcher resolves; on a CPU, for a
    model type Liger lacks, or without liger-kernel it does nothing and says why."""
    import sys
    import types

    from cegppo_utils import models
    calls = []

    def apply_liger_kernel_to_qwen2(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                    swiglu=True, model=None):
        calls.append(dict(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                          rms_norm=rms_norm, swiglu=swiglu, model=model))
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": apply_liger_kernel_to_qwen2}
    dispatch = types.ModuleType("liger_kernel.backends.dispatch")  # 0.8.5's: the per-op variable first, else auto
    dispatch.resolve_impl = lambda op, device=None: SimpleNamespace(
        impl_name=os.environ.get(f"LIGER_KERNEL_IMPL_{op.upper()}", "nvidia-cutedsl"))  # auto: CuTe at the preset
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", patch)
    monkeypatch.setitem(sys.modules, "liger_kernel.backends.dispatch", dispatch)
    monkeypatch.delenv("LIGER_KERNEL_IMPL_ROPE", raising=False)
    model = tiny_qwen2(tied=False)
    assert models.use_liger(model, torch.device("cpu")).startswith("off (Triton kernels need CUDA)") and calls == []
    assert "LIGER_KERNEL_IMPL_ROPE" not in os.environ
    assert models.use_liger(model, CUDA) == "on: rms_norm, rope (nvidia-triton), swiglu"  # pinned, and read back
    assert os.environ["LIGER_KERNEL_IMPL_ROPE"] == "nvidia-triton"
    assert calls == [dict(rope=True, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True,
                          model=model)]
    model.config.model_type = "unknown"
    assert "no kernels for model type 'unknown'" in models.use_liger(model, CUDA) and len(calls) == 1
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # not installed
    assert "not installed" in models.use_liger(model, CUDA)


def liger_family(monkeypatch):
    """Liger's kernels on a CUDA machine, where requirements-gpu.txt installs them (a missing liger-kernel fails: the
    GPU presets run them), with the Qwen2 module's names Liger replaces module-wide restored after the test."""
    from transformers.models.qwen2 import modeling_qwen2 as Q
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        pytest.fail("liger-kernel is not installed (requirements-gpu.txt): the GPU presets' Liger kernels go untested")
    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):
        monkeypatch.setattr(Q, name, getattr(Q, name))
    monkeypatch.delenv("LIGER_KERNEL_IMPL_ROPE", raising=False)  # use_liger's pin, undone after the test
    return Q


def forward_and_grad(fn, *inputs):
    """fn's outputs and the gradients of its inputs under a fixed weighting of the outputs, in fp32."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    sum((o.float() * torch.linspace(-1, 1, o.numel(), device=o.device).view_as(o)).sum() for o in out).backward()
    return [o.float() for o in out] + [t.grad.float() for t in inputs]


def bf16_close(got, want):
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 2 ** -6 * w.abs().max() + 1e-3, (g - w).abs().max()


@needs_cuda
def test_liger_kernels_match_eager_on_cuda(monkeypatch):
    """Each op Liger patches against transformers' eager one, in bf16 on the GPU: RMSNorm, the rotary embedding and the
    SwiGLU MLP, forward and input gradient; then the whole model's log-probs, entropies and gradients through
    model_logprobs under bf16 autocast, against a model run before Liger's patches existed (they reach every model of
    the family at its next call, one built before them included: the rotary function is looked up at call time).
    Within bf16 rounding."""
    from cegppo_utils import models
    Q = liger_family(monkeypatch)
    eager_rope = Q.apply_rotary_pos_emb
    eager = tiny_qwen2(tied=False, seed=5).to(CUDA, torch.bfloat16)
    batch = on_cuda(padded_batch(seed=5))
    want = run_model(eager, batch, fused=True, autocast_dtype=torch.bfloat16)  # no Liger anywhere yet
    assert not any(k.startswith("liger") for k in models.kernels_in_use(eager).values() if isinstance(k, str))
    patched = tiny_qwen2(tied=False, seed=5).to(CUDA, torch.bfloat16)
    assert models.use_liger(patched, CUDA).startswith("on") and models.liger_in_use(models.kernels_in_use(patched))
    x = torch.randn(3, 11, 64, device=CUDA, dtype=torch.bfloat16)
    for a, b in ((eager.model.layers[0].input_layernorm, patched.model.layers[0].input_layernorm),
                 (eager.model.norm, patched.model.norm), (eager.model.layers[1].mlp, patched.model.layers[1].mlp)):
        assert b.forward.__func__.__module__.startswith("liger_kernel")  # Liger's forward, bound to the module
        assert not a.forward.__func__.__module__.startswith("liger_kernel")
        bf16_close(forward_and_grad(b, x), forward_and_grad(a, x))
    positions = torch.arange(11, device=CUDA).expand(3, 11)
    cos, sin = eager.model.rotary_emb(x, positions)
    q, k = (torch.randn(3, 4, 11, 16, device=CUDA, dtype=torch.bfloat16),
            torch.randn(3, 2, 11, 16, device=CUDA, dtype=torch.bfloat16))
    assert Q.apply_rotary_pos_emb is not eager_rope
    bf16_close(forward_and_grad(lambda q, k: Q.apply_rotary_pos_emb(q, k, cos, sin), q, k),
               forward_and_grad(lambda q, k: eager_rope(q, k, cos, sin), q, k))
    got = run_model(patched, batch, fused=True, autocast_dtype=torch.bfloat16)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=5e-2)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=5e-2)
    for name in want[2]:
        assert (got[2][name].float() - want[2][name].float()).norm() <= 0.05 * want[2][name].float().norm() + 1e-6, name


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_selective_checkpointing_under_liger_gives_the_gradients_of_no_checkpointing_on_cuda(monkeypatch, layout,
                                                                                            dtype):
    """test_levers' in-place rotary test with Liger's own kernels (its RoPE rotates q and k in place with Triton stores
    that bump no version counter): selective checkpointing (the rotary on copies of q and k) gives no checkpointing's
    log-probs, entropies and gradients, padded and packed, fp32 and bf16 (the varlen kernel); the policy without the
    copies is off by more than half the gradients' size, which is what made this test necessary."""
    from functools import partial

    from test_levers import micro_batch, model_with, relative_error
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from cegppo_utils import models
    liger_family(monkeypatch)
    batch, bf16 = micro_batch(layout, CUDA), dtype == torch.bfloat16
    autocast, tol = (torch.bfloat16, 2e-2) if bf16 else (None, 1e-4)
    options = dict(liger=True, device=CUDA, dtype=dtype)
    want = run_model(model_with(**options), batch, fused=True, autocast_dtype=autocast)
    old = model_with(**options)
    old.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, models.selective_policy)})
    wrong = run_model(old, batch, fused=True, autocast_dtype=autocast)
    assert relative_error(wrong, want) > 0.5, "Liger's RoPE no longer writes q and k in place: no copies needed"
    selective = model_with("selective", **options)
    assert models.kernels_in_use(selective)["rope"].endswith("(on copies of q and k)")
    got = run_model(selective, batch, fused=True, autocast_dtype=autocast)
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    assert relative_error(got, want) <= tol, relative_error(got, want)


@needs_cuda
def test_liger_rope_runs_triton_at_the_presets_shape_on_cuda(monkeypatch):
    """liger-kernel 0.8.5's dispatcher would send the 1.5B preset's packed row (q [1, 12 heads, 20,480 tokens, head_dim
    128] in bf16, needing a gradient: 245,760 q head-rows) to its CuTe DSL RoPE where `cutlass` imports; use_liger pins
    Triton's. At that shape: the dispatcher resolves Triton's, CuTe DSL's kernel is never called (where it imports at
    all), and the rotation and its input gradients match transformers' own within bf16 rounding."""
    from cegppo_utils import models
    Q = liger_family(monkeypatch)
    eager_rope = Q.apply_rotary_pos_emb
    assert "rope (nvidia-triton)" in models.use_liger(tiny_qwen2(tied=False).to(CUDA), CUDA)
    from liger_kernel.backends.dispatch import resolve_impl
    assert resolve_impl("rope", device=CUDA).impl_name == "nvidia-triton"
    try:
        from liger_kernel.ops.backends._cutedsl import rope as cute
    except Exception:  # no cutlass here: the dispatcher could not have picked it either
        cute = None
    if cute is not None:
        monkeypatch.setattr(cute._LigerRopeCuTeDSLFunction, "apply",
                            lambda *a: pytest.fail("the CuTe DSL RoPE ran, not the pinned Triton one"))
    heads, kv_heads, tokens, head_dim = 12, 2, 20480, 128  # R1-Distill-Qwen-1.5B, one packed row of the preset
    g = torch.Generator(device=CUDA).manual_seed(0)
    q = torch.randn(1, heads, tokens, head_dim, device=CUDA, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=CUDA, dtype=torch.bfloat16, generator=g)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device=CUDA).float() / head_dim)
    angles = torch.arange(tokens, device=CUDA).float()[:, None] * inv_freq
    angles = torch.cat((angles, angles), -1)[None]
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    bf16_close(forward_and_grad(lambda q, k: Q.apply_rotary_pos_emb(q, k, cos, sin), q, k),
               forward_and_grad(lambda q, k: eager_rope(q, k, cos, sin), q, k))


def update_sequences(count=8, seed=3):
    """Sequences of the tiny model's tokens with advantages of both signs, as train.py's update takes them."""
    import random
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(5, 270) for _ in range(5)],
             "response_ids": [rng.randrange(5, 270) for _ in range(rng.randrange(4, 14))],
             "advantage": rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 1.5), "correct": rng.random() < 0.5}
            for _ in range(count)]


def recorded_steps(policy) -> list:
    """The gradients ({name: fp32 copy}) the optimizer finds at each of its steps, recorded as they come."""
    steps = []

    def record(optimizer, args, kwargs):
        steps.append({n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().float().clone()
                      for n, p in policy.model.named_parameters() if p.grad is not None})
    policy.optimizer.register_step_pre_hook(record)
    return steps


def local_parameters(model) -> dict:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().float().clone()
            for n, p in model.named_parameters()}


def largest_relative_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and want
    return max(((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-12)).item() for n in want)


@needs_cuda
@pytest.mark.parametrize("checkpointing", [[], ["--gradient-checkpointing"],
                                           ["--gradient-checkpointing", "--selective-checkpointing"]],
                         ids=["no checkpointing", "full", "selective"])
def test_the_region_split_leaves_the_update_alone_under_liger_on_cuda(monkeypatch, tiny_model_path, checkpointing):
    """Liger's SwiGLU backward writes its gradients into the gate and up activations it saved, and
    --region-grad-norms backwards the graph once per non-empty clip region before loss.backward() runs over it. With
    Liger's real kernels, in fp32 (the tiny preset's precision on CUDA), the model as train.load_policy builds it: an
    optimizer step (train.update_policy) that splits the gradient by region ("last", the default) finds the gradients
    and makes the parameters of the same step with --region-grad-norms off, under no, full and selective
    checkpointing; and the split measured something (its first mini-batch's old policy is moved away from this one so
    that both regions hold tokens). A combination train.py refuses in one line is skipped, named."""
    from conftest import parse_train_args

    import train
    from cegppo_utils import models
    liger_family(monkeypatch)
    runs = {}
    for split in ("off", "last"):
        try:
            args = parse_train_args([*checkpointing, "--region-grad-norms", split, "--lr", "1e-3",
                                     "--warmup-steps", "0"])
        except SystemExit:
            pytest.skip(f"train.py refuses {' '.join(checkpointing)} --region-grad-norms {split} (one line, exit 2)")
        policy, _ = train.load_policy(args, tiny_model_path, CUDA, ["Compute 2 + 3."])
        assert models.liger_in_use(models.kernels_in_use(policy.model)) and policy.region_grad_norms == split
        mini = train.make_mini_batches(policy, [update_sequences()], args.loss)[0]
        g = torch.Generator().manual_seed(5)
        for mb in mini.micro:
            logp, mb.old_entropy, _ = train.response_logprobs(policy, mb)
            mb.old_logp = logp + 0.6 * torch.randn(logp.shape, generator=g).to(CUDA) * mb.response_mask
        before, steps = local_parameters(policy.model), recorded_steps(policy)
        metrics = train.update_policy(policy, [mini], args.loss)
        after = local_parameters(policy.model)
        runs[split] = steps[0], {n: after[n] - before[n] for n in after}, metrics
    assert runs["last"][2]["grad_norm_low_neg"] > 0 and runs["last"][2]["grad_norm_high_pos"] > 0
    assert "grad_norm_low_neg" not in runs["off"][2]
    assert largest_relative_difference(runs["last"][0], runs["off"][0]) <= 1e-4  # the gradients (the bug: ~0.8)
    assert largest_relative_difference(runs["last"][1], runs["off"][1]) <= 1e-2  # AdamW's steps (the bug: ~0.8)


@needs_cuda
@pytest.mark.parametrize("layout", [[], ["--micro-batch-tokens", "512"]], ids=["padded", "packed"])
def test_selective_checkpointing_under_fsdp2_with_liger_makes_no_checkpointings_update_on_cuda(monkeypatch,
                                                                                             tiny_model_path, layout):
    """train.py --precision bf16 in one process (FSDP2's bf16 over fp32 masters, Liger's real kernels, per-sequence
    varlen attention): an update of two mini-batches (the old log-probs' forward on the second, two AdamW steps) with
    --gradient-checkpointing --selective-checkpointing finds, at each optimizer step, the gradients of the same update
    without checkpointing, within bf16 rounding, and moves the parameters as it does; padded micro-batches and packed
    rows."""
    import torch.distributed as dist
    from conftest import parse_train_args

    import train
    from cegppo_utils import models
    liger_family(monkeypatch)
    seqs, runs = update_sequences(), {}
    try:
        for checkpointing in ([], ["--gradient-checkpointing", "--selective-checkpointing"]):
            args = parse_train_args(["--precision", "bf16", *layout, *checkpointing, "--lr", "1e-3",
                                     "--warmup-steps", "0"])
            policy, _ = train.load_policy(args, tiny_model_path, CUDA, ["Compute 2 + 3."])
            kernels = models.kernels_in_use(policy.model)
            assert models.liger_in_use(kernels) and kernels["checkpointing"].startswith(
                "selective" if checkpointing else "off"), kernels
            minis = train.make_mini_batches(policy, [seqs[:4], seqs[4:]], args.loss)
            before, steps = local_parameters(policy.model), recorded_steps(policy)
            train.old_logprobs(policy, minis)
            train.update_policy(policy, minis, args.loss)
            after = local_parameters(policy.model)
            runs[bool(checkpointing)] = steps, {n: after[n] - before[n] for n in after}
    finally:
        if dist.is_initialized():  # the group of one that place_model made for this process
            dist.destroy_process_group()
    (plain_steps, plain_moved), (selective_steps, selective_moved) = runs[False], runs[True]
    assert len(plain_steps) == len(selective_steps) == 2
    for got, want in zip(selective_steps, plain_steps):
        assert largest_relative_difference(got, want) <= 2e-2
    # AdamW's first steps are close to lr x sign(gradient): a gradient near 0 may change sign within bf16 rounding
    assert largest_relative_difference(selective_moved, plain_moved) <= 0.2


@needs_cuda
@pytest.mark.slow  # compiling: tools/gpu_accept.sh runs it as a part of its own
def test_compiled_layers_under_liger_give_the_same_gradients_on_cuda(monkeypatch):
    """models.compile_layers on the GPU (inductor's Triton code), with Liger's kernels and full checkpointing, the
    preset's settings: the plain model's log-probs, entropies and gradients, padded and packed, to fp32 rounding; and
    torch.compile made graphs, with a graph break where attention is left out of them (printed: the graphs and graph
    breaks made, and why, beside the software)."""
    from test_levers import micro_batch, model_with
    from torch._dynamo.utils import counters

    from cegppo_utils import models
    from tools import bench
    liger_family(monkeypatch)
    options = dict(liger=True, device=CUDA)
    counters.clear()
    try:
        model = model_with("full", **options)
        models.compile_layers(model)
        for layout in ("padded", "packed"):
            want = run_model(model_with("full", **options), micro_batch(layout, CUDA), fused=True)
            assert_same_run(run_model(model, micro_batch(layout, CUDA), fused=True), want, tol=1e-4)
        made = bench.compile_counts()
        assert made["graphs"] >= 2 and any("attention_forward" in reason for reason in counters["graph_break"]), made
        print(f"\ncompiled layers: {len(models.decoder_layers(model))} wrapped, {made['graphs']} graphs, "
              f"{made['graph_breaks']} graph breaks ({made['graph_break_reasons']}); {bench.software()}")
    finally:
        torch.compiler.reset()


# --- the engine's sleep: level 2 ---------------------------------------------------------------------------------

class FakeLLM:
    """vllm.LLM as VLLMSampler calls it, recording the calls."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, requests, params, use_tqdm):
        self.calls.append(("generate", len(requests)))
        return []


def test_the_engine_sleeps_at_level_2_and_samples_only_after_a_sync():
    """Level 2 drops the engine's weights: after wake_up() it refuses to sample until load_weights() has run (the
    order train.py keeps: wake, sync, check, sample), and it sleeps again at level 2."""
    sampler = object.__new__(rollout.VLLMSampler)  # its engine start needs vLLM; the methods need only these
    sampler.llm, sampler.sleep_mode, sampler.asleep, sampler.weights_dropped = FakeLLM(), True, False, False
    sampler.context_len, sampler.stop_ids, sampler.SamplingParams = 512, [0], dict
    sampler.generate([[1, 2]], n=1)
    sampler.sleep()
    for state in ("asleep", "awake without weights"):
        with pytest.raises(RuntimeError, match=f"the vLLM engine is {state}: call wake_up"):
            sampler.generate([[1, 2]], n=1)
        sampler.wake_up()
    sampler.load_weights([("w", torch.zeros(1))])
    sampler.generate([[1, 2]], n=1)
    sampler.sleep()
    assert rollout.SLEEP_LEVEL == 2 and sampler.llm.calls == [
        ("generate", 1), ("sleep", 2), ("wake_up",), ("reload_weights", ["w"]), ("reset_prefix_cache",),
        ("generate", 1), ("sleep", 2)]


# --- what only the paper's scale reaches ---------------------------------------------------------------------------

def test_quantile_is_torch_quantile_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for n in [*range(1, 40), 1000, 4097]:
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(n, generator=g, dtype=dtype) * 3
            x[: n // 3] = x[0]  # ties
            for q in (0.0, 0.01, 0.2, 1 / 3, 0.5, 0.8, 0.99, 0.999, 1.0):
                assert torch.equal(L.quantile(x, q), torch.quantile(x, q)), (n, dtype, q)


@pytest.mark.slow
def test_rollout_metrics_and_entropy_quantile_over_more_than_2_24_tokens():
    """torch.quantile refuses more than 2^24 elements: the rollout correction's p99 of |log rho| and the top-entropy
    selection take 2^24 + 1 tokens, by torch.quantile's rule (rank q (n - 1) in float32, the two sorted values there
    interpolated). The values are a shuffled 0, 1, ..., n - 1 (times a scale), so the i-th smallest is i itself."""
    n = 2**24 + 1
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float()
    m = correction.metrics(order * 1e-6, torch.zeros(n, dtype=torch.bool))
    rank = torch.tensor(0.99) * (n - 1)
    assert m["rollout_abs_log_ratio_p99"] == pytest.approx(rank.item() * 1e-6, rel=1e-6)
    chosen = L.high_entropy_tokens(order[None], torch.ones(1, n), 0.2)  # the top 20% by entropy (0 to 2^24: exact)
    threshold = (torch.tensor(0.8) * (n - 1)).item()  # the rank, and the value there
    assert chosen.sum().item() == n - math.ceil(threshold)
    assert chosen[0, order >= threshold].all() and not chosen[0, order < threshold].any()


def test_a_sampled_token_outside_the_trainers_kept_set_is_counted():
    """A sampler whose top-p cut-off differs from the trainer's (vLLM's CUDA kernel bisects for it) can sample a token
    the trainer's kept set leaves out. Forced here: a response that alternates the trainer's most likely token (always
    kept) and its least likely one (left out by top-p 0.5 over 300 tokens), the sampler's log-probs equal to the
    trainer's over its kept set elsewhere. Those tokens' correction weight is ~0, and the step logs how many."""
    model = tiny_qwen2(tied=True, seed=4).eval()
    ids = [11, 57, 203, 9, 140]
    with torch.no_grad():
        for t in range(8):  # greedy on the trainer, alternating its most and least likely token
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax() if t % 2 == 0 else logits.argmin()))
        full = torch.tensor([ids])
        logp, _, kept = LP.model_logprobs(model, full, torch.ones_like(full), torch.arange(len(ids))[None],
                                          full[:, 5:], truncation=(0.5, 0))
    assert kept.inside.tolist() == [[True, False] * 4]
    mask, outside = torch.ones(1, 8), ~kept.inside
    sampler_logp = torch.where(outside, logp, LP.truncated_logprobs(logp, kept))  # the sampler kept them all
    mb = SimpleNamespace(old_logp=logp, kept=kept, sampler_logp=sampler_logp, response_mask=mask)
    metrics = correction.correct([[mb]], "token-tis", 2.0, torch.device("cpu"))
    assert metrics["rollout_outside_kept_tokens"] == 4 and metrics["rollout_outside_kept_frac"] == 0.5
    assert (mb.weights[outside] < 1e-8).all() and torch.equal(mb.weights[~outside], torch.ones(4))
    mb.kept = LP.Truncation(torch.zeros(1, 8), torch.ones(1, 8, dtype=torch.bool))  # no truncation: none outside
    assert correction.correct([[mb]], "token-tis", 2.0, torch.device("cpu"))["rollout_outside_kept_tokens"] == 0


# --- on a CUDA device ----------------------------------------------------------------------------------------------

def on_cuda(batch):
    return tuple(t.to(CUDA) for t in batch)


def to_cpu(run):
    return run[0].cpu(), run[1].cpu(), {n: g.cpu() for n, g in run[2].items()}


@needs_cuda
@pytest.mark.parametrize("tied", [False, True])
def test_fused_matches_reference_on_cuda(tied):
    model = tiny_qwen2(tied).to(CUDA)
    batch = on_cuda(padded_batch())
    want = run_model(model, batch, fused=False)
    got = run_model(model, batch, fused=True)
    assert_same_run(got, want, tol=1e-4)  # TF32 may be on for either side's GEMMs
    cpu = run_model(tiny_qwen2(tied), padded_batch(), fused=False)
    assert_same_run(to_cpu(got), cpu, tol=1e-3)  # and both are the CPU's numbers
    assert LP.check_fused(model) and LP.check_fused(model, autocast_dtype=torch.bfloat16)


@needs_cuda
def test_fused_matches_reference_under_bf16_autocast_on_cuda():
    model = tiny_qwen2(tied=False, seed=2).to(CUDA)
    batch = on_cuda(padded_batch(seed=2))
    want = run_model(model, batch, fused=False, autocast_dtype=torch.bfloat16)
    got = run_model(model, batch, fused=True, autocast_dtype=torch.bfloat16)
    exact = run_model(model, batch, fused=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=5e-2)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=5e-2)
    for name in want[2]:
        scale = exact[2][name].norm()
        assert (got[2][name] - want[2][name]).norm() <= 0.05 * scale + 1e-6, name


@needs_cuda
def test_varlen_attention_on_cuda_matches_sdpa_under_bf16_autocast(monkeypatch):
    """The real kernel (PyTorch's varlen_attn, or FlashAttention-2), on a model whose weights are bf16 as FSDP2's mixed
    precision gathers them, so that q, k and v reach attention in bf16 and the kernel runs (every call recorded), on
    packed and padded micro-batches, against transformers' sdpa with fp32 weights on the padded batch, all under bf16
    autocast: bf16-close, gradient by gradient."""
    reference = tiny_qwen2(tied=False, seed=4).to(CUDA)
    model = tiny_qwen2(tied=False, seed=4).to(CUDA, torch.bfloat16)
    attention.use(model)
    ran = []
    for name, kernel in list(attention.KERNELS.items()):
        monkeypatch.setitem(attention.KERNELS, name,
                            lambda *a, name=name, kernel=kernel: ran.append(name) or kernel(*a))
    want = run_model(reference, on_cuda(padded_batch(seed=4, **LENGTHS)), fused=True, autocast_dtype=torch.bfloat16)
    exact = run_model(reference, on_cuda(padded_batch(seed=4, **LENGTHS)), fused=True)
    for batch in (packed_batch(seed=4, **LENGTHS), padded_batch(seed=4, **LENGTHS)):
        batch = tuple(t.to(CUDA) if isinstance(t, torch.Tensor) else t for t in batch[:5]) + tuple(
            LP.Packing(*(x.to(CUDA) for x in p[:3])) for p in batch[5:])
        ran.clear()
        got = run_model(model, batch, fused=True, autocast_dtype=torch.bfloat16)
        assert ran and set(ran) <= {"varlen_attn", "flash_attn"}, set(ran)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=5e-2)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=5e-2)
        for name in want[2]:
            assert (got[2][name].float() - want[2][name]).norm() <= 0.05 * exact[2][name].norm() + 1e-6, name


@needs_cuda
def test_the_bf16_model_path_runs_the_varlen_kernel_on_cuda(monkeypatch, tiny_model_path):
    """test_logprobs' check of train.py's own model path at --precision bf16, where CUDA makes it the varlen kernel."""
    test_bf16_precision_hands_attention_bf16_q_k_v(monkeypatch, tiny_model_path)


@needs_cuda
def test_one_update_gives_the_same_parameters_on_cuda():
    params = {}
    for fused in (False, True):
        model = tiny_qwen2(tied=True, seed=3).to(CUDA)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run_model(model, on_cuda(padded_batch(seed=3)), fused=fused)
        opt.step()
        params[fused] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name in params[False]:
        torch.testing.assert_close(params[True][name], params[False][name], rtol=1e-4, atol=1e-5, msg=name)


@needs_cuda
def test_a_bf16_run_with_rollout_correction_on_cuda(tmp_path, tiny_model_path):
    """train.py on the GPU (HF sampler): bf16 training against the fp32 sampler's log-probs, top-p 0.9. The correction's
    ratios are taken over the sampler's support, so their mean stays ~1; bf16 shows as a nonzero mismatch."""
    run_train(tmp_path, "--max-steps", "2", "--sampler", "hf", "--precision", "bf16", "--top-p", "0.9",
              "--rollout-correction", "token-tis", "--min-response-len", "8")
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert row["rollout_ratio_mean"] == pytest.approx(1.0, abs=0.05), row
        assert 0 < row["rollout_abs_log_ratio_p99"] < 0.5, row
