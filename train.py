"""The CE-GPPO training loop.

    python train.py --preset tiny                      # offline CPU default: tiny model, arithmetic task
    python train.py --preset r1-distill-1.5b           # the official 1.5B script's settings (GPU)
    python train.py --preset tiny --algo grpo --max-steps 60 --output-dir runs/grpo

One step (FACTS §1, official scripts):
  1. sample n responses for each of `gen_prompts` prompts                          rollout.py
  2. score them, +1 correct / -1 otherwise                                          reward.py
  3. dynamic sampling: drop groups whose accuracy has zero variance; keep at most `train_prompts`
  4. GRPO advantages (r - mean) / (std + 1e-6) per group                            loss.group_advantages
  5. old log-probs (and entropy) from the training model, no grad
  6. split the kept groups into mini-batches of `mini_batch_prompts` prompts; for each, accumulate
     micro-batches with the mini-batch's exact token count -> grad clip -> AdamW step
  7. LR schedule step (linear warm-up, then constant), weight sync into the sampler, log, checkpoint

Flags given after --preset override it. Outputs in --output-dir: metrics.jsonl (one JSON object per
step, appended), checkpoints/step_NNNNNN (atomic), final/ (HF format).
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, fields

import torch

import loss as L


@dataclass
class Args:
    # --- what to train
    model: str = "tiny"  # HF hub id or local path; "tiny" builds/reuses the project's warm-started tiny model
    train_data: str = "arith"  # hub dataset id, local .json/.jsonl/.parquet, or "arith" (the tiny task)
    # --- the objective (loss.py)
    algo: str = "ce_gppo"  # ce_gppo | gppo | grpo | dapo | cispo | gspo
    beta1: float = 0.5  # CE-GPPO gradient scale on the left boundary (d < 1-eps, A < 0); larger lowers entropy
    beta2: float = 1.0  # CE-GPPO gradient scale on the right boundary (d > 1+eps, A > 0); larger keeps entropy up
    eps_low: float | None = None  # lower clip range; None = the algorithm's default
    eps_high: float | None = None  # upper clip range; None = the algorithm's default
    clip_ratio_c: float = 10.0  # dual-clip bound for A < 0 (official scripts: 10); 0 disables
    loss_agg_mode: str | None = None  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm; None = algo default
    dynamic_clip: str = "none"  # none | id | did | od: probability-dependent clip schedule (arXiv 2602.09782)
    positive_lm_coef: float = 0.0  # weight of the NLL on correct responses (official scripts: 0.1; not in the paper)
    scale_adv_by_std: bool = True  # GRPO advantages; False = Dr. GRPO (r - mean)
    dynamic_sampling: bool = True  # drop groups whose accuracy has zero variance (official: on)
    # --- optimiser
    lr: float = 1e-6  # AdamW learning rate, constant after warm-up
    warmup_steps: int = 10  # linear warm-up, in training steps
    weight_decay: float = 0.1  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm
    # --- batch sizes
    gen_prompts: int = 256  # prompts sampled per step
    train_prompts: int = 128  # at most this many kept groups are trained on per step
    mini_batch_prompts: int = 16  # prompts per optimizer step (train_prompts / this = optimizer steps per step)
    micro_batch_size: int = 8  # sequences per forward/backward; gradients accumulate over micro-batches
    n: int = 8  # responses per prompt
    # --- sampling
    temperature: float = 1.0  # rollout temperature; log-probs use the same temperature
    top_p: float = 1.0  # rollout nucleus sampling
    max_prompt_len: int = 4096  # longer prompts are an error
    max_response_len: int = 16384  # responses are truncated here
    sampler: str = "auto"  # auto | vllm | hf
    gpu_memory_utilization: float = 0.5  # share of GPU memory for vLLM (the rest is for training)
    # --- system
    precision: str = "bf16"  # bf16 (autocast, fp32 master weights) | fp32
    gradient_checkpointing: bool = False  # recompute activations in backward to save memory
    seed: int = 0  # seeds data order, sampling and initialisation
    output_dir: str = "runs/tiny"  # metrics.jsonl, checkpoints/, final/
    max_steps: int = 1000  # training steps
    resume: bool = False  # continue from the latest checkpoint in output_dir
    save_every: int = 50  # checkpoint every N steps (and at the end)
    keep_checkpoints: int = 2  # how many checkpoints to keep
    eval_every: int = 0  # held-out accuracy every N steps (0 = never); needs an eval split (tiny task)
    tensorboard: bool = False  # also log to tensorboard (needs the tensorboard package)
    wandb: bool = False  # also log to Weights & Biases (needs wandb)


PRESETS = {
    # The offline CPU default: ~5 minutes on 2 cores, no downloads. Larger lr than the paper's (a 3M-parameter
    # model), and up to 8 mini-batches per step so ratios leave the clip interval and CE-GPPO's terms act.
    "tiny": dict(
        model="tiny", train_data="arith", lr=1e-4, warmup_steps=0, weight_decay=0.0,
        gen_prompts=32, train_prompts=32, mini_batch_prompts=4, micro_batch_size=32, n=8,
        max_prompt_len=64, max_response_len=48, precision="fp32", output_dir="runs/tiny",
        max_steps=100, save_every=25, eval_every=25,
    ),
    # Official CE-GPPO script for DeepSeek-R1-Distill-Qwen-1.5B (FACTS §1). Code vs paper text:
    # dual clip c=10 and the 0.1 positive-example LM loss are in the code, not the paper; the token mean is
    # exact here (the official code approximates it per micro-batch).
    "r1-distill-1.5b": dict(
        model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", train_data="Kwai-Klear/KlearReasoner-MathSub-30K",
        algo="ce_gppo", beta1=0.5, beta2=1.0, eps_low=0.2, eps_high=0.2, clip_ratio_c=10.0,
        loss_agg_mode="token-mean", positive_lm_coef=0.1, dynamic_sampling=True,
        lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0,
        gen_prompts=256, train_prompts=128, mini_batch_prompts=16, micro_batch_size=4, n=8,
        temperature=1.0, top_p=1.0, max_prompt_len=4096, max_response_len=16384,
        precision="bf16", gradient_checkpointing=True, output_dir="runs/r1-distill-1.5b",
        max_steps=1000, save_every=50,
    ),
}
# The 7B script differs only in beta1 (and its validation length).
PRESETS["r1-distill-7b"] = {**PRESETS["r1-distill-1.5b"], "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
                            "beta1": 0.75, "micro_batch_size": 2, "output_dir": "runs/r1-distill-7b"}


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------

def _field_docs():
    """One-line docs of Args, read from the comments beside each field."""
    import inspect
    docs = {}
    for line in inspect.getsource(Args).splitlines():
        line = line.strip()
        if ":" in line and "#" in line and not line.startswith("#"):
            docs[line.split(":")[0]] = line.split("#", 1)[1].strip()
    return docs


def parse_args(argv=None) -> Args:
    docs = _field_docs()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)}; flags after it override it")
    for f in fields(Args):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{docs.get(f.name, '')} (default: {f.default})"
        if f.type is bool or f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=_parser_type(f), default=None, help=help_text)
    ns = parser.parse_args(argv)
    if ns.preset not in PRESETS:
        parser.error(f"unknown preset {ns.preset!r}; choose one of {sorted(PRESETS)}")
    values = {**PRESETS[ns.preset], **{k: v for k, v in vars(ns).items() if v is not None and k != "preset"}}
    args = Args(**values)
    problems = validate(args)
    if problems:
        parser.error("; ".join(problems))
    return args


def _parser_type(f):
    base = {"float | None": float, "int | None": int, "str | None": str}.get(str(f.type), f.type)
    base = {float | None: float, int | None: int, str | None: str}.get(base, base)

    def convert(text):
        if text.lower() == "none" and "None" in str(f.type):
            return None
        return base(text)
    convert.__name__ = getattr(base, "__name__", "value")
    return convert


def validate(a: Args) -> list[str]:
    """Out-of-range values, rejected before anything is loaded."""
    problems = []
    if a.algo not in L.ALGORITHMS:
        problems.append(f"--algo must be one of {sorted(L.ALGORITHMS)}, got {a.algo!r}")
    for name in ("eps_low", "eps_high"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            problems.append(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    for name in ("beta1", "beta2", "positive_lm_coef", "weight_decay", "clip_ratio_c"):
        if getattr(a, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    for name in ("lr", "grad_clip", "temperature", "gen_prompts", "train_prompts", "mini_batch_prompts",
                 "micro_batch_size", "max_prompt_len", "max_response_len", "max_steps", "save_every", "keep_checkpoints"):
        if getattr(a, name) <= 0:
            problems.append(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if a.n < 2:
        problems.append(f"--n must be >= 2 (group-relative advantages need a group), got {a.n}")
    if not 0 < a.top_p <= 1:
        problems.append(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.train_prompts > a.gen_prompts:
        problems.append(f"--train-prompts ({a.train_prompts}) cannot exceed --gen-prompts ({a.gen_prompts})")
    if a.mini_batch_prompts > 0 and a.train_prompts % a.mini_batch_prompts:
        problems.append(f"--train-prompts ({a.train_prompts}) must be a multiple of --mini-batch-prompts ({a.mini_batch_prompts})")
    if a.micro_batch_size > 0 and (a.mini_batch_prompts * a.n) % a.micro_batch_size:
        problems.append(f"--micro-batch-size ({a.micro_batch_size}) must divide mini-batch-prompts x n = {a.mini_batch_prompts * a.n}")
    if a.dynamic_clip not in ("none",) + L.DYNAMIC_SCHEDULES:
        problems.append(f"--dynamic-clip must be one of {('none',) + L.DYNAMIC_SCHEDULES}, got {a.dynamic_clip!r}")
    elif a.dynamic_clip != "none" and a.algo in L.ALGORITHMS and not L.ALGORITHMS[a.algo].dynamic_clip:
        problems.append(f"--dynamic-clip does not apply to --algo {a.algo}")
    if a.loss_agg_mode is not None and a.loss_agg_mode not in L.LOSS_AGG_MODES:
        problems.append(f"--loss-agg-mode must be one of {L.LOSS_AGG_MODES}, got {a.loss_agg_mode!r}")
    if a.precision not in ("bf16", "fp32"):
        problems.append(f"--precision must be bf16 or fp32, got {a.precision!r}")
    if a.sampler not in ("auto", "vllm", "hf"):
        problems.append(f"--sampler must be auto, vllm or hf, got {a.sampler!r}")
    if a.warmup_steps < 0 or a.eval_every < 0:
        problems.append("--warmup-steps and --eval-every must be >= 0")
    if a.clip_ratio_c and a.clip_ratio_c <= 1 + (a.eps_high or 0.28):
        problems.append(f"--clip-ratio-c must exceed 1 + eps_high (or be 0 to disable), got {a.clip_ratio_c}")
    return problems


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

def load_rows(source: str, seed: int = 0) -> list[dict]:
    """Rows {"prompt": chat messages, "answer": gold} from a hub id, a local file, or the tiny task.

    Accepts the KlearReasoner format (`prompt` = [{"role": "user", "content": ...}], `reward_model.ground_truth`)
    and plain `problem` / `answer` columns. A row without a question or an answer is an error naming it.
    """
    if source == "arith":
        import tiny
        raw = tiny.arithmetic_split("train", 4096, seed=seed)
    else:
        import datasets
        if os.path.exists(source):
            ext = os.path.splitext(source)[1].lower()
            kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(ext)
            if kind is None:
                raise ValueError(f"{source}: unsupported file type {ext!r}; use .json, .jsonl or .parquet")
            raw = datasets.load_dataset(kind, data_files=source, split="train")
        else:
            raw = datasets.load_dataset(source, split="train")
    rows = [_normalise_row(r, source, i) for i, r in enumerate(raw)]
    if not rows:
        raise ValueError(f"{source}: no rows")
    return rows


def _normalise_row(row: dict, source: str, index: int) -> dict:
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        messages = [{"role": m.get("role"), "content": m.get("content")} for m in prompt]
        if not all(m["role"] and isinstance(m["content"], str) and m["content"].strip() for m in messages):
            raise ValueError(f"{source}: row {index}: `prompt` messages need a role and non-empty content")
    else:
        question = row.get("problem") or row.get("question") or (prompt if isinstance(prompt, str) else None)
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{source}: row {index} has no question (expected `prompt` messages or a `problem` column)")
        messages = [{"role": "user", "content": question}]
    answer = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
    if answer is None:
        answer = row.get("answer")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise ValueError(f"{source}: row {index} has no answer (expected `reward_model.ground_truth` or an `answer` column)")
    return {"prompt": messages, "answer": answer}


class PromptStream:
    """Endless shuffled passes over the rows; `position` (epoch, index) is checkpointed for exact resume."""

    def __init__(self, rows, seed):
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self):
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def next_batch(self, size):
        batch = []
        while len(batch) < size:
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.rows[self._order[self.index]])
            self.index += 1
        return batch

    def state(self):
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state):
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation()


# ---------------------------------------------------------------------------------------------
# Batches: left-padded prompts, right-padded responses, so logits[:, P-1 : P+R-1] predict the responses
# ---------------------------------------------------------------------------------------------

def collate(seqs, pad_id, device):
    """seqs: dicts with prompt_ids, response_ids (+ per-sequence scalars). Returns tensors for one micro-batch."""
    P = max(len(s["prompt_ids"]) for s in seqs)
    R = max(len(s["response_ids"]) for s in seqs)
    input_ids = torch.full((len(seqs), P + R), pad_id, dtype=torch.long)
    attention = torch.zeros(len(seqs), P + R, dtype=torch.long)
    for i, s in enumerate(seqs):
        p, r = s["prompt_ids"], s["response_ids"]
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(r)] = torch.tensor(r)
        attention[i, P - len(p):P + len(r)] = 1
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": attention.to(device),
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0).to(device),
        "response_ids": input_ids[:, P:].to(device),
        "response_mask": attention[:, P:].float().to(device),
        "advantages": torch.tensor([s["advantage"] for s in seqs], dtype=torch.float32, device=device).unsqueeze(-1),
        "correct": torch.tensor([s["correct"] for s in seqs], dtype=torch.bool, device=device),
    }


def response_logprobs(model, mb, temperature, precision, with_entropy):
    """Log-probs (and entropy) of the response tokens under softmax(logits / temperature)."""
    R = mb["response_ids"].shape[1]
    with torch.autocast(mb["input_ids"].device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"],
                       logits_to_keep=R + 1, use_cache=False).logits
    return L.token_logprobs_and_entropy(logits[:, :-1], mb["response_ids"], temperature=temperature, with_entropy=with_entropy)


# ---------------------------------------------------------------------------------------------
# Checkpoints: written to a temporary folder, then renamed into place
# ---------------------------------------------------------------------------------------------

def checkpoint_dirs(output_dir):
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("step_") and "." not in d)


def write_folder_atomically(path, write):
    """write(tmp) fills a temporary folder, which then replaces `path` by rename: readers see the old folder or
    the complete new one, never a half-written one."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def save_checkpoint(args, step, model, tokenizer, optimizer, scheduler, stream, loop_state):
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()

    def write(folder):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        torch.save({
            "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng,
            "data": stream.state(), "loop": loop_state, "args": dataclasses.asdict(args),
        }, os.path.join(folder, "trainer_state.pt"))

    path = write_folder_atomically(os.path.join(args.output_dir, "checkpoints", f"step_{step:06d}"), write)
    for stale in checkpoint_dirs(args.output_dir)[:-args.keep_checkpoints]:
        shutil.rmtree(stale, ignore_errors=True)
    return path


