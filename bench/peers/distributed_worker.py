"""One rank of a multi-GPU peer: what users run on N GPUs of one host, trained under torchrun.

    torchrun --standalone --nproc_per_node 8 -m turnip.bench.peers.distributed_worker \\
        --system fsdp2-ckpt --model gpt1.3b --steps 5 --warmup 2 --out row.json

Every rank builds the same workload (bench/models: the model, its bf16-autocast loss, AdamW with its
options) and trains on a micro-batch of its own, ``--batch`` sequences (the workload's batch by
default): rank 0's is the workload's own batch, the one the single-GPU rows train on, rank r's is
drawn the same way with seed r. The math is eager's: fp32 weights, the forward under the loss's
bf16 autocast, gradients averaged over the ranks. The systems:

ddp                  DistributedDataParallel, AdamW(fused=True) on CUDA
ddp-foreach          the same with torch's default AdamW (foreach)
ddp-ckpt             DDP + per-block activation checkpointing (peers/checkpoint.py)
fsdp2                fully_shard per transformer block, then the root
fsdp2-ckpt           the same + per-block checkpointing
fsdp2-offload-ckpt   fully_shard with CPUOffloadPolicy(pin_memory=True) + checkpointing: the optimizer
                     steps on the CPU
zero2-offload        DeepSpeed ZeRO stage 2, optimizer states in pinned CPU memory, + checkpointing
zero3-offload        DeepSpeed ZeRO stage 3, parameters and optimizer in pinned CPU memory, + checkpointing
turnip-ranks         turnip over the ranks (compile's process_group=, ``--gpus-per-rank`` GPUs each, one by
                     default), at ``--budget`` per GPU (bytes, or a fraction of the unplanned peak) with
                     ``--planner``: the workload's AdamW traced (fused on CUDA), messages between ranks through
                     the process group

Without CUDA, ddp* and fsdp2 / fsdp2-ckpt run on the gloo backend (tiny models: the tests); the offloading
systems need CUDA and DeepSpeed its package, and their row says so ("skipped", "not installed").

Timing: before each step every rank synchronizes its GPU and meets the others at a barrier; a step's
time is the slowest rank's; the row's steps are those after ``--warmup``. Peak memory is the largest
torch.cuda.max_memory_allocated (and _reserved) over the ranks, each rank's in ``peak_allocated_per_rank``.
Rank 0 writes the row (bench/peers/common.py's fields + ``devices``) as JSON to ``--out``; a rank that
fails writes ``<out>.rank<r>.json`` with its status (``oom`` / ``error``) and exits 1, so torchrun stops
the others and the launcher (peers/distributed.py) can tell an OOM from another error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ... import engine, memgraph
from ...engine.timing_sim import transfer_bytes
from ...ir.memgraph import Stream
from .checkpoint import checkpoint_blocks, find_blocks
from .common import (
    EAGER_MATH,
    ERROR,
    NOT_INSTALLED,
    OOM,
    SKIPPED,
    PeerResult,
    Workload,
    batch_on,
    describe,
    importable,
    is_oom,
    sync,
    trainable,
)
from .eager import training_step
from .isolated import WorkloadSpec, build_workload
from .zero_offload import ds_config
from .zero_offload import estimated_bytes as single_gpu_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class System:
    """How one multi-GPU peer wraps the model and where it keeps what."""

    kind: str  # "ddp", "fsdp2", "deepspeed" or "turnip"
    checkpoint: bool = False  # per-block activation checkpointing
    fused: bool = True  # AdamW(fused=True) on CUDA; False: torch's default AdamW (foreach)
    offload: bool = False  # parameters and/or optimizer states in pinned host memory
    zero_stage: int | None = None  # DeepSpeed's ZeRO stage

    @property
    def needs_cuda(self) -> bool:
        # pinned host memory and DeepSpeed's CPU Adam only make sense beside a GPU (DeepSpeed also needs NCCL)
        return self.offload or self.kind == "deepspeed"


SYSTEMS = {
    "ddp": System("ddp"),
    "ddp-foreach": System("ddp", fused=False),
    "ddp-ckpt": System("ddp", checkpoint=True),
    "fsdp2": System("fsdp2"),
    "fsdp2-ckpt": System("fsdp2", checkpoint=True),
    "fsdp2-offload-ckpt": System("fsdp2", checkpoint=True, offload=True),
    "zero2-offload": System("deepspeed", checkpoint=True, offload=True, zero_stage=2),
    "zero3-offload": System("deepspeed", checkpoint=True, offload=True, zero_stage=3),
    "turnip-ranks": System("turnip"),
}


def refusal(name: str, device_type: str) -> PeerResult | None:
    """The row of a system that cannot run here (without starting anything), or None.

    Same statuses as the single-GPU peers (common.unavailable): "skipped" without CUDA, "not installed"
    without DeepSpeed."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    system = SYSTEMS[name]
    if system.needs_cuda and (device_type != "cuda" or not torch.cuda.is_available()):
        why = "needs CUDA" + (" (pinned host memory beside a GPU)" if system.kind == "fsdp2" else
                              " (DeepSpeed's offload and NCCL)")
        return PeerResult(name, status=SKIPPED, error=f"{name} {why}; this run is on {device_type}", math=EAGER_MATH)
    missing = importable("deepspeed") if system.kind == "deepspeed" else None
    if missing is not None:
        return PeerResult(name, status=NOT_INSTALLED, error=f"deepspeed not installed ({missing})", math=EAGER_MATH)
    return None


