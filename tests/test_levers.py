"""The one-GPU update's levers, each against the update without it, on a CPU: selective checkpointing under a rotary
embedding that writes in place unseen (Liger's, stood in for), checkpointing every k-th layer, packed rows that need
no search for their sequences (no host sync in their forward), FSDP2's settings for one process, and compiled decoder
layers. Each must give the same log-probs, entropies and gradients (or parameters) as the plain update. Liger's own
Triton kernels need CUDA (and triton, not in the CPU stack): tests/test_cuda.py runs them."""

import pytest
import torch
from test_logprobs import LENGTHS, assert_same_run, run_model, tiny_qwen2

import train
from cegppo_utils import attention, models

PAD = 0


def sequences(seed=4, vocab=300):
    """LENGTHS' five sequences of random tokens, as train.py's micro-batch builders take them."""
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(1, vocab, (p,), generator=g).tolist(),
             "response_ids": torch.randint(1, vocab, (r,), generator=g).tolist(), "advantage": 1.0, "correct": True}
            for p, r in zip(*LENGTHS.values())]


def batch_of(mb):
    """A train.MicroBatch as test_logprobs.run_model takes a batch."""
    fields = (mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_ids, mb.response_mask)
    return fields + ((mb.packed,) if mb.packed is not None else ())


def micro_batch(layout, device="cpu"):
    """The five sequences as one padded (train.collate) or packed (train.pack) micro-batch."""
    build = train.pack if layout == "packed" else train.collate
    return batch_of(build(sequences(), PAD, torch.device(device)))


def relative_error(got, want) -> float:
    """The largest relative error (Frobenius norm) of any parameter's gradient."""
    return max(((got[2][n].float() - want[2][n].float()).norm() / want[2][n].float().norm()).item() for n in want[2])


# --- a rotary embedding that writes in place, unseen, as Liger's Triton kernel does ------------------------------

def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


class InPlaceRotary(torch.autograd.Function):
    """RoPE as Liger's kernel runs it: q and k rotated inside their own storage (the q and k projections' outputs)
    through .data, which has a version counter of its own, so autograd and torch.utils.checkpoint see no write (a
    Triton store bumps none either); returned as views of that storage."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        for x in (q, k):
            x.data.copy_(x.data * cos + rotate_half(x.data) * sin)
        return q.transpose(1, 2).transpose(1, 2), k.transpose(1, 2).transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return dq * cos - rotate_half(dq * sin), dk * cos - rotate_half(dk * sin), None, None


def in_place_rotary(q, k, cos, sin, unsqueeze_dim=1):
    return InPlaceRotary.apply(q, k, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def model_with(checkpointing=None, seed=4, liger=False, device="cpu", dtype=torch.float32, **options):
    """The tiny Qwen2 as train.load_policy builds it: per-sequence attention, Liger's kernels (CUDA), checkpointing."""
    model = tiny_qwen2(tied=False, seed=seed).to(device, dtype).train()
    attention.use(model)
    if liger:
        assert models.use_liger(model, torch.device(device)).startswith("on")
    if checkpointing:
        models.enable_checkpointing(model, selective=checkpointing == "selective", **options)
    return model


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_selective_checkpointing_gives_the_gradients_of_no_checkpointing_under_an_in_place_rotary(monkeypatch,
                                                                                                  layout):
    """The policy keeps the q and k projections' outputs (addmm) as aliases guarded by their version counter only; a
    rotary embedding that rotates them in place unseen would be run again on the kept, already rotated q and k in the
    backward's recomputation. models.enable_checkpointing(selective=True) gives it copies, so selective and no
    checkpointing agree to fp32 rounding. The same policy without the copies (as it was) is shown wrong here: the
    log-probs equal, the gradients off by more than half their size."""
    from functools import partial

    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from transformers.models.qwen2 import modeling_qwen2 as Q
    batch = micro_batch(layout)
    eager = run_model(model_with(), batch, fused=True)
    monkeypatch.setattr(Q, "apply_rotary_pos_emb", in_place_rotary)  # restored after the test, copies and all
    want = run_model(model_with(), batch, fused=True)
    assert_same_run(want, eager, tol=2e-5)  # the stand-in is a RoPE, its gradient included
    assert_same_run(run_model(model_with("full"), batch, fused=True), want, tol=2e-5)
    old = model_with()
    old.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, models.selective_policy)})
    wrong = run_model(old, batch, fused=True)
    torch.testing.assert_close(wrong[0], want[0], rtol=2e-5, atol=2e-5)
    assert relative_error(wrong, want) > 0.5
    selective = model_with("selective")
    assert_same_run(run_model(selective, batch, fused=True), want, tol=2e-5)
    kernels = models.kernels_in_use(selective)
    assert kernels["rope"] == f"{__name__}.in_place_rotary (on copies of q and k)", kernels
    assert kernels["checkpointing"] == "selective, 2 of 2 layers"