def save_final(args, model, tokenizer):
    def write(folder):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return write_folder_atomically(os.path.join(args.output_dir, "final"), write)


def discard_metrics_after(metrics_path, step):
    """On resume, rows logged after the checkpoint are redone: move them to metrics.discarded.jsonl."""
    if not os.path.exists(metrics_path):
        return
    with open(metrics_path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    if len(keep) == len(lines):
        return
    with open(metrics_path.replace(".jsonl", ".discarded.jsonl"), "a") as f:
        f.writelines(line for line in lines if json.loads(line)["step"] > step)
    tmp = metrics_path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, metrics_path)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

def main(args: Args):
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import reward
    import rollout

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.output_dir, exist_ok=True)
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    resume_from = None
    if args.resume:
        found = checkpoint_dirs(args.output_dir)
        if not found:
            raise SystemExit(f"--resume: no checkpoint in {args.output_dir}/checkpoints")
        resume_from = found[-1]
    elif os.path.exists(metrics_path):
        raise SystemExit(f"{metrics_path} exists: pass --resume to continue that run, or choose another --output-dir")

    model_path = args.model
    if model_path == "tiny":
        import tiny
        model_path = tiny.ensure_tiny_model()
    rows = load_rows(args.train_data, seed=args.seed)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(resume_from or model_path, dtype=torch.float32).to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0)
    stream = PromptStream(rows, args.seed)
    loop_state = {"od_state": 0, "initial_entropy": None}
    start_step = 0
    if resume_from:
        state = torch.load(os.path.join(resume_from, "trainer_state.pt"), weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        stream.restore(state["data"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        loop_state, start_step = state["loop"], state["step"]
        discard_metrics_after(metrics_path, start_step)
        print(f"resumed from {resume_from} at step {start_step}")

    sampler = rollout.make_sampler(
        args.sampler, model_path, model=model, tokenizer=tokenizer,
        **({} if args.sampler == "hf" else dict(
            dtype="float32" if args.precision == "fp32" else "bfloat16", seed=args.seed,
            max_model_len=args.max_prompt_len + args.max_response_len,
            gpu_memory_utilization=args.gpu_memory_utilization)),
    )
    print(f"sampler: {type(sampler).__name__}; device: {device}; model: {model_path}; {len(rows)} training rows")
    eval_rows = _eval_rows(args)
    loggers = _loggers(args)
    dynamic_clip = L.DynamicClip(schedule=args.dynamic_clip) if args.dynamic_clip != "none" else None

    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps, desc="train", dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        # 1. rollout, from the current weights; seeded per step so a resumed run samples what a straight run would
        sampler.wake_up()
        sampler.load_weights(model.named_parameters())
        batch = stream.next_batch(args.gen_prompts)
        torch.manual_seed(args.seed * 1_000_003 + step)
        groups = rollout.sample(sampler, tokenizer, [r["prompt"] for r in batch], n=args.n,
                                temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_response_len,
                                max_prompt_len=args.max_prompt_len, seed=args.seed * 1_000_003 + step, progress=False)
        sampler.sleep()
        t1 = time.perf_counter()
        # 2. rewards
        texts = [c.text for g in groups for c in g]
        answers = [r["answer"] for r in batch for _ in range(args.n)]
        scores, reward_stats = reward.score_batch(texts, answers, return_stats=True)
        rewards = torch.tensor(scores, dtype=torch.float32).view(len(batch), args.n)
        correct = rewards == reward.CORRECT_REWARD
        t2 = time.perf_counter()
        # 3-4. dynamic sampling, then advantages
        acc_std = correct.float().std(dim=1)
        keep = [i for i in range(len(batch)) if acc_std[i] > 0 or not args.dynamic_sampling][:args.train_prompts]
        advantages = L.group_advantages(rewards[keep].flatten(), args.n, scale_by_std=args.scale_adv_by_std).view(len(keep), args.n) if keep else None
        prompt_ids = rollout.encode_prompts(tokenizer, [batch[i]["prompt"] for i in keep]) if keep else []
        seqs = [{"prompt_ids": prompt_ids[k], "response_ids": groups[i][j].token_ids,
                 "advantage": advantages[k, j].item(), "correct": bool(correct[i, j])}
                for k, i in enumerate(keep) for j in range(args.n)]
        # 5-6. old log-probs, then mini-batch updates
        update = update_policy(args, model, optimizer, seqs, pad_id, device, step, dynamic_clip, loop_state) if seqs else {}
        lr_used = optimizer.param_groups[0]["lr"]
        scheduler.step()
        t3 = time.perf_counter()

        lengths = [len(c.token_ids) for g in groups for c in g]
        row = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            "acc_mean": correct.float().mean().item(),
            **update,
            "lr": lr_used,
            "response_length_mean": sum(lengths) / len(lengths),
            "response_length_max": max(lengths),
            "truncated_frac": sum(not c.finished for g in groups for c in g) / len(lengths),
            "kept_group_frac": len(keep) / len(batch),
            "reward_timeouts": reward_stats["timeouts"],
            "reward_parse_failures": reward_stats["no_answer"],  # nothing extractable in the response
            "time_rollout_s": t1 - t0,
            "time_reward_s": t2 - t1,
            "time_update_s": t3 - t2,
            "tokens_per_s": sum(lengths) / (t3 - t0),
        }
        if dynamic_clip is not None and dynamic_clip.schedule == "od" and "entropy" in row:
            loop_state["initial_entropy"] = loop_state["initial_entropy"] or row["entropy"]
            loop_state["od_state"] = L.oscillatory_decay_state(loop_state["od_state"], row["entropy"], min(1.0, (step + 1) / args.max_steps),
                                                               loop_state["initial_entropy"], dynamic_clip)
            row["od_state"] = loop_state["od_state"]
        if eval_rows and args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.max_steps):
            row["eval_acc"] = evaluate_accuracy(args, sampler, model, tokenizer, eval_rows, step)
        with open(metrics_path, "a") as f:  # append-only, one object per step
            f.write(json.dumps(row) + "\n")
        for log in loggers:
            log(row)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['acc_mean']:.3f}",
                        ent=f"{row.get('entropy', float('nan')):.3f}", clip=f"{row.get('clip_frac_high_pos', 0):.3f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps:
            save_checkpoint(args, step + 1, model, tokenizer, optimizer, scheduler, stream, loop_state)
    final = save_final(args, model, tokenizer)
    print(f"done: metrics in {metrics_path}, final policy in {final}")


