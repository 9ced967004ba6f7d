"""Which model a `--model` name means, for train.py and evaluate.py alike: a local HF folder, a run's checkpoint
folder (verified, and its policy exported once to HF format in its hf/ folder, or in the export cache where the
checkpoint cannot be written: runfolder.exported), a hub id, or the project's offline tiny model ("tiny",
"tiny:<task>"), built once and cached by tiny.py. A leading ~ is the home folder."""

import inspect
import os

from cegppo_utils import data
from cegppo_utils import distributed as D
from cegppo_utils import runfolder as RF
from cegppo_utils.data import UserError


def resolve_model(name: str) -> str:
    """A local folder or a hub id as it is; "tiny" (or "tiny:<task>") -> the warm-started offline model, built once."""
    name = os.path.expanduser(name)
    if name == "tiny" or name.startswith("tiny:"):
        from cegppo_utils import tiny
        task = name.partition(":")[2] or "arith"
        if task not in tiny.TASKS:
            raise UserError(f"--model {name}: no offline task {task!r}; choose from {sorted(tiny.TASKS)}")
        if D.is_main():  # built once, by rank 0; the others then find it cached
            path = tiny.ensure_task_model(task)
        D.barrier()
        return path if D.is_main() else tiny.ensure_task_model(task, log=lambda *a: None)
    if os.path.isdir(name) and RF.is_checkpoint(name):
        # verified, then exported once (a checkpoint still named .tmp, whose write did not finish, is refused): by
        # rank 0, under a lock that makes another run or evaluation of it wait for the export and use it
        hf = RF.exported(name) if D.is_main() else None
        D.barrier()
        return hf if D.is_main() else RF.exported(name, log=lambda *a: None)
    if os.path.isdir(name):
        RF.check_model_folder(name)  # config.json, weights, intact headers: one line for what is missing
        return name
    if os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"--model {name}: no such model folder, and not a hub id (owner/name)")
    from huggingface_hub import try_to_load_from_cache
    if not isinstance(try_to_load_from_cache(name, "config.json"), str):
        problem = data.hub_unreachable(f"--model {name}")
        if problem:
            raise UserError(problem)
    return name


def weights_hash(path: str) -> str | None:
    """SHA-256 (first 16 hex digits) of a local model folder's weights: every tensor's name, dtype, shape and bytes,
    in name order, over its .safetensors files. Which warm start a run started from, whatever the file layout or the
    safetensors metadata. None for a hub id (its revision names it)."""
    import hashlib

    import torch
    from safetensors import safe_open
    if not os.path.isdir(path):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return None
    digest, handles = hashlib.sha256(), {}
    for f in files:
        handle = safe_open(os.path.join(path, f), framework="pt")
        handles.update({name: handle for name in handle.keys()})
    for name in sorted(handles):
        t = handles[name].get_tensor(name).contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


# Liger's Triton kernels for the trained model's RMSNorm, rotary embedding and SwiGLU MLP; its cross-entropy kernels
# stay off: the objective needs each token's log-prob and entropy at the sampling temperature, which logprobs.py's
# fused head computes, not a mean cross-entropy.
LIGER_PATCHES = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def use_liger(model, device) -> str:
    """Patch `model` (before FSDP2 wraps it) with Liger's kernels where they run: on CUDA, for a model type Liger
    covers, with liger-kernel installed (requirements-gpu.txt). Returns what it did, in words, for the run's log. The
    patches are Liger's: module-level replacements in the model family's transformers module (the rotary function,
    the RMSNorm and MLP classes, so every model of that family built later in this process, the KL reference included,
    gets them too), and this model's own RMSNorm and MLP modules."""
    if device.type != "cuda":
        return "off (Triton kernels need CUDA)"
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return "off (liger-kernel is not installed: requirements-gpu.txt)"
    model_type = getattr(model.config, "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return f"off (Liger has no kernels for model type {model_type!r})"
    takes = inspect.signature(apply).parameters
    apply(model=model, **{name: on for name, on in LIGER_PATCHES.items() if name in takes})
    return "on: " + ", ".join(name for name in ("rms_norm", "rope", "swiglu") if LIGER_PATCHES[name] and name in takes)


# Selective activation checkpointing: what a checkpointed decoder layer keeps from its forward for the backward. Full
# checkpointing keeps only the layer's input and runs the whole forward again in the backward: every GEMM twice. The
# selective policy keeps the outputs of the expensive ops and recomputes the rest (norms, rotary, SiLU x mul, casts,
# adds: cheap elementwise work), at the memory of those kept outputs. The policy sees the ops after composite ones
# (linear, matmul) have decomposed, so what it keeps is, by name: aten's matrix products mm, addmm and bmm, and every
# op whose name holds "attention" or "attn": aten's _scaled_dot_product_{flash,efficient,cudnn}_attention (and
# _for_cpu), _flash_attention_forward and _efficient_attention_forward, PyTorch's varlen_attn and flash-attn's ops.
def _saved_by_selective(op) -> bool:
    name = str(op.overloadpacket.__name__) if hasattr(op, "overloadpacket") else str(op)
    return name in ("mm", "addmm", "bmm") or "attention" in name or "attn" in name


def enable_checkpointing(model, selective: bool = False):
    """Gradient checkpointing of every decoder layer (transformers' own, non-reentrant); selective: keep the matrix
    products' and attention's outputs and recompute only the elementwise ops in the backward
    (torch.utils.checkpoint's selective policy), so no GEMM runs twice, for more memory than full checkpointing."""
    kwargs = {"use_reentrant": False}
    if selective:
        import functools

        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        def policy(ctx, op, *args, **kw):
            return CheckpointPolicy.MUST_SAVE if _saved_by_selective(op) else CheckpointPolicy.PREFER_RECOMPUTE
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