def test_transformers_own_rotary_gets_no_copies():
    model = model_with("selective")
    assert models.kernels_in_use(model)["rope"] == "transformers.models.qwen2.modeling_qwen2.apply_rotary_pos_emb"


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_checkpointing_every_kth_layer_gives_the_same_gradients_and_recomputes_only_those(layout):
    """--checkpoint-every 2 on two decoder layers: the first is checkpointed (its forward runs again in the backward),
    the second keeps its activations; the matrix products counted at the dispatcher lie between full checkpointing's
    and none's, and the gradients are none's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountProducts(TorchDispatchMode):
        products = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.products += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
            return func(*args, **(kwargs or {}))

    batch, runs, products = micro_batch(layout), {}, {}
    for mode, options in (("none", {}), ("full", {}), ("every 2", {"every": 2})):
        model = model_with(None if mode == "none" else "full", **options)
        with CountProducts() as count:
            runs[mode] = run_model(model, batch, fused=True)
        products[mode] = count.products
    assert products["none"] < products["every 2"] < products["full"], products
    assert_same_run(runs["every 2"], runs["none"], tol=2e-5)
    assert models.kernels_in_use(model)["checkpointing"] == "full, 1 of 2 layers"


# --- packed rows: their sequences from pack(), no host sync in the forward -----------------------------------------

def test_a_packed_row_reaches_attention_with_its_layout_and_no_host_sync(monkeypatch):
    """train.pack gives the row's sequences (cu_seqlens built on the host); the forward and backward, checkpointed,
    then neither search the position ids for them (attention.layout, transformers' packed-sequence check) nor read a
    value back from the device (item, bool, nonzero: counted at the dispatcher), and give the padded micro-batch's
    log-probs, entropies and gradients."""
    import transformers.masking_utils as masking
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountReads(TorchDispatchMode):
        reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero", "is_nonzero", "equal"):
                self.reads.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    want = run_model(model_with("full"), micro_batch("padded"), fused=True)
    packed = micro_batch("packed")
    lay = packed[5].layout
    assert lay.lengths == [p + r for p, r in zip(*LENGTHS.values())] and lay.index is None
    assert lay.cu_seqlens.tolist() == [0, 11, 22, 30, 35, 50] and lay.max_len == 15
    monkeypatch.setattr(attention, "layout", lambda *a: pytest.fail("the forward searched for the sequences"))
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a: pytest.fail("transformers' check ran"))
    model = model_with("full")
    with CountReads() as count:
        got = run_model(model, packed, fused=True)
    assert count.reads == []
    assert_same_run(got, want, tol=2e-5)


def test_a_packed_row_under_another_attention_finds_its_sequences_itself():
    """Under transformers' sdpa (a model attention.py cannot take) the layout pack() gave is not used: transformers'
    own mask keeps attention within each sequence, as before."""
    reference = model_with()
    want = run_model(reference, micro_batch("padded"), fused=True)
    model = tiny_qwen2(tied=False, seed=4).train()
    assert model.config._attn_implementation == "sdpa"
    assert_same_run(run_model(model, micro_batch("packed"), fused=True), want, tol=2e-5)


def test_host_syncs_are_counted_on_a_cpu_where_a_device_would_be_read():
    """tools.bench's CPU count (a lower bound of CUDA's sync-debug count): a value read back, a list, a boolean mask's
    selection, a nonzero each count one; arithmetic on the device counts none."""
    from tools import bench
    x, tolist = torch.arange(6.0), torch.Tensor.tolist
    with bench.counting_host_syncs("cpu") as counts:
        y = x * 2 + 1
        y.sum().item()
        y.tolist()
        y[y > 3]
        (y > 3).nonzero()
        bool(y.max() > 0)
    assert dict(counts) == {"_local_scalar_dense": 2, "tolist": 1, "index (boolean mask)": 1, "nonzero": 1}, counts
    with bench.counting_host_syncs("cpu") as counts:
        torch.cumsum(y, 0).softmax(0)
    assert dict(counts) == {} and torch.Tensor.tolist is tolist  # put back


def test_the_update_stages_host_syncs_are_counted_per_micro_batch_and_per_optimizer_step():
    """tools.bench's host_syncs section on a CPU: the counts of stages of 1 and 2 mini-batches of 1 and 2
    micro-batches fit mini-batches x (micro-batches x a + b) + c exactly, so "per micro-batch" and "per optimizer
    step" mean what they say; a packed row's no-grad forward (the old log-probs') reads nothing back, where a padded
    micro-batch's searches its mask for the sequences."""
    from tools import bench
    out = bench.bench_host_syncs("cpu")
    for layout in ("packed", "padded"):
        counted = out[layout]
        assert counted["two_by_two_as_predicted"], counted
        assert counted["per_micro_batch"] > 0 and counted["per_optimizer_step"] > 0, counted
    assert out["packed"]["old_logprobs_per_micro_batch"] == 0 < out["padded"]["old_logprobs_per_micro_batch"]
    assert out["kernels"]["checkpointing"].startswith("full") and out["region_grad_norms"] == "off"


