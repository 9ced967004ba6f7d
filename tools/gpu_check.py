"""The GPU acceptance check: what a person with one (or two) GPUs runs first, in one command and under 18 minutes.
It prints one row per check: pass / FAIL against the limit it names, "measured" for a figure held to no limit, or
skipped; the number measured; and the part's time budget.

    python -m tools.gpu_check                              # every part this machine can run
    python -m tools.gpu_check --output checks/gpu.json     # the same rows as JSON (its folder is created)
    python -m tools.gpu_check --only "preset path"         # some parts
    python -m tools.gpu_check --estimate-bf16-gap          # any machine: the basis of the bf16 sync tolerance

Each part that the machine can run runs in a process of its own (vLLM allows one sleep-mode engine per process) under
its time budget, the seconds beside its name below: one that overruns is killed and its row is a FAIL naming it, one
that crashes a FAIL with its last error line, and the parts after it still run. The budgets add up to 1,080 s;
--time-scale stretches them all. Measured on one H200 (torch 2.11, no vllm, the tiny model cached): cuda tests 48-60
s, bf16 run 26-32 s, 1.5B update 60-64 s (one mini-batch then, before Liger and FSDP2's bf16; the whole update stage
it times now has not run on a GPU); the vLLM parts' budgets are twice an estimate that includes a cold engine's
compile and graph capture, untimed with vLLM.
  tiny model   (75)  the warm-started tiny model the next three parts use, built into .cache/ if it is not there
  cuda tests  (100)  tests/test_cuda.py's fast tier: the fused log-probs against full logits, the varlen attention
                     kernels against sdpa, Liger's kernels against a model that never saw them (its RoPE, pinned to
                     Triton, at the preset's shape too), selective checkpointing's gradients under Liger's in-place RoPE
                     and under FSDP2, the region split leaving the update alone under Liger, a bf16 run with rollout
                     correction
  bf16 run     (90)  3 steps of `train.py --preset tiny --precision bf16`: exit code, and the sampler/trainer log-prob
                     gap after each sync against the stale-sampler check's bf16 tolerance (rollout.SYNC_TOLERANCE)
  vllm cycles (240)  3 sleep / wake / sync cycles of a colocated engine (sleep level 2, as train.py runs it) on the tiny
                     model: memory given back asleep, greedy tokens equal to HF's after each sync, a skipped sync caught
                     by the exact check (rollout.stale_tensors); the per-request seeds (rollout.request_seed)
  preset path (360)  the 1.5B preset's own path on random weights saved to a local folder: the trainer built by
                     train.load_policy at the preset's settings (FSDP2's bf16 over fp32 masters, Liger's kernels, full
                     checkpointing, packed rows of 20,480 tokens) with AdamW's moments resident, and a bf16 engine of
                     R1-Distill-Qwen-1.5B's shape at the preset's 20,480-token context and memory share, asleep beside
                     it through one update (one mini-batch, one AdamW step at lr 1e-6) of 4 sequences with unequal
                     prompts (4,096 down to 1,024 tokens) and 16,384-token responses, each its own packed row (20,480
                     down to 17,408 tokens: the preset's largest rows): its peak (torch's max_memory_reserved plus what
                     is resident outside torch, the engine asleep and the CUDA context) against the device's memory;
                     what the engine keeps asleep of its own memory (its footprint at start minus what its sleep gave
                     back); then wake, one sync, the exact check and the probe's log-prob gap on the updated weights
  1.5B update (140)  Liger's kernels in the model the update ran (read from its forwards: a CUDA machine without
                     liger-kernel fails); tokens/s (measured) and MFU of packed and padded (the preset's micro-batches
                     of 4) update stages at the 1.5B shape on 32 long-tailed sequences, timed as train.py runs the
                     stage (its own old_logprobs and update_policy: 8 mini-batches, the old log-probs' forward on 7,
                     FSDP2's bf16, Liger's kernels, the attention kernel that ran counted; tools/bench.py's
                     update_throughput, one round); MFU under both conventions, each named (attention causal-halved,
                     this project's and the target's; full-square, torchtitan's and PaLM's), against the card's dense
                     bf16 peak (bench.DENSE_BF16_PEAK_TFLOPS; the GEMM rate measured here beside it, or in its place
                     for a card the table lacks); the target: packed >= 40% of the peak, causal-halved
  two ranks    (75)  tests/test_distributed.py's two-rank update on two GPUs (NCCL), exactly one process's
On a machine without CUDA every part is skipped and the command exits 0: the suite runs it that way.
Exit code: 1 if any check failed, 2 for a bad flag (before any part runs), else 0.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Row:
    part: str
    check: str
    status: str  # "pass" or "FAIL" against its limit, "measured" (a figure with no limit), or "skipped: why"
    number: str = ""
    limit: str = ""
    budget: str = ""  # the part's time budget (times --time-scale), within which all its rows were measured


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def needs(cuda=True, vllm=False, gpus=1) -> str | None:
    """Why a part cannot run here, or None."""
    if cuda and not torch.cuda.is_available():
        return "skipped: no CUDA device"
    if gpus > 1 and torch.cuda.device_count() < gpus:
        return f"skipped: needs {gpus} GPUs, {torch.cuda.device_count()} here"
    if vllm:
        import rollout
        if not rollout.vllm_available():
            return "skipped: vllm does not import (requirements-gpu.txt)"
    return None


def gib(nbytes) -> float:
    return nbytes / 2**30


# --- the parts ---------------------------------------------------------------------------------------------------

def tiny_model() -> list[Row]:
    why = needs()
    if why:
        return [Row("tiny model", "the warm-started tiny model in .cache/", why)]
    from cegppo_utils import tiny
    start = time.perf_counter()
    path = tiny.ensure_tiny_model(log=lambda *a: None)
    return [Row("tiny model", "the warm-started tiny model in .cache/", "pass",
                f"{os.path.relpath(path, ROOT)} ({time.perf_counter() - start:.0f} s)", "there or built")]


def pytest_rows(part, path, *select, gpus=1) -> list[Row]:
    why = needs(gpus=gpus)
    if why:
        return [Row(part, path, why)]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", path, *select], cwd=ROOT, capture_output=True,
                         text=True)
    summary = (out.stdout.strip().splitlines() or ["no output"])[-1]
    return [Row(part, path, verdict(out.returncode == 0), f"{summary} ({time.perf_counter() - start:.0f} s)",
                "all pass")]


def bf16_run() -> list[Row]:
    import rollout
    why = needs()
    if why:
        return [Row("bf16 run", "train.py --preset tiny --precision bf16, 3 steps", why)]
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "train.py", "--preset", "tiny", "--precision", "bf16", "--max-steps", "3",
                              "--eval-every", "0", "--log-samples-every", "0", "--output-dir", os.path.join(d, "run")],
                             cwd=ROOT, capture_output=True, text=True)
        rows = []
        if os.path.exists(os.path.join(d, "run", "metrics.jsonl")):
            with open(os.path.join(d, "run", "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
    last = (out.stderr.strip().splitlines() or [""])[-1]
    result = [Row("bf16 run", "exit code and steps", verdict(out.returncode == 0 and len(rows) == 3),
                  f"exit {out.returncode}, {len(rows)} steps" + ("" if out.returncode == 0 else f": {last[:150]}"),
                  "0, 3")]
    gaps = [r["sync_logprob_gap"] for r in rows if "sync_logprob_gap" in r]
    if gaps:
        tolerance = rollout.SYNC_TOLERANCE["bf16"]
        result.append(Row("bf16 run", "sampler/trainer log-prob gap after each sync (max)",
                          verdict(max(gaps) <= tolerance), f"{max(gaps):.3g}",
                          f"<= {tolerance:g} (the stale-sampler check's bf16 tolerance)"))
    return result


def vllm_cycles() -> list[Row]:
    why = needs(vllm=True)
    if why:
        return [Row("vllm cycles", "sleep / wake / sync, seeds", why)]
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rollout
    from cegppo_utils import tiny
    path = tiny.ensure_tiny_model(log=lambda *a: None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    prompts = rollout.encode_prompts(tokenizer, [r["problem"] for r in tiny.arithmetic_split("test", 6)])
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    engine = rollout.make_sampler("vllm", path, tokenizer=tokenizer, dtype="float32", max_model_len=256,
                                  gpu_memory_utilization=0.2, enable_sleep_mode=True)
    engine_bytes = free_before - torch.cuda.mem_get_info()[0]
    rows, freed, greedy_equal, caught = [], [], [], []

    def greedy(sampler):
        return [g[0].token_ids for g in sampler.generate(prompts, n=1, temperature=0.0, max_tokens=24)]

    for cycle in range(3):
        awake_free = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed.append((torch.cuda.mem_get_info()[0] - awake_free) / max(engine_bytes, 1))
        with torch.no_grad():  # the update the engine sleeps through
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        engine.wake_up()
        engine.load_weights(policy.named_parameters())
        greedy_equal.append(greedy(engine) == greedy(rollout.HFSampler(policy, tokenizer)))
        synced = rollout.stale_tensors(engine, policy) == []
        moved = copy.deepcopy(policy)
        with torch.no_grad():
            moved.get_parameter("lm_head.weight")[0, 0] += 1e-3  # a sync that missed one weight
        caught.append(synced and rollout.stale_tensors(engine, moved) == ["lm_head.weight"])
    rows.append(Row("vllm cycles", f"memory given back while asleep (level {rollout.SLEEP_LEVEL}; least of 3 cycles)",
                    verdict(min(freed) >= 0.8), f"{100 * min(freed):.0f}% of {gib(engine_bytes):.2f} GiB", ">= 80%"))
    rows.append(Row("vllm cycles", "greedy tokens equal to HF generate after each sync", verdict(all(greedy_equal)),
                    f"{sum(greedy_equal)}/3 cycles", "3/3"))
    rows.append(Row("vllm cycles", "exact check: synced tensors equal, a skipped one named", verdict(all(caught)),
                    f"{sum(caught)}/3 cycles", "3/3"))
    # seeds: CUDA vLLM seeds each request (rollout.request_seed)
    prompt = prompts[0]

    def samples(seed):
        return [tuple(c.token_ids) for g in engine.generate([prompt, prompt], n=2, temperature=1.0, max_tokens=24,
                                                              ignore_eos=True, seed=seed) for c in g]
    a, again, b = samples(11), samples(11), samples(12)
    ok = len(set(a)) == 4 and a == again and not set(a) & set(b)
    rows.append(Row("vllm cycles", "seeds: a prompt twice (n=2) all distinct; a call seed repeats; the next differs",
                    verdict(ok), f"distinct {len(set(a))}/4, repeat equal {a == again}, "
                                 f"shared with next {len(set(a) & set(b))}", "4/4, True, 0"))
    engine.close()
    return rows


# R1-Distill-Qwen-1.5B's preset: prompts up to 4,096 tokens, responses up to 16,384, packed rows of 20,480 tokens (one
# longest sequence). Unequal prompts, every response at the cap: four rows of 20,480, 19,456, 18,432 and 17,408 tokens.
PRESET_PROMPTS, PRESET_RESPONSE = (4096, 3072, 2048, 1024), 16384


def preset_path(folder, device="cuda", config=None, prompts=PRESET_PROMPTS, response=PRESET_RESPONSE) -> dict:
    """The preset's own path, as train.py runs it, on random weights saved to `folder` (bf16) with a stand-in
    tokenizer: the trainer built by train.load_policy itself from that folder at the preset's settings (FSDP2's bf16
    compute over fp32 masters, Liger's kernels on CUDA, full checkpointing, the attention train.py runs, fused
    log-probs, AdamW, its moments made resident), then the engine (rollout.make_sampler with the preset's dtype,
    context and memory share), asleep through one update (one mini-batch, one AdamW step) of len(prompts) sequences,
    each its own packed row of prompt + response tokens (--micro-batch-tokens = the longest prompt + response), then
    wake, sync, the exact check and the probe. Returns the numbers (memory ones on CUDA only) and the kernels the
    trainer ran (models.kernels_in_use). config: another model shape (a CPU runs a small one)."""
    import train
    from cegppo_utils import flags, models
    from tools import bench
    device = torch.device(device)
    # no warm-up: the preset's first step runs at lr 0 (verl's schedule), and the probe must see trained weights; the
    # lengths at the preset's own (4,096, 16,384, 20,480) unless a CPU runs a smaller shape
    args = flags.resolve("r1-distill-1.5b", {"warmup_steps": 0, "max_prompt_len": max(prompts),
                                             "max_response_len": response,
                                             "micro_batch_tokens": max(prompts) + response})
    config = config or bench.R1_DISTILL_1P5B
    tokenizer = _preset_folder(folder, config, device, args)
    policy, _ = train.load_policy(args, folder, device, ["1"])  # the prompts it checks: one short enough for a CPU's
    out = {"kernels": models.kernels_in_use(policy.model)}
    engine = _preset_engine(folder, tokenizer, args, config, out, policy)
    g = torch.Generator().manual_seed(0)
    seqs = [{"prompt_ids": torch.randint(1, len(tokenizer), (p,), generator=g).tolist(),
             "response_ids": torch.randint(1, config["vocab_size"], (response,), generator=g).tolist(),
             "advantage": (-1.0) ** i, "correct": i % 2 == 0} for i, p in enumerate(prompts)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        # what device memory holds beyond torch's default pool: the engine asleep, the CUDA context (the engine's
        # sleep-mode pool is torch's too, but holds nothing while it sleeps at level 2)
        out["outside_torch_bytes"] = _used() - torch.cuda.memory_reserved()
        out["total_bytes"] = torch.cuda.mem_get_info()[1]
    model = policy.model
    before = next(p for p in model.parameters()).detach().clone()
    out["update_s"], out["micro_batches"], _ = bench._timed_update(policy, seqs, args)  # resets the peaks first
    out["update_moved"] = not torch.equal(before, next(p for p in model.parameters()).detach())  # lr > 0
    if device.type == "cuda":
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    context = min(args.max_prompt_len + args.max_response_len, config["max_position_embeddings"])
    out.update(_synced_engine_checks(engine, model, tokenizer, g, torch.bfloat16 if args.precision == "bf16" else None,
                                     context))
    engine.close()
    return out


def _used():
    """Device memory in use by anyone: torch's allocator, the engine's pool, the CUDA context."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def _preset_folder(folder, config, device, args):
    """Random weights of `config` saved to `folder` in the preset's dtype, with a tokenizer: a byte-level BPE of the
    tiny task (seconds) stands in for the hub's (the engine needs one; the model keeps its rows: ids past the
    tokenizer's decode to nothing). Returns the tokenizer."""
    from cegppo_utils import tiny
    from tools import bench
    corpus = [r["problem"] + "\n" + r["solution"] for r in tiny.arithmetic_split("train", 2000)]
    tokenizer = tiny.build_tokenizer(corpus, 400)
    model = bench.update_model(config, device, checkpointing=False)
    half = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model.save_pretrained(folder, state_dict={k: v.to("cpu", half) for k, v in model.state_dict().items()})
    tokenizer.save_pretrained(folder)
    del model
    return tokenizer