def update_policy(args, model, optimizer, seqs, pad_id, device, step, dynamic_clip, loop_state):
    """Old log-probs, then one optimizer step per mini-batch with exact token-mean accumulation."""
    per_mini = args.mini_batch_prompts * args.n
    minis = [seqs[i:i + per_mini] for i in range(0, len(seqs), per_mini)]
    micro = [[collate(m[j:j + args.micro_batch_size], pad_id, device) for j in range(0, len(m), args.micro_batch_size)]
             for m in minis]
    entropy_sum, token_total = 0.0, 0.0
    with torch.no_grad():  # 5. old log-probs: the policy that sampled (up to sampler numerics)
        for mbs in micro:
            for mb in mbs:
                mb["old_logp"], mb["old_entropy"] = response_logprobs(model, mb, args.temperature, args.precision, True)
                entropy_sum += (mb["old_entropy"] * mb["response_mask"]).sum().item()
                token_total += mb["response_mask"].sum().item()
    sums, grad_norms = {}, []
    progress = min(1.0, step / args.max_steps)
    for mbs in micro:  # 6. one optimizer step per mini-batch
        num_tokens = sum(mb["response_mask"].sum() for mb in mbs)
        num_seqs = sum(mb["response_mask"].shape[0] for mb in mbs)
        num_correct_tokens = sum((mb["response_mask"] * mb["correct"].unsqueeze(-1)).sum() for mb in mbs)
        for mb in mbs:
            logp, _ = response_logprobs(model, mb, args.temperature, args.precision, False)
            pg_loss, m = L.policy_loss(
                logp, mb["old_logp"], mb["advantages"], mb["response_mask"], algo=args.algo,
                eps_low=args.eps_low, eps_high=args.eps_high, beta1=args.beta1, beta2=args.beta2,
                clip_ratio_c=args.clip_ratio_c or None, loss_agg_mode=args.loss_agg_mode,
                num_tokens=num_tokens, num_seqs=num_seqs, norm_len=args.max_response_len,
                dynamic_clip=dynamic_clip, progress=progress, od_state=loop_state["od_state"], entropy=mb["old_entropy"])
            total = pg_loss
            if args.positive_lm_coef:
                lm = L.positive_example_lm_loss(logp, mb["response_mask"], mb["correct"], num_tokens=num_correct_tokens)
                total = total + args.positive_lm_coef * lm
                sums["positive_lm_loss"] = sums.get("positive_lm_loss", 0.0) + lm.item()
            if not torch.isfinite(total):
                raise FloatingPointError(f"step {step + 1}: the loss is {total.item()}; stopping (the last checkpoint is intact)")
            total.backward()
            sums["pg_loss"] = sums.get("pg_loss", 0.0) + pg_loss.item()
            weight = m.pop("num_tokens").item()
            for k, v in m.items():  # token-weighted, so the step's metric is the mean over all its tokens
                sums[k] = sums.get(k, 0.0) + v.item() * weight
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"step {step + 1}: the gradient norm is {grad_norm.item()}; stopping (the last checkpoint is intact)")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    out = {k: (v / token_total if k not in ("pg_loss", "positive_lm_loss") else v / len(micro)) for k, v in sums.items()}
    out["entropy"] = entropy_sum / max(token_total, 1)
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["optimizer_steps"] = len(micro)
    return out


