"""A job: one layout resolved for one workload, with every value Megatron derives from the pair.

Why: the cost model needs the layers of each pipeline stage, the model chunks per rank, the
micro-batches per iteration and the parameters each device holds; derived once here (and the
layout validated once, by Megatron's rules), every estimate reads them instead of deriving
them again.

    job = resolve_job(workload_from_preset("gpt3-1.3b"), Layout(pipeline_model_parallel_size=4,
                                                               data_parallel_size=8))
    job.stage_layers == (6, 6, 6, 6); job.num_microbatches == 64; job.virtual_stages == 1
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from megatron_pipette.spec.layout import Layout, chunk_sizes, validate_layout
from megatron_pipette.spec.workload import Workload


@dataclass(frozen=True, kw_only=True)
class Job:
    """What Megatron would run: a workload under a layout. Hashable, so estimates cache on it."""

    workload: Workload
    layout: Layout
    chunk_sizes: tuple[tuple[int, ...], ...]
    """Transformer layers in each (pipeline stage, model chunk): uneven first/last stages, and the
    embedding's or loss's place in the split, included."""
    num_microbatches: int
    """Micro-batches per iteration and data-parallel replica: global batch / (micro-batch x DP)."""
    moe_layers: tuple[tuple[int, ...], ...] = ()
    """MoE layers in each (pipeline stage, model chunk); () for a dense model."""
    window_layers: tuple[tuple[int, ...], ...] = ()
    """Sliding-window attention layers in each (pipeline stage, model chunk); () without --window-size."""

    @property
    def tokens_per_microbatch(self) -> int:
        """Tokens one rank of a tensor-parallel group sees per micro-batch: its context-parallel share."""
        return self.layout.micro_batch_size * self.workload.seq_length // self.layout.cp

    @cached_property
    def stage_layers(self) -> tuple[int, ...]:
        """Transformer layers on each pipeline stage."""
        return tuple(sum(chunks) for chunks in self.chunk_sizes)

    @property
    def embedding_on_last_stage(self) -> bool:
        """The last pipeline stage holds a copy of the word embedding, all-reduced with the first
        stage's every step: as the tied output layer, or for the MTP layers' lookups (GPTModel
        builds an embedding where mtp_process)."""
        w = self.workload
        return self.layout.pp > 1 and (not w.untie_embeddings_and_output_weights or w.mtp_layers > 0)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        return len(self.chunk_sizes[0])

    def chunk_layers(self) -> list[list[int]]:
        """Global layer indices of each (stage, chunk), as Megatron assigns them: chunk c of every
        stage in turn, then chunk c+1 (get_transformer_layer_offset), each after the ones before."""
        pp, v = self.layout.pp, self.virtual_stages
        out: list[list[list[int]]] = [[[] for _ in range(v)] for _ in range(pp)]
        start = 0
        for c in range(v):
            for r in range(pp):
                n = self.chunk_sizes[r][c]
                out[r][c] = list(range(start, start + n))
                start += n
        return out


def resolve_job(workload: Workload, layout: Layout, world_size: int | None = None) -> Job:
    """The job of `layout` for `workload`; raises Infeasible (naming the flags) where Megatron
    would reject the layout, and when `world_size` is given and the layout does not fill it."""
    validate_layout(workload, layout, world_size)
    job = Job(workload=workload, layout=layout,
              chunk_sizes=tuple(tuple(chunks) for chunks in chunk_sizes(workload, layout)),
              num_microbatches=workload.global_batch_size // (layout.micro_batch_size * layout.dp))
    windows = workload.window_layer_pattern()
    if workload.num_experts is None and not any(windows):
        return job
    chunks = job.chunk_layers()

    def per_chunk(pattern: tuple[bool, ...]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sum(pattern[i] for i in chunk) for chunk in stage) for stage in chunks)

    return dataclasses.replace(job, moe_layers=per_chunk(workload.moe_layer_pattern()) if workload.num_experts else (),
                               window_layers=per_chunk(windows) if any(windows) else ())
