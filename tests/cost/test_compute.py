"""Roofline and profiled compute per stage and chunk."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_pipette.cost import compute
from megatron_pipette.cost.compute import roofline_layer, stage_work
from megatron_pipette.cost.gemm import GemmCurve, gemm_curve
from megatron_pipette.cost.model import CostModel
from megatron_pipette.spec.hardware import cluster_presets, lookup_gpu, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import LayerProfile, ProfiledModel, ProfileEntry
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

A100 = preset_cluster("dgx-a100", num_nodes=1)
UNIT = GemmCurve(log_table=None, half_dim=0.0)
"""Every GEMM at the large-GEMM rate: effective FLOPs are FLOPs."""
H100_GEMMS = sorted(Path(__file__).parents[2].glob("benchmarks/results/h100-*/gemm_efficiency.json"))


def attention_shape(b: int, heads: int, s: int, head_dim: int, cp: int = 1) -> compute.RankShape:
    """A TP rank's shape with b sequences of s tokens and `heads` heads of `head_dim` (MHA, 4h FFN)."""
    return compute.RankShape(tokens=b * s // cp, micro_batch=b, seq_length=s, cp=cp, hidden=heads * head_dim,
                             heads=heads, query_groups=heads, query_head_dim=head_dim, value_head_dim=head_dim,
                             ffn=4 * heads * head_dim, element_bytes=2, sp=1)


