"""The run's settings: the Args dataclass (one flag per field, its help the comment beside it), the presets, and
the command line: flags from dataclasses (`--eps-low` for `eps_low`), booleans as --x / --no-x, errors in one line
with exit code 2 (no usage block). Nothing here is about the algorithm; loss.LossConfig's fields become flags too.
"""

import argparse
import dataclasses
import inspect
import math
import os
import sys
from dataclasses import dataclass, field, fields

import correction
import data
import loss as L


@dataclass
class Args:
    # --- what to train
    model: str = "tiny"  # HF hub id or local path; "tiny" builds/reuses the project's warm-started tiny model
    train_data: str = "arith"  # hub dataset id, local .json/.jsonl/.parquet, or an offline task name
    eval_data: str = "auto"  # held-out problems for eval_acc: a benchmark name or file; auto = the task's own held-out set
    # --- the objective: every field of loss.LossConfig is a flag of its own (--algo, --beta1, --eps-low, ...)
    loss: L.LossConfig = field(default_factory=L.LossConfig)
    scale_adv_by_std: bool = True  # GRPO advantages; --no-scale-adv-by-std = Dr. GRPO (r - mean)
    dynamic_sampling: bool = True  # drop groups whose accuracy has zero variance (official: on)
    # --- optimiser
    lr: float = 1e-4  # AdamW learning rate, constant after warm-up
    warmup_steps: int = 0  # linear warm-up over the first optimizer updates (official: 10, first update at lr 0)
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm
    # --- batch sizes
    gen_prompts: int = 32  # prompts sampled per step
    train_prompts: int = 32  # at most this many kept groups are trained on per step
    mini_batch_prompts: int = 4  # prompts per optimizer step (train_prompts / this = optimizer steps per step)
    micro_batch_size: int = 32  # sequences per forward/backward; gradients accumulate over micro-batches
    n: int = 8  # responses per prompt
    # --- sampling
    temperature: float = 1.0  # rollout temperature; log-probs use the same temperature
    top_p: float = 1.0  # rollout nucleus sampling
    top_k: int = 0  # rollout top-k (0 = off)
    max_prompt_len: int = 64  # longer prompts are an error, found at start
    max_response_len: int = 48  # responses are truncated here
    min_response_len: int = 0  # no EOS before this many tokens (benchmarks: equal lengths on every side); 0 = off
    sampler: str = "auto"  # auto | vllm | hf
    gpu_memory_utilization: float = 0.5  # share of GPU memory for vLLM (the rest is for training)
    rollout_correction: str = "none"  # sampler/trainer mismatch weights (correction.py): none | token-tis | token-mis | seq-tis | seq-mis
    rollout_correction_threshold: float = 2.0  # C: TIS truncates the weight at C, MIS drops what exceeds C
    # --- system
    precision: str = "fp32"  # bf16 (autocast, fp32 master weights) | fp32
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    fused_logprobs: bool = True  # log-probs straight from hidden states, one chunk of logits at a time (logprobs.py)
    seed: int = 0  # seeds data order, sampling and initialisation
    output_dir: str = "runs/tiny"  # config.json, metrics.jsonl, samples.jsonl, checkpoints/, final/, curves.png
    max_steps: int = 100  # training steps
    resume: bool = False  # continue from the latest checkpoint in output_dir (from step 0 if there is none)
    save_every: int = 25  # checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2  # how many checkpoints to keep
    # --- what you see
    eval_every: int = 25  # held-out avg@k (as evaluate.py computes it) every N steps and at the end; 0 = never
    log_samples_every: int = 10  # write a few prompts with their completions to samples.jsonl every N steps; 0 = never
    run_name: str = ""  # name for tensorboard / wandb; empty = the output folder's name
    tensorboard: bool = False  # also log to tensorboard (pip install -r requirements-logging.txt)
    wandb: bool = False  # also log to Weights & Biases (pip install -r requirements-logging.txt)


