"""The GPU paths: the fused log-probs against the full-logits reference on CUDA (fp32 and bf16 autocast, where the
GEMMs are real bf16 tensor-core GEMMs, unlike on a CPU), one update through either path, and a short train.py run with
rollout correction. Every test skips without a CUDA device (CI has none)."""

import pytest
import torch
from test_logprobs import assert_same_run, padded_batch, run_model, tiny_qwen2
from test_train import read_metrics, run_train

from cegppo_utils import logprobs as LP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def on_cuda(batch):
    return tuple(t.to(CUDA) for t in batch)


def to_cpu(run):
    return run[0].cpu(), run[1].cpu(), {n: g.cpu() for n, g in run[2].items()}


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