def measured_h100_gemms(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(dims (N, 3), rate over the run's 8192^3 rate (N,)) of every GEMM timed on the H100."""
    rows = [r for path in H100_GEMMS for r in json.loads(path.read_text())["rows"]
            if r["dtype"] == dtype and r.get("vs_reference")]
    return np.array([(r["m"], r["n"], r["k"]) for r in rows], dtype=float), np.array([r["vs_reference"] for r in rows])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_h100_table_holds_the_measured_gemms(dtype):
    """The H100 curve is the table fitted to these measurements (benchmarks/calibration/gemm_table.py): over all of
    them (fit and held-out shapes) it misses by 5% on average; the n / (n + 32) curve it replaced
    missed by over 10%, and the parametric fallback by 9-13%."""
    dims, measured = measured_h100_gemms(dtype)
    assert len(dims) > 3000
    curve = gemm_curve(lookup_gpu("H100"), dtype)
    error = np.abs(np.array([curve(*d) for d in dims]) / measured - 1)
    assert np.mean(error) < 0.06 and np.median(error) < 0.04
    fallback = gemm_curve(None, dtype)
    assert np.mean(np.abs(np.array([fallback(*d) for d in dims]) / measured - 1)) > 0.08


def test_gpus_without_a_table_use_the_parametric_curve_fitted_on_the_h100():
    data = json.loads((Path(compute.__file__).parents[1] / "data" / "gemm_efficiency.json").read_text())
    c = data["half_dim"]["bf16"]
    for gpu in (lookup_gpu("A100"), None):
        curve = gemm_curve(gpu, "bf16")
        assert curve.log_table is None
        assert curve(1024, 4096, 8192) == pytest.approx(np.prod([x / (x + c) for x in (1024, 4096, 8192)]))
    assert gemm_curve(lookup_gpu("A100"), "fp16").half_dim == gemm_curve(lookup_gpu("A100"), "bf16").half_dim == c
    h100, h200 = (gemm_curve(lookup_gpu(name), "bf16") for name in ("H100", "H200"))
    assert h200(4096, 4096, 4096) == h100(4096, 4096, 4096)


def test_table_interpolates_between_nodes_and_clamps_beyond_them():
    curve = gemm_curve(lookup_gpu("H100"), "bf16")
    lo, table = curve.lo, np.exp(curve.log_table)
    assert curve(2 ** 10, 2 ** 12, 2 ** 13) == pytest.approx(table[10 - lo, 12 - lo, 13 - lo])
    mid = curve(2 ** 10.5, 2 ** 12, 2 ** 13)
    assert mid == pytest.approx(np.sqrt(table[10 - lo, 12 - lo, 13 - lo] * table[11 - lo, 12 - lo, 13 - lo]))
    assert curve(2 ** 30, 2 ** 12, 2 ** 13) == curve(2 ** 18, 2 ** 12, 2 ** 13)


def test_a_gemm_below_the_tables_smallest_dimension_takes_at_least_its_time():
    """Tensor-core kernels compute whole tiles: below the table's 128 on any axis a GEMM takes at least
    the time of the same GEMM at 128 (an H200 timed M 16 and 64 alike against 8192 x 8192 weights),
    not the clamped rate's shorter time, nor the HBM floor's 0.73 of it."""
    curve = gemm_curve(lookup_gpu("H100"), "bf16")

    def seconds(m, n, k):
        return 2 * m * n * k / curve(m, n, k)

    for small in (16, 64, 100):
        for shape in ((small, 8192, 8192), (8192, small, 8192), (8192, 8192, small), (small, small, 4096)):
            assert seconds(*shape) >= seconds(*(max(x, 128) for x in shape)) * (1 - 1e-12)
    assert seconds(16, 8192, 8192) == pytest.approx(seconds(128, 8192, 8192), rel=1e-12)
    assert gemm_curve(None, "bf16")(16, 8192, 8192) < gemm_curve(None, "bf16")(128, 8192, 8192) / 4   # no table


def test_presets_run_at_the_measured_large_gemm_rate():
    h100 = lookup_gpu("H100")
    assert preset_cluster("dgx-h100", num_nodes=1).gemm_flops[0] == pytest.approx(0.795 * h100.peak("bf16"))
    assert A100.gemm_flops[0] == pytest.approx(0.83 * 312e12)          # calibrated on published runs
    v100 = preset_cluster("dgx-v100", num_nodes=1, precision="fp16")
    assert v100.gemm_flops[0] == pytest.approx(0.75 * 125e12)          # neither: the default


def test_raw_gemm_flops_are_megatrons_model_flops(monkeypatch):
    """With the efficiency curve off, forward + backward FLOPs of all stages x micro-batches x
    replicas are exactly workload.model_flops_per_iteration()."""
    monkeypatch.setattr(compute, "gemm_curve", lambda gpu, precision: UNIT)
    for name in ("gpt3-1.3b", "llama3-8b"):
        w = workload_from_preset(name)
        layout = Layout(pipeline_model_parallel_size=2, data_parallel_size=4, micro_batch_size=2)
        work = stage_work(resolve_job(w, layout), preset_cluster("dgx-a100", num_nodes=1))
        flops = work.forward.flops.sum() + work.backward.flops.sum()
        total = flops * resolve_job(w, layout).num_microbatches * layout.dp
        assert total == pytest.approx(w.model_flops_per_iteration(), rel=1e-12)


def test_causal_kernels_skip_the_masked_half_of_the_scores():
    """Flash/fused (and auto) causal attention does half the s^2 work; unfused attention multiplies
    the whole score matrix and masks it. Without a measured kernel the half runs at the GEMM curve."""
    curve = gemm_curve(lookup_gpu("A100"), "bf16")
    shape = attention_shape(2, 16, 4096, 128)
    full_f, full_b = compute.core_attention(shape=shape, gemm=curve, attention=None, causal_kernel=False)
    half_f, half_b = compute.core_attention(shape=shape, gemm=curve, attention=None, causal_kernel=True)
    assert (half_f, half_b) == (full_f / 2, full_b / 2) and full_b == 2 * full_f
    unit_f, _ = compute.core_attention(shape=shape, gemm=UNIT, attention=None, causal_kernel=False)
    assert unit_f == 4 * 2 * 16 * 4096 ** 2 * 128
    for backend, causal in (("auto", True), ("flash", True), ("fused", True), ("unfused", False), ("local", False)):
        w = workload_from_preset("llama3-8b", attention_backend=backend)
        work = stage_work(resolve_job(w, Layout(data_parallel_size=8)), A100)
        unfused = stage_work(resolve_job(workload_from_preset("llama3-8b", attention_backend="unfused"),
                                         Layout(data_parallel_size=8)), A100)
        assert (work.forward.flops.sum() < unfused.forward.flops.sum()) == causal


def test_measured_attention_kernels_price_the_core_on_h100():
    """Where the GPU has an attention table the core runs at the measured kernel's rate: cuDNN for
    auto and fused, FlashAttention for flash (benchmarks/results/h100-2026-11-23-run1/attention.json)."""
    h100 = lookup_gpu("H100")
    cudnn, flash = compute.attention_curve(h100, "auto"), compute.attention_curve(h100, "flash")
    assert np.array_equal(compute.attention_curve(h100, "fused").log_table, cudnn.log_table)
    assert compute.attention_curve(h100, "unfused") is None
    assert compute.attention_curve(lookup_gpu("A100"), "auto") is None
    flops = 2.0 * 1 * 32 * 8192 ** 2 * 128                         # llama3-8b, TP 1, s 8192: one call
    assert 0.75 < cudnn.efficiency(0, flops) < 0.85 and 0.35 < flash.efficiency(0, flops) < 0.45
    assert 0.5 < cudnn.efficiency(1, 2 * flops) < 0.6
    fwd, bwd = compute.core_attention(shape=attention_shape(1, 32, 8192, 128), gemm=gemm_curve(h100, "bf16"),
                                      attention=cudnn, causal_kernel=True)
    assert fwd == pytest.approx(flops / cudnn.efficiency(0, flops))
    assert bwd == pytest.approx(2 * flops / cudnn.efficiency(1, 2 * flops))


def test_backward_is_twice_forward_and_recompute_adds_forward_work():
    w = workload_from_preset("gpt3-6.7b")
    job = resolve_job(w, Layout(tensor_model_parallel_size=2))
    unit = roofline_layer(job, 2e12, UNIT)
    assert unit.backward.flops == pytest.approx(2 * unit.forward.flops)
    plain = roofline_layer(job, 2e12, gemm_curve(lookup_gpu("H100"), "bf16"))
    assert plain.backward.flops == pytest.approx(2 * plain.forward.flops, rel=0.05)   # data- and weight-
    assert plain.backward.flops != pytest.approx(2 * plain.forward.flops, rel=1e-3)   # gradient GEMMs at their shapes
    assert plain.recompute.flops == 0
    full = roofline_layer(resolve_job(w, Layout(tensor_model_parallel_size=2, recompute_granularity="full",
                                    recompute_method="uniform", recompute_num_layers=1)), 2e12)
    assert full.recompute == full.forward
    sel = roofline_layer(resolve_job(w, Layout(tensor_model_parallel_size=2, recompute_granularity="selective")), 2e12)
    assert 0 < sel.recompute.flops < 0.3 * sel.forward.flops


def test_tensor_parallelism_shards_the_layer():
    w = workload_from_preset("gpt3-13b")
    one, eight = (roofline_layer(resolve_job(w, Layout(tensor_model_parallel_size=t)), 2e12) for t in (1, 8))
    assert 8 / 1.15 < one.forward.flops / eight.forward.flops < 8   # smaller GEMMs run less efficiently


def test_sequence_parallel_shards_the_memory_bound_ops():
    w = workload_from_preset("gpt3-13b")
    tp, sp = (roofline_layer(resolve_job(w, Layout(tensor_model_parallel_size=4, sequence_parallel=s)), 2e12)
              for s in (False, True))
    assert sp.forward.mem_s < tp.forward.mem_s and sp.forward.flops == tp.forward.flops


def test_unfused_attention_pays_for_the_score_matrix():
    flash = roofline_layer(resolve_job(workload_from_preset("gpt3-1.3b"), Layout()), 2e12)
    local = roofline_layer(resolve_job(workload_from_preset("gpt3-1.3b", attention_backend="local"), Layout()), 2e12)
    assert local.forward.mem_s > 2 * flash.forward.mem_s


def test_first_and_last_stages_carry_embedding_and_output_layer():
    w = workload_from_preset("gpt3-1.3b")
    work = stage_work(resolve_job(w, Layout(pipeline_model_parallel_size=4, data_parallel_size=2)), A100)
    fwd = work.forward.flops + work.forward.mem_s * 1e15
    assert fwd[0, 0] > fwd[1, 0] and fwd[3, 0] > fwd[1, 0] and fwd[1, 0] == fwd[2, 0]
    output_gemm = 2 * 2048 * 2048 * 50304 / gemm_curve(A100.gpu, "bf16")(2048, 50304, 2048)
    assert work.forward.flops[3, 0] - work.forward.flops[1, 0] == pytest.approx(output_gemm)


def test_interleaving_splits_stages_into_chunks_with_the_ends_on_their_chunks():
    w = workload_from_preset("gpt3-1.3b")
    work = stage_work(resolve_job(w, Layout(pipeline_model_parallel_size=2, data_parallel_size=4,
                                num_layers_per_virtual_pipeline_stage=3)), A100)
    assert work.layers.shape == (2, 4) and np.all(work.layers == 3)
    assert work.forward.flops[1, 3] > work.forward.flops[1, 0]        # output layer on the last chunk
    assert work.backward.mem_s[0, 0] > work.backward.mem_s[0, 1]      # embedding on the first chunk


def test_block_recompute_counts_n_layers_per_chunk():
    w = workload_from_preset("gpt3-1.3b")
    layout = Layout(pipeline_model_parallel_size=2, data_parallel_size=4, recompute_granularity="full",
                    recompute_method="block", recompute_num_layers=5)
    work = stage_work(resolve_job(w, layout), A100)
    assert np.all(work.recomputed_layers == 5)
    per_layer = roofline_layer(resolve_job(w, layout), A100.memory_bandwidth_Bps).forward.flops
    assert work.recompute.flops[0, 0] == pytest.approx(5 * per_layer)


def _profile(rank=0, fwd=0.01, bwd=0.02, rc_bwd=None, gemm_flops=None):
    layers = [ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=1, forward_s=fwd, backward_s=bwd,
                           activation_bytes=1)]
    if rc_bwd is not None:
        layers.append(ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=1, forward_s=fwd,
                                   backward_s=rc_bwd, activation_bytes=1, recompute_granularity="full"))
    return LayerProfile(device_name="x", rank=rank, layers=tuple(layers), embedding=(), output_layer=(),
                        model=ProfiledModel(),
                        gemm_flops=gemm_flops)