def test_what_selective_checkpointing_keeps_is_the_reckoned_bytes():
    """tools.bench.checkpoint_kept_bytes (the figure performance.md gives: ~26 GiB of a 20,480-token row at the 1.5B
    shape against full checkpointing's ~1.6 GiB) against what the selective policy keeps, summed at the dispatcher:
    the outputs of the ops it marks MUST_SAVE in the decoder layers' forward of a packed row, fp32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tools import bench

    class KeptBytes(TorchDispatchMode):
        inside, total = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.inside and models._saved_by_selective(func):
                outs = out if isinstance(out, (tuple, list)) else (out,)
                KeptBytes.total += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
            return out

    model = model_with("selective")
    for layer in models.decoder_layers(model):
        layer.register_forward_pre_hook(lambda *a: KeptBytes.inside.append(1))
        layer.register_forward_hook(lambda *a: KeptBytes.inside.pop() and None)  # a value returned replaces the output
    config = {k: getattr(model.config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads")}
    batch = micro_batch("packed")
    with KeptBytes():
        model(input_ids=batch[0], position_ids=batch[2])
    tokens = sum(p + r for p, r in zip(*LENGTHS.values()))
    assert KeptBytes.total == bench.checkpoint_kept_bytes(config, tokens, "selective", bytes_per_value=4) > 0
    assert round(bench.checkpoint_kept_bytes(bench.R1_DISTILL_1P5B, 20480, "selective") / 2**30) == 26
    assert round(bench.checkpoint_kept_bytes(bench.R1_DISTILL_1P5B, 20480, "full") / 2**30, 1) == 1.6
    assert bench.rotary_copy_bytes(bench.R1_DISTILL_1P5B, 20480) == 70 * 2**20


# --- FSDP2's settings for one process ------------------------------------------------------------------------------

def test_fsdp_one_process_settings_give_the_same_update(monkeypatch):
    """--fsdp-one-process (bf16, one process): the decoder layers keep their gathered bf16 weights from forward to
    backward and FSDP2 divides nothing; one update (old log-probs, two mini-batches, two AdamW steps, packed) gives
    the parameters of the update without them, bit for bit. Under FSDP2 too the packed rows reach attention with the
    layout pack() gave them (no forward searches for it)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from cegppo_utils import distributed as D
    from cegppo_utils import flags
    monkeypatch.setattr(attention, "layout", lambda *a: pytest.fail("a forward searched for the sequences"))
    args = flags.resolve("tiny", {"micro_batch_tokens": 64, "precision": "bf16", "lr": 1e-2})
    seqs, weights = sequences(), {}
    try:
        for one_process in (False, True):
            model = D.place_model(model_with(seed=5), "bf16", torch.device("cpu"), one_process=one_process)
            policy = train.make_policy(args, model, torch.optim.AdamW(model.parameters(), lr=args.lr), PAD,
                                       torch.device("cpu"), fused=True)
            minis = train.make_mini_batches(policy, [seqs[:3], seqs[3:]], args.loss)
            train.old_logprobs(policy, minis)
            train.update_policy(policy, minis, args.loss)
            weights[one_process] = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
            layers = [m._get_fsdp_state()._fsdp_param_group for m in models.decoder_layers(model)]
            groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
            assert len(layers) == 2 and all((g.post_forward_mesh_info is None) == one_process for g in layers)
            assert all((g.gradient_divide_factor is None) == one_process for g in groups)
    finally:
        if dist.is_initialized():  # the group of one that place_model made for this process
            dist.destroy_process_group()
    moved = any(not torch.equal(weights[True][n], model_with(seed=5).state_dict()[n]) for n in weights[True])
    assert moved and weights[True].keys() == weights[False].keys()
    for name in weights[False]:
        assert torch.equal(weights[True][name], weights[False][name]), name


