"""logprobs.py: both kernels against autograd through a naive log_softmax, on a bare head and on real (tiny, random)
Qwen2 models, tied and untied, padded, bf16, checkpointed, sharded by FSDP2; the truncation statistics against vLLM's
rule; the memory claim in a fresh process."""

import math
import os

import pytest
import torch
import warm
from conftest import ROOT

from cegppo_utils import attention
from cegppo_utils import logprobs as LP


def naive_logprobs_and_entropy(logits, targets, temperature):
    logsm = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def tiny_qwen2(tied, seed=0, vocab=300):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # a random head gives near-uniform softmaxes; sharper ones test more
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def padded_batch(seed=0, vocab=300, prompts=(5, 2, 7), responses=(6, 9, 1), select=None):
    """train.collate's layout: prompts left-padded into P columns, responses right-padded into R. Sequence i's tokens
    depend on (seed, i) only, so a selection of sequences (one rank's share) holds the same sequences, padded anew."""
    select = range(len(prompts)) if select is None else select
    prompts, responses = [prompts[i] for i in select], [responses[i] for i in select]
    P, R = max(prompts), max(responses)
    ids = torch.zeros(len(prompts), P + R, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, (i, p, r) in enumerate(zip(select, prompts, responses)):
        g = torch.Generator().manual_seed(1000 * seed + i)
        ids[row, P - p:P + r] = torch.randint(1, vocab, (p + r,), generator=g)
        attention[row, P - p:P + r] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return ids, attention, positions, ids[:, P:], attention[:, P:].double()


def packed_batch(seed=0, vocab=300, prompts=(5, 2, 7), responses=(6, 9, 1)):
    """The sequences of padded_batch(seed, ...) in train.pack's layout: one row, position ids restarting per sequence,
    no attention mask; response_ids and the mask still [S, R]."""
    ids, _, _, response, mask = padded_batch(seed, vocab, prompts, responses)
    P, row, positions, where = ids.shape[1] - response.shape[1], [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        where += range(len(row) + p - 1, len(row) + p - 1 + r)
        row += ids[i, P - p:P + r].tolist()
        positions += range(p + r)
    seqs, cols = mask.nonzero(as_tuple=True)
    packing = LP.Packing(torch.tensor(where), seqs, cols)
    return torch.tensor([row]), None, torch.tensor([positions]), response, mask, packing


def run_model(model, batch, fused, temperature=0.7, autocast_dtype=None, seed=1):
    """model_logprobs plus a loss that uses both outputs; returns (logp, entropy, {param name: grad}); padding's
    log-probs and entropies zeroed (packed rows return 0 there, padded ones whatever the pad tokens give)."""
    ids, attention, positions, response, mask, *packing = batch
    model.zero_grad(set_to_none=True)
    logp, entropy = LP.model_logprobs(model, ids, attention, positions, response, temperature=temperature,
                                      autocast_dtype=autocast_dtype, fused=fused,
                                      packed=packing[0] if packing else None)
    g = torch.Generator().manual_seed(seed)
    a, c = (torch.randn(logp.shape, generator=g).to(logp.device) for _ in range(2))
    ((a * logp + 0.5 * c * entropy) * mask).sum().backward()
    return logp.detach() * mask, entropy.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_run(got, want, tol):
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=tol, atol=tol, msg=name)


# --- 1. the chunked kernel on logits (moved from test_loss.py) --------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [2**25, 3 * 50, 1000 * 50])  # one chunk; < one row; several rows
def test_chunked_logprobs_match_naive(dtype, temperature, chunk_elements):
    g = torch.Generator().manual_seed(0)
    vocab = 50
    full = (torch.randn(4, 9, vocab, generator=g) * 3).to(dtype)
    logits = full[:, :-1].detach().requires_grad_(False)  # a non-contiguous view, as models' logits are sliced
    base = full.clone().requires_grad_(True)
    targets = torch.randint(0, vocab, (4, 8), generator=g)
    upstream, upstream_h = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    logp, entropy = LP.token_logprobs_and_entropy(base[:, :-1], targets, temperature=temperature,
                                                  chunk_elements=chunk_elements)
    (logp * upstream + entropy * upstream_h).sum().backward()
    ours_grad = base.grad.clone()
    base.grad = None
    want_logp, want_entropy = naive_logprobs_and_entropy(base[:, :-1], targets, temperature)
    (want_logp * upstream + want_entropy * upstream_h).sum().backward()

    assert logp.dtype == entropy.dtype == torch.float32 and entropy.requires_grad
    torch.testing.assert_close(logp, want_logp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours_grad, base.grad, rtol=tol, atol=tol)
    assert torch.equal(logits, full[:, :-1])  # input untouched


def test_chunked_logprobs_without_entropy_and_under_no_grad():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        logp, entropy = LP.token_logprobs_and_entropy(logits, targets, with_entropy=False)
    assert entropy is None and not logp.requires_grad
    torch.testing.assert_close(logp, naive_logprobs_and_entropy(logits, targets, 1.0)[0].float())
    with pytest.raises(ValueError, match="temperature must be > 0"):
        LP.token_logprobs_and_entropy(logits, targets, temperature=0)
    with pytest.raises(ValueError, match=r"targets \[batch, T\]"):
        LP.token_logprobs_and_entropy(logits, targets[:, :3])


@pytest.mark.slow
def test_chunked_logprobs_peak_memory_stays_bounded():
    """At vocabulary 151,936 the forward's extra memory is ~one fp32 chunk, not [T, vocab] in fp32."""
    from tools import bench
    chunk_elements = 2**22
    naive = bench.logprob_peak("naive", tokens=512, chunk_elements=chunk_elements, repeats=0)
    ours = bench.logprob_peak("chunked", tokens=512, chunk_elements=chunk_elements, repeats=0)
    logits_bytes, chunk_bytes = naive["logits_bytes"], chunk_elements * 4
    assert naive["forward_peak_bytes"] > 3 * logits_bytes  # fp32 copy, log_softmax, exp: each 2x the bf16 logits
    assert ours["forward_peak_bytes"] < 4 * chunk_bytes, ours
    assert ours["forward_peak_bytes"] < 0.1 * naive["forward_peak_bytes"], (ours, naive)
    # backward must return a gradient the size of the logits; beyond that, again about a chunk
    assert ours["total_peak_bytes"] < logits_bytes + 4 * chunk_bytes, ours
    assert naive["total_peak_bytes"] > 2 * ours["total_peak_bytes"], (ours, naive)


# --- 2. entropy gradient, and one output at a time --------------------------------------------

@pytest.mark.parametrize("kernel", ["logits", "fused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("used", ["both", "logp", "entropy"])
def test_entropy_and_logp_gradients_match_autograd(monkeypatch, kernel, dtype, temperature, used):
    monkeypatch.setattr(LP, "MIN_VOCAB_BLOCK", 8)  # the fused kernel then splits this small vocabulary too
    g = torch.Generator().manual_seed(0)
    vocab, hid = 37, 6
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    if kernel == "logits":
        inputs = [(torch.randn(3, 5, vocab, generator=g) * 3).to(dtype).requires_grad_(True)]

        def ours(x):
            return LP.token_logprobs_and_entropy(x[0], targets, temperature=temperature, chunk_elements=2 * vocab)

        def logits(x):
            return x[0]
    else:
        inputs = [torch.randn(3, 5, hid, generator=g).to(dtype).requires_grad_(True),
                  torch.randn(vocab, hid, generator=g).to(dtype).requires_grad_(True),
                  torch.randn(vocab, generator=g).to(dtype).requires_grad_(True)]

        def ours(x):
            return LP.hidden_logprobs_and_entropy(x[0], x[1], targets, bias=x[2], temperature=temperature,
                                                  chunk_elements=4 * 8)  # tiles of 4 tokens x 8 vocab entries

        def logits(x):
            return x[0] @ x[1].T + x[2]
    up_logp, up_ent = (torch.randn(3, 5, generator=g, dtype=torch.float64),
                       torch.randn(3, 5, generator=g, dtype=torch.float64))

    def loss(logp, entropy):
        terms = {"both": (logp * up_logp + entropy * up_ent), "logp": logp * up_logp, "entropy": entropy * up_ent}
        return terms[used].sum()

    logp, entropy = ours(inputs)
    loss(logp.double(), entropy.double()).backward()
    got = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    want_logp, want_entropy = naive_logprobs_and_entropy(logits(inputs), targets, temperature)
    loss(want_logp, want_entropy).backward()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(logp.double(), want_logp, rtol=tol, atol=tol)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=tol, atol=tol)
    for ours_grad, x in zip(got, inputs):
        torch.testing.assert_close(ours_grad, x.grad, rtol=tol, atol=tol)


def test_fused_kernel_passes_gradcheck(monkeypatch):
    monkeypatch.setattr(LP, "MIN_VOCAB_BLOCK", 4)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3), generator=g)

    def f(h, w, b):
        return LP.hidden_logprobs_and_entropy(h, w, targets, bias=b, temperature=0.7, chunk_elements=2 * 4)
    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