def _preset_engine(folder, tokenizer, args, config, out, policy):
    """The engine started beside the trainer, as train.start_run starts it after load_policy; its footprint at start
    and what it keeps asleep (read around its sleep: nothing else allocates or frees in between) into `out`; then
    AdamW's moments made resident, as from a run's second step on. Returns the engine, asleep."""
    import rollout
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before_engine = _used()
    engine = rollout.make_sampler("vllm", folder, tokenizer=tokenizer,
                                  dtype="float32" if args.precision == "fp32" else "bfloat16", seed=args.seed,
                                  max_model_len=min(args.max_prompt_len + args.max_response_len,
                                                    config["max_position_embeddings"]),
                                  gpu_memory_utilization=args.gpu_memory_utilization)
    if cuda:
        out["engine_awake_bytes"] = _used() - before_engine
        torch.cuda.synchronize()
        awake = _used()
    engine.sleep()
    if cuda:
        torch.cuda.synchronize()
        out["engine_asleep_bytes"] = out["engine_awake_bytes"] - (awake - _used())
    for p in policy.model.parameters():
        p.grad = torch.zeros_like(p)
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return engine


def _synced_engine_checks(engine, model, tokenizer, g, autocast_dtype, context) -> dict:
    """Wake the engine, sync the updated weights as train.py does, then: the memory in use awake (CUDA), the exact
    check, a weight the sync missed named, and the probe's log-prob gap (a prompt of 64 random tokens, fewer where the
    engine's context is short, and the tokens the engine samples after it, under the trainer's autocast dtype)."""
    import rollout
    from cegppo_utils import distributed as D
    out = {}
    engine.wake_up()
    engine.load_weights(D.full_named_parameters(model))  # the weight sync as train.py makes it
    if torch.cuda.is_available() and next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
        out["awake_bytes"] = _used()
    out["stale"] = rollout.stale_tensors(engine, model)
    head = model.get_parameter("lm_head.weight")
    head = head.to_local() if hasattr(head, "to_local") else head  # FSDP2 in one process: the local shard is whole
    kept = head[0, 0].item()
    with torch.no_grad():
        head[0, 0] += 1.0  # the trainer moves a weight the sync then misses (a change bf16 sees)
        out["missed_named"] = rollout.stale_tensors(engine, model)
        head[0, 0] = kept
    probe = torch.randint(1, len(tokenizer), (min(64, context - rollout.PROBE_TOKENS),), generator=g).tolist()
    out["probe_gap"] = rollout.sync_mismatch(engine, model, probe, autocast_dtype=autocast_dtype)
    return out


