"""The named configurations that the long-run study (study.py) and the one-step experiment (mechanism.py) compare:
name -> train.py flags on top of a preset. One list, so both tools name the same things alike.

    python -m tools.configs                    # every configuration and its flags
    python -m tools.configs grpo ce_gppo_0.5_1 # some

PPO-clip is CE-GPPO with beta1 = beta2 = 0 (the same gradient, CE-GPPO's token mean), so every CE-GPPO config
differs from it only in the betas; `grpo` is PPO-clip with GRPO's per-response aggregation.
"""

PPO = ["--algo", "ce_gppo", "--beta1", "0", "--beta2", "0"]

CONFIGS = {
    "grpo": ["--algo", "grpo"],
    "ppo_clip": PPO,
    "ppo_clip_repeat": PPO,  # PPO-clip again: in the paired experiment its difference from ppo_clip must be exactly 0
    "dapo": ["--algo", "dapo"],
    "gppo": ["--algo", "gppo"],
    "cispo": ["--algo", "cispo"],
    "gspo": ["--algo", "gspo"],
    "ce_gppo_0_1": ["--algo", "ce_gppo", "--beta1", "0", "--beta2", "1"],
    "ce_gppo_0.5_1": ["--algo", "ce_gppo", "--beta1", "0.5", "--beta2", "1"],
    "ce_gppo_0.75_1": ["--algo", "ce_gppo", "--beta1", "0.75", "--beta2", "1"],
    "ce_gppo_1_1": ["--algo", "ce_gppo", "--beta1", "1", "--beta2", "1"],
    "ce_gppo_1_0.5": ["--algo", "ce_gppo", "--beta1", "1", "--beta2", "0.5"],
    "ce_gppo_1_0": ["--algo", "ce_gppo", "--beta1", "1", "--beta2", "0"],
    # dynamic clipping (arXiv 2602.09782) on GRPO's PPO-clip objective, the algorithm its authors apply it to
    "grpo_dyn_id": ["--algo", "grpo", "--dynamic-clip", "id"],
    "grpo_dyn_did": ["--algo", "grpo", "--dynamic-clip", "did"],
    # OD's H_init: the first step's measured entropy (what the merge study ran), or the public defaults' fixed 0.5
    "grpo_dyn_od": ["--algo", "grpo", "--dynamic-clip", "od", "--od-initial-entropy", "0"],
    "grpo_dyn_od_h0.5": ["--algo", "grpo", "--dynamic-clip", "od", "--od-initial-entropy", "0.5"],
    # an extension
    "ce_gppo_0.5_1_dyn_id": ["--algo", "ce_gppo", "--beta1", "0.5", "--beta2", "1", "--dynamic-clip", "id"],
    "entropy_0.001": PPO + ["--entropy-coef", "0.001"],  # the paper's §4 entropy-regularisation baseline values
    "entropy_0.003": PPO + ["--entropy-coef", "0.003"],
    # entropy control from other papers, each with its own defaults (loss.py; README "Entropy control")
    "sapo": ["--algo", "sapo"],
    "clip_cov": ["--algo", "clip_cov"],
    "kl_cov": ["--algo", "kl_cov"],
    "top_entropy_0.2": ["--algo", "dapo", "--top-entropy-quantile", "0.2"],  # "Beyond the 80/20 rule" trains DAPO
    "adaptive_entropy": ["--algo", "grpo", "--adaptive-entropy"],  # Skywork-OR1's target 0.2, step 0.005, from 0
    "grpo_kl_0.04": ["--algo", "grpo", "--kl-coef", "0.04", "--kl-estimator", "k3"],  # the GRPO paper's KL penalty
}

# The grid that chooses the regime of the second study (docs/study-protocol-active.md), GRPO only: lr x optimizer steps
# per rollout batch (u) on top of --preset merge (8 prompts trained per step): u4 its mini-batches of 2 prompts, u8
# mini-batches of 1, u16 mini-batches of 1 in two passes.
UPDATES = {"u4": [], "u8": ["--mini-batch-prompts", "1", "--micro-batch-size", "8"],
           "u16": ["--mini-batch-prompts", "1", "--micro-batch-size", "8", "--ppo-epochs", "2"]}
CONFIGS.update({f"grid_lr{lr}_{u}": ["--algo", "grpo", "--lr", lr, *more] for lr in ("1e-4", "2e-4", "3e-4")
                for u, more in UPDATES.items()})
REGIME_GRID = [f"grid_lr{lr}_{u}" for u in ("u8", "u16", "u4") for lr in ("1e-4", "2e-4", "3e-4")]  # the choice's order