# -- the workload and each rank's micro-batch ----------------------------------------------------

def load_workload(model: str, tiny: bool, batch: int | None, snapshot: str | None) -> Workload:
    """The suite's workload by name (its snapshot, when given, instead of a second random initialization)."""

    return build_workload(WorkloadSpec(model, tiny=tiny, batch=batch, snapshot=snapshot))


def rank_batch(workload: Workload, index: int):
    """The micro-batch of the step's device ``index`` (a rank's, with one GPU per rank), the shape of the
    workload's: next-token pairs over the model's vocabulary, drawn with seed ``index`` as bench/models draws
    the workload's own with seed 0 (so device 0 trains on the batch the single-GPU rows train on)."""
    if index == 0:
        return workload.batch
    idx, _ = workload.batch
    config = workload.info.get("config", {})
    vocab = config.get("vocab") or config.get("vocab_size")
    if vocab is None:
        raise ValueError(f"{workload.name}: no vocabulary size in its info to draw device {index}'s tokens from")
    generator = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, int(vocab), (idx.shape[0], idx.shape[1] + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# -- wrapping the model, per system --------------------------------------------------------------

@dataclass
class Trainer:
    """A wrapped model and its step: ``step()`` trains one step and returns the loss."""

    step: Callable[[], torch.Tensor]
    full_state: Callable[[], dict] | None  # every rank calls it (FSDP gathers); None where not supported
    optimizer: str
    extra: dict


def adamw(workload: Workload, params, fused: bool) -> tuple[torch.optim.Optimizer, str]:
    """The workload's optimizer with its options, fused where asked (the fastest CUDA AdamW)."""
    kwargs = workload.optimizer.options(fused)
    label = f"{workload.optimizer.name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    return workload.optimizer(params, fused=fused), label


def plain_state(state: dict) -> dict:
    """A state dict as full CPU tensors (an FSDP parameter is a sharded DTensor: gathered here)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}


def ddp_trainer(system: System, workload: Workload, device: torch.device, batch) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel

    model = workload.fresh_model(device)
    if system.checkpoint:
        checkpoint_blocks(model)
    ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=ids)
    optimizer, label = adamw(workload, trainable(model), fused=system.fused and device.type == "cuda")
    return Trainer(lambda: training_step(wrapped, workload.loss_fn, batch, optimizer),
                   lambda: plain_state(model.state_dict()), label, {})


def fsdp2_trainer(system: System, workload: Workload, device: torch.device, batch) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # built on the CPU: fully_shard moves each block's parameters to the GPU as it shards them (and with the
    # offload policy back to pinned host memory), so no rank ever holds the whole model on its GPU
    model = workload.fresh_model("cpu")
    if system.checkpoint:
        checkpoint_blocks(model)  # before fully_shard: FSDP's hooks stay outside the checkpointed forward
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=True) if system.offload else OffloadPolicy()
    for block in find_blocks(model):
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    optimizer, label = adamw(workload, trainable(model), fused=system.fused and device.type == "cuda")
    extra = {"offload_policy": "CPUOffloadPolicy(pin_memory=True)" if system.offload else None}
    return Trainer(lambda: training_step(model, workload.loss_fn, batch, optimizer),
                   lambda: plain_state(model.state_dict()), label, extra)


def deepspeed_trainer(system: System, workload: Workload, device: torch.device, batch) -> Trainer:
    import deepspeed  # optional: refusal() has checked it imports


    # zero_offload's config: eager's math ("torch_autocast", no clipping), the workload's AdamW options,
    # offload_optimizer (and at stage 3 offload_param) to pinned CPU memory; the micro-batch is this rank's
    config = ds_config(workload, system.zero_stage, bf16_weights=False)
    deepspeed.init_distributed(dist_backend="nccl")  # adopts torchrun's process group
    model = workload.fresh_model("cpu")  # DeepSpeed places (and at stage 3 partitions) it
    checkpoint_blocks(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model), config=config)

    def step():
        loss = workload.loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        return loss

    label = f"DeepSpeedCPUAdam({config['optimizer']['params']})"
    return Trainer(step, None, label, {"ds_config": config})


def turnip_trainer(system: System, workload: Workload, device: torch.device, batch, budget=None,
                   planner: str = "greedy", batches: list | None = None) -> Trainer:
    """turnip's MemGraph of this rank (compile over the initialized world group), on this rank's GPUs:
    ``device`` and the next ones, one per micro-batch of ``batches`` (default: ``batch`` alone)."""
    model = workload.model
    optimizer = workload.optimizer(trainable(model))
    batches = batches or [batch]
    started = time.perf_counter()
    mg = memgraph.compile(model, workload.loss_fn, batches[0], optimizer=optimizer, budget=budget, device=device,
                          devices=len(batches), planner=planner, verbose=False)
    extra = {"compile_s": time.perf_counter() - started, "budget_bytes": mg.plan.gpu_budget,
             "arena_bytes": mg.arena_bytes, "cpu_bytes": mg.cpu_bytes, "vertices": len(mg.vertices),
             "planner": mg.plan.planner, "unplanned_peak": mg.stats.get("unplanned_peak"),
             "messages": sum(mv.stream is Stream.COMM for mv in mg.vertices),
             "sim_step_s": mg.stats.get("simulated_step_s")}
    extra["bytes_moved"] = transfer_bytes(mg)  # the plan's own host traffic, where the peers' is estimated
    run_with = batches if len(batches) > 1 else batches[0]
    return Trainer(lambda timeline=None: engine.run(mg, run_with, timeline=timeline)["loss"], mg.state_dict,
                   repr(optimizer).split(" ")[0], extra)


TRAINERS = {"ddp": ddp_trainer, "fsdp2": fsdp2_trainer, "deepspeed": deepspeed_trainer, "turnip": turnip_trainer}


def estimated_bytes(system: System, workload: Workload, world: int) -> tuple[int, int]:
    """(host->device, device->host) bytes one step moves per GPU: 0 without offload; with it each rank moves
    its 1/world share of what the single-GPU DeepSpeed rows move (zero_offload.estimated_bytes). FSDP2's
    offload fetches the shards for the forward and again for the backward, as ZeRO-3 does."""
    if not system.offload:
        return 0, 0

    stage = system.zero_stage if system.kind == "deepspeed" else 3
    h2d, d2h = single_gpu_bytes(workload, stage, bf16_weights=False)
    return h2d // world, d2h // world


# -- timing across ranks -------------------------------------------------------------------------

def across_ranks(values: list[float], device: torch.device) -> torch.Tensor:
    """Every rank's ``values`` as a (world, len(values)) float64 tensor on the CPU (one all_gather)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return torch.stack(gathered).cpu()


def timed_steps(result: PeerResult, step: Callable[[], torch.Tensor], steps: int, warmup: int,
                device: torch.device, deadline: float | None) -> None:
    """``warmup + steps`` steps; each one's time is the slowest rank's, its loss the mean over the ranks.

    The barrier puts every rank at the start line together, so a rank that finished its last step early
    does not count the wait for the others in this step. Stops after a timed step once any rank is past
    ``deadline`` (time.time()), keeping what it has: every rank learns it from the same all_gather.
    """
    for i in range(warmup + steps):
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        elapsed = time.perf_counter() - t0
        late = deadline is not None and time.time() > deadline
        table = across_ranks([elapsed, float(loss.detach().float().item()), float(late)], device)
        slowest, mean_loss = float(table[:, 0].max()), float(table[:, 1].mean())
        result.losses.append(mean_loss)
        if i < warmup:
            result.first_step_s = result.first_step_s if i else slowest
        else:
            result.step_s.append(slowest)
        log.info("%s step %d/%d: %.1f ms (slowest rank), loss %.5f", result.system, i + 1 - warmup, steps,
                 slowest * 1e3, mean_loss)
        if bool(table[:, 2].any()) and i + 1 < warmup + steps and i >= warmup:
            result.extra["truncated"] = f"deadline after {i + 1 - warmup} timed steps"
            log.warning("%s: deadline reached after %d timed steps", result.system, i + 1 - warmup)
            break


def record_peaks(result: PeerResult, device: torch.device) -> None:
    """The largest peak over the ranks (and each rank's); None on the CPU, as the single-GPU rows."""
    if device.type != "cuda":
        return
    table = across_ranks([torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)], device)
    result.peak_allocated, result.peak_reserved = int(table[:, 0].max()), int(table[:, 1].max())
    result.extra["peak_allocated_per_rank"] = [int(x) for x in table[:, 0]]