def preset_rows() -> list[Row]:
    why = needs(vllm=True)
    if why:
        return [Row("preset path", "1.5B-shaped bf16 engine asleep beside the trainer; update, wake, sync", why)]
    import rollout
    from cegppo_utils import models
    with tempfile.TemporaryDirectory() as folder:
        m = preset_path(folder)
    total, shape = m["total_bytes"], " / ".join(f"{p:,}" for p in PRESET_PROMPTS)
    peak = m["peak_reserved_bytes"] + m["outside_torch_bytes"]
    tolerance = rollout.SYNC_TOLERANCE["bf16"]
    ran = f"checkpointing {m['kernels']['checkpointing']}, Liger {'on' if models.liger_in_use(m['kernels']) else 'off'}"
    return [
        Row("preset path", f"peak memory, engine asleep: one update of 4 packed rows (prompts {shape} + "
                           f"{PRESET_RESPONSE:,}), train.py's preset settings ({ran}), AdamW's moments resident",
            verdict(peak <= 0.9 * total),
            f"{gib(peak):.1f} GiB = {gib(m['peak_reserved_bytes']):.1f} reserved by torch (allocated "
            f"{gib(m['peak_allocated_bytes']):.1f}) + {gib(m['outside_torch_bytes']):.1f} outside it "
            f"({m['update_s']:.0f} s)",
            f"<= 90% of {gib(total):.0f} GiB"),
        Row("preset path", f"the engine asleep (level {rollout.SLEEP_LEVEL}): what it keeps of its own memory (its "
                           "footprint at start minus what sleep gave back, read around the call)",
            verdict(m["engine_asleep_bytes"] <= 0.2 * m["engine_awake_bytes"]),
            f"{gib(m['engine_asleep_bytes']):.2f} of {gib(m['engine_awake_bytes']):.1f} GiB", "<= 20%"),
        Row("preset path", "awake after the update: the engine beside the trainer's resident state",
            verdict(m["awake_bytes"] <= 0.95 * total), f"{gib(m['awake_bytes']):.1f} GiB",
            f"<= 95% of {gib(total):.0f} GiB"),
        Row("preset path", "one sync after wake: the exact check equal; a weight the sync missed named",
            verdict(m["stale"] == [] and m["missed_named"] == ["lm_head.weight"]),
            f"stale {m['stale'] or 'none'}; missed one named {m['missed_named']}", "none; ['lm_head.weight']"),
        Row("preset path", "probe log-prob gap at the 1.5B shape in bf16 after an update at lr 1e-6 (random weights: "
                           "near-uniform, a lower bound)",
            verdict(m["probe_gap"] <= tolerance and m["update_moved"]),
            f"{m['probe_gap']:.3g}" + ("" if m["update_moved"] else "; the update moved no weight"),
            f"<= {tolerance:g}"),
    ]


