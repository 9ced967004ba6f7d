"""The run's settings: the Args dataclass (one flag per field, its help the comment beside it), the presets, and
train.py's command line, built from the dataclasses by command_line.py (`--eps-low` for `eps_low`, booleans as --x /
--no-x, errors in one line with exit code 2, no usage block). Nothing here is about the algorithm; loss.LossConfig's
fields become flags too.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import stat
import sys
from dataclasses import dataclass, field, fields

import loss as L
from cegppo_utils import data
from cegppo_utils import runfolder as RF
from cegppo_utils.command_line import (  # noqa: F401 (HelpFormatter: flags.HelpFormatter for the tools)
    HelpFormatter,
    Parser,
    add_flags,
    closest_flag,
    dash_flags,
    field_docs,
    field_type,
    join_negative_values,
    refuse_empty,
    refuse_unknown,
)

# correction.py's modes and IcePop's band, named here so that the command line is read without importing torch
# (correction.py imports it); tests/test_bad_input.py keeps them equal to correction.MODES and ICEPOP_BAND
CORRECTION_MODES = ("none", "token-tis", "token-mis", "seq-tis", "seq-mis", "token-icepop")
ICEPOP_BAND = (0.5, 5.0)
COUNT = L.Rule(0, low_open=True, integer=True)  # a whole number > 0 (and below 2**31, as every integer flag)
AT_LEAST_0 = L.Rule(0, integer=True)


@dataclass
class Args:
    """Every setting of a run but the objective's (loss.LossConfig): one flag each, its help the comment beside it,
    its allowed values its Rule (loss.field_problems checks both dataclasses alike)."""
    # --- model
    model: str = "tiny"  # HF hub id or local path; "tiny" (or "tiny:<task>")
                         # builds/reuses the project's warm-started tiny model
    precision: str = L.option("fp32", L.Rule(choices=("bf16", "fp32")))  # bf16 (FSDP2 mixed precision: bf16
                                                                         # compute, fp32 master weights) | fp32
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    selective_checkpointing: bool = False  # with --gradient-checkpointing: keep the matrix products' and attention's
                                           # outputs, recompute only the elementwise ops (models.enable_checkpointing)
    checkpoint_every: int = L.option(1, COUNT)  # with --gradient-checkpointing: checkpoint every k-th decoder layer
                                                # (1: all; 2: every other, the rest keep their activations)
    compile_layers: bool = False  # torch.compile each decoder layer (models.compile_layers); not with
                                  # --selective-checkpointing
    fsdp_one_process: bool = False  # one process under FSDP2 (--precision bf16, no torchrun): keep the bf16 weights
                                    # from forward to backward, no gradient divide factor (distributed.shard_model)
    fused_logprobs: bool = True  # log-probs straight from hidden states, one chunk of logits at a time (logprobs.py)
    liger_kernels: bool = True  # on CUDA: Liger's Triton RMSNorm, RoPE and SwiGLU in the
                                # trained model (models.use_liger); no effect on a CPU
    # --- data
    train_data: str = "arith"  # hub dataset id, local .json/.jsonl/.parquet, or an offline task name
    eval_data: str = "auto"  # held-out problems for eval_acc: a benchmark name
                             # or file; auto = the task's own held-out set
    seed: int = L.option(  # seeds data order, sampling and initialisation
        0, L.Rule(0, 2**31, high_open=True, integer=True, says="in [0, 2**31) (the sampler's engine seed is 32-bit)"))
    # --- algorithm: besides these, every field of loss.LossConfig is a flag of its own (--algo, --beta1, ...)
    loss: L.LossConfig = field(default_factory=L.LossConfig)
    scale_adv_by_std: bool = True  # GRPO advantages; --no-scale-adv-by-std = Dr. GRPO (r - mean)
    max_rl: bool = False  # MaxRL advantages (arXiv 2602.02710): (c - mean c) / mean c per group on the success
                          # indicator c, the group's mean in place of GRPO's std (--scale-adv-by-std does not apply)
    dynamic_sampling: bool = True  # drop groups whose accuracy has zero variance (official: on)
    rollout_correction: str = L.option("none", L.Rule(choices=CORRECTION_MODES))  # sampler/trainer mismatch
                                                                                  # weights (correction.py)
    rollout_correction_threshold: float = L.option(  # C: TIS truncates the weight at C, MIS drops what exceeds C
        2.0, L.Rule(1, low_open=True, says="a finite number > 1"))
    icepop_low: float = L.option(ICEPOP_BAND[0], L.Rule(0, 1, low_open=True))  # alpha: --rollout-correction
                                                                               # token-icepop zeroes the weight
                                                                               # where pi_old / q < alpha
                                                                               # (IcePop paper, verl: 0.5)
    icepop_high: float = L.option(ICEPOP_BAND[1], L.Rule(1))  # beta: token-icepop zeroes the weight where
                                                              # pi_old / q > beta (IcePop paper, verl: 5)
    # --- sampling
    gen_prompts: int = L.option(32, COUNT)  # prompts sampled per step
    n: int = L.option(  # responses per prompt
        8, L.Rule(2, integer=True, says=">= 2 (group-relative advantages need a group)"))
    temperature: float = L.option(  # rollout temperature; log-probs use the same temperature
        1.0, L.Rule(0.01, 100, says="in [0.01, 100] (logits / temperature must stay finite)"))
    top_p: float = L.option(1.0, L.Rule(0, 1, low_open=True))  # rollout nucleus sampling
    top_k: int = L.option(0, AT_LEAST_0)  # rollout top-k (0 = off)
    max_prompt_len: int = L.option(64, COUNT)  # longer prompts are an error, found at start
    max_response_len: int = L.option(48, COUNT)  # responses are truncated here
    min_response_len: int = L.option(0, AT_LEAST_0)  # no EOS before this many tokens (benchmarks:
                                                     # equal lengths on every side); 0 = off
    sampler: str = L.option("auto", L.Rule(choices=("auto", "vllm", "hf")))  # which engine samples
    off_policy_steps: int = L.option(0, L.Rule(0, 1, integer=True, says="0 (synchronous) or 1"))  # 1: step k+1's
                                    # batch is sampled during step k's update, from the weights before it (old
                                    # log-probs recomputed; docs/training.md); 0: synchronous
    sampler_process: bool = True  # with --off-policy-steps 1: the sampler in a process of its own (half the cores, or
                                  # a second GPU) while the trainer updates; --no-sampler-process samples ahead in this
                                  # process instead (the same numbers, no overlap)
    gpu_memory_utilization: float = L.option(  # share of GPU memory for vLLM (the rest is for training)
        0.5, L.Rule(0, 1, low_open=True, high_open=True))
    # --- optimisation
    lr: float = L.option(  # AdamW learning rate, constant after warm-up
        1e-4, L.Rule(0, 1, low_open=True, says="> 0 and at most 1 (an AdamW step moves a weight by about lr)"))
    warmup_steps: int = L.option(0, AT_LEAST_0)  # linear warm-up over the first optimizer
                                                 # updates (official: 10, first update at lr 0)
    weight_decay: float = L.option(0.0, L.Rule(0))  # AdamW weight decay
    grad_clip: float = L.option(1.0, L.Rule(0, low_open=True))  # max global gradient norm
    train_prompts: int = L.option(32, COUNT)  # at most this many kept groups are trained on per
                                              # step (not given: follows --gen-prompts down)
    mini_batch_prompts: int = L.option(4, COUNT)  # prompts per optimizer step (train_prompts / this = optimizer
                                                  # steps per step; not given: follows --gen-prompts down)
    ppo_epochs: int = L.option(1, COUNT)  # passes over the step's kept groups (verl ppo_epochs):
                                          # ppo_epochs x train_prompts / mini_batch_prompts
                                          # optimizer steps per step, the later passes off-policy
    micro_batch_size: int = L.option(32, COUNT)  # sequences per forward/backward;
                                                 # gradients accumulate over micro-batches
    micro_batch_tokens: int = L.option(0, AT_LEAST_0)  # >0: padding-free micro-batches, sequences packed into rows of
                                                       # at most this many tokens (micro_batch_size unused); 0 = padded
    max_steps: int = L.option(100, COUNT)  # training steps
    region_grad_norms: str = L.option(  # log the norms of the gradient's parts by clip region (the beta1
        "last", L.Rule(choices=("off", "last", "all")))  # region, the beta2 region, the rest) on the step's last
                                                         # mini-batch, on all, or off (a forward and a backward more
                                                         # per region that holds tokens, on each micro-batch measured;
                                                         # the update unchanged); fp32 on one process (not FSDP2)
    # --- run folder
    output_dir: str = "runs/tiny"  # the run folder; not given: runs/PRESET[-ALGO][-FLAG-VALUE...] (flags.py)
    resume: bool = False  # continue the run in output_dir (`--resume RUN` names it) from its latest checkpoint,
                          # with its own config.json's settings (from step 0 if there is no checkpoint)
    save_every: int = L.option(25, COUNT)  # checkpoint every N steps (and at the end)
    save_first: int = L.option(5, AT_LEAST_0)  # also checkpoint at this step, before the first --save-every,
                                               # so that a stop in the first minutes loses little; 0 = not
    keep_checkpoints: int = L.option(2, COUNT)  # how many checkpoints to keep
    # --- logging
    eval_every: int = L.option(25, AT_LEAST_0)  # held-out avg@k (as evaluate.py computes it)
                                                # every N steps and at the end; 0 = never
    eval_before_train: bool = True  # also evaluate the starting weights, logged as
                                    # step 0 (off under --eval-every 0 unless given)
    log_samples_every: int = L.option(10, AT_LEAST_0)  # write a few prompts with their completions
                                                       # to samples.jsonl every N steps; 0 = never
    curves: bool = True  # draw OUTPUT_DIR/curves.png at the end (about 2 s of matplotlib);
                         # `python -m cegppo_utils.plot RUN` draws it any time
    run_name: str = ""  # name for tensorboard / wandb; empty = the output folder's name
    tensorboard: bool = False  # also log to tensorboard (requirements-logging.txt; the error says how to install it)
    wandb: bool = False  # also log to Weights & Biases (requirements-logging.txt; the error says how to install it)


# A preset sets what its official script sets, and names the algorithm that script runs: `algo_options` apply
# only while that algorithm is in effect, so `--preset r1-distill-1.5b --algo dapo` runs DAPO with DAPO's own
# defaults (loss.ALGORITHMS), not with CE-GPPO's betas. Args' defaults are the offline `tiny` preset.
PRESETS = {
    # The offline CPU default: 100 steps, no downloads (README's quick start: its time and numbers per CPU type).
    # Larger lr than the paper's (a 3M-parameter model), and up to 8 mini-batches per step so ratios leave the clip
    # interval and CE-GPPO's terms act.
    "tiny": dict(algo="ce_gppo", algo_options={}),
    # The offline task with ~105-token responses and genuine choice points (tiny.py: sums with a free order), and
    # the paper's 256 -> 128 -> 16 scaled down to 32 -> 16 -> 2: up to 8 optimizer steps per rollout batch, so ratios
    # leave the clip interval. How its lr was chosen: docs/cpu-reproduction.md.
    "sums": dict(model="tiny:sums", train_data="sums", lr=3e-4, gen_prompts=32, train_prompts=16, mini_batch_prompts=2,
                 micro_batch_size=16, max_prompt_len=96, max_response_len=192, output_dir="runs/sums", max_steps=150,
                 save_every=25, eval_every=50, eval_before_train=True, log_samples_every=15, algo="ce_gppo",
                 algo_options={}),
    # The task where RL learns on a laptop (tiny.py: merge, 5-7 numbers, the pool written after each merge): ~82-token
    # responses, warm start 29% at T=1 (50% held-out avg@8). 8 -> 8 -> 2: up to 4 optimizer steps per rollout batch.
    # Evaluated before training and every 25 steps (the study's curves). lr: GRPO's best of 1e-4, 3e-4 and 1e-3 on a
    # seed outside the study (docs/study-protocol.md; results in docs/cpu-reproduction.md).
    "merge": dict(model="tiny:merge", train_data="merge", lr=1e-4, gen_prompts=8, train_prompts=8, mini_batch_prompts=2,
                  micro_batch_size=16, max_prompt_len=64, max_response_len=128, output_dir="runs/merge", max_steps=200,
                  save_every=25, eval_every=25, eval_before_train=True, log_samples_every=25, algo="ce_gppo",
                  algo_options={}),
    # `merge` where the clip binds (docs/study-protocol-active.md): lr 2e-4 and mini-batches of 1 prompt, 8 optimizer
    # steps per rollout batch as the official scripts make; chosen on GRPO alone by that protocol's rule (at least 1% of
    # tokens outside the clip interval, GRPO learns, no collapse) from a grid of lr x optimizer steps per batch.
    "merge-active": dict(model="tiny:merge", train_data="merge", lr=2e-4, gen_prompts=8, train_prompts=8,
                         mini_batch_prompts=1, micro_batch_size=8, max_prompt_len=64, max_response_len=128,
                         output_dir="runs/merge-active", max_steps=200, save_every=25, eval_every=25,
                         eval_before_train=True, log_samples_every=25, algo="ce_gppo", algo_options={}),
    # Official CE-GPPO script for DeepSeek-R1-Distill-Qwen-1.5B. Code vs paper text: the 0.1 positive-example LM
    # loss and dual clip 10 are in the code, not the paper; the token mean is exact here (the official code
    # approximates it per micro-batch). Evaluation (not in the official training script's cadence): AIME24, the
    # paper's headline benchmark and the smallest (30 problems x 32 samples), before training and with every
    # checkpoint, so each saved policy has its score beside it; its 32k budget is capped to the sampler's context.
    # Micro-batches: packed rows of one full-length sequence's tokens (4,096 + 16,384), 1.6-1.8x the tokens/s of
    # padded micro-batches of 4 on an H200 (docs/performance.md), the same loss; --micro-batch-tokens 0 pads again.
    "r1-distill-1.5b": dict(
        model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", train_data="Kwai-Klear/KlearReasoner-MathSub-30K",
        dynamic_sampling=True, lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0,
        gen_prompts=256, train_prompts=128, mini_batch_prompts=16, micro_batch_size=4, n=8,
        temperature=1.0, top_p=1.0, max_prompt_len=4096, max_response_len=16384, micro_batch_tokens=20480,
        precision="bf16", gradient_checkpointing=True, output_dir="runs/r1-distill-1.5b",
        max_steps=1000, save_every=50, eval_data="aime24", eval_every=50, eval_before_train=True,
        algo="ce_gppo", algo_options=dict(beta1=0.5, beta2=1.0, positive_lm_coef=0.1),
    ),
}
# The 7B script differs only in beta1 (and its validation length).
PRESETS["r1-distill-7b"] = {**PRESETS["r1-distill-1.5b"], "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
                            "micro_batch_size": 2, "output_dir": "runs/r1-distill-7b",
                            "algo_options": dict(beta1=0.75, beta2=1.0, positive_lm_coef=0.1)}

RUN_FIELDS = [f for f in fields(Args) if f.name != "loss"]
PATH_FIELDS = ("model", "train_data", "eval_data", "output_dir")  # `~` is the home folder in these
LOSS_FIELDS = list(fields(L.LossConfig))
# torchrun's own parser (Python <= 3.11) takes `--n` after the script name for an abbreviation of its flags
# and stops; `--group-size` passes through.
ALIASES = {"n": ["--group-size"]}


# ---------------------------------------------------------------------------------------------
# Resolving and checking
# ---------------------------------------------------------------------------------------------

def resolve(preset: str, given: dict, name_folder: bool = True) -> Args:
    """The values a run uses: Args' defaults <- the preset <- the algorithm's defaults (<- the preset's options for
    its own algorithm) <- what was given (a --config file, then the command line). Nothing is left to be decided
    later. Without an --output-dir given, the folder is named after what was given (default_output_dir)."""
    spec = PRESETS[preset]
    run = {f.name: f.default for f in RUN_FIELDS}
    run.update({k: v for k, v in spec.items() if k not in ("algo", "algo_options")})
    preset_gen = run["gen_prompts"]
    # a path as the user gave it: `--output-dir=~/x` or `output_dir: ~/x` reaches here unexpanded (no shell expands a
    # ~ after = or in a file); taken literally it would be a folder named ~ in the working directory
    run.update({k: os.path.expanduser(v) if k in PATH_FIELDS and isinstance(v, str) else v
                for k, v in given.items() if k in run})
    if "mini_batch_prompts" not in given and run["gen_prompts"] < preset_gen:
        # fewer prompts sampled: smaller mini-batches, so a step still makes the preset's optimizer steps per rollout
        # batch and updates off-policy after the first (with one, every objective here has PPO's on-policy gradient)
        run["mini_batch_prompts"] = max(1, run["mini_batch_prompts"] * run["gen_prompts"] // preset_gen)
        if "micro_batch_size" not in given:
            run["micro_batch_size"] = math.gcd(run["micro_batch_size"], run["mini_batch_prompts"] * run["n"])
    if "train_prompts" not in given:  # fewer prompts sampled: train on at most those, in whole mini-batches
        fit = min(run["train_prompts"], run["gen_prompts"])
        run["train_prompts"] = max(fit - fit % max(run["mini_batch_prompts"], 1), min(run["mini_batch_prompts"], fit))
    algo = given.get("algo", spec["algo"])
    options = dict(L.ALGORITHMS[algo].defaults) if algo in L.ALGORITHMS else {}
    if algo == spec["algo"]:
        options.update(spec["algo_options"])
    options.update({f.name: given[f.name] for f in LOSS_FIELDS if f.name in given})
    if not options.get("norm_len"):
        options["norm_len"] = run["max_response_len"]  # Dr. GRPO's constant: the max response length
    if "eval_before_train" not in given and run["eval_every"] == 0:  # --eval-every 0 alone: no evaluation at all
        run["eval_before_train"] = False
    if run["eval_data"] == "auto":  # an offline task evaluates on its own held-out set; other data needs --eval-data
        run["eval_data"] = run["train_data"] if run["train_data"] in data.task_names() else ""
    args = Args(**run, loss=L.LossConfig(**{**options, "algo": algo}))
    if name_folder and "output_dir" not in given and algo in L.ALGORITHMS:
        args.output_dir = default_output_dir(preset, given, args)
    args.run_name = args.run_name or os.path.basename(os.path.normpath(args.output_dir))
    return args


def default_output_dir(preset: str, given: dict, args: Args) -> str:
    """The folder of a run given no --output-dir: runs/PRESET (the preset's own), then -ALGO where the algorithm is
    not the preset's, then -FLAG-VALUE for each other setting given that the run computes with (not how long it runs
    or what it logs: runfolder.RESUMABLE) and that differs from the preset's, in the order of --help; past 80
    characters, the preset and algorithm and a hash of the rest. So different runs of the documented commands never
    share a folder, and a command typed again finds its own run (to --resume)."""
    spec = PRESETS[preset]
    base = resolve(preset, {"algo": args.loss.algo}, name_folder=False)
    now, before = flat_flags(args), flat_flags(base)
    parts = [] if args.loss.algo == spec["algo"] else [args.loss.algo]
    for name in [f.name for f in RUN_FIELDS + LOSS_FIELDS]:
        if name in given and name not in RF.RESUMABLE | {"algo", "run_name"} and now[name] != before[name]:
            parts.append(folder_part(name, now[name]))
    named = "-".join([os.path.basename(spec.get("output_dir", Args.output_dir))] + parts)
    if len(named) > 80:
        import hashlib
        digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:8]
        named = "-".join([os.path.basename(spec.get("output_dir", Args.output_dir))] + parts[:1] + [digest])
    return os.path.join(os.path.dirname(spec.get("output_dir", Args.output_dir)), named)


def folder_part(name: str, value) -> str:
    """One setting in a default folder's name, one name per value: the flag's name (dashes), then its value as written
    where that is exact (0.0003; a float :g would round, 0.00012345671 written in full) and uses only letters, digits
    and . + - _; else its value's characters made safe and a short hash of the value itself (data/a_b.jsonl and
    data/a-b.jsonl, which would both read data-a-b.jsonl, stay apart)."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"no-{flag}"
    written = str(value)
    if isinstance(value, float):
        written = f"{value:g}" if float(f"{value:g}") == value else repr(value)
    safe = re.sub(r"[^\w.+-]+", "-", written).strip("-")
    if safe == written:
        return f"{flag}-{written}"
    import hashlib
    return f"{flag}-{safe[:40]}-{hashlib.sha256(written.encode()).hexdigest()[:6]}"


