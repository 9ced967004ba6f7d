"""The CE-GPPO training loop.

    python train.py --preset tiny                      # offline CPU default: tiny model, arithmetic task
    python train.py --preset r1-distill-1.5b           # the official 1.5B script's settings (GPU)
    python train.py --preset tiny --algo grpo --max-steps 60 --output-dir runs/grpo
    torchrun --nproc-per-node=8 train.py --preset r1-distill-7b   # FSDP2 over 8 GPUs, one vLLM engine per rank

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
step, appended), checkpoints/step_NNNNNN (torch.distributed.checkpoint, atomic), final/ (HF format).
Under torchrun each rank samples and trains on its share of the groups; counts are all-reduced so the update
is the one a single process would make (see the Distributed section).
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

import loss as L
from rollout import world_size  # 1 without torchrun


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


# torchrun's own parser (Python <= 3.11) takes `--n` after the script name for an abbreviation of its flags
# and stops; `--group-size` passes through.
ALIASES = {"n": ["--group-size"]}


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
            parser.add_argument(flag, *ALIASES.get(f.name, []), dest=f.name, type=_parser_type(f), default=None, help=help_text)
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
# Distributed: under torchrun, FSDP2 shards parameters, gradients and optimizer state over the ranks and
# each rank samples its share of the prompts with its own engine. Without torchrun these are no-ops.
# ---------------------------------------------------------------------------------------------

def init_distributed():
    """-> (rank, world_size, device). torchrun sets WORLD_SIZE, RANK and LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), world, device


def this_rank():
    return dist.get_rank() if world_size() > 1 else 0


def is_main():
    return this_rank() == 0


def barrier():
    if world_size() > 1:
        dist.barrier()


def all_reduce(values, device, op="sum"):
    """Sum (or max/min) a list of numbers over the ranks; returns floats."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.tolist()


def gather_groups(local, device):
    """Per-group tensors [G_local, ...] from each rank -> [G_local * world, ...] in the global batch order
    (rank r holds global groups r, r + world, r + 2 world, ...)."""
    if world_size() == 1:
        return local
    parts = [torch.empty_like(local, device=device) for _ in range(world_size())]
    dist.all_gather(parts, local.to(device))
    return torch.stack(parts, dim=1).flatten(0, 1).cpu()


def shard_model(model, precision):
    """FSDP2: each decoder layer is one unit (gathered for its forward/backward, then freed), the root holds the
    embeddings and LM head. Gradients are summed, not averaged, over ranks: each rank's loss is already its share
    of the global token mean."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None, reduce_dtype=torch.float32)
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return model


def full_named_parameters(model):
    """(name, full tensor) pairs for the weight sync; FSDP2 shards are all-gathered one parameter at a time."""
    from torch.distributed.tensor import DTensor
    for name, p in model.named_parameters():
        yield name, (p.full_tensor() if isinstance(p, DTensor) else p)


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

# torch.distributed.checkpoint warns on every single-process save/load that it assumes a single process: it is one.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def checkpoint_dirs(output_dir):
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("step_") and "." not in d)


def write_folder_atomically(path, write):
    """write(tmp) fills a temporary folder (every rank writes its part), which rank 0 then renames over `path`:
    readers see the old folder or the complete new one, never a half-written one."""
    tmp, old = path + ".tmp", path + ".old"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    write(tmp)
    barrier()
    if is_main():
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return path


def save_checkpoint(args, step, model, tokenizer, optimizer, scheduler, stream, loop_state):
    """Model and optimizer through torch.distributed.checkpoint (each rank writes its shards; a checkpoint loads
    at any world size, 1 included), the rest in trainer_state.pt. final/ is the HF-format policy."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    model_state, optimizer_state = get_state_dict(model, optimizer)

    def write(folder):
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder, no_dist=world_size() == 1)
        if is_main():
            model.config.save_pretrained(folder)
            model.generation_config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            torch.save({
                "step": step, "scheduler": scheduler.state_dict(), "rng": rng, "data": stream.state(),
                "loop": loop_state, "args": dataclasses.asdict(args), "world_size": world_size(),
            }, os.path.join(folder, "trainer_state.pt"))

    path = write_folder_atomically(os.path.join(args.output_dir, "checkpoints", f"step_{step:06d}"), write)
    if is_main():
        for stale in checkpoint_dirs(args.output_dir)[:-args.keep_checkpoints]:
            shutil.rmtree(stale, ignore_errors=True)
    return path


def load_checkpoint(folder, model, optimizer):
    """Loads a save_checkpoint folder into the (possibly sharded) model and optimizer; returns trainer_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder, no_dist=world_size() == 1)  # reshards to this run's world size
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=False)