def test_profile_replaces_the_roofline_and_scales_with_device_speed():
    w = workload_from_preset("gpt3-1.3b")
    c = preset_cluster("dgx-a100", num_nodes=1)
    c.gemm_flops[3] = c.gemm_flops[0] / 2                        # the profiled device is twice slower
    layout = Layout(data_parallel_size=8)
    work = stage_work(resolve_job(w, layout), c, _profile(rank=3))
    assert work.profiled
    output = compute.roofline_output(resolve_job(w, layout), c.memory_bandwidth_Bps).forward.flops   # not profiled here
    layers_s_on_fast_device = (work.forward.flops[0, 0] - output) / c.gemm_flops[0]
    assert layers_s_on_fast_device == pytest.approx(w.num_layers * 0.01 / 2)


def test_devices_sharing_cores_run_the_profile_slower():
    """Profiled alone at rate R; the probe saw every device at R/2 while all computed at once
    (four processes on two cores): the plan runs the profiled layer at half speed."""
    w = workload_from_preset("gpt3-1.3b")
    c = preset_cluster("dgx-a100", num_nodes=1)
    alone = stage_work(resolve_job(w, Layout(data_parallel_size=8)), c, _profile())
    shared = stage_work(resolve_job(w, Layout(data_parallel_size=8)), c, _profile(gemm_flops=2 * c.gemm_flops[0]))
    output = compute.roofline_output(resolve_job(w, Layout(data_parallel_size=8)), c.memory_bandwidth_Bps).forward.flops
    assert (shared.forward.flops[0, 0] - output) == pytest.approx(2 * (alone.forward.flops[0, 0] - output))