def flat_flags(args: Args) -> dict:
    """{flag name: value} for every flag, the loss's included (config.json, resume checks)."""
    out = {f.name: getattr(args, f.name) for f in RUN_FIELDS}
    out.update(dataclasses.asdict(args.loss))
    return out


def validate(a: Args) -> list[str]:
    """Values out of range, found before anything is loaded; the first names the first real problem (a missing
    data file before what depends on the data)."""
    problems = []
    for name in ("train_data", "eval_data"):
        path = getattr(a, name)
        if path.endswith(data.FILE_TYPES) and not os.path.lexists(path):  # a broken link: data.py says how
            problems.append(f"--{name.replace('_', '-')} {path}: no such file")
        elif path.endswith(data.FILE_TYPES) and not os.path.isdir(path):  # a FIFO or a device: now, not after torch
            try:
                data.open_regular_file(path).close()
            except data.UserError as e:
                problems.append(f"--{name.replace('_', '-')} {e}")
    problems += model_problems(a.model)
    # every field's own Rule, Args' and the loss's alike; then the loss's rules that relate two of its fields
    problems += [f"--{name.replace('_', '-')}{message[len(name):]}"
                 for name, message in L.field_problems(a) + L.config_problems(a.loss)]
    if problems:
        return problems
    if a.min_response_len > a.max_response_len:
        problems.append(f"--min-response-len ({a.min_response_len}) cannot exceed --max-response-len "
                        f"({a.max_response_len})")
    if a.train_prompts > a.gen_prompts:
        problems.append(f"--train-prompts ({a.train_prompts}) cannot exceed --gen-prompts ({a.gen_prompts})")
    if a.train_prompts % a.mini_batch_prompts:
        problems.append(f"--train-prompts ({a.train_prompts}) must be a multiple of --mini-batch-prompts "
                        f"({a.mini_batch_prompts})")
    if not a.micro_batch_tokens and (a.mini_batch_prompts * a.n) % a.micro_batch_size:  # packed: no size to divide
        problems.append(f"--micro-batch-size ({a.micro_batch_size}) must divide mini-batch-prompts x n = "
                        f"{a.mini_batch_prompts * a.n}")
    if 0 < a.micro_batch_tokens < a.max_prompt_len + a.max_response_len:
        problems.append(f"--micro-batch-tokens ({a.micro_batch_tokens}) must hold the longest sequence, "
                        f"max-prompt-len + max-response-len = {a.max_prompt_len + a.max_response_len} (or be 0: "
                        "padded micro-batches)")
    if a.compile_layers and a.gradient_checkpointing and a.selective_checkpointing:
        problems.append("--compile-layers cannot run with --selective-checkpointing (compiled layers write into the "
                        "outputs the selective policy keeps); choose one")
    problems += off_policy_problems(a)
    if (a.eval_every or a.eval_before_train) and not a.eval_data:  # --eval-every 0 turns both off (resolve)
        asked = f"--eval-every {a.eval_every}" if a.eval_every else "--eval-before-train"
        problems.append(f"{asked} needs --eval-data (a benchmark name or file) for --train-data {a.train_data}; "
                        f"or pass {'--eval-every 0' if a.eval_every else '--no-eval-before-train'}")
    return problems