# --- 3. the fused kernel on a bare head ---------------------------------------------------------

@pytest.mark.parametrize("chunk_elements, min_block", [(2**23, 1024), (24 * 16, 16), (5 * 16, 16)])  # one tile; vocab
def test_fused_head_matches_naive(monkeypatch, chunk_elements, min_block):  # blocks only; token chunks x vocab blocks
    monkeypatch.setattr(LP, "MIN_VOCAB_BLOCK", min_block)
    g = torch.Generator().manual_seed(0)
    vocab, hid = 100, 16
    full = torch.randn(3, 9, hid, generator=g)
    hidden = full[:, 1:].requires_grad_(False).clone().requires_grad_(True)
    weight = (torch.randn(vocab, hid, generator=g) * 0.5).requires_grad_(True)
    targets = torch.randint(0, vocab, (3, 8), generator=g)
    up = torch.randn(3, 8, generator=g)
    logp, entropy = LP.hidden_logprobs_and_entropy(hidden, weight, targets, temperature=0.7,
                                                   chunk_elements=chunk_elements)
    (logp * up).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want_logp, want_entropy = naive_logprobs_and_entropy(hidden @ weight.T, targets, 0.7)
    (want_logp * up).sum().backward()
    assert logp.dtype == torch.float32 and logp.shape == (3, 8)
    torch.testing.assert_close(logp, want_logp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], weight.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        logp, entropy = LP.hidden_logprobs_and_entropy(hidden, weight, targets, temperature=0.7, with_entropy=False)
    assert entropy is None and not logp.requires_grad
    torch.testing.assert_close(logp, want_logp.float(), rtol=1e-5, atol=1e-5)