def update_rows() -> list[Row]:
    why = needs()
    if why:
        return [Row("1.5B update", "Liger's kernels in the model; tokens/s, MFU", why)]
    from tools import bench
    out = bench.bench_update_throughput("cuda", sequences=32, repeats=1, draws=("long_tailed",))
    k = out["kernels"]
    calls = ", ".join(f"{name} x{n}" for name, n in out["attention_kernel_calls"].items()) or "none"
    tag = f"{out['precision']}, Liger {'on' if out['liger'] else 'off'}, checkpointing {k['checkpointing']}"
    stage = f"the update stage as train.py runs it: {out['mini_batches']} mini-batches, old log-probs of all but one"
    rows = [Row("1.5B update", "Liger's RMSNorm, RoPE and SwiGLU in the model the update ran (its forwards read)",
                verdict(out["liger"]), f"rms_norm {k['rms_norm']}; rope {k['rope']}; swiglu {k['swiglu']}",
                "all Liger's (liger-kernel: requirements-gpu.txt)")]
    for layout, what in (("padded", "padded micro-batches of 4 (the preset's)"), ("packed", "packed rows of 20,480")):
        rows.append(Row("1.5B update", f"tokens/s, {what}, 32 long-tailed sequences, {stage} ({tag}; attention "
                                       f"ran: {calls})", "measured",
                        f"{out[f'long_tailed_{layout}_tokens_per_s']:,.0f} tok/s, "
                        f"peak {out[f'long_tailed_{layout}_peak_gib']:.1f} GiB"))
    return rows + [mfu_row(out, "packed"), mfu_row(out, "padded")]