def off_policy_problems(a: Args) -> list[str]:
    """--off-policy-steps 1 where it cannot run, said before torch loads: under torchrun (one trainer process beside
    one sampler process is what it is built for), and with a sampler process that HF generate (which samples from the
    training model itself) cannot be, or that has no core of its own. train.py says the rest (no second GPU, no
    vLLM)."""
    if not a.off_policy_steps:
        return []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        return [f"--off-policy-steps {a.off_policy_steps} runs one trainer beside one sampler; it is not supported "
                f"under torchrun ({world} ranks here): run it as one process, or with --off-policy-steps 0"]
    if not a.sampler_process:
        return []
    if a.sampler == "hf":
        return ["--off-policy-steps 1 --sampler hf: HF generate samples from the training model itself, so it cannot "
                "sample in a process of its own; use --sampler vllm, or add --no-sampler-process to sample one step "
                "ahead in this process"]
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < 2:
        return ["--off-policy-steps 1: the sampler process needs a core of its own, and this process may run on one "
                "core only; add --no-sampler-process to sample one step ahead in this process (the same numbers, no "
                "overlap)"]
    return []


# Options read only in a mode: {field: (whether the run is in that mode, the mode as flags)}. The algorithm's own
# options are loss.ALGORITHMS[algo].reads; together, the one rule for an option given where nothing reads it.
MODE_OPTIONS = {
    "scale_adv_by_std": (lambda a: not a.max_rl, "GRPO's advantages, not --max-rl's (which divide by the group's "
                                                 "mean, not its std)"),
    "icepop_low": (lambda a: a.rollout_correction == "token-icepop", "--rollout-correction token-icepop"),
    "icepop_high": (lambda a: a.rollout_correction == "token-icepop", "--rollout-correction token-icepop"),
    "rollout_correction_threshold": (lambda a: a.rollout_correction not in ("none", "token-icepop"),
                                     "--rollout-correction token-tis, token-mis, seq-tis or seq-mis"),
    "od_initial_entropy": (lambda a: a.loss.dynamic_clip == "od", "--dynamic-clip od"),
    "entropy_target": (lambda a: a.loss.adaptive_entropy, "--adaptive-entropy"),
    "entropy_coef_delta": (lambda a: a.loss.adaptive_entropy, "--adaptive-entropy"),
    "entropy_coef_min": (lambda a: a.loss.adaptive_entropy, "--adaptive-entropy"),
    "entropy_coef_max": (lambda a: a.loss.adaptive_entropy, "--adaptive-entropy"),
    "kl_estimator": (lambda a: a.loss.kl_coef > 0, "--kl-coef above 0"),
    "norm_len": (lambda a: a.loss.loss_agg_mode == "seq-mean-token-sum-norm",
                 "--loss-agg-mode seq-mean-token-sum-norm"),
    "micro_batch_size": (lambda a: not a.micro_batch_tokens, "padded micro-batches (--micro-batch-tokens 0)"),
    "selective_checkpointing": (lambda a: a.gradient_checkpointing, "--gradient-checkpointing"),
    "sampler_process": (lambda a: a.off_policy_steps > 0, "--off-policy-steps 1"),
    "checkpoint_every": (lambda a: a.gradient_checkpointing, "--gradient-checkpointing"),
    "fsdp_one_process": (lambda a: a.precision == "bf16" and int(os.environ.get("WORLD_SIZE", "1")) == 1,
                         "--precision bf16 in one process (no torchrun)"),
    "region_grad_norms": (lambda a: (a.precision == "fp32" and int(os.environ.get("WORLD_SIZE", "1")) == 1
                                     and bool(L.ALGORITHMS[a.loss.algo].regions)),
                          "--precision fp32 on one process, with an algorithm that has clip regions"),
}
# The value of an option that asks for nothing (every switch's is False): given where the option is not read, it
# agrees with the run, as the option's default does. A beta of 0 leaves a clipped token without gradient, as the
# algorithms without CE-GPPO's terms do; a dual clip, a KL or a covariance weight of 0 is no such term.
OFF_VALUES = {"region_grad_norms": "off", "beta1": 0.0, "beta2": 0.0, "clip_ratio_c": 0.0, "kimi_kl_tau": 0.0,
              "kl_cov_coef": 0.0}


