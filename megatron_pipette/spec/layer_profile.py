"""The layer-profile input: measured per-layer compute time and activation memory.

`megatron_pipette.profile` measures one transformer layer (and the embedding
and output layer with loss) on one device, sharded as for each candidate
tensor-parallel size, and writes this document (schema version 1). The
planner uses it in place of the roofline estimate. Times are compute only:
tensor-parallel communication is modelled from the link matrix.

    {
      "schema": "megatron-pipette/layer-profile", "version": 1,
      "device": {"rank": 0, "host": "node0", "device_name": "NVIDIA H100 80GB HBM3"},
      "model": {"hidden_size": 4096, "num_attention_heads": 32, "ffn_hidden_size": 16384,
                "num_query_groups": 32, "seq_length": 2048, "swiglu": false,
                "precision": "bf16", "vocab_size": 50257},
      "layers": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1,
                  "sequence_parallel": false, "recompute_granularity": null,
                  "forward_s": 0.0021, "backward_s": 0.0043,
                  "activation_bytes": 570425344, "measured": true}, ...],
      "embedding": [{"tensor_model_parallel_size": 1, "micro_batch_size": 1,
                     "forward_s": ..., "backward_s": ..., "activation_bytes": ..., "measured": true}],
      "output_layer": [... the same keys, loss included ...]
    }

`backward_s` of an entry with recomputation includes the recomputed forward.
Entries with `"measured": false` were interpolated by the profiler, or (sequence-parallel entries)
derived from the measured non-SP entry: its times and the activation bytes SP shards. A layer
entry with `"context_parallel_size": CP` (absent: 1) times one CP rank's seq_length / CP tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.expressions import in_range
from megatron_pipette.spec.hardware import Cluster, gpu_catalog
from megatron_pipette.spec.job import Job
from megatron_pipette.spec.layout import DEFAULT_RECOMPUTE_MODULES
from megatron_pipette.spec.workload import (
    ATTENTION_BACKENDS,
    MAX_SIZE,
    NORMALIZATIONS,
    POSITION_EMBEDDINGS,
    PRECISIONS,
    AttentionBackend,
    Normalization,
    PositionEmbeddingType,
    Precision,
    Workload,
)

SCHEMA = "megatron-pipette/layer-profile"
VERSION = 1


@dataclass(frozen=True, kw_only=True)
class ProfileEntry:
    """One measured (or interpolated) shape."""

    tensor_model_parallel_size: int
    micro_batch_size: int
    forward_s: float
    backward_s: float
    activation_bytes: int
    """Bytes a micro-batch keeps alive from forward to backward (per device)."""
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    measured: bool = True
    context_parallel_size: int = 1
    """> 1: a layer over one context-parallel rank's seq_length / CP tokens, attending to its own
    keys only (cost.compute.profile_layer adds the other ranks')."""


@dataclass(frozen=True, kw_only=True)
class ProfiledModel:
    """The model a profile timed, as its "model" block holds it: the fields it is tied to
    (profile_model_fields) and those that rebuild its layer (ProfileFile.workload). None: the block
    does not name it (a hand-written profile, or none at all), which check_profile_matches counts as
    another model where the field is tied."""

    hidden_size: int | None = None
    num_attention_heads: int | None = None
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    seq_length: int | None = None
    swiglu: bool | None = None
    precision: Precision | None = None
    vocab_size: int | None = None
    normalization: Normalization | None = None
    add_bias_linear: bool | None = None
    position_embedding_type: PositionEmbeddingType | None = None
    attention_backend: AttentionBackend | None = None
    hidden_dropout: float | None = None
    attention_dropout: float | None = None

    @classmethod
    def of(cls, workload: Workload) -> ProfiledModel:
        """What the profiler writes of the model it times."""
        return cls(**profile_model_fields(workload), normalization=workload.normalization,
                   add_bias_linear=workload.add_bias_linear, position_embedding_type=workload.position_embedding_type,
                   attention_backend=workload.attention_backend, hidden_dropout=workload.hidden_dropout,
                   attention_dropout=workload.attention_dropout)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, doc: dict[str, Any], where: str) -> ProfiledModel:
        """The "model" block (keys it does not know are left to the document); PipetteError naming
        `where` and the field on a value of the wrong kind."""
        names = [f.name for f in dataclasses.fields(cls)]
        for name in names:
            kind, holds = _KINDS[name]
            if doc.get(name) is not None and not holds(doc[name]):
                raise PipetteError(f"{where}: model.{name} must be {kind}, got {doc[name]!r}")
        return cls(**{name: doc.get(name) for name in names})


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(values: tuple[str, ...]) -> tuple[str, Callable[[Any], bool]]:
    return f"one of {', '.join(values)}", lambda value: value in values


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **dict.fromkeys(("hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups", "seq_length",
                     "vocab_size"), ("an integer", _integer)),
    **dict.fromkeys(("swiglu", "add_bias_linear"), ("true or false", lambda value: isinstance(value, bool))),
    **dict.fromkeys(("hidden_dropout", "attention_dropout"),
                    ("a number", lambda value: _integer(value) or isinstance(value, float))),
    "precision": _one_of(PRECISIONS), "normalization": _one_of(NORMALIZATIONS),
    "position_embedding_type": _one_of(POSITION_EMBEDDINGS), "attention_backend": _one_of(ATTENTION_BACKENDS)}
