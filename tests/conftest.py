# Shares the tiny model and vLLM engines between tests, and runs train.py's stages the way its main does. The
# repository root is on the import path through pyproject.toml (pytest's `pythonpath`).
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`) each worker, and each script it starts, computes on one thread: the tiny model's
    work is too small to gain from a second thread, and two workers with two threads each would fight over the
    cores. Set before torch is imported, which reads it once."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def tiny_model_path():
    """The warm-started tiny model, built once into .cache/ (about 1.5 min on 2 AMD EPYC cores) and reused. One
    worker builds it on every core, as train.py would, while the others wait on its lock (tiny.py), then find it
    built."""
    import torch

    from cegppo_utils import tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        return tiny.ensure_tiny_model()
    finally:
        torch.set_num_threads(threads)


def few_problems(folder, count=4):
    """A held-out file of `count` arith-like problems: evaluations that test bookkeeping, not the benchmark's size."""
    path = folder / f"few-{count}.jsonl"
    path.write_text("".join(json.dumps({"problem": f"Compute {a} + {a + 1}.", "answer": str(2 * a + 1)}) + "\n"
                            for a in range(1, count + 1)))
    return path


def vllm_or_skip():
    """Import vllm, or skip; under REQUIRE_VLLM=1 (CI) a missing vllm fails instead of skipping."""
    import rollout
    if rollout.vllm_available():
        return
    if os.environ.get("REQUIRE_VLLM") == "1":
        pytest.fail("REQUIRE_VLLM=1 but vllm does not import")
    pytest.skip("vllm is not installed")


def small_engine(model_path, tokenizer, dtype="float32"):
    """A vLLM engine for a test, small enough that several fit side by side on one GPU beside a training run: a
    tenth of its memory and no sleep mode (vLLM allows one sleep-mode memory pool per process). Close it after use."""
    import rollout
    vllm_or_skip()
    return rollout.make_sampler("vllm", model_path, tokenizer=tokenizer, dtype=dtype, max_model_len=256,
                                gpu_memory_utilization=0.1, enable_sleep_mode=False)


def close_engine(engine):
    """Shut a test's engine down and give its GPU memory back before the next test's."""
    import gc

    import torch
    engine.close()
    del engine.llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_train_args(argv):
    """train.py's command line as train.run parses it."""
    import train
    from cegppo_utils import flags
    return flags.parse_args(argv, train.__doc__)


def train_update(policy, seq_lists, cfg, **kw):
    """train.py's stages 5 and 6 on mini-batches of sequences, as main runs them."""
    import train
    minis = train.make_mini_batches(policy, seq_lists, cfg)
    train.old_logprobs(policy, minis)
    return train.update_policy(policy, minis, cfg, **kw)