# The third study, on why CE-GPPO collapses at --preset merge-active (docs/study-protocol-collapse.md): the token-mean
# PPO-clip control (CE-GPPO (0, 0): the same aggregation as every CE-GPPO arm), a beta1 dose at beta2 = 1, the official
# recipe (the positive-example NLL 0.1 and oversampling: 16 prompts sampled, up to 8 kept, as 256 -> 128), and fewer
# optimizer steps per rollout batch (u4: mini-batches of 2 prompts, u2: of 4; the preset's 8 prompts per step).
RECIPE = ["--positive-lm-coef", "0.1", "--gen-prompts", "16", "--train-prompts", "8"]
FEWER_STEPS = {"u4": ["--mini-batch-prompts", "2"], "u2": ["--mini-batch-prompts", "4"]}
CONFIGS.update({
    "ppo_clip_tm": PPO,
    "ce_gppo_0.1_1": ["--algo", "ce_gppo", "--beta1", "0.1", "--beta2", "1"],
    "ce_gppo_0.25_1": ["--algo", "ce_gppo", "--beta1", "0.25", "--beta2", "1"],
    "ce_gppo_0.5_1_recipe": CONFIGS["ce_gppo_0.5_1"] + RECIPE,
    "ppo_clip_tm_recipe": PPO + RECIPE,
    **{f"{name}_{u}": CONFIGS[base] + more for u, more in FEWER_STEPS.items()
       for name, base in (("ce_gppo_0.5_1", "ce_gppo_0.5_1"), ("ppo_clip_tm", "ppo_clip"))},
})
COLLAPSE_ARMS = ["grpo", "ppo_clip_tm", "ce_gppo_0_1", "ce_gppo_0.1_1", "ce_gppo_0.25_1", "ce_gppo_0.5_1",
                 "ce_gppo_1_1", "ce_gppo_0.5_1_recipe", "ppo_clip_tm_recipe", "ce_gppo_0.5_1_u4", "ppo_clip_tm_u4",
                 "ce_gppo_0.5_1_u2", "ppo_clip_tm_u2"]

# The fourth study, on what sets CE-GPPO's stability at --preset merge-active (docs/study-protocol-stability.md):
# cells of learning rate x optimizer steps per rollout batch, each with (0.5, 1) beside its token-mean PPO-clip control;
# the reference cell (lr 2e-4, 8 steps) with (1, 1); the ratio-aware beta1 (a mechanism arm: weight beta1 d in the beta1
# region); and the official recipe's two parts apart (the positive-example NLL alone, the oversampling alone).
CELLS = {"lr1e-4": ["--lr", "1e-4"], "lr5e-5": ["--lr", "5e-5"],
         "u2_lr8e-4": ["--mini-batch-prompts", "4", "--lr", "8e-4"]}
CONFIGS.update({
    **{f"{name}_{cell}": CONFIGS[base] + more for cell, more in CELLS.items()
       for name, base in (("ce_gppo_0.5_1", "ce_gppo_0.5_1"), ("ppo_clip_tm", "ppo_clip"))},
    "ce_gppo_1_1_ratio": CONFIGS["ce_gppo_1_1"] + ["--beta1-weight", "ratio"],
    "ce_gppo_0.5_1_ratio": CONFIGS["ce_gppo_0.5_1"] + ["--beta1-weight", "ratio"],
    "ce_gppo_0.5_1_nll": CONFIGS["ce_gppo_0.5_1"] + RECIPE[:2],
    "ce_gppo_0.5_1_oversample": CONFIGS["ce_gppo_0.5_1"] + RECIPE[2:],
})
STABILITY_ARMS = ["ppo_clip_tm", "ce_gppo_0.5_1", "ce_gppo_1_1", "ppo_clip_tm_lr1e-4", "ce_gppo_0.5_1_lr1e-4",
                  "ppo_clip_tm_lr5e-5", "ce_gppo_0.5_1_lr5e-5", "ppo_clip_tm_u2_lr8e-4", "ce_gppo_0.5_1_u2_lr8e-4",
                  "ce_gppo_1_1_ratio", "ce_gppo_0.5_1_ratio", "ce_gppo_0.5_1_nll", "ce_gppo_0.5_1_oversample"]