def unread_problems(a: Args, typed: dict, preset: str, untyped: dict) -> list[str]:
    """An option typed on the command line whose value would change something the run does not do: one its algorithm
    does not use (loss.ignored_fields), or one of a mode that is off (MODE_OPTIONS), given a value other than the one
    the run has without it (its default, the --config file's or the resumed run's own) and other than its "off"
    (OFF_VALUES; False for a switch). Refused, as --dynamic-clip on an algorithm without it is: a setting that
    silently changes nothing is a run other than the one meant. An explicit default or "off" is taken: scripts and
    config files write them. untyped: the values from the --config file or the resumed run's config.json."""
    problems = []
    ignored = set(L.ignored_fields(a.loss))
    now = flat_flags(a)
    kinds = {f.name: field_type(f) for f in RUN_FIELDS + LOSS_FIELDS}
    for name in [f.name for f in RUN_FIELDS + LOSS_FIELDS if f.name in typed]:
        if name not in ignored and not (name in MODE_OPTIONS and not MODE_OPTIONS[name][0](a)):
            continue
        without = flat_flags(resolve(preset, {**untyped, **{k: v for k, v in typed.items() if k != name}},
                                     name_folder=False))[name]
        if now[name] == without or now[name] == OFF_VALUES.get(name, False if kinds[name] is bool else None):
            continue
        flag = "--" + name.replace("_", "-")
        if name in ignored:
            readers = [algo for algo, spec in L.ALGORITHMS.items() if name in spec.reads]
            named = " and ".join([", ".join(readers[:-1]), readers[-1]] if len(readers) > 1 else readers)
            problems.append(f"{flag} does not apply to {a.loss.algo} (only {named} "
                            f"read{'s' if len(readers) == 1 else ''} it); leave it out, or choose "
                            f"{'it' if len(readers) == 1 else 'one of those'} with --algo")
        elif name == "checkpoint_every":  # the name reads as "save every N steps", which is --save-every
            problems.append(f"{flag} is read only with {MODE_OPTIONS[name][1]}, which this run does not use: it "
                            "recomputes the activations of every k-th decoder layer in backward, it does not save "
                            f"the run; to save the run every {now[name]} steps, give --save-every {now[name]}; to "
                            "recompute activations, add --gradient-checkpointing")
        else:
            problems.append(f"{flag} is read only with {MODE_OPTIONS[name][1]}, which this run does not use; leave "
                            f"it out{taken(name, kinds[name])}, or turn that on")
    return problems


