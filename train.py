"""train.py — the CE-GPPO training loop (not built yet: issue 5).

Will hold: generate prompts x n responses (rollout.py) -> score (reward.py) -> dynamic sampling ->
GRPO advantages -> old log-probs -> mini-batch / micro-batch updates with loss.policy_loss ->
AdamW with warm-up -> weight sync -> metrics.jsonl and atomic checkpoints; presets `tiny`
(offline CPU default), `r1-distill-1.5b`, `r1-distill-7b`.
"""

if __name__ == "__main__":
    raise SystemExit("train.py is not built yet (issue 5); loss.py holds the objective today.")