"""What each ProfiledModel field holds, and its check."""


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    device_name: str
    rank: int
    """Rank of the profiled device in the cluster file, to scale other devices' speed."""
    gemm_flops: float | None = None
    """The probe's GEMM rate on the profiled device, alone, just before profiling; None (older
    profiles): the cluster file's rate for `rank` stands in."""
    layers: tuple[ProfileEntry, ...]
    embedding: tuple[ProfileEntry, ...]
    output_layer: tuple[ProfileEntry, ...]
    model: ProfiledModel

    def covers(self, job: Job) -> bool:
        """Whether its dense-layer figures stand for this job's: the profiler times the training
        dtype through standard attention, and selective recomputation of the attention core only,
        so not under FP8 or FP4, multi-latent attention, --qk-layernorm or other --recompute-modules; under
        context parallelism only if it timed that CP size's shard."""
        w, cp = job.workload, job.layout.cp
        return ((cp == 1 or any(e.context_parallel_size == cp for e in self.layers))
                and w.quantisation_recipe is None and not w.multi_latent_attention and not w.qk_layernorm
                and job.layout.selective_modules in (frozenset(), DEFAULT_RECOMPUTE_MODULES))

    def layer(self, tp: int, mbs: int, sequence_parallel: bool, recompute: str | None,
              cp: int = 1) -> ProfileEntry | None:
        return _lookup(self.layers, tp, mbs, sequence_parallel, recompute, cp)

    def embedding_entry(self, tp: int, mbs: int, cp: int = 1) -> ProfileEntry | None:
        """Whole sequences; under CP a rank's share (the gather is per token)."""
        return _shard(_lookup(self.embedding, tp, mbs, None, None), cp)

    def output_entry(self, tp: int, mbs: int, cp: int = 1) -> ProfileEntry | None:
        """Whole sequences; under CP a rank's share (norm, logits and loss are per token)."""
        return _shard(_lookup(self.output_layer, tp, mbs, None, None), cp)