def taken(name: str, kind) -> str:
    """The "off" of an option read only in a mode, as it is given, where it has one: taken as the default is."""
    flag = "--" + name.replace("_", "-")
    if kind is bool:
        return f" (or give --no-{flag[2:]})"
    return f" (or give {flag} {OFF_VALUES[name]})" if name in OFF_VALUES else ""


def model_problems(model: str) -> list[str]:
    """--model names nothing, found before the output folder is made and torch loads: a path that does not exist (a
    name models.resolve_model takes for a path, not a hub id), or an offline task that is not one."""
    if model == "tiny" or model.startswith("tiny:"):
        task = model.partition(":")[2] or "arith"
        return [] if task in data.task_names() else [f"--model {model}: no offline task {task!r}; choose from "
                                                     f"{sorted(data.task_names())}"]
    if os.path.exists(model) or not (model.startswith((".", "/", "~")) or model.count("/") != 1):
        return []
    return [f"--model {model}: no such model folder, and not a hub id (owner/name)"]


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None, description: str = "", prog: str = "train.py") -> Args:
    """train.py's command line -> the resolved Args (bad values: one line, exit code 2). description: train.py's doc.
    `--config FILE` (JSON or YAML: a mapping of flag names, or a run's own config.json) gives values that the
    command line overrides; flags may be spelled with underscores (--max_steps). `--resume [RUN]` reads the run's
    own config.json (resume_settings): a flag typed beside it may change how long the run goes on and what it logs,
    nothing else. Nothing here imports torch, so a typo or --help is answered at once; and with argv None (train.py's
    own command line) so is an output folder a new run may not write into."""
    argv_given = argv
    argv = join_negative_values(dash_flags(list(sys.argv[1:] if argv is None else argv)))
    parser = Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False)  # --max-step is a mistake to name, not a prefix to accept
    refuse_unknown(parser, argv, known_flags())
    argv = name_resumed_folder(argv, parser)
    known = early_flags(argv, parser)
    run_dir, from_file, file_preset = None, {}, None
    if known.resume and known.config is None:
        run_dir, from_file, file_preset = resume_settings(known, argv, parser)
    elif known.config is not None:
        from_file, file_preset = read_config(known.config, parser)
    source = known.config or (run_dir and os.path.join(run_dir, "config.json"))
    preset = known.preset or file_preset or "tiny"
    if preset not in PRESETS:  # read from a file (one typed is checked above): said as the file's
        parser.error(f"{source}: unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
                     f"{L.did_you_mean(preset, PRESETS)}")
    algo = known.algo or from_file.get("algo")
    shown = resolve(preset, {**from_file, **({"algo": algo} if algo in L.ALGORITHMS else {})})
    parser.description = (f"preset in effect: {preset} (algorithm {shown.loss.algo}); defaults below are its values"
                          f"{' with ' + source if source else ''}\n\n" + description)
    parser.add_argument("--preset", default="tiny",
                        help=f"the run's settings: one of {sorted(PRESETS)} (default: 'tiny')")
    parser.add_argument("--config", default=None,
                        help="a JSON or YAML file of flag values (a run's config.json works); the command line "
                             "overrides it")
    ignored = set(L.ignored_fields(shown.loss))
    add_flags(parser, RUN_FIELDS + LOSS_FIELDS, {**field_docs(Args), **field_docs(L.LossConfig)}, shown, ALIASES,
              note=lambda name: f" [not used by {shown.loss.algo}]" if name in ignored else "")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None and k not in ("preset", "config")}
    refuse_empty(parser, [k for k, v in given.items() if v == "" and k not in EMPTY_OK])
    if run_dir is not None:
        check_same_settings(run_dir, from_file, file_preset, given, known.preset, parser)
        given["output_dir"] = run_dir  # where the run is now, if its folder was moved since it started
    args = resolve(preset, {**from_file, **given})
    problems = validate(args)
    if not problems:  # typed, not in a --config file (one may hold settings for several runs); on --resume as well
        problems = unread_problems(args, given, preset, from_file)
    if problems:
        parser.error(named_source(problems[0], given, from_file, source) + "".join(f"; {p}" for p in problems[1:]))
    args.preset = preset
    answer_before_torch(args, prog, parser, new_run=argv_given is None)
    return args