def test_profiled_recompute_is_split_out_of_backward():
    w = workload_from_preset("gpt3-1.3b")
    layout = Layout(data_parallel_size=8, recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)
    part = compute.profile_layer(_profile(rc_bwd=0.031), resolve_job(w, layout), A100)
    rate = A100.gemm_flops[0]
    assert part.backward.flops / rate == pytest.approx(0.02)
    assert part.recompute.flops / rate == pytest.approx(0.011)
    missing = compute.profile_layer(_profile(), resolve_job(w, layout), A100)   # no recompute entry: add one forward
    assert missing.recompute.flops / rate == pytest.approx(0.01)


def test_unprofiled_tensor_parallel_size_falls_back_to_the_roofline():
    w = workload_from_preset("gpt3-1.3b")
    job = resolve_job(w, Layout(tensor_model_parallel_size=2, data_parallel_size=4))
    assert not stage_work(job, A100, _profile()).profiled


def test_a_context_parallel_shard_gets_the_attention_to_the_other_ranks_keys_added():
    """The profile timed a CP-2 rank's s/2 tokens attending to their own s/2 keys; the rank's
    queries meet all s keys: the layer is the shard's time plus that attention difference (the
    causal s/2 x s core is twice the shard's own), forward, backward and in full recomputation.
    The embedding and output layer, timed over whole sequences, count the rank's half."""
    w = dataclasses.replace(workload_from_preset("gpt3-1.3b"), seq_length=8192, max_position_embeddings=8192)
    shard = ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=1, forward_s=0.004, backward_s=0.008,
                         activation_bytes=1, context_parallel_size=2)
    whole = ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=1, forward_s=0.006, backward_s=0.012,
                         activation_bytes=2)
    profile = LayerProfile(device_name="x", rank=0, layers=(whole, shard), embedding=(whole,), output_layer=(whole,),
                           model=ProfiledModel(), gemm_flops=1e15)
    layout = Layout(context_parallel_size=2, data_parallel_size=4, recompute_granularity="full",
                    recompute_method="uniform", recompute_num_layers=1)
    job = resolve_job(w, layout)
    gemm, attention = gemm_curve(A100.gpu, "bf16"), compute.attention_curve(A100.gpu, w.attention_backend)
    d = w.head_dim
    shard_core = compute.core_attention(shape=attention_shape(1, w.num_attention_heads, 4096, d), gemm=gemm,
                                        attention=attention, causal_kernel=True)
    rank_core = compute.core_attention(shape=attention_shape(1, w.num_attention_heads, 8192, d, cp=2), gemm=gemm,
                                       attention=attention, causal_kernel=True)
    assert rank_core[0] == pytest.approx(2 * shard_core[0], rel=0.2)       # twice the FLOPs, at another size's rate
    part = compute.profile_layer(profile, job, A100)
    assert part.forward.flops == pytest.approx(0.004e15 + rank_core[0] - shard_core[0])
    assert part.backward.flops == pytest.approx(0.008e15 + rank_core[1] - shard_core[1])
    assert part.recompute.flops == pytest.approx(part.forward.flops)
    assert profile.embedding_entry(1, 1, cp=2).forward_s == profile.output_entry(1, 1, cp=2).forward_s == 0.003
    assert stage_work(job, A100, profile).profiled
    assert not stage_work(resolve_job(w, dataclasses.replace(layout, context_parallel_size=4, data_parallel_size=2)),
                          A100, profile).profiled