def export_hf(checkpoint_dir, out_dir):
    """A checkpoint's policy in HF format (for evaluate.py or vLLM), in one process whatever world size wrote it:
    python -c "import train; train.export_hf('runs/tiny/checkpoints/step_000050', 'runs/tiny/step_50')" """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint_dir), dtype=torch.float32)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)  # the model part only; the optimizer stays on disk
    set_model_state_dict(model, state["model"])
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(checkpoint_dir).save_pretrained(out_dir)
    return out_dir


def save_final(args, model, tokenizer):
    """The policy in HF format (gathered from the shards onto rank 0), ready for evaluate.py and vLLM."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write(folder):
        if is_main():
            model.save_pretrained(folder, state_dict=full)
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

    rank, world, device = init_distributed()
    if args.gen_prompts % world:
        raise SystemExit(f"--gen-prompts ({args.gen_prompts}) must be a multiple of the number of ranks ({world})")
    log = print if is_main() else (lambda *a, **k: None)
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    resume_from = None
    if args.resume:
        found = checkpoint_dirs(args.output_dir)
        if not found:
            raise SystemExit(f"--resume: no checkpoint in {args.output_dir}/checkpoints")
        resume_from = found[-1]
    elif os.path.exists(metrics_path):
        raise SystemExit(f"{metrics_path} exists: pass --resume to continue that run, or choose another --output-dir")
    barrier()  # every rank has checked before rank 0 creates anything
    if is_main():
        os.makedirs(args.output_dir, exist_ok=True)

    model_path = args.model
    if model_path == "tiny":
        import tiny
        if is_main():  # built once, by rank 0; the others then find it cached
            tiny.ensure_tiny_model()
        barrier()
        model_path = tiny.ensure_tiny_model()
    rows = load_rows(args.train_data, seed=args.seed)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = shard_model(model, args.precision) if world > 1 else model.to(device)
    model.train()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps) if args.warmup_steps else 1.0)
    stream = PromptStream(rows, args.seed)
    loop_state = {"od_state": 0, "initial_entropy": None}
    start_step = 0
    if resume_from:
        state = load_checkpoint(resume_from, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        stream.restore(state["data"])
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available() and world == 1:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        loop_state, start_step = state["loop"], state["step"]
        if is_main():
            discard_metrics_after(metrics_path, start_step)
        log(f"resumed from {resume_from} at step {start_step} (saved by {state.get('world_size', 1)} rank(s), now {world})")

    sampler = rollout.make_sampler(
        args.sampler, model_path, model=model, tokenizer=tokenizer,
        **({} if args.sampler == "hf" else dict(
            dtype="float32" if args.precision == "fp32" else "bfloat16", seed=args.seed + rank,
            max_model_len=args.max_prompt_len + args.max_response_len,
            gpu_memory_utilization=args.gpu_memory_utilization)),
    )
    log(f"sampler: {type(sampler).__name__}; device: {device}; ranks: {world}; model: {model_path}; {len(rows)} training rows")
    eval_rows = _eval_rows(args)
    loggers = _loggers(args) if is_main() else []
    dynamic_clip = L.DynamicClip(schedule=args.dynamic_clip) if args.dynamic_clip != "none" else None

    bar = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps, desc="train",
               dynamic_ncols=True, disable=not is_main())
    for step in bar:
        t0 = time.perf_counter()
        # 1. rollout, from the current weights. Every rank draws the same global batch and samples the groups
        # rank, rank + world, ...; seeded per step (and rank) so a resumed run samples what a straight run would.
        sampler.wake_up()
        sampler.load_weights(full_named_parameters(model))
        batch = stream.next_batch(args.gen_prompts)
        mine = batch[rank::world]
        sample_seed = (args.seed * 1_000_003 + step) * world + rank
        torch.manual_seed(sample_seed)
        groups = rollout.sample(sampler, tokenizer, [r["prompt"] for r in mine], n=args.n,
                                temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_response_len,
                                max_prompt_len=args.max_prompt_len, seed=sample_seed, progress=False)
        sampler.sleep()
        t1 = time.perf_counter()
        # 2. rewards, for this rank's groups; then every rank sees the whole batch's rewards
        texts = [c.text for g in groups for c in g]
        answers = [r["answer"] for r in mine for _ in range(args.n)]
        scores, reward_stats = reward.score_batch(texts, answers, return_stats=True)
        local = torch.tensor([[[s, len(c.token_ids), c.finished] for s, c in zip(scores[i * args.n:(i + 1) * args.n], g)]
                              for i, g in enumerate(groups)], dtype=torch.float32)
        global_ = gather_groups(local, device)  # [gen_prompts, n, (reward, length, finished)]
        rewards, lengths, finished = global_.unbind(-1)
        correct = rewards == reward.CORRECT_REWARD
        timeouts, parse_failures = all_reduce([reward_stats["timeouts"], reward_stats["no_answer"]], device)
        t2 = time.perf_counter()
        # 3-4. dynamic sampling (on global statistics, same decision on every rank), then advantages
        acc_std = correct.float().std(dim=1)
        keep = [i for i in range(len(batch)) if acc_std[i] > 0 or not args.dynamic_sampling][:args.train_prompts]
        advantages = L.group_advantages(rewards[keep].flatten(), args.n, scale_by_std=args.scale_adv_by_std).view(len(keep), args.n) if keep else None
        # mini-batches of kept groups in global order; each rank trains on the groups it sampled (i % world == rank)
        mini_batches = []
        for start in range(0, len(keep), args.mini_batch_prompts):
            chunk = [(k, i) for k, i in enumerate(keep[start:start + args.mini_batch_prompts], start) if i % world == rank]
            prompt_ids = rollout.encode_prompts(tokenizer, [batch[i]["prompt"] for _, i in chunk]) if chunk else []
            mini_batches.append([{"prompt_ids": ids, "response_ids": groups[i // world][j].token_ids,
                                  "advantage": advantages[k, j].item(), "correct": bool(correct[i, j])}
                                 for ids, (k, i) in zip(prompt_ids, chunk) for j in range(args.n)])
        # 5-6. old log-probs, then mini-batch updates
        update = update_policy(args, model, optimizer, mini_batches, pad_id, device, step, dynamic_clip, loop_state) if keep else {}
        lr_used = optimizer.param_groups[0]["lr"]
        scheduler.step()
        t3 = time.perf_counter()

        row = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            "acc_mean": correct.float().mean().item(),
            **update,
            "lr": lr_used,
            "response_length_mean": lengths.mean().item(),
            "response_length_max": int(lengths.max().item()),
            "truncated_frac": (finished == 0).float().mean().item(),
            "kept_group_frac": len(keep) / len(batch),
            "reward_timeouts": int(timeouts),
            "reward_parse_failures": int(parse_failures),  # nothing extractable in the response
            "time_rollout_s": t1 - t0,
            "time_reward_s": t2 - t1,
            "time_update_s": t3 - t2,
            "tokens_per_s": lengths.sum().item() / (t3 - t0),
        }
        if dynamic_clip is not None and dynamic_clip.schedule == "od" and "entropy" in row:
            loop_state["initial_entropy"] = loop_state["initial_entropy"] or row["entropy"]
            loop_state["od_state"] = L.oscillatory_decay_state(loop_state["od_state"], row["entropy"], min(1.0, (step + 1) / args.max_steps),
                                                               loop_state["initial_entropy"], dynamic_clip)
            row["od_state"] = loop_state["od_state"]
        if eval_rows and args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.max_steps):
            row["eval_acc"] = evaluate_accuracy(args, sampler, model, tokenizer, eval_rows, step, device)
        if is_main():
            with open(metrics_path, "a") as f:  # append-only, one object per step, written by rank 0 only
                f.write(json.dumps(row) + "\n")
            for log_row in loggers:
                log_row(row)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['acc_mean']:.3f}",
                        ent=f"{row.get('entropy', float('nan')):.3f}", clip=f"{row.get('clip_frac_high_pos', 0):.3f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps:
            save_checkpoint(args, step + 1, model, tokenizer, optimizer, scheduler, stream, loop_state)
    final = save_final(args, model, tokenizer)
    log(f"done: metrics in {metrics_path}, final policy in {final}")
    if world > 1:
        sampler.close()  # vLLM's teardown destroys its groups, and with external_launcher the default one too
        if dist.is_initialized():
            dist.destroy_process_group()


def padding_micro_batch(pad_id, device):
    """A one-token micro-batch with an empty response mask: it adds nothing to the loss or the gradient, and
    keeps a rank with fewer sequences running the same forward/backward passes (FSDP's collectives) as the rest."""
    mb = collate([{"prompt_ids": [pad_id], "response_ids": [pad_id], "advantage": 0.0, "correct": False}], pad_id, device)
    mb["response_mask"].zero_()
    return mb


def update_policy(args, model, optimizer, mini_batches, pad_id, device, step, dynamic_clip, loop_state):
    """Old log-probs, then one optimizer step per mini-batch with exact token-mean accumulation.

    mini_batches: for each mini-batch, this rank's sequences (a rank may have none). The token and sequence
    counts are all-reduced, so each rank's loss is its share of the global mean and the summed gradients are
    those of one process holding the whole mini-batch.

    Two savings that leave the update unchanged:
    - A sequence with zero advantage gets no gradient from any of the objectives (each term is proportional to
      A), so unless the positive-example LM term is on, it counts in the token mean but is not run. (Only seen
      with --no-dynamic-sampling: a kept group always has non-zero advantages.) Update metrics and entropy are
      over the sequences that are run.
    - The first mini-batch is trained on the weights that sampled it, so its old log-probs are its current ones,
      detached: no separate forward for it (none at all when a step has one mini-batch).
    """
    run = [[s for s in m if s["advantage"] != 0 or args.positive_lm_coef] for m in mini_batches]
    micro = [[collate(m[j:j + args.micro_batch_size], pad_id, device) for j in range(0, len(m), args.micro_batch_size)]
             for m in run]
    most = all_reduce([max(1, len(mbs)) for mbs in micro], device, op="max")  # >= 1: zero gradients, not none
    micro = [mbs + [padding_micro_batch(pad_id, device) for _ in range(int(k) - len(mbs))] for mbs, k in zip(micro, most)]
    entropy_sum, token_total = 0.0, 0.0
    with torch.no_grad():  # 5. old log-probs: the policy that sampled (up to sampler numerics)
        for mbs in micro[1:]:
            for mb in mbs:
                mb["old_logp"], mb["old_entropy"] = response_logprobs(model, mb, args.temperature, args.precision, True)
                entropy_sum += (mb["old_entropy"] * mb["response_mask"]).sum().item()
                token_total += mb["response_mask"].sum().item()
    sums, grad_norms = {}, []
    progress = min(1.0, step / args.max_steps)
    for index, (mbs, seqs) in enumerate(zip(micro, mini_batches)):  # 6. one optimizer step per mini-batch
        num_tokens, num_seqs, num_correct_tokens = all_reduce([
            sum(len(s["response_ids"]) for s in seqs), len(seqs),
            sum(len(s["response_ids"]) for s in seqs if s["correct"])], device)
        bad_loss = None
        for mb in mbs:
            logp, entropy = response_logprobs(model, mb, args.temperature, args.precision, index == 0)
            if index == 0:  # no update yet since sampling: old = current
                mb["old_logp"], mb["old_entropy"] = logp.detach(), entropy
                entropy_sum += (entropy * mb["response_mask"]).sum().item()
                token_total += mb["response_mask"].sum().item()
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
            if bad_loss is None and not torch.isfinite(total):
                bad_loss = total.item()
            total.backward()
            sums["pg_loss"] = sums.get("pg_loss", 0.0) + pg_loss.item()
            weight = (mb["response_mask"] > 0).sum().item()
            m.pop("num_tokens")
            for k, v in m.items():  # token-weighted, so the step's metric is the mean over all its tokens
                sums[k] = sums.get(k, 0.0) + v.item() * weight
        if all_reduce([bad_loss is not None], device, op="max")[0]:  # every rank stops, not just the one that saw it
            raise FloatingPointError(f"step {step + 1}: the loss is {bad_loss if bad_loss is not None else 'not finite on another rank'}; "
                                     "stopping (the last checkpoint is intact)")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"step {step + 1}: the gradient norm is {grad_norm.item()}; stopping (the last checkpoint is intact)")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    keys = sorted(sums)
    sums = dict(zip(keys, all_reduce([sums[k] for k in keys], device)))
    entropy_sum, token_total = all_reduce([entropy_sum, token_total], device)
    out = {k: (v / max(token_total, 1) if k not in ("pg_loss", "positive_lm_loss") else v / len(micro)) for k, v in sums.items()}
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
def evaluate_accuracy(args, sampler, model, tokenizer, rows, step, device, n=4):
    """Held-out avg@4 at the official validation sampling (temperature 0.6, top_p 0.95), through evaluate.py;
    under torchrun each rank evaluates every world-th problem."""
    import evaluate
    mine = rows[this_rank()::world_size()]
    sampler.wake_up()
    sampler.load_weights(full_named_parameters(model))
    result = evaluate.evaluate(sampler, tokenizer, mine, k=n, temperature=0.6, top_p=0.95,
                               max_tokens=args.max_response_len, seed=args.seed * 1_000_003 + step + 500_000,
                               progress=False)
    sampler.sleep()
    correct, count = all_reduce([result["avg@k"] * len(mine), len(mine)], device)
    return correct / count


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