BF16_EPS = 2.0 ** -8  # bf16's relative precision (8 significant bits): the unit device-dependent tolerances are made of


@pytest.mark.parametrize("native", [False, True])
def test_fused_head_under_bf16_autocast_with_fp32_master_weight(monkeypatch, native):
    """The promise (logprobs.py, section 2), the same on every device: under bf16 autocast the logits are rounded to
    bf16 once, as autocast's own linear returns them; the softmax stays fp32. native=True forces the bf16 GEMM that
    GPUs and CPUs with AVX512-BF16 or AMX run (torch's reference kernel here), native=False the fp32 GEMM on
    bf16-rounded operands that AVX2 CPUs run: both must give the bf16-rounded logits' log-probs and entropy.
    Inputs on a 1/16 grid fit bf16 exactly and their dot products are exact in fp32 in any summation order, so every
    path holds the same logit before rounding and the same bf16 logit after it: the forward is compared at fp32
    precision on any hardware, and an implementation that kept fp32 logits (off by up to |z| 2^-9) fails."""
    monkeypatch.setattr(LP, "_CPU_HALF_GEMM", native)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(2, 7, 32, generator=g) * 4).round().div(16).requires_grad_(True)
    weight = (torch.randn(200, 32, generator=g) * 8).round().div(16).requires_grad_(True)
    bias = (torch.randn(200, generator=g) * 16).round().div(256).requires_grad_(True)
    targets = torch.randint(0, 200, (2, 7), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = LP.hidden_logprobs_and_entropy(hidden, weight, targets, bias=bias)
        (logp.sum() + entropy.sum()).backward()
    assert logp.dtype == entropy.dtype == torch.float32
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = bias.grad = None
    # the reference in float64: the exact logits (the grid makes them exact), rounded once to bf16
    exact = hidden.bfloat16().double() @ weight.bfloat16().double().T + bias.double()
    assert torch.equal(exact, exact.float().double())  # exact in fp32 too: every GEMM path starts from these values
    want_logp, want_entropy = naive_logprobs_and_entropy(exact.bfloat16().double(), targets, 1.0)
    torch.testing.assert_close(logp, want_logp.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropy, want_entropy.float(), rtol=1e-4, atol=1e-4)
    unrounded = naive_logprobs_and_entropy(exact.detach(), targets, 1.0)[0]
    assert (unrounded - want_logp).abs().max() > 10 * 1e-4  # the rounding is visible: fp32 logits would fail above
    (want_logp.sum() + want_entropy.sum()).backward()  # flows through the rounding as a straight-through cast
    # The gradient GEMMs take bf16 operands (dL/dlogits rounded to bf16 on every device); a bf16 GEMM (native) also
    # rounds each vocab block's product to bf16: a few bf16 steps, 2^-8 each, relative to the gradient's scale.
    for mine, want in zip(got, (hidden.grad, weight.grad)):
        scale = want.abs().max().item()
        assert (mine - want).abs().max().item() <= 4 * BF16_EPS * scale, (
            native, (mine - want).abs().max().item(), scale)


# --- 4. on a real HF model: model_logprobs fused vs the reference -------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_model_logprobs_fused_matches_reference(tied):
    model = tiny_qwen2(tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    batch = padded_batch()
    want = run_model(model, batch, fused=False)
    got = run_model(model, batch, fused=True)
    assert_same_run(got, want, tol=2e-5)
    assert all(torch.isfinite(t).all() for t in got[:2])  # padded positions too
    assert "forward" not in model.get_output_embeddings().__dict__  # the head's own forward is back
    with torch.no_grad():
        logp, entropy = LP.model_logprobs(model, *batch[:4], temperature=0.7)
    torch.testing.assert_close(logp * batch[4], want[0], rtol=2e-5, atol=2e-5)
    assert not logp.requires_grad
    assert LP.check_fused(model) and LP.check_fused(model, autocast_dtype=torch.bfloat16)


def test_model_logprobs_fused_with_gradient_checkpointing_and_temperature_one():
    model = tiny_qwen2(tied=False, seed=1)
    batch = padded_batch(seed=1)
    want = run_model(model, batch, fused=False, temperature=1.0)
    model.gradient_checkpointing_enable()
    model.train()
    got = run_model(model, batch, fused=True, temperature=1.0)
    assert_same_run(got, want, tol=2e-5)


def test_selective_checkpointing_recomputes_no_matrix_product_and_keeps_the_gradients():
    """Full checkpointing runs each decoder layer's forward again in the backward, its matrix products included; the
    selective policy (models.enable_checkpointing) keeps the products' and attention's outputs and recomputes only the
    elementwise ops. Counted at the dispatcher: selective runs as many matrix products as no checkpointing, full runs
    more; all three give the same log-probs and gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cegppo_utils import models

    class CountProducts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.products = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.products += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
            return func(*args, **(kwargs or {}))

    batch, runs, products = padded_batch(seed=3), {}, {}
    for mode in ("none", "full", "selective"):
        model = tiny_qwen2(tied=False, seed=3).train()
        if mode != "none":
            models.enable_checkpointing(model, selective=mode == "selective")
        with CountProducts() as count:
            runs[mode] = run_model(model, batch, fused=False)
        products[mode] = count.products
    assert products["selective"] == products["none"] < products["full"], products
    assert_same_run(runs["full"], runs["none"], tol=1e-6)
    assert_same_run(runs["selective"], runs["none"], tol=1e-6)


def test_model_logprobs_fused_under_bf16_autocast():
    """Looser: the reference rounds each logit to bf16 (error up to |z| 2^-9, ~0.01 at |z| ~ 5) and backpropagates a
    bf16 gradient of the logits; on this CPU the fused GEMMs take the same bf16-rounded operands but keep the tile in
    fp32. Both sides are bf16-accurate, not equal."""
    model = tiny_qwen2(tied=False, seed=2)
    batch = padded_batch(seed=2)
    want = run_model(model, batch, fused=False, autocast_dtype=torch.bfloat16)
    got = run_model(model, batch, fused=True, autocast_dtype=torch.bfloat16)
    exact = run_model(model, batch, fused=True)  # fp32, for scale
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=5e-2)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=5e-2)
    for name in want[2]:  # each bf16 gradient is as close to the other as to the fp32 one
        scale = exact[2][name].norm()
        assert (got[2][name] - want[2][name]).norm() <= 0.05 * scale + 1e-6, name
        assert (got[2][name] - exact[2][name]).norm() <= 0.05 * scale + 1e-6, name


# --- 4b. packed rows (train.pack) against padded ones -------------------------------------------

LENGTHS = dict(prompts=(5, 2, 7, 1, 3), responses=(6, 9, 1, 4, 12))  # mixed lengths, a 1-token prompt and response


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", attention.NAME])
def test_packed_row_matches_padded_rows(fused, checkpointing, attn):
    """One row of five sequences gives the log-probs, entropies and gradients of the padded batch (under transformers'
    sdpa) to fp32 accuracy: attention stays within each sequence (were it to cross, every sequence after the first
    would differ), under sdpa's block-diagonal mask and under attention.py's per-sequence attention, which also takes
    the padded batch itself (its padding is left out of attention, not masked)."""
    reference = tiny_qwen2(tied=False, seed=4)
    want = run_model(reference, padded_batch(seed=4, **LENGTHS), fused=False)
    model = tiny_qwen2(tied=False, seed=4)
    if attn != "sdpa":
        assert attention.use(model) == attn
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    got = run_model(model, packed_batch(seed=4, **LENGTHS), fused=fused)
    assert_same_run(got, want, tol=2e-5)
    assert "forward" not in model.get_output_embeddings().__dict__
    assert_same_run(run_model(model, padded_batch(seed=4, **LENGTHS), fused=fused), want, tol=2e-5)


def test_per_sequence_attention_builds_no_square_mask(monkeypatch):
    """Padded and packed micro-batches reach the kernel as sequences with no mask at all, one causal sdpa per sequence
    on a CPU (kernel_for), and attention over a sequence's tokens only: the padded batch's 3 rows and the packed row's
    5 sequences, each of its own length."""
    model = tiny_qwen2(tied=False, seed=4)
    attention.use(model)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[2], attn_mask, kwargs.get("is_causal")))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    layers = model.config.num_hidden_layers
    for batch, lengths in ((padded_batch(seed=4), [5 + 6, 2 + 9, 7 + 1]),
                           (packed_batch(seed=4, **LENGTHS), [p + r for p, r in zip(*LENGTHS.values())])):
        calls.clear()
        with torch.no_grad():
            LP.model_logprobs(model, *batch[:4], packed=batch[5] if len(batch) > 5 else None)
        assert [n for n, _, _ in calls] == lengths * layers
        assert all(mask is None and causal for _, mask, causal in calls)
    assert attention.kernel_for(torch.zeros(1, dtype=torch.bfloat16)) == "sdpa_per_sequence"  # CPU
    layout = attention.layout(None, torch.tensor([[0, 1, 2, 0, 1, 0, 5, 6]]), 1, 8, "cpu")
    assert layout.lengths == [3, 2, 1, 2] and layout.cu_seqlens.tolist() == [0, 3, 5, 6, 8] and layout.index is None
    assert layout.cu_seqlens.dtype == torch.int32 and layout.max_len == 3


def test_per_sequence_attention_generates_as_sdpa_with_a_kv_cache():
    """HF generate on the training model (the hf sampler): left-padded prompts, then decoding steps with a KV cache
    (queries fewer than keys, attention under the shifted causal and padding mask): greedy tokens as under sdpa."""
    reference, model = tiny_qwen2(tied=False, seed=6), tiny_qwen2(tied=False, seed=6)
    attention.use(model)
    ids, mask, *_ = padded_batch(seed=6, responses=(0, 0, 0))
    out = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
           for m in (reference, model)]
    assert torch.equal(out[0], out[1]) and out[0].shape[1] == ids.shape[1] + 6


def test_packed_row_truncation_matches_padded_rows():
    model = tiny_qwen2(tied=True, seed=5)
    padded, packed = padded_batch(seed=5, **LENGTHS), packed_batch(seed=5, **LENGTHS)
    mask = padded[4] > 0
    with torch.no_grad():
        want = LP.model_logprobs(model, *padded[:4], temperature=0.8, fused=False, truncation=(0.7, 20))
        for fused in (False, True):
            got = LP.model_logprobs(model, *packed[:4], temperature=0.8, fused=fused, truncation=(0.7, 20),
                                    packed=packed[5])
            torch.testing.assert_close(got[0][mask], want[0][mask], rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(got[2].log_kept_mass[mask], want[2].log_kept_mass[mask], rtol=2e-5, atol=2e-5)
            assert torch.equal(got[2].inside[mask], want[2].inside[mask]) and got[2].inside[~mask].all()
    assert (want[2].log_kept_mass[mask] < 0).all()  # the truncation removed mass


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_one_optimizer_step_gives_the_same_parameters(optimizer):
    params = {}
    for fused in (False, True):
        model = tiny_qwen2(tied=True, seed=3)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
               else torch.optim.SGD(model.parameters(), lr=0.5))
        run_model(model, padded_batch(seed=3), fused=fused)
        opt.step()
        params[fused] = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max((params[True][n] - tiny_qwen2(tied=True, seed=3).state_dict()[n]).abs().max() for n in params[True])
    assert moved > 1e-3
    for name in params[False]:
        torch.testing.assert_close(params[True][name], params[False][name], rtol=1e-5, atol=1e-6, msg=name)


def test_check_fused_refuses_post_processed_logits():
    from transformers import Qwen2ForCausalLM

    class ScaledQwen2(Qwen2ForCausalLM):  # a model that post-processes its logits, unknown to the config check
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out

    model = tiny_qwen2(tied=False)
    assert LP.check_fused(model)
    scaled = ScaledQwen2(model.config)
    scaled.load_state_dict(model.state_dict())
    assert not LP.check_fused(scaled)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's
    assert not LP.check_fused(model)


# --- 5. truncation statistics: vLLM's top-k / top-p rule ----------------------------------------

def brute_force_kept(z, top_p, top_k):
    """The kept set of one row z (fp32, after temperature), token by token: top-k then top-p as vLLM's native
    sampler."""
    vocab = z.numel()
    kept = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        kth = sorted(z.tolist(), reverse=True)[top_k - 1]
        kept = z >= kth  # ties with the k-th value stay
    if top_p < 1:
        survivors = z.masked_fill(~kept, -math.inf)
        order = survivors.sort().indices  # ascending; ties in torch.sort's order
        probs = survivors.softmax(-1)
        running = torch.zeros((), dtype=torch.float32)
        for pos, v in enumerate(order.tolist()):
            running = running + probs[v]  # fp32, left to right, like cumsum
            if pos < vocab - 1 and running <= 1 - torch.tensor(top_p, dtype=torch.float32):
                kept[v] = False
    return kept


def truncation_rows():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(13, generator=g) * 2 for _ in range(6)]
    rows.append(torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0, 0.0, -1.0, 2.0, -5.0, 0.5, 0.25, 3.0]))  # ties at ranks 2-5
    rows.append(torch.tensor([0.5, 0.25, 0.125, 0.125] + [0.0] * 9).clamp(min=1e-30).log())  # p exactly at 1/2, 3/4
    rows.append(torch.zeros(13))  # all tied
    return torch.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (1.0, 1), (1.0, 3), (1.0, 13), (0.5, 0), (0.75, 0), (0.9, 0),
                                          (0.3, 4), (0.8, 2), (0.95, 5), (1e-6, 0)])
def test_truncation_matches_brute_force_and_vllm(top_p, top_k):
    z = truncation_rows()  # [rows, 13]: logits / T
    targets = torch.arange(z.shape[0]) % 13
    want_kept = torch.stack([brute_force_kept(row, top_p, top_k) for row in z])
    try:  # vLLM's own function, when installed: the kept set is what it does not set to -inf
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
        k = torch.full((z.shape[0],), top_k if top_k else 13, dtype=torch.int32)
        p = torch.full((z.shape[0],), top_p, dtype=torch.float32)
        vllm_kept = apply_top_k_top_p_pytorch(z.clone(), k if top_k else None, p if top_p < 1 else None,
                                              allow_cpu_sync=True) > -math.inf
        assert torch.equal(vllm_kept, want_kept)
    except ImportError:
        pass
    want_mass = torch.log_softmax(z, -1).masked_fill(~want_kept, -math.inf).logsumexp(-1)
    want_inside = want_kept.gather(-1, targets[:, None]).squeeze(-1)

    # the logits kernel at T = 0.5 (it divides), the fused kernel with an identity head (hidden = z / 0.5)
    with torch.no_grad():
        logp, _, trunc = LP.token_logprobs_and_entropy((z * 0.5)[None], targets[None], temperature=0.5,
                                                       truncation=(top_p, top_k), chunk_elements=2 * 13 * 6)
        flogp, _, ftrunc = LP.hidden_logprobs_and_entropy(z * 0.5, torch.eye(13), targets, temperature=0.5,
                                                          truncation=(top_p, top_k), chunk_elements=3 * 13 * 6)
    for lp, t in ((logp[0], LP.Truncation(trunc.log_kept_mass[0], trunc.inside[0])), (flogp, ftrunc)):
        assert torch.equal(t.inside, want_inside)
        torch.testing.assert_close(t.log_kept_mass, want_mass, rtol=1e-6, atol=1e-6)
        trunc_logp = LP.truncated_logprobs(lp, t)
        assert torch.equal(torch.isinf(trunc_logp), ~want_inside)
        # inside the kept set: the log-prob under the truncated, renormalised distribution
        renormalised = torch.log_softmax(z.masked_fill(~want_kept, -math.inf), -1).gather(-1, targets[:, None])[:, 0]
        torch.testing.assert_close(trunc_logp[want_inside], renormalised[want_inside], rtol=1e-5, atol=1e-5)


def test_truncation_off_does_not_sort_and_needs_no_grad(monkeypatch):
    z = torch.randn(2, 3, 17)
    targets = torch.randint(0, 17, (2, 3))
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: pytest.fail("sorted"))
    monkeypatch.setattr(torch.Tensor, "topk", lambda *a, **k: pytest.fail("topk"))
    with torch.no_grad():
        _, _, trunc = LP.token_logprobs_and_entropy(z, targets, truncation=(1.0, 0))
        _, _, ftrunc = LP.hidden_logprobs_and_entropy(z, torch.eye(17), targets, truncation=(1.0, 17))
    for t in (trunc, ftrunc):
        assert torch.equal(t.log_kept_mass, torch.zeros(2, 3)) and t.inside.all()
    with pytest.raises(ValueError, match="no_grad"):
        LP.token_logprobs_and_entropy(z.requires_grad_(True), targets, truncation=(0.9, 0))
    with pytest.raises(ValueError, match="top_p"):
        LP.hidden_logprobs_and_entropy(z.detach(), torch.eye(17), targets, truncation=(0.0, 0))


def test_model_logprobs_truncation_fused_matches_reference():
    model = tiny_qwen2(tied=True, seed=4)
    batch = padded_batch(seed=4)
    with torch.no_grad():
        want = LP.model_logprobs(model, *batch[:4], temperature=0.7, fused=False, truncation=(0.9, 20))
        got = LP.model_logprobs(model, *batch[:4], temperature=0.7, fused=True, truncation=(0.9, 20))
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got[2].log_kept_mass, want[2].log_kept_mass, rtol=2e-5, atol=2e-5)
    assert torch.equal(got[2].inside, want[2].inside)
    # some targets outside the kept set, some inside; every kept mass in [0.9, 1] (top-p 0.9 keeps at least 0.9)
    assert not want[2].inside.all() and want[2].inside.any()
    assert (want[2].log_kept_mass <= 0).all() and (want[2].log_kept_mass >= math.log(0.9) - 1e-6).all()
    assert (want[2].log_kept_mass < -1e-3).any()


# --- 6. FSDP2 over 2 gloo ranks ----------------------------------------------------------------

FSDP_WORKER = r'''
import copy, os, sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from cegppo_utils import logprobs as LP
from test_logprobs import tiny_qwen2, padded_batch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
lengths = dict(prompts=(5, 2, 7, 3), responses=(6, 9, 1, 4))
worst = 0.0
for tied, use, bf16 in ((False, "both", False), (True, "both", False), (False, "entropy", False), (True, "both", True)):
    model = tiny_qwen2(tied, seed=5)
    reference = copy.deepcopy(model)  # unsharded, the whole batch, fused=False
    # as train.shard_model: one unit per decoder layer, then the root; with --precision bf16, bf16 compute parameters
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a plain sum over ranks: each rank's loss is its share
            module.set_force_sum_reduction_for_comms(True)
    assert LP.check_fused(model)

    def loss_of(m, seqs, fused):
        ids, attention, positions, response, mask = padded_batch(seed=5, select=list(seqs), **lengths)
        logp, entropy = LP.model_logprobs(m, ids, attention, positions, response, temperature=0.7, fused=fused,
                                          autocast_dtype=torch.bfloat16 if bf16 else None)
        g = torch.Generator().manual_seed(7)
        a = torch.randn(4, 16, generator=g)[list(seqs), :logp.shape[1]]
        terms = 0.5 * entropy if use == "entropy" else a * logp + 0.5 * entropy
        return (terms * mask).sum() / 20.0

    want = loss_of(reference, range(4), fused=False)
    want.backward()
    mine = loss_of(model, range(rank, 4, world), fused=True)  # each rank its own sequences, its own padding
    mine.backward()
    total = mine.detach().clone()
    dist.all_reduce(total)
    grads = dict(reference.named_parameters())
    if bf16:  # bf16 parameters against fp32 ones under autocast: bf16-close, gradient by gradient
        assert torch.allclose(total, want.detach(), rtol=2e-2, atol=1e-3), (total, want)
        for name, p in model.named_parameters():
            full, ref = p.grad.full_tensor(), grads[name].grad
            assert full.dtype == torch.float32 and (full - ref).norm() <= 0.05 * ref.norm() + 1e-6, name
        continue
    assert torch.allclose(total, want.detach(), rtol=1e-5, atol=1e-6), (total, want)
    for name, p in model.named_parameters():
        full = p.grad.full_tensor()
        diff = (full - grads[name].grad).abs().max().item()
        worst = max(worst, diff)
        assert torch.allclose(full, grads[name].grad, rtol=1e-4, atol=1e-5), (tied, use, name, diff)
if rank == 0:
    print("FSDP-OK", worst)
from cegppo_utils import distributed
distributed.end_process()  # barrier, destroy, exit without finalizing: see there why
'''


@pytest.mark.slow
def test_fsdp2_two_ranks_fused_matches_one_process_reference(tmp_path):
    script = tmp_path / "fsdp_worker.py"
    script.write_text(FSDP_WORKER)
    out = warm.torchrun(2, [script], cwd=ROOT, timeout=300,
                        env={**os.environ, "OMP_NUM_THREADS": "1",
                             "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])})
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    assert "FSDP-OK" in out.stdout


# --- 7. the memory claim ----------------------------------------------------------------------

@pytest.mark.slow
def test_fused_peak_memory_is_about_one_tile():
    """hidden 128, vocab 151,936, 512 tokens, bf16: the logits would be 156 MB, and any full-logits path holds them and
    their gradient; the fused path's extra memory, forward and backward, beyond the gradients it returns (grad_hidden,
    grad_weight), is about one 8 MiB fp32 tile (the tile and its exp, plus small [*, hidden] operands)."""
    from tools import bench
    chunk_elements = 2**21
    ours = bench.logprob_peak("fused", tokens=512, hidden=128, chunk_elements=chunk_elements, repeats=0)
    tile_bytes, logits_bytes = chunk_elements * 4, ours["logits_bytes"]
    beyond_grads = ours["total_peak_bytes"] - ours["grads_bytes"]
    assert ours["forward_peak_bytes"] < 4 * tile_bytes, ours
    assert beyond_grads < 4 * tile_bytes, ours
    assert beyond_grads < 0.1 * (2 * logits_bytes), ours


def test_bf16_precision_hands_attention_bf16_q_k_v(monkeypatch, tiny_model_path):
    """The preset's precision (--precision bf16) through train.py's own model path (load_policy, response_logprobs,
    backward): attention receives q, k and v in bf16, so on CUDA the varlen kernel runs and on a CPU the per-sequence
    sdpa does. (fp32 weights under bf16 autocast hand it fp32 q and k: the rotary embedding multiplies bf16 q and k
    by fp32 cos and sin, and the per-sequence sdpa loop runs even on a GPU.)"""
    import torch.distributed as dist
    from conftest import parse_train_args
    from transformers.models.qwen2 import modeling_qwen2 as Q

    import train
    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):  # on CUDA, Liger's module-wide patches: undone
        monkeypatch.setattr(Q, name, getattr(Q, name))
    seen = []
    for name, kernel in list(attention.KERNELS.items()):
        def recording(q, k, v, lay, scale, name=name, kernel=kernel):
            seen.append((name, q.dtype, k.dtype, v.dtype))
            return kernel(q, k, v, lay, scale)
        monkeypatch.setitem(attention.KERNELS, name, recording)
    args = parse_train_args(["--precision", "bf16"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        policy, _ = train.load_policy(args, tiny_model_path, device, ["Compute 2 + 3."])
        seen.clear()  # load_policy's own check of the fused head ran the model too
        seqs = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11], "advantage": 1.0, "correct": True},
                {"prompt_ids": [12, 13], "response_ids": [14, 15], "advantage": -1.0, "correct": False}]
        logp, _, _ = train.response_logprobs(policy, train.collate(seqs, policy.pad_id, device), grad=True)
        logp.sum().backward()
        want = "varlen_attn" if device.type == "cuda" else "sdpa_per_sequence"
        assert seen and set(seen) == {(want, torch.bfloat16, torch.bfloat16, torch.bfloat16)}, set(seen)
        master = {p.dtype for p in policy.model.parameters()}
        assert master == {torch.float32}  # the optimizer steps fp32 master weights
    finally:
        if dist.is_initialized():  # the group of one that place_model made for this process
            dist.destroy_process_group()


def test_vocab_blocks_are_aligned_for_the_gemms():
    """A vocab block narrower than the vocabulary is a multiple of 128 (bf16 GEMMs with an unaligned leading dimension
    fall back from Hopper's kernels): the 1.5B preset's packed row of 20,480 tokens gets 1,536, not 2**25 // 20,480 =
    1,638; the tile stays within its budget."""
    for tokens in (20_480, 16_384, 4_097, 300):
        chunk, block = LP._tile(tokens, 151_936, 2**25, False)
        assert block % LP.VOCAB_ALIGN == 0 and chunk * block <= 2**25 and chunk == min(tokens, 2**25 // block)
    assert LP._tile(20_480, 151_936, 2**25, False)[1] == 1_536
    assert LP._tile(8, 151_936, 2**25, False)[1] == 151_936  # the whole vocabulary in one block: no alignment needed