# The fifth study, on where CE-GPPO is stable and what its betas do there (docs/study-protocol-depth.md): cells of
# optimizer steps per rollout batch x lr at --preset merge-active. `e2` is --ppo-epochs 2: the same mini-batches of one
# prompt in two passes against the sampling policy, so up to 16 optimizer steps per batch at the same step size. Cell A
# (8 steps, lr 1e-4) separates beta2 ((0, 1) - (0, 0)) from beta1 ((0.5, 1) - (0, 1)) and holds the benefit contrasts;
# B (16 steps, lr 1e-4) doubles the off-policy depth and the summed movement; C (16 steps, lr 5e-5) doubles the depth
# at A's summed movement; D (8 steps, lr 2e-4, the preset's lr) is the in-block reference that collapsed before.
DEPTH = {"e2_lr1e-4": ["--ppo-epochs", "2", "--lr", "1e-4"], "e2_lr5e-5": ["--ppo-epochs", "2", "--lr", "5e-5"]}
CONFIGS.update({
    "ce_gppo_0_1_lr1e-4": CONFIGS["ce_gppo_0_1"] + CELLS["lr1e-4"],
    "dapo_lr1e-4": CONFIGS["dapo"] + CELLS["lr1e-4"],
    "ce_gppo_0.5_1_ratio_lr1e-4": CONFIGS["ce_gppo_0.5_1_ratio"] + CELLS["lr1e-4"],
    **{f"{name}_{cell}": CONFIGS[name] + more for cell, more in DEPTH.items()
       for name in ("ppo_clip_tm", "ce_gppo_0.5_1", "dapo")},
})
DEPTH_CELLS = {  # cell -> (optimizer steps per batch, lr, its arms with the control first)
    "A": (8, 1e-4, ["ppo_clip_tm_lr1e-4", "ce_gppo_0_1_lr1e-4", "ce_gppo_0.5_1_lr1e-4", "dapo_lr1e-4",
                    "ce_gppo_0.5_1_ratio_lr1e-4"]),
    "B": (16, 1e-4, ["ppo_clip_tm_e2_lr1e-4", "ce_gppo_0.5_1_e2_lr1e-4", "dapo_e2_lr1e-4"]),
    "C": (16, 5e-5, ["ppo_clip_tm_e2_lr5e-5", "ce_gppo_0.5_1_e2_lr5e-5"]),
    "D": (8, 2e-4, ["ppo_clip_tm", "ce_gppo_0.5_1"]),
}
DEPTH_ARMS = [arm for _, _, arms in DEPTH_CELLS.values() for arm in arms]
DEPTH_SEEDS = {"all": list(range(30, 38)), "A only": list(range(38, 42))}  # every cell 30-37; cell A also 38-41

# What one step of staleness does (train.py --off-policy-steps 1, docs/training.md; tools/study_stale.py): CE-GPPO
# (0.5, 1) and its token-mean control at cell A's lr 1e-4, synchronous and one step stale. The stale arms sample ahead
# in the run's own process (--no-sampler-process: a sampler process's numbers, and one core per run, as the study pins).
STALE = ["--off-policy-steps", "1", "--no-sampler-process"]
CONFIGS.update({"ppo_clip_tm_lr1e-4_stale1": CONFIGS["ppo_clip_tm_lr1e-4"] + STALE,
                "ce_gppo_0.5_1_lr1e-4_stale1": CONFIGS["ce_gppo_0.5_1_lr1e-4"] + STALE})
STALE_PAIRS = {"token-mean PPO-clip": ("ppo_clip_tm_lr1e-4_stale1", "ppo_clip_tm_lr1e-4"),  # (stale, synchronous)
               "CE-GPPO (0.5, 1)": ("ce_gppo_0.5_1_lr1e-4_stale1", "ce_gppo_0.5_1_lr1e-4")}
STALE_ARMS = [arm for pair in STALE_PAIRS.values() for arm in reversed(pair)]

# What each tool runs unless told otherwise.
MECHANISM_DEFAULT = ["ppo_clip", "ppo_clip_repeat", "ce_gppo_0_1", "ce_gppo_0.5_1", "ce_gppo_1_1", "ce_gppo_1_0.5",
                     "ce_gppo_1_0", "gppo", "dapo", "entropy_0.001", "entropy_0.003"]
# The study's configurations (docs/study-protocol.md): the paper's Table 1 and entropy baselines, CE-GPPO's betas,
# and dynamic clipping; then the other entropy-control methods.
STUDY_DEFAULT = ["grpo", "dapo", "ppo_clip", "ce_gppo_0.5_1", "ce_gppo_0.75_1", "ce_gppo_1_0.5", "ce_gppo_0_1", "gppo",
                 "cispo", "gspo", "entropy_0.001", "entropy_0.003", "grpo_dyn_id", "grpo_dyn_did", "grpo_dyn_od"]
STUDY_SECONDARY = ["sapo", "clip_cov", "kl_cov", "top_entropy_0.2", "adaptive_entropy", "grpo_kl_0.04"]


def main(argv=None):
    """The command line: the named configurations' train.py flags (all, with none named), one per line."""
    from cegppo_utils import cli
    parser = cli.Parser("configs.py", description=__doc__)
    parser.add_argument("names", nargs="*", help="configurations to show (default: every one)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {cli.short(unknown)}; choose from {list(CONFIGS)}")
    for name in args.names or CONFIGS:
        print(f"{name}: {' '.join(CONFIGS[name]) or '(the preset as it is)'}")


if __name__ == "__main__":
    main()
