"""The GPU acceptance check: what a person with one (or two) GPUs runs first, in one command and under 10 minutes.
It prints one row per check: pass / FAIL / skipped, the number measured and the limit it is held to.

    python -m tools.gpu_check                         # every part this machine can run
    python -m tools.gpu_check --output gpu_check.json  # the same rows as JSON

Parts (each says "skipped: why" where the machine lacks what it needs: a CUDA device, vllm, a second GPU):
  cuda tests   tests/test_cuda.py: the fused log-probs against full logits on the GPU, a bf16 run with correction
  bf16 run     3 steps of `train.py --preset tiny --precision bf16` on the GPU; the sampler/trainer log-prob gap
               after each weight sync against the bf16 tolerance of the stale-sampler check (rollout.SYNC_TOLERANCE)
  vllm cycles  3 sleep / wake / sync cycles of a colocated engine (sleep mode, as train.py runs it) on the tiny model:
               memory given back while asleep, greedy tokens equal to HF's after each sync, a skipped sync caught by
               the exact check (rollout.stale_tensors); and the per-request seeds (rollout.request_seed): the same
               prompt twice gives different samples, the same call seed the same ones, the next call seed others
  1.5B update  one update (stages 5 and 6) at DeepSeek-R1-Distill-Qwen-1.5B's published shape with random weights
               (nothing downloaded), bf16 autocast, gradient checkpointing, fused log-probs, the preset's micro-batch
               of 4: its peak memory with every sequence at the preset's longest (4,096 + 16,384 tokens), and tokens/s
               and MFU (against a bf16 GEMM rate measured here) on long-tailed lengths (tools/bench.py)
  two ranks    tests/test_distributed.py on two GPUs (NCCL)
On a machine without CUDA every part is skipped and the command exits 0: the suite runs it that way.
Exit code: 1 if any check failed, else 0.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Row:
    part: str
    check: str
    status: str  # "pass", "FAIL" or "skipped: why"
    number: str = ""
    limit: str = ""


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


def pytest_rows(part, path, gpus=1) -> list[Row]:
    why = needs(gpus=gpus)
    if why:
        return [Row(part, path, why)]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", path], cwd=ROOT, capture_output=True, text=True)
    summary = (out.stdout.strip().splitlines() or ["no output"])[-1]
    return [Row(part, path, verdict(out.returncode == 0), f"{summary} ({time.perf_counter() - start:.0f} s)", "all pass")]


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
                  f"exit {out.returncode}, {len(rows)} steps" + ("" if out.returncode == 0 else f": {last[:150]}"), "0, 3")]
    gaps = [r["sync_logprob_gap"] for r in rows if "sync_logprob_gap" in r]
    if gaps:
        tolerance = rollout.SYNC_TOLERANCE["bf16"]
        result.append(Row("bf16 run", "sampler/trainer log-prob gap after each sync (max)", verdict(max(gaps) <= tolerance),
                          f"{max(gaps):.3g}", f"<= {tolerance:g} (the stale-sampler check's bf16 tolerance)"))
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
    rows.append(Row("vllm cycles", "memory given back while asleep (least of 3 cycles)", verdict(min(freed) >= 0.8),
                    f"{100 * min(freed):.0f}% of {engine_bytes / 2**30:.2f} GiB", ">= 80%"))
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
                    verdict(ok), f"distinct {len(set(a))}/4, repeat equal {a == again}, shared with next {len(set(a) & set(b))}",
                    "4/4, True, 0"))
    engine.close()
    return rows


# R1-Distill-Qwen-1.5B's preset: micro-batches of 4 sequences, each up to 4,096 prompt + 16,384 response tokens
PRESET_MICRO_BATCH, PRESET_PROMPT, PRESET_RESPONSE = 4, 4096, 16384


def update_at_shape(device="cuda", config=None, prompt=PRESET_PROMPT, response=PRESET_RESPONSE,
                    micro_batch=PRESET_MICRO_BATCH) -> dict:
    """Peak memory and seconds of one update (stages 5 and 6, as train.main runs them) of a micro-batch of
    `micro_batch` sequences of `prompt` + `response` tokens: the preset's worst case, every response truncated."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    import train
    from cegppo_utils import flags
    from tools import bench
    device = torch.device(device)
    config = config or bench.R1_DISTILL_1P5B
    g = torch.Generator().manual_seed(0)
    seqs = [{"prompt_ids": torch.randint(1, config["vocab_size"], (prompt,), generator=g).tolist(),
             "response_ids": torch.randint(1, config["vocab_size"], (response,), generator=g).tolist(),
             "advantage": (-1.0) ** i, "correct": i % 2 == 0} for i in range(micro_batch)]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=torch.float32).to(device)
    model.gradient_checkpointing_enable()
    model.train()
    args = flags.resolve("r1-distill-1.5b", {"micro_batch_size": micro_batch, "precision": "bf16" if device.type == "cuda" else "fp32"})
    policy = train.make_policy(args, model, torch.optim.AdamW(model.parameters(), lr=1e-6), pad_id=0, device=device, fused=True)
    seconds, micro_batches, peak = bench._timed_update(policy, seqs, args)
    return {"seconds": seconds, "micro_batches": micro_batches, "peak_bytes": peak, "tokens": micro_batch * (prompt + response)}