# --- compiled decoder layers ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_compiled_layers_give_the_same_gradients():
    """models.compile_layers (torch.compile's inductor on the CPU, dynamic shapes), attention left out of the graphs:
    the plain model's log-probs, entropies and gradients to fp32 rounding, padded and packed, without checkpointing and
    with full checkpointing. Compiled code is kept per function with its guards, so every layer, and the second
    model, reuse the first layer's graphs: one compile in all (the padded and the packed micro-batch each get their
    own graphs, a mask against none), about a minute on a CPU. torch._dynamo's counters: the only graph breaks are the
    attention calls left out on purpose, though each reference model, set up after compile_layers, registers the
    attention again (attention.register keeps it untraced: traced, dynamo would follow the layout search into a
    nonzero and a tolist, a break each, and compile more graphs)."""
    from torch._dynamo.utils import counters

    from tools import bench
    counters.clear()
    try:
        for checkpointing in (None, "full"):
            model = model_with(checkpointing)
            models.compile_layers(model)
            assert models.kernels_in_use(model)["compiled_layers"] == 2
            for layout in ("padded", "packed"):
                want = run_model(model_with(checkpointing), micro_batch(layout), fused=True)
                assert_same_run(run_model(model, micro_batch(layout), fused=True), want, tol=5e-5)
        made, breaks = bench.compile_counts(), counters["graph_break"]
        assert made["graphs"] >= 2 and made["graph_breaks"] >= 2, made
        assert all("torch.compiler.disable" in reason and "attention_forward" in reason for reason in breaks), breaks
    finally:
        torch.compiler.reset()


def test_compiled_layers_refuse_the_selective_policy():
    with pytest.raises(ValueError, match="selective checkpointing policy"):
        models.compile_layers(model_with("selective"))


# --- the flags -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-every", "2"], "--checkpoint-every is read only with --gradient-checkpointing"),
    (["--gradient-checkpointing", "--checkpoint-every", "0"], "--checkpoint-every"),
    (["--fsdp-one-process"], "--fsdp-one-process is read only with --precision bf16 in one process"),
    (["--gradient-checkpointing", "--selective-checkpointing", "--compile-layers"],
     "--compile-layers cannot run with --selective-checkpointing"),
])
def test_lever_flags_are_checked(argv, message, capsys):
    from conftest import parse_train_args
    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_the_lever_flags_reach_the_model(tiny_model_path):
    """train.load_policy builds what the flags say: every other layer checkpointed, FSDP2's one-process settings."""
    import torch.distributed as dist
    from conftest import parse_train_args
    args = parse_train_args(["--gradient-checkpointing", "--checkpoint-every", "2", "--precision", "bf16",
                             "--fsdp-one-process"])
    try:
        policy, _ = train.load_policy(args, tiny_model_path, torch.device("cpu"), ["Compute 2 + 3."])
        layers = models.decoder_layers(policy.model)
        kernels = models.kernels_in_use(policy.model)
        assert kernels["checkpointing"] == f"full, {(len(layers) + 1) // 2} of {len(layers)} layers", kernels
        assert all(m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is None for m in layers)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
