"""What a compiled MemGraph does with memory, in words: the plan mix and the compile report.

    print(compile_report(mg))     # the paragraph memgraph.compile logs (and prints when verbose)
    plan_mix(mg)                  # values kept / offloaded / recomputed, weights homed on the CPU

Both read the MemGraph alone (its TaskGraph, plan and stats), so they work the same on a
MemGraph just compiled and on one loaded from a file.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.timing_sim import transfer_bytes
from ..ir.budget import budget_fields, format_bytes
from ..ir.memgraph import Kind, MemGraph
from ..ir.taskgraph import ValueKind
from ..trace.half_width import half_width_values

CPU = "cpu"


@dataclass
class PlanMix:
    """The step's tensors by what the MemGraph does with them, each counted once: homed on the CPU
    (weights and optimizer states streamed in, with their updated versions), else recomputed, else
    offloaded, else kept. Recomputed copies are not counted as tensors of their own."""

    values: int = 0
    kept: int = 0
    offloaded: int = 0  # copied to CPU memory and back (planned or evicted by the builder)
    recomputed: int = 0
    bytes_kept: int = 0
    bytes_offloaded: int = 0
    bytes_recomputed: int = 0
    homed_on_cpu: int = 0  # weights and optimizer states living in pinned CPU memory between steps
    bytes_homed_on_cpu: int = 0
    bytes_moved: int = 0  # bytes crossing the host<->device link per step, both ways
    bytes_h2d: int = 0  # of those, host to device (reloads, fetches of CPU homes, the batch)
    bytes_d2h: int = 0  # device to host (offloads, write-backs, gradients of host updates, outputs)
    # trainable parameters by where the step updates them: homed on the GPU; homed on the CPU and
    # fetched, with their optimizer states, for an update on the GPU; updated by the host's cores
    parameters_kept: int = 0
    bytes_parameters_kept: int = 0
    parameters_streamed: int = 0
    bytes_parameters_streamed: int = 0
    parameters_host_stepped: int = 0
    bytes_parameters_host_stepped: int = 0
    # frozen weights kept, and fetched, in the narrower dtype of their only casts (trace/half_width.py)
    half_width_weights: int = 0
    bytes_half_width: int = 0
    loss_blocks: int = 1  # row blocks of the loss head (trace/split_loss.py; 1: not split)


def plan_mix(mg: MemGraph) -> PlanMix:
    tg = mg.taskgraph
    copies = {o for v in tg.vertices if v.recompute_of >= 0 for o in v.outputs if o >= 0}
    recomputed = {o for v in tg.vertices if v.recompute_of >= 0
                  for o in tg.vertices[v.recompute_of].outputs if o >= 0}
    moved = {v.value for v in mg.vertices if v.kind in (Kind.OFFLOAD, Kind.RELOAD) and v.value >= 0}
    cpu_homes = {v for v, p in mg.homes.items() if p.where == CPU}
    streamed = cpu_homes | {tg.bindings[v] for v in cpu_homes if v in tg.bindings}  # and their updates
    mix = PlanMix()
    for value in tg.values:
        if value.id in copies:
            continue
        mix.values += 1
        if value.id in streamed:
            continue  # counted with the CPU homes below
        fate = "recomputed" if value.id in recomputed else "offloaded" if value.id in moved else "kept"
        _count(mix, fate, value.nbytes)
    mix.homed_on_cpu = len(cpu_homes)
    mix.bytes_homed_on_cpu = sum(tg.values[v].nbytes for v in cpu_homes if 0 <= v < len(tg.values))
    mix.bytes_moved = sum(p.nbytes for v in mg.vertices if v.kind in (Kind.OFFLOAD, Kind.RELOAD)
                          for p in v.writes.values())
    mix.bytes_h2d, mix.bytes_d2h = transfer_bytes(mg)
    host_stepped = {old for vid in mg.plan.host_update if 0 <= vid < len(tg.vertices)
                    for old, _new in tg.vertices[vid].copy_in}
    for value in tg.values:
        if value.kind is ValueKind.PARAMETER:
            where = "host_stepped" if value.id in host_stepped else "streamed" if value.id in cpu_homes else "kept"
            _count(mix, f"parameters_{where}", value.nbytes)
    halved = half_width_values(tg)
    mix.half_width_weights = len(halved)
    mix.bytes_half_width = sum(tg.values[v].nbytes for v in halved)
    mix.loss_blocks = int(mg.stats.get("loss_blocks", 1))
    return mix


def _count(mix: PlanMix, field: str, nbytes: int) -> None:
    """One more tensor of ``nbytes`` in ``field`` (and its ``bytes_`` twin)."""
    setattr(mix, field, getattr(mix, field) + 1)
    setattr(mix, f"bytes_{field}", getattr(mix, f"bytes_{field}") + nbytes)


def predicted_step(mg: MemGraph) -> str:
    """'predicted 12.3 ms per step on <device>' where op costs were measured on the device the
    MemGraph runs on, else why there is no prediction."""
    seconds, where = mg.stats.get("predicted_step_s"), mg.stats.get("costs_measured_on")
    if seconds is None or not where:
        reason = ("op costs are not measured on the CPU backend" if mg.device.startswith("cpu")
                  else "op costs were not measured on this device")
        return f"step time not predicted ({reason})"
    return f"predicted {seconds * 1e3:.1f} ms per step on {where}"


def budget_text(mg: MemGraph) -> str:
    fields = budget_fields(mg.plan.gpu_budget, mg.stats.get("unplanned_peak"))
    text = f"budget {format_bytes(fields['budget_bytes'])}"
    if fields["budget_fraction"] is not None:
        text += (f" ({fields['budget_fraction']:.0%} of the unplanned peak, "
                 f"{format_bytes(fields['unplanned_peak'])} with everything kept)")
    return text


def compile_report(mg: MemGraph) -> str:
    """One paragraph: budget, unplanned peak, arena, what was kept / offloaded / recomputed, bytes
    moved per step and the predicted step time (or why there is none)."""
    mix = plan_mix(mg)
    planner = mg.plan.planner
    if planner == "none":
        fits = mg.plan.gpu_budget >= mg.stats.get("unplanned_peak", mg.arena_bytes)
        planner = "no planner (" + ("everything fits" if fits else "the builder evicts what does not fit") + ")"
    took = mg.stats.get("compile_seconds")
    parts = [
        f"turnip compiled {len(mg.taskgraph.vertices)} ops for {mg.device} with {planner}"
        + (f" in {took:.1f} s:" if took is not None else ":"),
        f"{budget_text(mg)};",
        f"arena {format_bytes(mg.arena_bytes)}, pinned CPU memory {format_bytes(mg.cpu_bytes)}.",
        f"Of {mix.values} tensors, {mix.kept} kept ({format_bytes(mix.bytes_kept)}),",
        f"{mix.offloaded} offloaded ({format_bytes(mix.bytes_offloaded)}),",
        f"{mix.recomputed} recomputed ({format_bytes(mix.bytes_recomputed)});",
        f"{mix.homed_on_cpu} weights and optimizer states live in CPU memory ({format_bytes(mix.bytes_homed_on_cpu)}).",
        f"{format_bytes(mix.bytes_moved)} cross the host-device link per step;",
        *_parameter_fates(mix),
        f"{predicted_step(mg)}.",
    ]
    blocks = mg.stats.get("loss_blocks", 1)
    if blocks > 1:  # the step is then eager's within float tolerance, not bit for bit: say so
        parts.append(f"The loss head runs in {blocks} row blocks (the budget is below the unsplit step's "
                     f"smallest): eager's numbers within float tolerance, not bit for bit.")
    return " ".join(parts)


def _parameter_fates(mix: PlanMix) -> list[str]:
    """The report's words on trainable parameters streamed or updated by the host (none: nothing)."""
    if not (mix.parameters_streamed or mix.parameters_host_stepped):
        return []
    words = (f"of the trainable parameters, {mix.parameters_streamed} are streamed "
             f"({format_bytes(mix.bytes_parameters_streamed)}) and {mix.parameters_host_stepped} updated by the "
             f"host's cores ({format_bytes(mix.bytes_parameters_host_stepped)});")
    return [words]