def _eval_rows(args):
    """Held-out problems of the tiny task, in evaluate.py's form; None for other data."""
    if args.train_data != "arith":
        return None
    import tiny
    rows = tiny.arithmetic_split("test", 128, seed=args.seed)
    return [{"id": i, "question": r["problem"], "answer": r["answer"]} for i, r in enumerate(rows)]


@torch.no_grad()
def evaluate_accuracy(args, sampler, model, tokenizer, rows, step, n=4):
    """Held-out avg@4 at the official validation sampling (temperature 0.6, top_p 0.95), through evaluate.py."""
    import evaluate
    sampler.wake_up()
    sampler.load_weights(model.named_parameters())
    result = evaluate.evaluate(sampler, tokenizer, rows, k=n, temperature=0.6, top_p=0.95,
                               max_tokens=args.max_response_len, seed=args.seed * 1_000_003 + step + 500_000,
                               progress=False)
    sampler.sleep()
    return result["avg@k"]


def _loggers(args):
    loggers = []
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        writer = SummaryWriter(os.path.join(args.output_dir, "tensorboard"))
        loggers.append(lambda row: [writer.add_scalar(k, v, row["step"]) for k, v in row.items() if k != "step"])
    if args.wandb:
        import wandb
        wandb.init(project="ce-gppo", config=dataclasses.asdict(args), dir=args.output_dir)
        loggers.append(lambda row: wandb.log(row, step=row["step"]))
    return loggers


if __name__ == "__main__":
    try:
        main(parse_args())
    except FloatingPointError as e:
        sys.exit(f"train.py: {e}")