def _shard(entry: ProfileEntry | None, cp: int) -> ProfileEntry | None:
    if entry is None or cp == 1:
        return entry
    return dataclasses.replace(entry, forward_s=entry.forward_s / cp, backward_s=entry.backward_s / cp,
                               activation_bytes=entry.activation_bytes // cp, measured=False)


def _lookup(entries: tuple[ProfileEntry, ...], tp: int, mbs: int, sp: bool | None,
            recompute: str | None, cp: int = 1) -> ProfileEntry | None:
    """The entry for this shape, scaling the nearest micro-batch size linearly (time and
    activations are affine-to-linear in tokens), or None if the TP (or CP) size was not profiled."""
    candidates = _candidates(entries, tp, sp, recompute, cp)
    if not candidates:
        return None
    exact = [e for e in candidates if e.micro_batch_size == mbs]
    if exact:
        return exact[0]
    near = _nearest(candidates, mbs)
    k = mbs / near.micro_batch_size
    return ProfileEntry(tensor_model_parallel_size=tp, micro_batch_size=mbs, forward_s=near.forward_s * k,
                        backward_s=near.backward_s * k, activation_bytes=int(near.activation_bytes * k),
                        sequence_parallel=near.sequence_parallel, recompute_granularity=recompute, measured=False,
                        context_parallel_size=cp)


def _candidates(entries: tuple[ProfileEntry, ...], tp: int, sp: bool | None, recompute: str | None,
                cp: int = 1) -> list[ProfileEntry]:
    """The entries of this shape but the micro-batch size (`sp` None: either)."""
    return [e for e in entries if e.tensor_model_parallel_size == tp and e.context_parallel_size == cp
            and (sp is None or e.sequence_parallel == sp) and e.recompute_granularity == recompute]


def _nearest(candidates: list[ProfileEntry], mbs: int) -> ProfileEntry:
    """The entry whose micro-batch size is nearest `mbs` (the larger of two as near)."""
    return min(candidates, key=lambda e: (abs(e.micro_batch_size - mbs), -e.micro_batch_size))


def profile_extrapolations(profile: LayerProfile, job: Job) -> tuple[str, ...]:
    """What pricing `job` takes from `profile` beyond what it measured, a line each; empty where
    every entry it uses was measured at the job's shape. Plans name these: a time scaled linearly from
    another micro-batch size misses what does not scale with tokens (a layer's launches and fixed
    costs), and an entry the profiler interpolated or derived (`"measured": false`) was never timed.
    Callers check the profile covers the job (LayerProfile.covers); another vocabulary or sequence
    length is another model (check_profile_matches), refused, not extrapolated."""
    layout = job.layout
    tp, mbs, sp, cp, rc = (layout.tp, layout.micro_batch_size, layout.sequence_parallel, layout.cp,
                           layout.recompute_granularity)
    parts = [("layer", profile.layers, sp, None, cp)]
    if rc:
        parts.append((f"layer with {rc} recomputation", profile.layers, sp, rc, cp))
    parts += [("embedding", profile.embedding, None, None, 1), ("output layer", profile.output_layer, None, None, 1)]
    found: dict[tuple[str, str], list[str]] = {}          # (shape, what was done) -> the parts
    for name, entries, part_sp, part_rc, part_cp in parts:
        candidates = _candidates(entries, tp, part_sp, part_rc, part_cp)
        if not candidates:
            continue
        shape = f"at tp {tp}" + (", sequence parallel" if part_sp else "") + (f", cp {part_cp}" if part_cp > 1 else "")
        exact = [e for e in candidates if e.micro_batch_size == mbs]
        if exact and not exact[0].measured:
            found.setdefault((shape, f"micro-batch {mbs} interpolated or derived by the profiler, not measured"),
                             []).append(name)
        elif not exact:
            measured = sorted({e.micro_batch_size for e in candidates if e.measured})
            near = _nearest(candidates, mbs).micro_batch_size
            found.setdefault((shape, f"profiled at micro-batch {','.join(map(str, measured)) or 'none measured'}; "
                                     f"micro-batch {mbs} extrapolated linearly from {near}"), []).append(name)
    lines = [f"{' and '.join(filter(None, (', '.join(names[:-1]), names[-1])))} {shape}: {what}"
             for (shape, what), names in found.items()]
    if rc and bool(_candidates(profile.layers, tp, sp, None, cp)) != bool(_candidates(profile.layers, tp, sp, rc, cp)):
        lines.append(f"layer at tp {tp}: {rc} recomputation's redone forward taken as the roofline's share of the "
                     f"profiled forward (only one of the entries with and without it was profiled)")
    return tuple(lines)


def _entries(data: dict, key: str, where: str) -> tuple[ProfileEntry, ...]:
    rows = data.get(key, [])
    if not isinstance(rows, list):
        raise PipetteError(f"{where}: '{key}' must be a list")
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(ProfileEntry(
                tensor_model_parallel_size=int(row["tensor_model_parallel_size"]),
                micro_batch_size=int(row["micro_batch_size"]), forward_s=float(row["forward_s"]),
                backward_s=float(row["backward_s"]), activation_bytes=int(row["activation_bytes"]),
                sequence_parallel=bool(row.get("sequence_parallel", False)),
                recompute_granularity=row.get("recompute_granularity"), measured=bool(row.get("measured", True)),
                context_parallel_size=int(row.get("context_parallel_size", 1))))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise PipetteError(f"{where}: {key}[{i}] is malformed ({e!r})") from None
        entry = out[-1]
        sizes = (entry.tensor_model_parallel_size, entry.micro_batch_size, entry.context_parallel_size)
        if not (all(in_range(t, 0, above=True) for t in (entry.forward_s, entry.backward_s))
                and entry.activation_bytes >= 0 and all(0 < n <= MAX_SIZE for n in sizes)):
            raise PipetteError(f"{where}: {key}[{i}] needs finite positive times, non-negative activation bytes, "
                               f"and tensor-parallel, micro-batch and context-parallel sizes in 1..{MAX_SIZE}")
    return tuple(out)


def profile_from_json(data: Any, where: str = "--layer-profile") -> LayerProfile:
    """Validate a layer-profile document."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise PipetteError(f"{where}: not a megatron-pipette layer profile (missing \"schema\": \"{SCHEMA}\")")
    if data.get("version") != VERSION:
        raise PipetteError(f"{where}: layer-profile schema version {data.get('version')!r} is not supported")
    layers = _entries(data, "layers", where)
    if not layers:
        raise PipetteError(f"{where}: 'layers' is empty")
    device, model = data.get("device", {}), data.get("model", {})
    if not isinstance(device, dict) or not isinstance(model, dict):
        raise PipetteError(f"{where}: 'device' and 'model' must be objects")
    rate, rank = device.get("gemm_flops"), device.get("rank", 0)
    if rate is not None and not in_range(rate, 0, above=True):
        raise PipetteError(f"{where}: device.gemm_flops must be a positive number, got {rate!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise PipetteError(f"{where}: device.rank must be a non-negative integer, got {rank!r}")
    return LayerProfile(device_name=str(device.get("device_name", "unknown")), rank=rank,
                        gemm_flops=None if rate is None else float(rate),
                        layers=layers, embedding=_entries(data, "embedding", where),
                        output_layer=_entries(data, "output_layer", where),
                        model=ProfiledModel.from_json(model, where))


def profile_model_fields(workload: Workload) -> dict:
    """The workload fields a profile is tied to; a profile of another model must not be used. Its
    sequence length and vocabulary are among them: a layer timed at another length runs another
    attention (s^2) to linear mix, an output layer and loss of another vocabulary other GEMMs, which
    no linear scaling recovers."""
    return {"hidden_size": workload.hidden_size, "num_attention_heads": workload.num_attention_heads,
            "ffn_hidden_size": workload.ffn, "num_query_groups": workload.query_groups,
            "seq_length": workload.seq_length, "swiglu": workload.gated_linear_unit,   # gated: the shapes timed
            "precision": workload.precision, "vocab_size": workload.vocab_size}   # the output layer's time


def check_profile_device(profile: LayerProfile, cluster: Cluster, where: str = "--layer-profile") -> None:
    """A profile times one kind of device; using a CPU or another GPU's times for this cluster would
    silently mispredict (device speed scaling only corrects for small differences)."""
    profiled = gpu_catalog().get(profile.device_name.lower())
    if cluster.gpu is not None and profiled is not cluster.gpu:
        raise PipetteError(f"{where}: profiled on {profile.device_name!r}, but the cluster's devices are "
                           f"{cluster.gpu.name}; profile on one of them")


def check_profile_matches(profile: LayerProfile, workload: Workload, where: str = "--layer-profile") -> None:
    expected = profile_model_fields(workload)
    wrong = {k: (getattr(profile.model, k), v) for k, v in expected.items() if getattr(profile.model, k) != v}
    if wrong:
        details = ", ".join(f"{k}={got!r} (model has {want!r})" for k, (got, want) in wrong.items())
        raise PipetteError(f"{where}: profiled for another model: {details}")


@dataclass(frozen=True)
class ProfileFile:
    """A layer-profile document (the profiler's: `pipette profile`, the hook), typed: the LayerProfile the
    cost model prices with and what the measurement covered. Its one reader is `from_json`; `document`
    is the file as written, which `to_json` gives back unchanged."""

    profile: LayerProfile
    layer_spec: str | None
    """"transformer_engine" or "local": the layer the times are of."""
    measured_shapes: int
    skipped_shapes: int
    """Shapes the budget or the device's memory left out."""
    elapsed_s: float | None
    document: Mapping[str, Any]

    @classmethod
    def from_json(cls, data: Any, where: str = "--layer-profile") -> ProfileFile:
        """Validate a layer-profile document: PipetteError naming `where` if it is not one."""
        profile = profile_from_json(data, where)
        m = data.get("measurement")
        m = m if isinstance(m, dict) else {}
        return cls(profile, m.get("layer_spec"), len(m.get("measured") or ()), len(m.get("skipped") or ()),
                   m.get("elapsed_s"), data)

    def to_json(self) -> dict[str, Any]:
        return dict(self.document)

    def workload(self) -> Workload:
        """The profiled model as a Workload (one layer; the batch does not matter here)."""
        m = self.profile.model
        named = {k: v for k, v in dataclasses.asdict(m).items() if v is not None}
        for k in ("num_query_groups", "num_attention_heads", "hidden_size", "ffn_hidden_size", "seq_length",
                  "swiglu", "precision"):
            if k not in named:
                raise PipetteError(f"layer profile: 'model' lacks {k!r}")
        gqa = named.pop("num_query_groups") != m.num_attention_heads
        workload = Workload(num_layers=1, global_batch_size=1, group_query_attention=gqa,
                            num_query_groups=m.num_query_groups if gqa else None,
                            kv_channels=m.hidden_size // m.num_attention_heads, **named)
        if self.layer_spec == "local":
            workload = dataclasses.replace(workload, attention_backend="unfused")
        return workload