# A preset sets what its official script sets, and names the algorithm that script runs: `algo_options` apply
# only while that algorithm is in effect, so `--preset r1-distill-1.5b --algo dapo` runs DAPO with DAPO's own
# defaults (loss.ALGORITHMS), not with CE-GPPO's betas. Args' defaults are the offline `tiny` preset.
PRESETS = {
    # The offline CPU default: ~3 minutes on 2 cores, no downloads. Larger lr than the paper's (a 3M-parameter
    # model), and up to 8 mini-batches per step so ratios leave the clip interval and CE-GPPO's terms act.
    "tiny": dict(algo="ce_gppo", algo_options={}),
    # The offline task where the paper's regime can exist (tiny.py: sums with a free order): ~105-token responses
    # with genuine choice points, and the paper's 256 -> 128 -> 16 scaled down to 32 -> 16 -> 2: up to 8 optimizer
    # steps per rollout batch. lr 3e-4 of {1e-4, 3e-4, 5e-4, 1e-3} tried over 20 steps: 1e-4 clips 0.2% of tokens
    # in the beta1 region, 5e-4 and 1e-3 drove accuracy to 0 within 5-20 steps.
    "sums": dict(model="tiny:sums", train_data="sums", lr=3e-4, gen_prompts=32, train_prompts=16, mini_batch_prompts=2,
                 micro_batch_size=16, max_prompt_len=96, max_response_len=192, output_dir="runs/sums", max_steps=150,
                 save_every=25, eval_every=50, log_samples_every=15, algo="ce_gppo", algo_options={}),
    # Official CE-GPPO script for DeepSeek-R1-Distill-Qwen-1.5B. Code vs paper text: the 0.1 positive-example LM
    # loss and dual clip 10 are in the code, not the paper; the token mean is exact here (the official code
    # approximates it per micro-batch).
    "r1-distill-1.5b": dict(
        model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", train_data="Kwai-Klear/KlearReasoner-MathSub-30K",
        eval_data="", dynamic_sampling=True, lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0,
        gen_prompts=256, train_prompts=128, mini_batch_prompts=16, micro_batch_size=4, n=8,
        temperature=1.0, top_p=1.0, max_prompt_len=4096, max_response_len=16384,
        precision="bf16", gradient_checkpointing=True, output_dir="runs/r1-distill-1.5b",
        max_steps=1000, save_every=50, eval_every=0,
        algo="ce_gppo", algo_options=dict(beta1=0.5, beta2=1.0, positive_lm_coef=0.1),
    ),
}
# The 7B script differs only in beta1 (and its validation length).
PRESETS["r1-distill-7b"] = {**PRESETS["r1-distill-1.5b"], "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
                            "micro_batch_size": 2, "output_dir": "runs/r1-distill-7b",
                            "algo_options": dict(beta1=0.75, beta2=1.0, positive_lm_coef=0.1)}

RUN_FIELDS = [f for f in fields(Args) if f.name != "loss"]
LOSS_FIELDS = list(fields(L.LossConfig))
# torchrun's own parser (Python <= 3.11) takes `--n` after the script name for an abbreviation of its flags
# and stops; `--group-size` passes through.
ALIASES = {"n": ["--group-size"]}


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------

def resolve(preset: str, given: dict) -> Args:
    """The values a run uses: Args' defaults <- the preset <- the algorithm's defaults (<- the preset's options for
    its own algorithm) <- what was given on the command line. Nothing is left to be decided later."""
    spec = PRESETS[preset]
    run = {f.name: f.default for f in RUN_FIELDS}
    run.update({k: v for k, v in spec.items() if k not in ("algo", "algo_options")})
    run.update({k: v for k, v in given.items() if k in run})
    algo = given.get("algo", spec["algo"])
    options = dict(L.ALGORITHMS[algo].defaults) if algo in L.ALGORITHMS else {}
    if algo == spec["algo"]:
        options.update(spec["algo_options"])
    options.update({f.name: given[f.name] for f in LOSS_FIELDS if f.name in given})
    if not options.get("norm_len"):
        options["norm_len"] = run["max_response_len"]  # Dr. GRPO's constant: the max response length
    if run["eval_data"] == "auto":  # an offline task evaluates on its own held-out set; other data needs --eval-data
        run["eval_data"] = run["train_data"] if run["train_data"] in data.task_names() else ""
    run["run_name"] = run["run_name"] or os.path.basename(os.path.normpath(run["output_dir"]))
    return Args(**run, loss=L.LossConfig(**{**options, "algo": algo}))


def flat_flags(args: Args) -> dict:
    """{flag name: value} for every flag, the loss's included (config.json, resume checks)."""
    out = {f.name: getattr(args, f.name) for f in RUN_FIELDS}
    out.update(dataclasses.asdict(args.loss))
    return out


