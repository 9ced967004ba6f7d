# Lets tests import the top-level scripts (loss.py, ...) from the repository root, and shares the tiny model.
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def tiny_model_path():
    """The warm-started tiny model, built once into .cache/ (about a minute on 2 cores) and reused."""
    import tiny
    return tiny.ensure_tiny_model()


def vllm_or_skip():
    """Import vllm, or skip; under REQUIRE_VLLM=1 (CI) a missing vllm fails instead of skipping."""
    import rollout
    if rollout.vllm_available():
        return
    if os.environ.get("REQUIRE_VLLM") == "1":
        pytest.fail("REQUIRE_VLLM=1 but vllm does not import")
    pytest.skip("vllm is not installed")
