"""Every prediction the cost model returns is a physical number: finite, and positive where a job
takes time or memory (non-negative where a part of it may be zero), over workloads, layouts, layer
profiles and clusters drawn at random."""

import dataclasses
import math
from itertools import islice

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.search import enumerate_layouts
from megatron_pipette.spec.hardware import cluster_presets, lookup_gpu, preset_cluster
from megatron_pipette.spec.layer_profile import LayerProfile, ProfileEntry, profile_model_fields
from megatron_pipette.spec.workload import workload_from_preset

PRESETS = ("dgx-v100", "dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "gb200-nvl72")


@st.composite
def workloads(draw):
    heads = draw(st.sampled_from([4, 8, 16]))
    seq = draw(st.sampled_from([256, 2048, 8192]))
    fields = dict(num_layers=draw(st.integers(1, 8)), num_attention_heads=heads,
                  hidden_size=heads * draw(st.sampled_from([16, 64, 128])), seq_length=seq,
                  max_position_embeddings=seq, vocab_size=draw(st.sampled_from([1000, 32000, 128256])),
                  global_batch_size=draw(st.sampled_from([8, 16, 64])),
                  precision=draw(st.sampled_from(["fp32", "fp16", "bf16"])), swiglu=draw(st.booleans()),
                  attention_backend=draw(st.sampled_from(["auto", "unfused"])),
                  hidden_dropout=draw(st.sampled_from([0.0, 0.1])), attention_dropout=draw(st.sampled_from([0.0, 0.1])))
    if draw(st.booleans()):
        fields.update(group_query_attention=True, num_query_groups=draw(st.sampled_from([1, 2, heads])))
    if draw(st.booleans()):
        fields.update(num_experts=draw(st.sampled_from([4, 8])), moe_router_topk=draw(st.sampled_from([1, 2])),
                      moe_token_dispatcher_type="alltoall")
    if draw(st.booleans()):
        fields.update(window_size=draw(st.sampled_from(["127,0", "511,0"])),
                      window_attn_skip_freq=draw(st.sampled_from([None, 2])))
    try:
        return workload_from_preset("gpt3-125m", **fields)
    except PipetteError:
        assume(False)


@st.composite
def clusters(draw, precision: str):
    preset = draw(st.sampled_from(PRESETS))
    assume(precision in lookup_gpu(cluster_presets()[preset]["gpu"]).peak_flops)
    cluster = preset_cluster(preset, num_nodes=draw(st.sampled_from([1, 2])),
                             gpus_per_node=draw(st.sampled_from([1, 2, 4])), precision=precision)
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    cluster = dataclasses.replace(cluster, gemm_flops=cluster.gemm_flops * rng.uniform(0.5, 1, cluster.world_size))
    kind = draw(st.sampled_from(["preset", "cpu", "no catalog gpu"]))
    if kind == "cpu":           # a CPU rehearsal's rates: GEMMs 10^4 slower, memory 10^3
        cluster = dataclasses.replace(cluster, gemm_flops=cluster.gemm_flops / 1e4,
                                      memory_bandwidth_Bps=cluster.memory_bandwidth_Bps / 1e3)
    return dataclasses.replace(cluster, gpu=None) if kind == "no catalog gpu" else cluster


@st.composite
def profiles(draw, workload):
    """A profile of `workload` (or none): tp 1, 2 and 4, micro-batch 1 and 2, every recomputation,
    times from a microsecond to seconds, profiled at rates from a CPU's to a GPU's."""
    if draw(st.booleans()):
        return None
    seconds = st.sampled_from([1e-6, 3e-4, 0.02, 5.0])

    def entries(recompute, sequence_parallel=(False,)):
        return [ProfileEntry(tensor_model_parallel_size=tp, micro_batch_size=mbs, forward_s=draw(seconds),
                             backward_s=draw(seconds), activation_bytes=draw(st.integers(0, 1 << 34)),
                             recompute_granularity=rc, sequence_parallel=sp, measured=draw(st.booleans()))
                for tp in (1, 2, 4) for mbs in draw(st.sampled_from([(1,), (1, 2), (2,)]))
                for rc in recompute for sp in sequence_parallel]

    layers = entries(draw(st.sampled_from([(None,), (None, "selective", "full"), ("full",)])), (False, True))
    return LayerProfile(device_name="x", rank=0, gemm_flops=draw(st.sampled_from([None, 1e9, 1e12, 1e15])),
                        layers=tuple(layers), embedding=tuple(entries((None,))),
                        output_layer=tuple(entries((None,))), model=profile_model_fields(workload))


@st.composite
def cases(draw):
    workload = draw(workloads())
    cluster = draw(clusters(workload.precision))
    jobs = list(islice(enumerate_layouts(workload, cluster.world_size, cluster.gpus_per_node), 400))
    assume(jobs)
    return workload, cluster, draw(st.sampled_from(jobs)), draw(profiles(workload)), draw(st.booleans())


def finite(x, positive: bool) -> bool:
    return math.isfinite(x) and (x > 0 if positive else x >= 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cases())
def test_every_time_and_memory_figure_is_finite_and_positive(case):
    workload, cluster, job, profile, simulate = case
    model = CostModel(cluster, profile=profile)
    time = model.time(job, simulate=simulate)
    assert finite(time.iteration_time_s, True) and finite(time.tflops_per_gpu, True)
    for stage in time.stage_times:
        assert finite(stage.forward_s, True) and finite(stage.backward_s, True), stage
    for part, seconds in time.breakdown.as_dict().items():
        assert finite(seconds, False), (part, seconds)
    assert finite(model.time_bound(job), True) and model.time_bound(job) <= time.iteration_time_s * (1 + 1e-9)
    memory = model.memory(job)
    assert finite(memory.peak_bytes, True)
    for stage in memory.stages:
        for name, value in dataclasses.asdict(stage).items():
            assert finite(value, name not in ("stage", "step_bytes", "activation_bytes", "transient_bytes",
                                              "optimizer_bytes", "gradient_bytes")), (stage.stage, name, value)
        assert finite(stage.total_bytes, True)
