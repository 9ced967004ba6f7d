"""Distributed plumbing for train.py under torchrun: ranks, sharding, gathering. Without torchrun (WORLD_SIZE
unset) every function here is the identity or a no-op, and train.py runs as one process.

The one layout rule: of a global batch of n items, rank r owns items r, r + world, r + 2 world, ... (my_share);
gather() puts per-item results back in global order on every rank. FSDP2 shards parameters, gradients and
optimizer state (shard_model); each rank's loss is its share of the global token mean, so gradients are summed,
not averaged.
"""

import atexit
import os
import sys

import torch
import torch.distributed as dist


def init() -> tuple[int, int, torch.device]:
    """-> (rank, world size, device). torchrun sets WORLD_SIZE, RANK and LOCAL_RANK."""
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


def world_size() -> int:
    """Processes in torch.distributed's default group (1 without torchrun)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def barrier():
    if world_size() > 1:
        dist.barrier()


def end_process():
    """The last call of a torchrun rank: wait for the other ranks, destroy the group, run the exit hooks (atexit:
    wandb's finish, the reward pool's shutdown, vLLM's), flush, and end with os._exit(0), skipping interpreter
    finalization. Why not a plain return: gloo's worker threads free a collective's buffers just after it completes,
    and freeing a tensor Python has already let go of takes the GIL; if the interpreter is finalizing by then, the
    thread is stopped inside C++ and the rank aborts (SIGABRT, "terminate called without an active exception") after
    all its work is done; a barrier first does not prevent it (its own work frees buffers the same way). PyTorch
    issue 190489. How often each exit aborted: docs/training.md, "Scaling out"."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit runs before finalization, while the interpreter is whole
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def all_reduce(values, device, op="sum") -> list[float]:
    """Sum (or max/min) a list of numbers over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size() > 1:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.tolist()


def my_share(n: int) -> list[int]:
    """The global indices of the n items this rank works on: rank, rank + world, ..."""
    return list(range(rank(), n, world_size()))


def gather(local: torch.Tensor, device) -> torch.Tensor:
    """Per-item tensors [n / world, ...] for my_share(n) on each rank -> [n, ...] in global order, on every rank."""
    if world_size() == 1:
        return local
    parts = [torch.empty_like(local, device=device) for _ in range(world_size())]
    dist.all_gather(parts, local.to(device))
    return torch.stack(parts, dim=1).flatten(0, 1).cpu()  # item i came from rank i % world, position i // world


def gather_values(local: torch.Tensor, device) -> torch.Tensor:
    """A 1-D tensor of any length on each rank -> every rank's values joined (rank 0's first), on every rank."""
    if world_size() == 1:
        return local
    sizes = [int(n) for n in all_reduce([local.numel() if r == rank() else 0 for r in range(world_size())], device)]
    padded = torch.zeros(max(sizes), dtype=local.dtype, device=device)
    padded[:local.numel()] = local.to(device)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).cpu()


def rank_seed(seed: int) -> int:
    """A seed of this rank's own, from one shared by all ranks (sampling differs per rank, reproducibly)."""
    return seed * world_size() + rank()


def shard_model(model, precision, one_process: bool = False):
    """FSDP2: each decoder layer is one unit (gathered for its forward/backward, then freed), the root holds the
    embeddings and LM head. Gradients are summed, not averaged, over ranks: each rank's loss is already its share
    of the global token mean. one_process (world size 1 only): each unit keeps its gathered bf16 weights from the
    forward to the backward (reshard_after_forward=False: no second cast of the fp32 masters, for 2 bytes per
    parameter held), and no gradient divide factor is set (there is nothing to divide or sum across; setting one
    costs a divide-and-copy of every gradient per micro-batch)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                                  reduce_dtype=torch.float32)
    alone = one_process and world_size() == 1
    options = {"mp_policy": policy, **({"reshard_after_forward": False} if alone else {})}
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule) and not alone:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return model


def place_model(model, precision, device, one_process: bool = False):
    """The model where this process trains it: sharded by FSDP2 under torchrun (each rank's shard on its own device)
    and in bf16 at any world size, else (fp32, one process) moved whole to `device`, the one init() returned. bf16 is
    FSDP2's mixed precision everywhere: fp32 master weights, bf16 copies gathered for each forward and backward,
    gradients reduced in fp32. So one process computes what N ranks do, and the residual stream, q, k and v are bf16
    (fp32 weights under autocast would carry an fp32 residual stream, and fp32 q and k from the rotary embedding).
    one_process: shard_model's settings for a world of one."""
    if world_size() == 1 and precision != "bf16":
        return model.to(device)
    group_of_one(device)
    if device.type == "cuda":
        model = model.to(device)  # fully_shard shards what it is given on the mesh's device
    return shard_model(model, precision, one_process)


def group_of_one(device):
    """A process group of one rank where torchrun started none: FSDP2 needs a group even for one process. Its store
    lives in this process (no port is opened); world_size() stays 1, so every collective here is skipped."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def full_named_parameters(model):
    """(name, full tensor) pairs for the weight sync; FSDP2 shards are all-gathered one parameter at a time."""
    from torch.distributed.tensor import DTensor
    for name, p in model.named_parameters():
        yield name, (p.full_tensor() if isinstance(p, DTensor) else p)


def full_tensor(t):
    """A DTensor gathered whole (e.g. clip_grad_norm_'s result under FSDP2); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