def mfu_row(out: dict, layout: str) -> Row:
    """The MFU of one layout under both conventions, each named: attention causal-halved (this project's; the target's)
    and full-square (torchtitan's, PaLM's); against the card's dense bf16 peak, or the GEMM rate measured here for a
    card the table lacks. The packed one is held to the target: >= 40% of the peak, causal-halved."""
    peak, rate = out["dense_bf16_peak_tflops"], out["matmul_rate_tflops"]
    key = f"long_tailed_{layout}_mfu" + ("_of_peak" if peak else "")
    of = (f"of the dense bf16 peak {peak:.0f} TFLOP/s" if peak else
          f"of the bf16 GEMM rate measured here, {rate:.0f} TFLOP/s (this card's peak is not in the table)")
    number = (f"{100 * out[key]:.1f}% {of}, attention causal-halved; {100 * out[key + '_full_square']:.1f}% "
              "full-square (torchtitan, PaLM)")
    if peak:
        number += f"; {100 * out[f'long_tailed_{layout}_mfu']:.0f}% of the GEMM rate measured, {rate:.0f}"
    return Row("1.5B update", f"MFU {layout}, the update stage's model FLOPs (old log-probs' forward included)",
               verdict(out[key] >= 0.40) if layout == "packed" else "measured", number,
               ">= 40%, causal-halved" if layout == "packed" else "")