def early_flags(argv, parser):
    """What must be known before the full command line is read (--preset, --algo, --config, --output-dir, --resume):
    the preset and its algorithm give the defaults --help shows, --config and --resume the values under the flags. An
    empty one, or a preset typed that is not one, is refused here."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--preset", "--algo", "--config", "--output-dir"):
        early.add_argument(name, default=None)
    early.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None)
    known, _ = early.parse_known_args(argv)
    refuse_empty(parser, [name for name, value in vars(known).items() if value == ""])
    if known.preset is not None and known.preset not in PRESETS:
        parser.error(f"unknown preset {known.preset!r}; choose one of {sorted(PRESETS)}"
                     f"{L.did_you_mean(known.preset, PRESETS)}")
    return known


def named_source(problem: str, typed: dict, from_file: dict, source: str | None) -> str:
    """A problem whose flags all come from a file (a --config file, or a resumed run's config.json), not from the
    command line, said as that file's: a hand-edited config.json is not something the user typed."""
    named = {name.replace("-", "_") for name in re.findall(r"--([a-z0-9-]+)", problem)}
    if source and named and not named & set(typed) and named & set(from_file):
        return f"{source}: {problem}"
    return problem


def answer_before_torch(args: Args, prog: str, parser, new_run: bool):
    """What the folder alone answers, before torch loads: a resume of a finished run (exit 0, the command that trains
    on); with new_run (train.py's own command line, about to start: rank 0 under torchrun, which holds the lock), a
    folder that a live run holds, or that no new run may write into (one that holds a run, say:
    runfolder.check_output_folder). Tools that read train.py's flags for other ends do not ask the folder."""
    if args.resume:
        done = RF.finished_step(args.output_dir, args.max_steps)
        if done is not None:  # before any model loads: nothing to do; said once (rank 0), every rank ends
            if os.environ.get("RANK", "0") == "0":
                print(f"{prog}: {args.output_dir} finished at step {done}; nothing to resume. Its policy is in "
                      f"{os.path.join(args.output_dir, 'final')}; to train on, raise --max-steps: "
                      f"{RF.resume_command(args.output_dir)} --max-steps N (N > {done})")
            sys.exit(0)
    elif new_run and os.environ.get("RANK", "0") == "0":
        try:
            check_new_folder(args.output_dir, resume=False)
        except data.UserError as e:
            parser.error(str(e))


def known_flags() -> set[str]:
    """Every option string train.py's command line takes (its parser's, known without building it)."""
    names = {"--preset", "--config", "--resume", "--no-resume", "--help", "-h"}
    for f in RUN_FIELDS + LOSS_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        names |= {flag, *ALIASES.get(f.name, [])} | ({"--no-" + flag[2:]} if field_type(f) is bool else set())
    return names


def name_resumed_folder(argv, parser) -> list[str]:
    """`--resume RUN` (or --resume=RUN) -> `--resume --output-dir RUN`: the run's folder named once."""
    out, folder = [], None
    for token in argv:
        if token.startswith("--resume="):
            folder = token.split("=", 1)[1]
            out.append("--resume")
        elif folder is None and out and out[-1] == "--resume" and not token.startswith("-"):
            folder = token
        else:
            out.append(token)
    if folder is None:
        return out
    if not folder:
        parser.error("--resume is given an empty folder name (an unset shell variable?); name the run's folder")
    typed = [v for flag, v in zip(out, out[1:]) if flag == "--output-dir"]
    typed += [t.split("=", 1)[1] for t in out if t.startswith("--output-dir=")]
    same = os.path.realpath(os.path.expanduser(folder))  # RUN and RUN/ (or ./RUN) are one folder
    differ = [v for v in typed if os.path.realpath(os.path.expanduser(v)) != same]
    if differ:
        parser.error(f"--resume {folder} and --output-dir {differ[0]} name two folders; give the run's folder once")
    return out + ["--output-dir", folder]


def resume_settings(known, argv, parser) -> tuple[str, dict, str | None]:
    """(the run's folder, its flags, its preset) for --resume without --config: the folder typed (--resume RUN or
    --output-dir) or the one the launch command typed again names (default_output_dir); its settings from its own
    config.json, where it holds a run's (none otherwise: a run from before config.json was kept resumes from the
    command line as typed, and check() compares it with the checkpoint). A folder that a live run holds is answered
    first, in one line naming it; then one that holds no run to resume (runfolder.check_resumable), before torch
    loads."""
    if known.output_dir is not None:
        run_dir = os.path.expanduser(known.output_dir)
    else:
        typed = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        add_flags(typed, RUN_FIELDS + LOSS_FIELDS, {}, resolve(known.preset or "tiny", {}), ALIASES)
        given = {k: v for k, v in vars(typed.parse_known_args(argv)[0]).items() if v is not None}
        run_dir = resolve(known.preset or "tiny", given).output_dir
    try:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 holds the lock (and looks at the folder)
            check_new_folder(run_dir, resume=True)
        # a damaged row, or a config.json whose record was edited, is refused now, not after torch loads
        RF.read_jsonl(os.path.join(run_dir, "metrics.jsonl"), what="--resume: ")
        config = RF.run_config_file(run_dir)
        record = RF.read_run_record(config, "--resume: ") if config else None
    except data.UserError as e:
        parser.error(str(e))
    if config is None:
        return run_dir, {}, None
    from_file, file_preset = read_config(config, parser, what=f"--resume {run_dir}: {config}")
    problem = RF.config_against_checkpoint(run_dir, record["flags"])
    if problem:
        parser.error(problem)
    return run_dir, from_file, file_preset


def check_new_folder(output_dir: str, resume: bool):
    """What train.py's rank 0 asks of its output folder before torch loads, each a UserError in one line: a live run
    holds it (runfolder.check_not_in_use), no run may write into it (check_output_folder), with resume it holds no
    run (check_resumable), or its path cannot be written (a name too long, a file in the way, a folder that cannot be
    made: runfolder.folder_problem, which makes nothing)."""
    RF.check_not_in_use(output_dir)
    RF.check_output_folder(output_dir, resume=resume)
    if resume:
        RF.check_resumable(output_dir)  # a mistyped folder is not a run to start from step 0
    problem = RF.folder_problem(output_dir, "--output-dir")
    if problem:
        raise data.UserError(problem)


def check_same_settings(run_dir, saved: dict, saved_preset, typed: dict, typed_preset, parser):
    """A flag typed beside --resume whose value differs from the run's own: one error line naming only those typed
    (the run's derived values are its own). A value is compared as the run resolves it (--norm-len 0 is the run's
    max response length): the launch command typed again restates the run's values. Those in RESUMABLE (how long it
    runs, what it logs) may differ."""
    preset = saved_preset if saved_preset in PRESETS else "tiny"
    own = flat_flags(resolve(preset, saved, name_folder=False))
    again = flat_flags(resolve(preset, {**saved, **typed}, name_folder=False))
    differ = [(f"--{k.replace('_', '-')}", typed[k], saved[k]) for k in typed
              if k in saved and k not in RF.RESUMABLE and again[k] != own[k]]
    if typed_preset and saved_preset and typed_preset != saved_preset:
        differ.insert(0, ("--preset", typed_preset, saved_preset))
    if differ:
        shown = ", ".join(f"{flag} {now!r} (the run's: {then!r})" for flag, now, then in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        parser.error(f"--resume {run_dir}: {shown}{more}; a run resumes with its own settings "
                     f"({os.path.join(run_dir, 'config.json')}): a flag typed beside --resume may restate the run's "
                     "own value, or change how long it runs and what it logs (--max-steps, --save-every, "
                     f"--eval-every, ...); drop {'it' if len(differ) == 1 else 'them'}, or start a new run in another "
                     "--output-dir")


EMPTY_OK = ("run_name", "eval_data")  # text flags where "" means something: the folder's name; no held-out set
MAX_CONFIG_BYTES = 1 << 20  # a config file is a page of flags; a larger one is a mistake (or a trap), refused unread
def read_config(path: str, parser, what: str | None = None) -> tuple[dict, str | None]:
    """(flag values, preset or None) from a --config file; a bad file or an unknown name is one error line. Read as a
    regular file of at most MAX_CONFIG_BYTES (a FIFO would block, a huge file exhaust memory); YAML without anchors or
    aliases (their expansion is exponential), duplicate keys refused in YAML and JSON, and YAML 1.2's numbers (1e-4 is a
    float, as in JSON). A run's own config.json works: its `flags`, without `resume` (how that run started, not a
    setting: a rerun from it is a new run). what: how errors name the file (default: --config PATH)."""
    def fail(why):
        parser.error(f"{what or '--config ' + path}: {why}")
    text = _config_text(path, fail)
    yaml_file = path.endswith((".yaml", ".yml"))
    try:
        values = _load_yaml(text) if yaml_file else json.loads(text, object_pairs_hook=_no_duplicates,
                                                              parse_float=_Written.number,
                                                              parse_constant=_Written.number)
    except _Duplicate as e:
        fail(f"the key {_short(e.args[0])} appears twice")
    except _Alias as e:
        fail(f"YAML anchors and aliases are not accepted ({e.args[0]})")
    except (ValueError, RecursionError) as e:
        fail(f"cannot read it ({type(e).__name__}: {_short(data.first_line(e, None), 200, quote=False)})")
    except Exception as e:  # yaml's parse errors: where (line, column) and what it found there
        fail(f"not valid YAML ({_short(_yaml_problem(e), 200, quote=False)})")
    if not isinstance(values, dict):
        fail("must hold a mapping of flag names to values")
    if "preset" in values and not isinstance(values["preset"], str):
        fail(f"preset must be a string naming a preset ({', '.join(sorted(PRESETS))}), got {_short(values['preset'])}")
    preset = values.get("preset")
    run_config = isinstance(values.get("flags"), dict)
    if run_config:  # a run's config.json: its flags under `flags`, beside only what the run recorded with them
        beside = [k for k in values if k not in RF.RUN_RECORD_KEYS]
        if beside:
            fail(f"unknown key {_short(beside[0])} at the top level beside `flags` (a run's config.json holds its "
                 f"flags under `flags`, beside only {', '.join(RF.RUN_RECORD_KEYS)}); move it into `flags`")
    values = values["flags"] if run_config else {k: v for k, v in values.items() if k != "preset"}
    known = {f.name: f for f in RUN_FIELDS + LOSS_FIELDS}
    out = {}
    for key, value in values.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name == "resume":
            if run_config:
                continue  # an older run's config.json saved it; a rerun from it is a new run
            fail("resume is not a setting of a run; pass --resume on the command line")
        if name not in known:
            close = closest_flag(name, known)
            fail(f"unknown flag {_short(key)}" + (f"; did you mean {close!r}?" if close else ""))
        if name in out:
            fail(f"{name} is given twice (as {_short(key)})")
        if isinstance(value, _Word):  # YAML 1.1's on/off/yes/no: a switch's value, or a text option's word as written
            value = value.switch if field_type(known[name]) is bool else str(value)
        problem = _value_problem(key, value, known[name])
        if problem:
            fail(problem)
        out[name] = float(value) if field_type(known[name]) is float else value
    return out, preset


def _config_text(path, fail) -> str:
    """A config file's text: a regular file (a FIFO opens at once, then is refused) of at most MAX_CONFIG_BYTES, in
    UTF-8; fail(why) otherwise."""
    try:
        fd = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                fail("not a regular file (a FIFO, device or folder)")
            if info.st_size > MAX_CONFIG_BYTES:
                fail(f"{info.st_size} bytes; a config file is at most {MAX_CONFIG_BYTES} bytes")
            raw = os.read(fd, MAX_CONFIG_BYTES + 1)
        finally:
            os.close(fd)
        if len(raw) > MAX_CONFIG_BYTES:
            fail(f"more than {MAX_CONFIG_BYTES} bytes; a config file is at most that")
        return raw.decode("utf-8")
    except OSError as e:
        fail(f"cannot read it ({e.strerror})")
    except UnicodeDecodeError:
        fail("not a UTF-8 text file")


def _value_problem(key, value, f) -> str | None:
    """What is wrong with one value of a config file, said as the file's (not as a flag the user typed: algo gpro, an
    edited lr): its type, its field's Rule, an empty text; None if it is good."""
    name, kind, rule = f.name, field_type(f), f.metadata.get("rule")
    if isinstance(value, _Written) and math.isinf(value) and not re.search(r"(?i)inf", value.text):
        return f"{_short(key, quote=False)}: {value.text} is beyond a float's range"
    whole = isinstance(value, int) and not isinstance(value, bool)  # JSON's true is not 1
    if not (whole if kind is int else (isinstance(value, kind) or (kind is float and whole))):
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        return f"{_short(key, quote=False)} must be {article} {kind.__name__}, got {_short(value)}"
    if value == "" and name not in EMPTY_OK:
        return f"{name} is empty; give it a value, or leave it out"
    return rule.problem(name, value) if rule is not None else None


def _yaml_problem(error) -> str:
    """A YAML parse error in a line: where (line and column, from 1) and what was wrong there, with the block it
    was reading where that started elsewhere (an indentation error is found on a later line than its cause)."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or not problem:
        return data.first_line(error, None) or type(error).__name__
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and start is not None and start.line != mark.line:
        text += f", {context} that starts on line {start.line + 1}"
    return text


def _short(value, limit=60, quote=True) -> str:
    """A value for a message: as the file wrote it (a number), or repr'd; cut, so a huge value is not printed whole."""
    text = value.text if isinstance(value, _Written) else repr(value) if quote else str(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class _Written(float):
    """A number read from a config file, with its text as the file wrote it (1e400, not inf; 2.50, not 2.5)."""

    def __new__(cls, value, text):
        number = super().__new__(cls, value)
        number.text = text
        return number

    @classmethod
    def number(cls, text):
        return cls(float(text), text)


class _Word(str):
    """A plain YAML on, off, yes or no (any case), which YAML 1.1 reads as a boolean: kept as written, with the
    boolean beside it (switch), so that `region_grad_norms: off` is the text its option expects and
    `dynamic_sampling: off` still a switch. true and false are booleans in YAML 1.2 and JSON alike, and stay so."""

    def __new__(cls, text, switch):
        word = super().__new__(cls, text)
        word.switch = switch
        return word


class _Duplicate(ValueError):
    pass


class _Alias(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _load_yaml(text):
    """yaml.safe_load with anchors and aliases refused (before anything is built), duplicate keys refused, and YAML
    1.2's float syntax (1e-4, not only 1.0e-4); numbers keep their text (_Written), and on/off/yes/no theirs (_Word)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise _Alias(f"line {event.start_mark.line + 1}")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise _Duplicate(key)
                seen.add(key)
            return super().construct_mapping(node, deep)

    Loader.add_constructor("tag:yaml.org,2002:bool", lambda loader, node: (
        loader.construct_yaml_bool(node) if node.value.lower() in ("true", "false")
        else _Word(node.value, loader.construct_yaml_bool(node))))
    Loader.add_constructor("tag:yaml.org,2002:float",
                           lambda loader, node: _Written(loader.construct_yaml_float(node), node.value))
    Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return yaml.load(text, Loader=Loader)


