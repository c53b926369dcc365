"""Plain-text reports of plans and estimates, for terminals and Megatron-style logs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_pipette.cost.memory import TIGHT_HEADROOM, MemoryEstimate, misfit_reason
from megatron_pipette.cost.timing import TimeEstimate
from megatron_pipette.plan.placement import Placement
from megatron_pipette.plan.planner import HEADROOM_TIME, Candidate, Plan
from megatron_pipette.spec.cluster_file import ClusterFile
from megatron_pipette.spec.layout import legend
from megatron_pipette.spec.workload import Workload, megatron_flag
from megatron_pipette.units import GiB


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def candidates_table(result: Plan) -> str:
    rows = []
    for i, c in enumerate(result.candidates, 1):
        sim = (f"{c.simulated_time_s:.3f}" if c.simulated_time_s is not None
               else "exact" if c.time.exact_schedule else "-")
        placement = "default" if c.placement.is_default else "nodes " + node_order(c.placement)
        rows.append([str(i), c.layout.describe(), f"{c.time.iteration_time_s:.3f}", sim,
                     f"{c.time.tflops_per_gpu:.3g}",
                     f"{_gib(c.memory.peak_bytes)}/{_gib(c.memory.capacity_bytes)}", placement])
    return (table(rows, ["#", "layout", "s/iter", "simulated", "TFLOP/s/GPU", "peak GiB/GPU", "placement"]) + "\n"
            + legend([c.layout for c in result.candidates]))


def node_order(placement: Placement, width: int = 22) -> str:
    """The physical node of each logical node, shortened to `width` characters."""
    text = ",".join(map(str, placement.node_order))
    return text if len(text) <= width else text[:width - 3] + "..."


def breakdown(time: TimeEstimate) -> str:
    parts = {k: v for k, v in time.breakdown.as_dict().items() if v > 0}
    total = time.iteration_time_s
    rows = [[k.removesuffix("_s").replace("_", " "), f"{v:.4f}", f"{100 * v / total:.1f}%"] for k, v in parts.items()]
    return table(rows, ["where the time goes", "seconds", "share"])


def stage_memory(memory: MemoryEstimate) -> str:
    rows = [[str(s.stage), _gib(s.weight_bytes), _gib(s.gradient_bytes), _gib(s.optimizer_bytes),
             _gib(s.activation_bytes), _gib(s.transient_bytes), _gib(s.overhead_bytes), _gib(s.total_bytes),
             "yes" if s.total_bytes <= memory.capacity_bytes else "NO"] for s in memory.stages]
    header = ["stage", "weights", "grads", "optimizer", "activations", "transient", "overheads", "total GiB", "fits"]
    return table(rows, header) + f"\ncapacity {_gib(memory.capacity_bytes)} GiB per GPU"


def tight_memory(memory: MemoryEstimate) -> list[str]:
    """The warning a layout that fits by less than TIGHT_HEADROOM carries."""
    if not memory.tight:
        return []
    return [f"Memory: it fits by {100 * memory.headroom:.1f}% ({_gib(memory.peak_bytes)} of "
            f"{_gib(memory.capacity_bytes)} GiB), less than the memory model's {100 * TIGHT_HEADROOM:.0f}% margin "
            f"of error: it may not fit; a smaller micro-batch or more recomputation leaves room."]


def extrapolated(time: TimeEstimate) -> list[str]:
    """The lines naming what an estimate took from the layer profile beyond what it measured."""
    return [f"Layer profile extrapolated: {line}." for line in time.extrapolations]


def winner(c: Candidate) -> str:
    lines = ["", "Best layout, as Megatron flags:", "  " + " \\\n  ".join(c.layout.megatron_args()),
             *tight_memory(c.memory), *extrapolated(c.time)]
    if c.placement.is_default:
        lines.append("Rank placement: Megatron's default order is already the best found.")
    else:
        gain = 100 * (1 - c.time.iteration_time_s / c.default_order_time_s)
        lines.append(f"Rank placement: logical node k runs on physical node {list(c.placement.node_order)}[k] "
                     f"({gain:.1f}% faster than the default order's {c.default_order_time_s:.3f} s); "
                     f"`--auto-parallel` applies it inside the job.")
    lines += ["", breakdown(c.time), "", stage_memory(c.memory)]
    return "\n".join(lines)


def rejected_by_rule(result: Plan) -> list[tuple[int, str]]:
    """The rules Megatron would reject layouts by, most common first: how many layouts broke each, and
    the rule as the first of them read it. Never the counting key, whose numbers are all N ("> N" for
    "> 1"): a placeholder no reader can fill."""
    common = sorted(result.rejected.items(), key=lambda kv: (-kv[1], kv[0]))
    return [(count, result.rejection_examples.get(kind, kind)) for kind, count in common]


def rejections(result: Plan, limit: int = 5) -> list[str]:
    """The layouts Megatron would reject, most common reasons first."""
    common = rejected_by_rule(result)
    if not common:
        return []
    lines = [f"{sum(c for c, _ in common)} layouts Megatron would reject were left out (each rule with the "
             "numbers of the first layout that broke it):"]
    lines += [f"  {count:>6}  {reason}" for count, reason in common[:limit]]
    if len(common) > limit:
        lines.append(f"  {sum(c for c, _ in common[limit:]):>6}  for {len(common) - limit} other reasons")
    return lines


def no_valid_layout(result: Plan) -> str:
    """One line for a search in which Megatron would reject every layout: the most common rule
    broken, as the first layout that broke it read."""
    common = rejected_by_rule(result)
    head = f"no layout of {result.workload.name} on {result.world_size} GPUs is valid"
    if not common:
        return f"{head} within the layout flags given"
    count, reason = common[0]
    others = sum(c for c, _ in common) - count
    reasons = f"{len(common) - 1} other reason" + ("s" if len(common) > 2 else "")
    rest = f" ({count} layouts; {others} more for {reasons})" if others else ""
    return f"{head}: {reason}{rest}"


def headroom(result: Plan) -> str:
    """What the pick leaves free, and why it is the pick (planner step 5: HEADROOM_TIME, memory_headroom;
    a plan made without a margin, such as plan.losses' of a few stored layouts, says only the first)."""
    best, margin = result.best, f"{100 * result.memory_headroom:g}%"
    line = (f"Memory headroom: #1 leaves {100 * best.memory.headroom:.1f}% free ({_gib(best.memory.peak_bytes)} of "
            f"{_gib(best.memory.capacity_bytes)} GiB on its fullest stage)")
    over = result.passed_over
    if over is not None:
        gap = best.time.iteration_time_s / over.time.iteration_time_s - 1
        return (f"{line}; chosen over {over.layout.describe()}, {gap:.1%} faster but "
                f"{100 * over.memory.headroom:.1f}% free, under the {margin} headroom margin.")
    if best.memory.headroom < result.memory_headroom:
        return (f"{line}, under the {margin} headroom margin: no layout within {100 * HEADROOM_TIME:g}% of its time "
                "leaves that much, so the fastest is chosen.")
    return f"{line}, the {margin} headroom margin or more." if result.memory_headroom else f"{line}."


def precision_priced(workload: Workload) -> str:
    """The precision a plan or estimate is priced in: the training dtype, and FP8 or FP4 GEMMs where
    --fp8-format or --fp4-format runs the layers' linears quantised (docs/fp8.md)."""
    if workload.fp4 is not None:
        return f"{workload.precision} with FP4 GEMMs (--fp4-format {workload.fp4}, --fp4-recipe {workload.fp4_recipe})"
    if workload.fp8 is None:
        return workload.precision
    return f"{workload.precision} with FP8 GEMMs (--fp8-format {workload.fp8}, --fp8-recipe {workload.fp8_recipe})"


def fixed_flags(fixed: Mapping[str, Any]) -> list[str]:
    """The line naming the layout flags the search kept as given (a pasted launch line's TP, PP,
    micro-batch...), so that a plan over one micro-batch size does not read as a search over all."""
    if not fixed:
        return []
    flags = [megatron_flag(name) if value is True else f"without {megatron_flag(name)}" if value is False
             else f"{megatron_flag(name)} {value}" for name, value in fixed.items()]
    return [f"Kept fixed, not searched: {', '.join(flags)}."]


def plan_report(result: Plan, precision_note: str = "", fixed: Mapping[str, Any] | None = None) -> str:
    """The plan as text; the head says the precision priced (and `precision_note`, where it came from),
    and the layout flags `fixed` that the search kept."""
    head = (f"Planned {result.workload.name} in {precision_priced(result.workload)}{precision_note} on "
            f"{result.cluster_name} ({result.world_size} GPUs): "
            f"{result.considered} layouts considered, {result.out_of_memory} do not fit in memory.")
    return "\n".join([head, *fixed_flags(fixed or {}), *rejections(result), "", candidates_table(result),
                      headroom(result), winner(result.candidates[0])])


def estimate_report(layout_desc: str, time: TimeEstimate, memory: MemoryEstimate) -> str:
    misfit = misfit_reason(memory)
    verdict = "fits" if misfit is None else "DOES NOT FIT"
    lines = [f"{layout_desc}: {time.iteration_time_s:.3f} s/iteration, {time.tflops_per_gpu:.3g} TFLOP/s per GPU, "
             f"peak {_gib(memory.peak_bytes)} GiB of {_gib(memory.capacity_bytes)} GiB ({verdict})"]
    if misfit:
        lines.append(f"  {misfit}")
    lines += [f"  {line}" for line in tight_memory(memory) + extrapolated(time)]
    return "\n".join([*lines, "", breakdown(time), "", stage_memory(memory)])


def twin_report(probed: ClusterFile, simulated_s: float, wall_s: float, document_build_s: float,
                errors: dict[str, float]) -> str:
    """What `pipette probe-sim` found: the probe's simulated cost, its findings, its error against the truth."""
    p, nodes = probed.probe, probed.cluster.num_nodes
    lines = [f"simulated probe time {simulated_s:.2f} s (budget {p.budget_s:g} s), wall time {wall_s:.2f} s "
             f"(of it {document_build_s:.2f} s building the document)",
             f"  {p.world_size} ranks on {nodes} nodes x {probed.cluster.gpus_per_node}: "
             f"{p.intra_rounds_measured} of {p.intra_rounds} intra-node and {p.inter_rounds_measured} of "
             f"{p.inter_rounds} inter-node rounds, {p.node_pairs_measured} of "
             f"{nodes * (nodes - 1) // 2} node pairs measured"]
    findings = p.slow_nodes + p.slow_links
    lines.append("slow: " + ("none found" if not findings else f"{len(findings)} found"))
    lines += [f"  - {f}" for f in findings[:20]]
    if len(findings) > 20:
        lines.append(f"  ... and {len(findings) - 20} more")
    if errors:
        lines.append(f"inter-node bandwidth against the truth: median error {errors['median']:.1%}, worst "
                     f"{errors['worst']:.1%} over all node pairs, {errors['worst_measured']:.1%} over measured ones")
    lines += [f"skipped: {s}" for s in p.skipped]
    return "\n".join(lines)