# -- one rank ------------------------------------------------------------------------------------

def start(device_type: str, gpus_per_rank: int = 1) -> torch.device:
    """This rank's (first) device and torchrun's process group (NCCL on CUDA, gloo on the CPU)."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) * gpus_per_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def train(args: argparse.Namespace, device: torch.device) -> tuple[PeerResult, dict | None]:
    """This rank's part of the run: the row (complete on every rank) and, if asked, the final weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    system = SYSTEMS[args.system]
    t0 = time.perf_counter()
    workload = load_workload(args.model, args.tiny, args.batch, args.snapshot)
    local = args.gpus_per_rank  # a rank's devices are devices rank * local ... of the step, each on a batch of its own
    own = [rank_batch(workload, rank * local + k) for k in range(local)]
    workload.batch = own[0]
    batch = workload.batch_on(device)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    budget = int(args.budget) if args.budget is not None and args.budget > 1 else args.budget
    options = {}
    if system.kind == "turnip":
        options = {"budget": budget, "planner": args.planner,
                   "batches": [batch, *(batch_on(b, device) for b in own[1:])] if local > 1 else None}
    trainer = TRAINERS[system.kind](system, workload, device, batch, **options)
    init_s = time.perf_counter() - t0
    result = PeerResult(args.system, math=EAGER_MATH)
    size = int(torch.utils._pytree.tree_leaves(workload.batch)[0].shape[0])
    result.extra.update(devices=world * local, ranks=world, gpus_per_rank=local, backend=dist.get_backend(),
                        model=workload.name, budget=args.budget,
                        batch_per_device=size, global_batch=size * world * local, optimizer=trainer.optimizer,
                        checkpoint="per block" if system.checkpoint else None, build_s=build_s, init_s=init_s,
                        **trainer.extra)
    if device.type == "cuda":  # what setting up cost (DeepSpeed's initialize, fully_shard's moves)
        result.extra["init_peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
    log.info("%s: %s built in %.1fs, wrapped in %.1fs", args.system, workload.name, build_s, init_s)
    timed_steps(result, trainer.step, args.steps, args.warmup, device, args.deadline)
    if args.timeline is not None:  # one more step, untimed, with every unit of this rank's MemGraph
        path = args.timeline.with_name(f"{args.timeline.stem}.rank{rank}{args.timeline.suffix}")
        trainer.step(timeline=path)
        result.extra["timeline"] = str(args.timeline)
    record_peaks(result, device)
    moved = result.extra.pop("bytes_moved", None)
    result.bytes_h2d, result.bytes_d2h = moved or estimated_bytes(system, workload, world)
    result.extra["bytes_estimated"] = system.offload and moved is None
    weights = None
    if args.save_weights:
        weights = trainer.full_state()  # a collective for FSDP: every rank takes part
    return result, weights


def row_of(result: PeerResult, devices: int) -> dict:
    """The row as the suite writes a single-GPU one (common.PeerResult.row) with ``devices``."""
    row = result.row()
    row.setdefault("devices", devices)
    return row


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)  # a reader never sees half a row