def validate(a: Args) -> list[str]:
    """Values out of range, found before anything is loaded."""
    problems = [f"--{name.replace('_', '-')}{message[len(name):]}" for name, message in L.config_problems(a.loss)]

    def check(name, ok, rule):
        value = getattr(a, name)
        finite = not isinstance(value, float) or math.isfinite(value)
        if not finite or not ok(value):
            problems.append(f"--{name.replace('_', '-')} must be {rule}, got {value}")

    check("lr", lambda v: 0 < v <= 1, "> 0 and at most 1 (an AdamW step moves a weight by about lr)")
    for name in ("grad_clip", "temperature", "gen_prompts", "train_prompts", "mini_batch_prompts",
                 "micro_batch_size", "max_prompt_len", "max_response_len", "max_steps", "save_every", "keep_checkpoints"):
        check(name, lambda v: v > 0, "> 0")
    for name in ("weight_decay", "warmup_steps", "eval_every", "log_samples_every", "top_k", "min_response_len"):
        check(name, lambda v: v >= 0, ">= 0")
    check("n", lambda v: v >= 2, ">= 2 (group-relative advantages need a group)")
    check("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    check("gpu_memory_utilization", lambda v: 0 < v < 1, "in (0, 1)")
    check("precision", lambda v: v in ("bf16", "fp32"), "bf16 or fp32")
    check("sampler", lambda v: v in ("auto", "vllm", "hf"), "auto, vllm or hf")
    check("rollout_correction", lambda v: v in correction.MODES, f"one of {correction.MODES}")
    check("rollout_correction_threshold", lambda v: v > 1, "a finite number > 1")
    # What torch and the samplers can take: the engine seed (numpy's, vLLM's) and counts are 32-bit; logits / temperature
    # must stay finite in float32 (and bf16); beta1 / beta2 scale the loss, 100 times the paper's 1 at most.
    check("seed", lambda v: 0 <= v < 2**31, "in [0, 2**31) (the sampler's engine seed is 32-bit)")
    for f in RUN_FIELDS:
        if f.type in (int, "int") and f.name != "seed":
            check(f.name, lambda v: v < 2**31, "below 2**31")
    check("temperature", lambda v: 0.01 <= v <= 100, "in [0.01, 100] (logits / temperature must stay finite)")
    for name in ("beta1", "beta2"):
        value = getattr(a.loss, name)
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 100:
            problems.append(f"--{name} must be at most 100 (it scales the loss's gradient; the paper uses 0.5 to 1), got {value}")
    if problems:
        return problems
    if a.min_response_len > a.max_response_len:
        problems.append(f"--min-response-len ({a.min_response_len}) cannot exceed --max-response-len ({a.max_response_len})")
    if a.train_prompts > a.gen_prompts:
        problems.append(f"--train-prompts ({a.train_prompts}) cannot exceed --gen-prompts ({a.gen_prompts})")
    if a.train_prompts % a.mini_batch_prompts:
        problems.append(f"--train-prompts ({a.train_prompts}) must be a multiple of --mini-batch-prompts ({a.mini_batch_prompts})")
    if (a.mini_batch_prompts * a.n) % a.micro_batch_size:
        problems.append(f"--micro-batch-size ({a.micro_batch_size}) must divide mini-batch-prompts x n = {a.mini_batch_prompts * a.n}")
    if a.eval_every and not a.eval_data:
        problems.append(f"--eval-every {a.eval_every} needs --eval-data (a benchmark name or file) for --train-data "
                        f"{a.train_data}; or pass --eval-every 0")
    return problems


def parse_args(argv=None, description: str = "") -> Args:
    """train.py's command line -> the resolved Args (bad values: one line, exit code 2). description: train.py's doc."""
    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--preset", default="tiny")
    early.add_argument("--algo", default=None)
    known, _ = early.parse_known_args(argv)
    parser = Parser(prog="train.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if known.preset not in PRESETS:
        parser.error(f"unknown preset {known.preset!r}; choose one of {sorted(PRESETS)}")
    shown = resolve(known.preset, {"algo": known.algo} if known.algo in L.ALGORITHMS else {})
    parser.description = (f"preset in effect: {known.preset} (algorithm {shown.loss.algo}); defaults below are its values\n\n"
                          + description)
    parser.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)}: the run's settings")
    add_flags(parser, RUN_FIELDS, field_docs(Args), shown, ALIASES)
    group = parser.add_argument_group("the objective (loss.py); an algorithm's own defaults apply unless set here")
    ignored = set(L.ignored_fields(shown.loss))
    add_flags(group, LOSS_FIELDS, field_docs(L.LossConfig), shown.loss,
                note=lambda name: f" [not used by {shown.loss.algo}]" if name in ignored else "")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None and k != "preset"}
    args = resolve(known.preset, given)
    problems = validate(args)
    if problems:
        parser.error("; ".join(problems))
    args.preset = known.preset
    return args


# --- from dataclasses to argparse -----------------------------------------------------------------

def field_docs(cls) -> dict:
    """One-line docs of a dataclass's fields, read from the comments beside them."""
    docs = {}
    for line in inspect.getsource(cls).splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            docs[line.split(":")[0]] = line.split("#", 1)[1].strip()
    return docs


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_flags(parser, dataclass_fields, docs, defaults, aliases=None, note=lambda name: ""):
    """A flag per field; its shown default is getattr(defaults, name); its parsed default None (= not given)."""
    for f in dataclass_fields:
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        rule = f.metadata.get("rule")
        allowed = f"; {rule.text()}" if rule is not None and rule.choices else ""
        help_text = f"{docs.get(f.name, '')}{allowed}{note(f.name)} (default: {default!r})"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type, f.type) if isinstance(f.type, str) else f.type
            parser.add_argument(flag, *(aliases or {}).get(f.name, []), dest=f.name, type=kind, default=None,
                                help=help_text, metavar=kind.__name__.upper())


def join_negative_values(argv):
    """argparse takes "-1e-4" for an option ("expected one argument"): write such values as --flag=-1e-4."""
    out = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and token.startswith("-") and _is_number(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False
