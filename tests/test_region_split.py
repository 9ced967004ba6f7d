"""One update, whatever is measured: train.py's split of the gradient by clip region (--region-grad-norms off, last,
all) under no, full and selective checkpointing, with and without CPU stand-ins for Liger's in-place kernels (its RoPE
rotates q and k in place in the forward; its SwiGLU backward writes its gradients into the saved gate and up
activations), leaves the parameters after the update bit for bit those of the same update without the split, and
measures with the stand-ins what it measures without them."""

import random

import pytest
import torch
import torch.nn.functional as F
from test_levers import PAD, in_place_rotary, model_with
from test_train import read_metrics, run_train
from transformers.models.qwen2 import modeling_qwen2 as Q

import train
from cegppo_utils import flags

# --- an MLP whose backward writes into its saved activations, unseen, as Liger's SwiGLU kernel does ---------------


class InPlaceSwiGLU(torch.autograd.Function):
    """silu(gate) * up as Liger's SwiGLU runs it: the backward writes the gradients on gate and up into the saved gate
    and up tensors themselves (through .data, which has a version counter of its own, so autograd sees no write; a
    Triton store bumps none either) and returns that storage as the gradients. A graph backwarded a second time reads
    gradients where it saved activations."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sigmoid = torch.sigmoid(gate.data)
        silu = gate.data * sigmoid
        d_gate = grad * up.data * sigmoid * (1 + gate.data * (1 - sigmoid))
        gate.data.copy_(d_gate)
        up.data.copy_(grad * silu)
        return gate.data, up.data


def in_place_swiglu_mlp(self, x):
    """Qwen2MLP.forward with its act(gate) * up in InPlaceSwiGLU."""
    return self.down_proj(InPlaceSwiGLU.apply(self.gate_proj(x), self.up_proj(x)))


def test_the_swiglu_stand_in_is_a_swiglu_that_spoils_a_second_backward():
    """Its gradients are silu(gate) * up's; a second backward of the same graph gets others (what the split must
    never do)."""
    g = torch.Generator().manual_seed(0)
    gate, up, weight = (torch.randn(3, 8, generator=g, requires_grad=True) for _ in range(3))
    want = torch.autograd.grad((F.silu(gate) * up * weight).sum(), (gate, up))
    out = (InPlaceSwiGLU.apply(gate * 1.0, up * 1.0) * weight).sum()
    first = [t.clone() for t in torch.autograd.grad(out, (gate, up), retain_graph=True)]
    for got, expected in zip(first, want):
        torch.testing.assert_close(got, expected)
    second = torch.autograd.grad(out, (gate, up))
    assert not any(torch.allclose(a, b) for a, b in zip(second, first))


# --- the split against the update without it ----------------------------------------------------------------------

MEASURE = ("off", "last", "all")


def mixed_sequences(seed=3, vocab=300):
    """Eight sequences of random tokens, advantages of both signs."""
    rng = random.Random(seed)
    return [{"prompt_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 7))],
             "response_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(3, 12))],
             "advantage": rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 1.5), "correct": rng.random() < 0.5}
            for _ in range(8)]


def update(measure, checkpointing, stand_ins, monkeypatch):
    """The parameters (and their values before) after train.update_policy's two AdamW steps, one per mini-batch of
    four sequences in two micro-batches each, and its logged metrics. The old log-probs are the current ones moved by
    noise, so both clip regions hold tokens in both mini-batches."""
    args = flags.resolve("tiny", {"micro_batch_size": 2, "beta1": 1.0, "beta2": 0.5, "lr": 1e-2,
                                  "region_grad_norms": measure})
    with monkeypatch.context() as patch:  # the module-wide patches (and the selective mode's copies) undone after
        if stand_ins:
            patch.setattr(Q, "apply_rotary_pos_emb", in_place_rotary)
            patch.setattr(Q.Qwen2MLP, "forward", in_place_swiglu_mlp)
        model = model_with(checkpointing, seed=5)
        before = [p.detach().clone() for p in model.parameters()]
        policy = train.make_policy(args, model, torch.optim.AdamW(model.parameters(), lr=args.lr), PAD,
                                   torch.device("cpu"), fused=True)
        seqs = mixed_sequences()
        minis = train.make_mini_batches(policy, [seqs[:4], seqs[4:]], args.loss)
        g = torch.Generator().manual_seed(5)
        for mb in (mb for mini in minis for mb in mini.micro):
            logp, mb.old_entropy, _ = train.response_logprobs(policy, mb)
            mb.old_logp = logp + 0.6 * torch.randn(logp.shape, generator=g) * mb.response_mask
        logged = train.update_policy(policy, minis, args.loss)
    return before, [p.detach().clone() for p in model.parameters()], logged


def update_error(got, want) -> float:
    """The relative difference (Frobenius norm) of the two updates' parameter changes, over all parameters."""
    before, after, _ = want
    change = sum(float((a - b).double().square().sum()) for a, b in zip(after, before)) ** 0.5
    return sum(float((a - b).double().square().sum()) for a, b in zip(got[1], after)) ** 0.5 / change


@pytest.mark.parametrize("checkpointing", [None, "full", "selective"])
def test_the_split_by_region_leaves_the_update_alone(checkpointing, monkeypatch):
    """Each --region-grad-norms option gives the parameters of the update without the split, bit for bit, with the
    stand-ins and without; with them it logs the norms it logs without them (fp32 rounding apart); "off" logs none,
    "last" and "all" measure a gradient with both regions' parts."""
    runs = {(m, s): update(m, checkpointing, s, monkeypatch) for s in (False, True) for m in MEASURE}
    wrong = {(m, s): update_error(runs[m, s], runs["off", s]) for m, s in runs if m != "off"
             if not all(torch.equal(a, b) for a, b in zip(runs[m, s][1], runs["off", s][1]))}
    assert not wrong, f"the update moved by the measurement (relative difference of the change): {wrong}"
    for measure in MEASURE:
        want = {k: v for k, v in runs[measure, False][2].items() if k.startswith("grad_")}
        got = {k: v for k, v in runs[measure, True][2].items() if k.startswith("grad_")}
        assert got.keys() == want.keys() and ("grad_norm_low_neg" in want) == (measure != "off"), want
        assert got == pytest.approx(want, rel=1e-4, abs=1e-7), measure
        if measure != "off":
            assert want["grad_norm_low_neg"] > 1e-3 and want["grad_norm_high_pos"] > 1e-3, want


@pytest.mark.slow
def test_selective_checkpointing_trains_with_the_default_split(tmp_path, tiny_model_path):
    """`train.py --preset tiny --gradient-checkpointing --selective-checkpointing` in fp32 with the default
    --region-grad-norms last: the split never backwards the update's graph a second time (selective checkpointing's
    kept outputs serve one backward), so the run ends, exit 0, with a clip region's part of the gradient logged. One
    prompt per optimizer step, two passes and lr 1e-3, so that tokens leave the clip interval in the first step (the
    run stopped there with "Trying to backward an extra time" when the split did)."""
    run_train(tmp_path, "--gradient-checkpointing", "--selective-checkpointing", "--max-steps", "2", "--sampler", "hf",
              "--log-samples-every", "0", "--mini-batch-prompts", "1", "--micro-batch-size", "4", "--ppo-epochs", "2",
              "--lr", "1e-3")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert any(r.get("grad_norm_low_neg", 0) > 0 or r.get("grad_norm_high_pos", 0) > 0 for r in rows), rows