def rank_failure_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.rank{rank}.json")


def report_failure(out: Path, rank: int, exc: BaseException, device_type: str) -> None:
    """``<out>.rank<r>.json``: this rank's status (oom / error), message and peak, for the launcher."""
    status = OOM if is_oom(exc) else ERROR
    peak = None
    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak = int(torch.cuda.max_memory_allocated())
    write_json(rank_failure_path(out, rank), {"rank": rank, "status": status, "error": describe(exc),
                                              "peak_allocated": peak})


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --standalone --nproc_per_node N -m "
                                          "turnip.bench.peers.distributed_worker",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", required=True, choices=list(SYSTEMS))
    parser.add_argument("--model", default="gpt1.3b", help="a bench/models workload: gpt350m, gpt1.3b, llama, ...")
    parser.add_argument("--tiny", action="store_true", help="the workload's CPU-sized shape")
    parser.add_argument("--batch", type=int, help="sequences per GPU (default: the workload's batch)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the row here (JSON)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--snapshot", help="the suite's safetensors weights (peers/isolated.py), instead of a new init")
    parser.add_argument("--deadline", type=float, help="time.time() after which no further timed step starts")
    parser.add_argument("--budget", type=float, help="turnip: per GPU, bytes (> 1) or a fraction of the unplanned peak")
    parser.add_argument("--planner", default="greedy", help="turnip: compile's planner")
    parser.add_argument("--timeline", type=Path, help="turnip-ranks: each rank writes a Perfetto timeline of one "
                        "more step to <stem>.rank<r><suffix> beside this path")
    parser.add_argument("--gpus-per-rank", type=int, default=1, help="turnip-ranks: GPUs (devices) each rank "
                        "drives, from cuda:<LOCAL_RANK x this>")
    parser.add_argument("--save-weights", type=Path, help="rank 0 saves the final weights here (torch.save; "
                        "ddp and fsdp2 systems): the tests compare them with a one-process step")
    args = parser.parse_args(argv)
    if args.save_weights and SYSTEMS[args.system].kind == "deepspeed":
        parser.error("--save-weights is for the ddp and fsdp2 systems")
    if args.timeline is not None and SYSTEMS[args.system].kind != "turnip":
        parser.error("--timeline is for turnip-ranks")
    if args.gpus_per_rank < 1 or (args.gpus_per_rank > 1 and SYSTEMS[args.system].kind != "turnip"):
        parser.error(f"--gpus-per-rank {args.gpus_per_rank}: turnip-ranks drives one or more GPUs per rank, "
                     f"the other systems one")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr, datefmt="%H:%M:%S",
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    refused = refusal(args.system, args.device)
    if refused is not None:  # before any process group: nothing to start or stop
        if rank == 0:
            write_json(args.out, row_of(refused, int(os.environ.get("WORLD_SIZE", "1"))))
        log.info("%s: %s (%s)", args.system, refused.status, refused.error)
        return 0
    try:
        device = start(args.device, args.gpus_per_rank)
        result, weights = train(args, device)
    except Exception as exc:  # the launcher turns this rank's failure into the row's status
        log.exception("%s failed on rank %d", args.system, rank)
        report_failure(args.out, rank, exc, args.device)
        return 1  # torchrun stops the other ranks, which may be waiting for this one in a collective
    if rank == 0:
        write_json(args.out, row_of(result, dist.get_world_size() * args.gpus_per_rank))
        if weights is not None:
            torch.save(weights, args.save_weights)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