@dataclass
class Part:
    run: Callable[[], list[Row]]
    budget_s: float  # killed past this (times --time-scale): a hang is a FAIL naming the part
    what: str  # its row where the machine cannot run it
    gpus: int = 1


PARTS = {
    "tiny model": Part(tiny_model, 75, "the warm-started tiny model in .cache/"),
    "cuda tests": Part(lambda: pytest_rows("cuda tests", "tests/test_cuda.py", "-m", "not slow"), 100,
                       "tests/test_cuda.py"),
    "bf16 run": Part(bf16_run, 90, "train.py --preset tiny --precision bf16, 3 steps"),
    # the vLLM parts: a cold engine compiles its model (torch.compile) and captures CUDA graphs, about a minute at start
    # (vLLM's documentation; rollout.make_sampler), so each budget is twice its estimate with that minute in it
    "vllm cycles": Part(vllm_cycles, 240, "sleep / wake / sync, seeds"),
    "preset path": Part(preset_rows, 360, "1.5B-shaped bf16 engine asleep beside the trainer; update, wake, sync"),
    "1.5B update": Part(update_rows, 140, "Liger's kernels in the model; tokens/s, MFU"),
    "two ranks": Part(lambda: pytest_rows("two ranks", "tests/test_distributed.py", "-k",
                                          "test_two_ranks_update_like_one_process", gpus=2), 75,
                      "tests/test_distributed.py", gpus=2),
}


# --- running the parts -------------------------------------------------------------------------------------------

def run_here(name) -> list[Row]:
    """One part, in this process: a part that breaks is a failed check, named, with its error's first line."""
    try:
        return PARTS[name].run()
    except Exception as e:
        first = str(e).splitlines()[0][:150] if str(e) else ""
        return [Row(name, "ran", "FAIL", f"{type(e).__name__}: {first}")]


def part_command(name, rows_path) -> list[str]:
    return [sys.executable, "-m", "tools.gpu_check", "--_part", name, "--_rows", rows_path]


