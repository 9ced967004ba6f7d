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


def cache_problem(name: str) -> str | None:
    """Why the offline model `name` ("tiny", "tiny:<task>") cannot be built in its cache, where it is not built yet
    (tiny.cache_problem); None for any other name. Asked before a run folder is made."""
    name = os.path.expanduser(name)
    if name != "tiny" and not name.startswith("tiny:"):
        return None
    from cegppo_utils import tiny
    task = name.partition(":")[2] or "arith"
    return tiny.cache_problem(task) if task in tiny.TASKS else None  # an unknown task: resolve_model says so


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
# The RoPE implementation, pinned. liger-kernel 0.8.5 routes its rotary function through a dispatcher
# (liger_kernel.backends.dispatch) that picks, per call, between its Triton kernel and a CuTe DSL one: where the
# `cutlass` package imports on a Hopper or newer GPU, a bf16 or fp16 q that needs a gradient, head_dim >= 128 and at
# least 131,072 q head-rows (batch x heads x length) go to CuTe DSL. The 1.5B preset's packed row is 12 heads x
# 20,480 tokens x head_dim 128 = 245,760 head-rows: exactly that zone, so the kernel trained with would depend on
# whether `cutlass` happens to be installed, and at shapes the CUDA tests never reach. The per-op variable below is
# the dispatcher's own override (it comes before LIGER_KERNEL_IMPL and liger_kernel.set_impl); Triton's kernel is the
# one tests/test_cuda.py checks, at the tests' shapes and at the preset's. Older liger-kernel releases have no
# dispatcher and run Triton's anyway.
LIGER_ROPE_IMPL = ("LIGER_KERNEL_IMPL_ROPE", "nvidia-triton")


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
    if LIGER_PATCHES["rope"] and "rope" in takes:
        os.environ[LIGER_ROPE_IMPL[0]] = LIGER_ROPE_IMPL[1]  # read at every call: set before the first forward
    apply(model=model, **{name: on for name, on in LIGER_PATCHES.items() if name in takes})
    return "on: " + ", ".join(name + (f" ({liger_rope_impl()})" if name == "rope" else "")
                              for name in ("rms_norm", "rope", "swiglu") if LIGER_PATCHES[name] and name in takes)


def liger_rope_impl(device=None) -> str:
    """The implementation Liger's dispatcher resolves for its RoPE here (its name, as LIGER_ROPE_IMPL spells them), or
    why none: read from the dispatcher itself, not from the setting."""
    try:
        from liger_kernel.backends.dispatch import resolve_impl
    except ImportError:
        return "Triton (a liger-kernel without the dispatcher)"
    try:
        return resolve_impl("rope", device=device).impl_name
    except Exception as e:  # no triton here (a CPU), an unknown name in the variable
        return f"unresolved: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


# Selective activation checkpointing: what a checkpointed decoder layer keeps from its forward for the backward. Full
# checkpointing keeps only the layer's input and runs the whole forward again in the backward: every GEMM twice. The
# selective policy keeps the outputs of the expensive ops and recomputes the rest (norms, rotary, SiLU x mul, casts,
# adds: cheap elementwise work), at the memory of those kept outputs. The policy sees the ops after composite ones
# (linear, matmul) have decomposed, so what it keeps is, by name: aten's matrix products mm, addmm and bmm, and every
# op whose name holds "attention" or "attn": aten's _scaled_dot_product_{flash,efficient,cudnn}_attention (and
# _for_cpu), _flash_attention_forward and _efficient_attention_forward, PyTorch's varlen_attn and flash-attn's ops.
#
# A kept output is a detached alias of the forward's tensor (torch.utils.checkpoint), guarded only by its version
# counter, and the recomputation starts again from it. So no later op may write into it unseen: Liger's RoPE rotates
# q and k in place, in the q and k projections' (addmm) outputs, with Triton stores that bump no version counter; the
# recomputation would rotate the kept, already rotated q and k a second time, and dq, dk and dv come out wrong while the
# loss looks right. Under the selective policy the model family's rotary function therefore gets copies of q and k
# (_rotary_on_copies). Of the three ways out, it costs least by this reckoning: a copy of q and of k per layer, in the
# forward and again in the recomputation. Their memory is transient: at the 1.5B shape one layer's q and k of a
# 20,480-token row in bf16 are 60 + 10 MiB, alive while that layer's attention runs (the copies are not kept: the
# policy recomputes them), so about 70 MiB at any time, not a sum over layers. Their time: 70 MiB read and written per
# layer and pass, 28 layers, two passes, about 7.7 GiB of traffic per row, about 2 ms at HBM rates against ~0.8 s per
# row (tools/bench.py's checkpoint_memory times them on a GPU). Transformers' out-of-place RoPE instead would run about
# six elementwise kernels forward and more backward over the same tensors; and keeping q and k out of the kept set
# would recompute their GEMMs, ~6% of a layer's GEMM FLOPs at that shape. What the selective policy keeps is far
# larger than the copies: every kept product's output, 24,576 values per token and layer at that shape (q, k, v, the
# attention output, o, gate, up, down), 48 KiB in bf16, about 26 GiB per 20,480-token row over 28 layers, against
# full checkpointing's 3 KiB (the layer's input), about 1.6 GiB per row.
def _saved_by_selective(op) -> bool:
    name = str(op.overloadpacket.__name__) if hasattr(op, "overloadpacket") else str(op)
    return name in ("mm", "addmm", "bmm") or "attention" in name or "attn" in name