def update_rows() -> list[Row]:
    why = needs()
    if why:
        return [Row("1.5B update", "peak memory, tokens/s, MFU", why)]
    from tools import bench
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    try:
        worst = update_at_shape()
        rows.append(Row("1.5B update", f"peak memory, micro-batch of {PRESET_MICRO_BATCH} x (4,096 + 16,384) tokens",
                        verdict(worst["peak_bytes"] <= 0.9 * total),
                        f"{worst['peak_bytes'] / 2**30:.1f} GiB ({worst['seconds']:.1f} s)",
                        f"<= 90% of {total / 2**30:.0f} GiB (the engine sleeps during the update)"))
    except torch.OutOfMemoryError as e:
        rows.append(Row("1.5B update", f"peak memory, micro-batch of {PRESET_MICRO_BATCH} x (4,096 + 16,384) tokens", "FAIL",
                        f"out of memory: {str(e).splitlines()[0][:120]}", f"<= 90% of {total / 2**30:.0f} GiB"))
    torch.cuda.empty_cache()
    out = bench.bench_update_throughput("cuda", sequences=32, micro_batch=PRESET_MICRO_BATCH, repeats=1)
    rows.append(Row("1.5B update", "tokens/s, padded micro-batches of 4 (32 long-tailed sequences)", "pass",
                    f"{out['padded_tokens_per_s']:,.0f} tok/s, peak {out['padded_peak_gib']:.1f} GiB", "measured"))
    rows.append(Row("1.5B update", "MFU, packed rows of 20,480 tokens", verdict(out["packed_mfu"] >= 0.40),
                    f"{100 * out['packed_mfu']:.0f}% of {out['matmul_rate_tflops']:.0f} TFLOP/s (bf16 GEMM measured here)",
                    ">= 40%"))
    return rows


PARTS = {
    "cuda tests": lambda: pytest_rows("cuda tests", "tests/test_cuda.py"),
    "bf16 run": bf16_run,
    "vllm cycles": vllm_cycles,
    "1.5B update": update_rows,
    "two ranks": lambda: pytest_rows("two ranks", "tests/test_distributed.py", gpus=2),
}


def table(rows: list[Row]) -> str:
    head = Row("part", "check", "status", "number", "limit")
    cells = [[r.part, r.check, r.status, r.number, r.limit] for r in [head, *rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(5)).rstrip() for c in cells]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {list(PARTS)}")
    parser.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        parser.exit(2, f"gpu_check.py: error: --only: unknown part(s) {unknown}; choose from {list(PARTS)}\n")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"gpu_check: {device}; torch {torch.__version__}", flush=True)
    rows = []
    for name in chosen:
        start = time.perf_counter()
        try:
            part = PARTS[name]()
        except Exception as e:  # a part that breaks is a failed check, and the others still run
            part = [Row(name, "ran", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")]
        rows += part
        print(f"  {name}: {', '.join(r.status.split(':')[0] for r in part)} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(table(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