def _synthetic_profile(gemm_flops: float) -> LayerProfile:
    """A layer, embedding and output layer measured at tp1 mbs1, at `gemm_flops` (the probe's rate)."""
    def entry(fwd, bwd):
        return ProfileEntry(tensor_model_parallel_size=1, micro_batch_size=1, forward_s=fwd, backward_s=bwd,
                            activation_bytes=1)
    return LayerProfile(device_name="x", rank=0, gemm_flops=gemm_flops, layers=(entry(0.01, 0.02),),
                        embedding=(entry(0.001, 0.002),), output_layer=(entry(0.003, 0.007),), model=ProfiledModel())


@pytest.mark.parametrize("preset", sorted(cluster_presets()))
def test_a_profile_comes_back_as_measured_on_every_gpu_of_the_catalog(preset):
    """Measured work is priced as measured: the step GEMM fraction (0.84 on H100 and H200) corrects the
    roofline's prices, not a profile's seconds, which the model gives back unchanged on the profiled
    device (one GPU: no collective, no other stage)."""
    gpu = lookup_gpu(cluster_presets()[preset]["gpu"])
    precision = "bf16" if "bf16" in gpu.peak_flops else "fp16"
    cluster = preset_cluster(preset, num_nodes=1, gpus_per_node=1, precision=precision)
    w = workload_from_preset("gpt3-1.3b", precision=precision, global_batch_size=4)
    stage = CostModel(cluster, profile=_synthetic_profile(float(cluster.gemm_flops[0]))).time(
        resolve_job(w, Layout(data_parallel_size=1))).stage_times[0]
    assert stage.forward_s == pytest.approx(w.num_layers * 0.01 + 0.001 + 0.003, rel=1e-12)
    assert stage.backward_s == pytest.approx(w.num_layers * 0.02 + 0.002 + 0.007, rel=1e-12)


def test_the_step_gemm_fraction_still_prices_the_roofline():
    """Without a profile the H100's layers take 1 / step_gemm_fraction of the tables' price."""
    cluster = preset_cluster("dgx-h100", num_nodes=1, gpus_per_node=1)
    job = resolve_job(workload_from_preset("gpt3-1.3b", global_batch_size=4), Layout(data_parallel_size=1))
    work = stage_work(job, cluster)
    assert cluster.step_gemm_fraction == 0.84
    assert CostModel(cluster).time(job).stage_times[0].forward_s == pytest.approx(
        float(work.forward.seconds(cluster.gemm_flops[0] * 0.84)[0, 0]), rel=1e-12)