def selective_policy(ctx, op, *args, **kwargs):
    """torch.utils.checkpoint's policy for the selective mode: keep what _saved_by_selective names, recompute the
    rest."""
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if _saved_by_selective(op) else CheckpointPolicy.PREFER_RECOMPUTE


def decoder_layers(model) -> list:
    """The model's decoder layers, in order: the modules transformers checkpoints (GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def family_module(model):
    """The transformers module of the model's family (modeling_qwen2, ...), where Liger replaces the rotary function
    and the norm and MLP classes for every model of that family in the process."""
    import sys
    owner = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")), None)
    return sys.modules[owner.__module__] if owner else None


def _rotary_on_copies(model):
    """Make the family's rotary function (where it is not transformers' own, out-of-place one: Liger's) rotate copies of
    q and k, never the tensors it is given. Module-wide, as Liger's own replacement is: every model of the family built
    in this process gets it too (kernels_in_use says so)."""
    family = family_module(model)
    rotary = getattr(family, "apply_rotary_pos_emb", None)
    if family is None or rotary is None or rotary.__module__ == family.__name__ or hasattr(rotary, "rotates_copies_of"):
        return

    def rotary_on_copies(q, k, *args, **kwargs):
        return rotary(q.clone(), k.clone(), *args, **kwargs)
    rotary_on_copies.rotates_copies_of = rotary
    family.apply_rotary_pos_emb = rotary_on_copies


def enable_checkpointing(model, selective: bool = False, every: int = 1):
    """Gradient checkpointing of every `every`-th decoder layer (0, every, 2 every, ...; transformers' own,
    non-reentrant), the others keeping their activations; selective: keep the matrix products' and attention's outputs
    and recompute only the elementwise ops in the backward (torch.utils.checkpoint's selective policy), so no GEMM runs
    twice, for more memory than full checkpointing, with the rotary embedding on copies of q and k (see above): after
    use_liger, whose patch would put the in-place rotary back (train.load_policy calls them in this order)."""
    kwargs = {"use_reentrant": False}
    if selective:
        import functools

        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
        _rotary_on_copies(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = decoder_layers(model)
    if every > 1 and not layers:
        raise ValueError(f"checkpointing one decoder layer in {every} needs the layers transformers checkpoints "
                         "(GradientCheckpointingLayer); this model has none")
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0


def compile_layers(model, backend: str = "inductor"):
    """torch.compile each decoder layer's forward (dynamic shapes: micro-batches differ in length), as torchtitan
    compiles its blocks; attention itself stays out of the graphs (attention.attention_forward is not traced). Not
    with the selective policy: compiled code writes into the outputs that policy keeps (torch refuses: "Tensor cached
    during selective activation checkpoint has been mutated")."""
    import torch

    from cegppo_utils import attention
    if model.config._attn_implementation == attention.NAME:
        attention.register(untraced=True)
    for layer in decoder_layers(model):
        if "context_fn" in getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", {}):
            raise ValueError("compiled decoder layers cannot run under the selective checkpointing policy")
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)


def _where(fn) -> str:
    """module.qualname of a function or bound method."""
    fn = getattr(fn, "__func__", fn)
    return f"{fn.__module__}.{fn.__qualname__}"


def kernels_in_use(model) -> dict:
    """What the built model's forwards run, read from the model itself (not from the settings that asked for it):
    the RMSNorm, rotary and MLP functions (Liger's or transformers'; for Liger's rotary, the kernel its dispatcher
    resolves), the attention implementation, how many decoder layers are checkpointed and how (full or selective),
    and how many have a compiled forward (wrapped layers, not graphs: tools/bench.py counts those)."""
    layers = decoder_layers(model)
    layer = layers[0]
    rotary = getattr(family_module(model), "apply_rotary_pos_emb", None)
    copies = getattr(rotary, "rotates_copies_of", None)
    rope = "none" if rotary is None else _where(copies or rotary)
    if rope.startswith("liger_kernel"):  # which of Liger's RoPE kernels its dispatcher runs (LIGER_ROPE_IMPL)
        rope += f" [{liger_rope_impl()}]"
    rope += " (on copies of q and k)" if copies else ""
    checkpointed = [m for m in layers if m.gradient_checkpointing]
    func = getattr(checkpointed[0], "_gradient_checkpointing_func", None) if checkpointed else None
    return {"rms_norm": _where(layer.input_layernorm.forward), "swiglu": _where(layer.mlp.forward),
            "rope": rope,
            "attention": model.config._attn_implementation,
            "checkpointing": ("off" if not checkpointed else
                              f"{'selective' if 'context_fn' in getattr(func, 'keywords', {}) else 'full'}, "
                              f"{len(checkpointed)} of {len(layers)} layers"),
            "compiled_layers": sum(hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable") for m in layers)}


def liger_in_use(kernels: dict) -> bool:
    """Whether kernels_in_use found Liger's RMSNorm, rotary and SwiGLU all three."""
    return all(kernels[op].startswith("liger_kernel") for op in ("rms_norm", "rope", "swiglu"))