def run_part(name, budget_s) -> list[Row]:
    """One part in a process of its own, killed (with everything it started) after budget_s seconds."""
    with tempfile.TemporaryDirectory() as d:
        rows_path, log_path = os.path.join(d, "rows.json"), os.path.join(d, "output.log")
        from cegppo_utils import runfolder
        with runfolder.open_for_writing(log_path, "gpu_check log") as log:  # never through a link
            proc = subprocess.Popen(part_command(name, rows_path), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own process group: a kill reaches its children
            try:
                proc.wait(timeout=budget_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return [Row(name, "finished within its budget", "FAIL", f"killed after {budget_s:.0f} s (hung or slow)",
                            f"<= {budget_s:.0f} s")]
        if os.path.exists(rows_path):
            with open(rows_path) as f:
                return [Row(**{**r, "budget": f"{budget_s:.0f} s"}) for r in json.load(f)]
        lines = open(log_path).read().strip().splitlines() or ["no output"]
        raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", line)]
        return [Row(name, "ran", "FAIL", f"exit {proc.returncode}: {(raised or lines)[-1][:150]}")]


def table(rows: list[Row]) -> str:
    head = Row("part", "check", "status", "number", "limit", "budget")
    cells = [[r.part, r.check, r.status, r.number, r.limit, r.budget] for r in [head, *rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(6)).rstrip() for c in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


# --- the basis of the bf16 sync tolerance ------------------------------------------------------------------------

def bf16_gap_estimate(vocab=151936, tokens=256, top=20.0, background=3.0, candidates=8, seed=0) -> dict:
    """How far bf16 logits move a sampled token's log-prob, at the preset's vocabulary. Logits (fp64): a N(0,
    background) floor over the vocabulary and `candidates` tokens near `top` (N(top, 2)), so most mass sits on a few
    tokens as in reasoning text; the token sampled from them. One side: the fp32 log-softmax of the logits rounded to
    bf16, against the exact one. Two sides (sampler and trainer): each rounds logits that its own kernels computed,
    modelled as a relative N(0, 2^-9) change before the rounding. Mean and max |gap| over `tokens` positions."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * background
    chosen = torch.randint(0, vocab, (tokens, candidates), generator=g)
    z.scatter_(1, chosen, top + 2.0 * torch.randn(tokens, candidates, generator=g, dtype=torch.float64))
    exact = torch.log_softmax(z, -1)
    y = torch.multinomial(exact.exp(), 1, generator=g)

    def bf16_side(logits):
        return torch.log_softmax(logits.float().bfloat16().float(), -1).gather(1, y).double()[:, 0]
    one = bf16_side(z)
    other = bf16_side(z * (1 + 2**-9 * torch.randn(tokens, vocab, generator=g, dtype=torch.float64)))
    one_gap, two_gap = (one - exact.gather(1, y)[:, 0]).abs(), (one - other).abs()
    return {"top": top, "entropy": -(exact.exp() * exact).sum(-1).mean().item(), "max_abs_logit": z.abs().max().item(),
            "one_side_mean": one_gap.mean().item(), "one_side_max": one_gap.max().item(),
            "two_sides_mean": two_gap.mean().item(), "two_sides_max": two_gap.max().item()}


def print_bf16_gap_estimate(vocab=151936, tops=(10.0, 20.0, 30.0, 40.0)):
    import rollout
    print(f"bf16 logits at vocabulary {vocab:,}: |log-prob gap| of a sampled token, 256 positions each "
          f"(rollout.SYNC_TOLERANCE['bf16'] = {rollout.SYNC_TOLERANCE['bf16']:g})")
    print("top logit  entropy  one side mean / max  two sides mean / max")
    for top in tops:
        e = bf16_gap_estimate(vocab, top=top)
        print(f"{top:9.0f}  {e['entropy']:7.2f}  {e['one_side_mean']:9.4f} / {e['one_side_max']:.4f}  "
              f"{e['two_sides_mean']:10.4f} / {e['two_sides_max']:.4f}")


# --- the acceptance call's header (tools/gpu_accept.sh) -----------------------------------------------------------

def pinned_versions(path=os.path.join(ROOT, "requirements-gpu.txt")) -> dict:
    """{package: version} of requirements-gpu.txt's `name==version` lines: the stack the GPU path is pinned to."""
    pins = {}
    with open(path) as f:
        for line in f:
            found = re.match(r"\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line)
            if found:
                pins[found.group(1).lower()] = found.group(2)
    return pins


def installed(name) -> str | None:
    import importlib.metadata
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def not_validated_here(pins: dict | None = None) -> list[str]:
    """What a pass of tools/gpu_accept.sh on this machine's software does not show for requirements-gpu.txt's, each in
    a line: another torch's selective-checkpointing replay, Liger's CuTe DSL RoPE (the project pins Triton's), native
    grouped-query attention in PyTorch's varlen kernel, another transformers or liger-kernel, vLLM's parts."""
    import importlib.util
    import inspect

    from cegppo_utils import attention, models
    pins = pins or pinned_versions()
    lines = []
    if torch.__version__.split("+")[0] != pins.get("torch"):
        lines.append(f"selective checkpointing under torch {pins.get('torch')} (its replay of the kept outputs): this "
                     f"is torch {torch.__version__}, so a pass here does not validate it")
    varlen = attention.torch_varlen()
    if varlen is None or "enable_gqa" not in inspect.signature(varlen).parameters:
        lines.append(f"native grouped-query attention in varlen_attn: torch {torch.__version__}'s "
                     f"{'has no varlen_attn' if varlen is None else 'takes no enable_gqa'} (k and v are repeated per "
                     "query head here), so its lever and MFU numbers are not the pinned stack's")
    variable, value = models.LIGER_ROPE_IMPL
    lines.append(f"Liger's CuTe DSL RoPE: not run (the project pins {variable}={value}); the cutlass package "
                 f"{'is' if importlib.util.find_spec('cutlass') else 'is not'} installed here")
    for name in ("transformers", "liger-kernel"):
        if installed(name) != pins.get(name):
            lines.append(f"{name} {pins.get(name)}: this is {installed(name) or 'not installed'}")
    if importlib.util.find_spec("vllm") is None:
        lines.append("vLLM (tools.gpu_check's vllm cycles and preset path, train.py's vLLM sampler): not here")
    return lines


def print_acceptance_header():
    """The software and device (tools/bench.py's software()), requirements-gpu.txt's pins, and what a pass here does
    not validate (not_validated_here)."""
    from tools import bench
    pins = pinned_versions()
    print(f"software: {bench.software()}")
    print("requirements-gpu.txt pins: " + ", ".join(f"{n} {pins[n]}" for n in ("torch", "transformers",
                                                                              "liger-kernel", "vllm") if n in pins))
    for line in not_validated_here(pins):
        print(f"not validated here: {line}")


# --- the command line --------------------------------------------------------------------------------------------

def check_output(parser, path):
    """--output is a file (not a folder, a link or a FIFO) whose folder exists (created here) and takes a file, before
    any part runs; else one line, exit 2."""
    from cegppo_utils import cli
    problem = cli.output_problem(path, "--output", create=True)
    if problem:
        parser.error(problem)


def write_json(path, payload):
    """Whole or not at all, never through a link planted at its name (runfolder's writer)."""
    from cegppo_utils import runfolder
    runfolder.write_json_atomically(path, payload)


def main(argv=None) -> int:
    from cegppo_utils import cli  # one line and exit code 2 for every bad input, before any part runs
    parser = cli.Parser("gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {list(PARTS)}")
    parser.add_argument("--output", default=None, help="also write the rows as JSON to this file (folder created)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every part's budget (a slow machine)")
    parser.add_argument("--estimate-bf16-gap", action="store_true", help="print the bf16 log-prob gap estimate, exit")
    parser.add_argument("--_part", default=None, help=argparse.SUPPRESS)  # internal: run one part in this process
    parser.add_argument("--_rows", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._part:
        rows = run_here(args._part)
        write_json(args._rows, [asdict(r) for r in rows])
        return 0
    if args.estimate_bf16_gap:
        print_bf16_gap_estimate()
        return 0
    chosen = cli.choices(parser, args.only, PARTS, "--only", "part")  # an empty one would check nothing and pass
    if not 0 < args.time_scale < float("inf"):
        parser.error(f"--time-scale must be > 0 and finite, got {args.time_scale}")
    if args.output:
        args.output = os.path.expanduser(args.output)
        check_output(parser, args.output)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    budget = sum(PARTS[name].budget_s for name in chosen) * args.time_scale
    print(f"gpu_check: {device}; torch {torch.__version__}; {len(chosen)} part(s), at most {budget:.0f} s", flush=True)
    rows = []
    for name in chosen:
        start = time.perf_counter()
        why = needs(gpus=PARTS[name].gpus)  # the device check is cheap: a part that cannot run starts no process
        part = [Row(name, PARTS[name].what, why)] if why else run_part(name, PARTS[name].budget_s * args.time_scale)
        rows += part
        print(f"  {name}: {', '.join(r.status.split(':')[0] for r in part)} ({time.perf_counter() - start:.0f} s of "
              f"{PARTS[name].budget_s * args.time_scale:.0f})", flush=True)
    print(table(rows))
    if args.output:
        write_json(args.output, {"device": device, "torch": torch.__version__, "rows": [asdict(r) for r in rows]})
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
