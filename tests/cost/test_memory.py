import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pipette.cost import simulator
from megatron_pipette.cost.memory import (
    DEFAULT_OVERHEADS,
    GiB,
    MemoryEstimate,
    RuntimeOverheads,
    StageMemory,
    _chunk_activations,
    _in_flight_states,
    _job_terms,
    _peak_candidates,
    activation_bytes_per_layer,
    communicators,
    estimate_memory,
    in_flight_microbatches,
    microbatches_in_flight,
    misfit_reason,
    state_bytes_per_parameter,
)
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.spec.hardware import lookup_gpu, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import LayerProfile, ProfiledModel, ProfileEntry
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

H100 = lookup_gpu("H100").memory_bytes  # 81085 MiB, as torch reports it
GPT3 = workload_from_preset("gpt3-175b")  # 96 layers, h 12288, 96 heads, s 2048, dropout 0.1
# Korthikanti et al. 2022 assume unfused attention (the s*s scores are stored) and 2-byte activations.
GPT3_PAPER = dataclasses.replace(GPT3, attention_backend="local")
NO_COMM = RuntimeOverheads(cuda_context_bytes=GiB, comm_buffer_bytes_per_group=0, fragmentation=0.15)


def L(**kw) -> Layout:
    return Layout(**kw)


# Model state: Megatron's distributed-optimizer table (docs/source/api-guide/dist_optimizer.md).

@pytest.mark.parametrize("precision, bf16_grads, replicated, sharded",
                         [("bf16", False, 6, 12), ("fp16", False, 4, 16), ("fp32", False, 8, 8),
                          ("bf16", True, 4, 16), ("fp32", True, 8, 8)])
@pytest.mark.parametrize("dp", [1, 2, 8, 64])
def test_bytes_per_parameter_match_megatron_table(precision, bf16_grads, replicated, sharded, dp):
    """18, 20, 16; --grad-reduce-in-bf16 makes bf16 fp16's case (bf16 gradient buffers, fp32 main
    gradients in the step) and leaves fp32 alone, as Megatron's validate_args does."""
    w = dataclasses.replace(workload_from_preset("gpt3-1.3b"), precision=precision, grad_reduce_in_bf16=bf16_grads)
    assert sum(state_bytes_per_parameter(w)) == replicated + sharded
    for dist, expected in ((False, replicated + sharded), (True, replicated + sharded / dp)):
        est = estimate_memory(resolve_job(w, L(data_parallel_size=dp, use_distributed_optimizer=dist)), H100)
        (stage,) = est.stages
        per_param = (stage.weight_bytes + stage.gradient_bytes + stage.optimizer_bytes
                     + stage.step_bytes) / stage.parameters
        assert per_param == pytest.approx(expected, rel=1e-9)


def test_fp16_main_gradients_live_only_in_the_optimizer_step():
    """fp16: step() creates the fp32 main gradients and zero_grad(set_to_none) frees them before the
    next forward, so they never meet the activations: the peak is model state plus the larger of
    the forward-backward's working set and the step's. GPT-3 175B, TP 8 x PP 8: 10.5 GiB on stage
    0, which the old model added on top of the activations."""
    w = dataclasses.replace(GPT3, precision="fp16")
    layout = L(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, recompute_granularity="full",
               recompute_method="uniform", recompute_num_layers=1)
    stage = estimate_memory(resolve_job(w, layout), H100).stages[0]
    assert stage.step_bytes == 4 * stage.parameters and stage.step_bytes / GiB == pytest.approx(10.5, abs=0.05)
    assert stage.optimizer_bytes == 12 * stage.parameters
    static = stage.weight_bytes + stage.gradient_bytes + stage.optimizer_bytes + stage.overhead_bytes
    assert stage.activation_bytes + stage.transient_bytes < stage.step_bytes
    assert stage.total_bytes == static + stage.step_bytes
    bf16 = estimate_memory(resolve_job(GPT3, layout), H100).stages[0]
    assert bf16.step_bytes == 0 and bf16.total_bytes == (bf16.weight_bytes + bf16.gradient_bytes + bf16.optimizer_bytes
                                                         + bf16.overhead_bytes + bf16.activation_bytes
                                                         + bf16.transient_bytes)
    dist = estimate_memory(resolve_job(w, dataclasses.replace(layout, data_parallel_size=4,
                                                             use_distributed_optimizer=True)), H100).stages[0]
    assert dist.step_bytes == -(-4 * dist.parameters // 4)


@pytest.mark.parametrize("preset", ["gpt3-175b", "llama2-70b"])
@pytest.mark.parametrize("pp", [1, 4])
def test_stage_parameters_add_up_to_the_model(preset, pp):
    w = workload_from_preset(preset)
    stages = estimate_memory(resolve_job(w, L(pipeline_model_parallel_size=pp)), H100).stages
    tied_copy = w.padded_vocab_size(1) * w.hidden_size if pp > 1 and not w.untie_embeddings_and_output_weights else 0
    assert sum(s.parameters for s in stages) == w.total_parameters(1) + tied_copy
    if pp > 1:  # embedding on the first stage, output layer and final norm on the last
        middle = w.num_layers // pp * w.layer_parameters()
        assert stages[1].parameters == middle
        assert stages[0].parameters == middle + w.embedding_parameters(1)
        assert stages[-1].parameters == middle + w.norm_parameters() + w.padded_vocab_size(1) * w.hidden_size


def test_tensor_parallel_shards_all_but_norms_and_row_biases():
    h = GPT3.hidden_size  # GPT-3 layer: 12h^2 + 13h; 2 LayerNorms (4h) and 2 row-parallel biases (2h) stay whole
    assert GPT3.layer_parameters() == 12 * h * h + 13 * h
    job = resolve_job(GPT3, L(tensor_model_parallel_size=8, pipeline_model_parallel_size=8))
    middle = estimate_memory(job, H100).stages[3]
    assert middle.parameters == 12 * ((12 * h * h + 7 * h) // 8 + 6 * h)


# Activations per layer: Korthikanti et al. 2022, the per-layer figures of section 4 (their Table 2).

@pytest.mark.parametrize("mbs", [1, 2])
@pytest.mark.parametrize("kw, expected", [
    (dict(), lambda sbh, a5: 34 * sbh + a5),                                            # no parallelism
    (dict(tensor_model_parallel_size=8), lambda sbh, a5: 10 * sbh + 24 * sbh // 8 + a5 // 8),
    (dict(tensor_model_parallel_size=8, sequence_parallel=True), lambda sbh, a5: (34 * sbh + a5) // 8),
    (dict(tensor_model_parallel_size=8, recompute_granularity="selective"), lambda sbh, a5: 10 * sbh + 24 * sbh // 8),
    (dict(tensor_model_parallel_size=8, sequence_parallel=True, recompute_granularity="selective"),
     lambda sbh, a5: 34 * sbh // 8),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), lambda sbh, a5: 2 * sbh),
    (dict(tensor_model_parallel_size=8, sequence_parallel=True, recompute_granularity="full",
          recompute_method="uniform", recompute_num_layers=1), lambda sbh, a5: 2 * sbh // 8),
])
def test_korthikanti_reduction_for_gpt3_175b(mbs, kw, expected):
    s, b, h, a = GPT3.seq_length, mbs, GPT3.hidden_size, GPT3.num_attention_heads
    sbh, a5 = s * b * h, 5 * a * s * s * b  # sbh * 5as/h = 5as^2b
    assert activation_bytes_per_layer(resolve_job(GPT3_PAPER, L(micro_batch_size=mbs, **kw))) == expected(sbh, a5)


def test_generalised_terms():
    s, h = GPT3.seq_length, GPT3.hidden_size
    sbh, a_ss = s * h, GPT3.num_attention_heads * s * s
    base = activation_bytes_per_layer(resolve_job(GPT3_PAPER, L()))
    # Flash/fused attention (auto is the default) keeps no s*s scores: 34sbh exactly.
    assert activation_bytes_per_layer(resolve_job(GPT3, L())) == 34 * sbh
    # No dropout: no hidden masks (2 x sbh bytes), no score mask (as^2b) or dropout output (2as^2b).
    quiet = dataclasses.replace(GPT3_PAPER, attention_dropout=0.0, hidden_dropout=0.0)
    assert activation_bytes_per_layer(resolve_job(quiet, L())) == base - 2 * sbh - 3 * a_ss
    # fp32: every stored tensor but the 1-byte masks doubles.
    fp32 = dataclasses.replace(GPT3_PAPER, precision="fp32")
    assert activation_bytes_per_layer(resolve_job(fp32, L())) == 2 * base - 2 * sbh - a_ss


def test_gqa_swiglu_layer_by_hand():
    w = workload_from_preset("llama2-70b")  # GQA 64 heads / 8 groups, SwiGLU f 28672, no dropout, flash
    s, h, d, g, f, t = w.seq_length, w.hidden_size, w.head_dim, w.query_groups, w.ffn, 8
    layout = L(tensor_model_parallel_size=t, sequence_parallel=True, micro_batch_size=2)
    sb = s * 2
    norm_side = 2 * sb * h * 4 // t                          # 2 norm inputs, QKV and fc1 inputs, /t by SP
    tp_side = 2 * sb * (2 * h + 2 * g * d + 2 * f + f) // t  # Q, proj input; K, V; fc1 out (2f); fc2 in
    assert activation_bytes_per_layer(resolve_job(w, layout)) == norm_side + tp_side
    # Unfused attention repeats K and V to every head before storing them, and keeps the scores.
    local = dataclasses.replace(w, attention_backend="local")
    scores = 2 * w.num_attention_heads * s * s * 2 // t
    repeated_kv = 2 * sb * 2 * (h - g * d) // t
    assert activation_bytes_per_layer(resolve_job(local, layout)) == norm_side + tp_side + repeated_kv + scores


# In-flight micro-batches: transcriptions of megatron-core 0.19 (pipeline_parallel/schedules.py).

def megatron_warmup(pipeline_parallel_size, pipeline_parallel_rank, num_microbatches, num_model_chunks):
    """get_pp_rank_microbatches, microbatch_group_size_per_vp_stage = PP, forward_only False."""
    total_num_microbatches = num_microbatches * num_model_chunks
    if num_model_chunks == 1:
        num_warmup_microbatches = pipeline_parallel_size - pipeline_parallel_rank - 1
    else:
        num_warmup_microbatches = (pipeline_parallel_size - pipeline_parallel_rank - 1) * 2
        num_warmup_microbatches += (num_model_chunks - 1) * pipeline_parallel_size
    return min(num_warmup_microbatches, total_num_microbatches), total_num_microbatches


def megatron_peak_by_running_the_schedule(pp, rank, m, vpp):
    """Run the schedule's loop: warmup forwards, then forward k + warmup before backward k."""
    warmup, total = megatron_warmup(pp, rank, m, vpp)
    live = peak = 0
    for k in range(total):
        live += 1
        peak = max(peak, live)
        if k >= warmup:
            live -= 1
    return peak


def held_by_the_program(pp, rank, m, vpp):
    """(chunks held, of them chunk 0, of them the last chunk) after each forward of the rank's
    simulator program, the op order tests/integration/test_schedule_programs.py checks against
    megatron-core's schedules."""
    program = simulator.program_1f1b(pp, m) if vpp == 1 else simulator.program_interleaved(pp, m, vpp)
    live, states = [0] * vpp, set()
    for op in program[rank]:
        if op[0] == simulator.COMPUTE:
            forward = op[1] == simulator.FORWARD
            live[op[2]] += 1 if forward else -1
            if forward:
                states.add((sum(live), live[0], live[-1]))
    return states


@given(pp=st.integers(2, 8), vpp=st.integers(1, 4), groups=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_in_flight_matches_megatron(pp, vpp, groups):
    m = pp * groups if vpp > 1 else groups
    counts = [microbatches_in_flight(pp, r, m, vpp) for r in range(pp)]
    for r, n in enumerate(counts):
        warmup, total = megatron_warmup(pp, r, m, vpp)
        assert n == min(warmup + 1, total) == megatron_peak_by_running_the_schedule(pp, r, m, vpp)
        held = held_by_the_program(pp, r, m, vpp)
        assert n == max(chunks for chunks, _, _ in held)
        # What the memory model weighs: every state where the embedding and output chunks cost
        # apart (the end ranks, interleaved), else the peak alone.
        charged = _in_flight_states(pp, r, m, vpp)
        if vpp > 1 and r in (0, pp - 1):
            assert charged == held
        else:
            assert charged == {(n, n, n) if vpp == 1 else (n, 0, 0)}
        if vpp == 1:
            assert n == min(pp - r, m)
    assert counts[0] == max(counts) and counts == sorted(counts, reverse=True)


@given(pp=st.integers(2, 8), vpp=st.integers(2, 4), groups=st.integers(1, 6),
       weights=st.tuples(*[st.integers(0, 10**9)] * 3))
@settings(max_examples=100, deadline=None)
def test_peak_candidates_hold_the_peak_of_every_state(pp, vpp, groups, weights):
    """The memory model weighs only the states no other one exceeds in every count; for any
    non-negative bytes of a chunk 0, a last chunk and any other chunk (each chunk kind its own:
    the embedding or the loss counted in the split can shorten chunk 0 or the last one below the
    others) the peak is the same."""
    for r in (0, pp - 1):
        states, kept = _in_flight_states(pp, r, pp * groups, vpp), _peak_candidates(pp, r, pp * groups, vpp)
        assert set(kept) <= states

        def peak(counts):
            return max((n - first - last) * weights[0] + first * weights[1] + last * weights[2]
                       for n, first, last in counts)
        assert peak(kept) == peak(states)


def test_in_flight_examples():
    assert [microbatches_in_flight(4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [microbatches_in_flight(4, r, 8, 2) for r in range(4)] == [11, 9, 7, 5]
    assert microbatches_in_flight(1, 0, 64) == 1
    layout = L(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, micro_batch_size=1)
    assert in_flight_microbatches(resolve_job(GPT3, layout)) == (8, 7, 6, 5, 4, 3, 2, 1)


def test_interleaved_first_stage_embedding_count():
    """PP 2, 2 chunks, 4 micro-batches, rank 0: forwards run chunks 0 0 1 1 0 0 1 1, backwards
    1 1 0 0 1 1 0 0; warmup 4, so after forward 5 chunk 0 holds 3 and chunk 1 holds 2, after backward 0
    and forward 5 chunk 0 holds 4 (every micro-batch's embedding) and chunk 1 one: 5 chunks, 4 masks."""
    w = dataclasses.replace(GPT3, global_batch_size=4)
    base = dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=2)
    first = estimate_memory(resolve_job(w, L(num_layers_per_virtual_pipeline_stage=24, **base)), H100).stages[0]
    mask = w.seq_length * w.hidden_size
    assert first.activation_bytes == 5 * 24 * activation_bytes_per_layer(resolve_job(w, L(**base))) + 4 * mask


def test_interleaved_last_stage_keeps_one_output_layer():
    """The last chunk of the last rank runs its backward right after its forward: one fp32 softmax."""
    w = dataclasses.replace(GPT3, global_batch_size=16)
    base = dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, sequence_parallel=True)
    inter = estimate_memory(resolve_job(w, L(num_layers_per_virtual_pipeline_stage=12, **base)), H100).stages[-1]
    chunk = 12 * activation_bytes_per_layer(resolve_job(w, L(**base)))
    output = 2 * 2 * w.seq_length * w.hidden_size // 8 + 4 * w.seq_length * w.padded_vocab_size(8) // 8
    assert inter.activation_bytes == 5 * chunk + output  # 5 chunks in flight, of them one last chunk



@pytest.mark.parametrize("fusion, impl, kept", [(False, "te", 4), (True, "native", 4), (True, "te", 2)])
def test_the_loss_keeps_what_its_implementation_saves(fusion, impl, kept):
    """megatron-core's plain and native fused cross entropy save the fp32 softmax; Transformer
    Engine's saves the logits' bf16 copy (--cross-entropy-fusion-impl te counts only with
    --cross-entropy-loss-fusion)."""
    w = dataclasses.replace(GPT3, cross_entropy_loss_fusion=fusion, cross_entropy_fusion_impl=impl)
    job = resolve_job(w, L(tensor_model_parallel_size=8, pipeline_model_parallel_size=1))
    tokens, vocab = w.seq_length, w.padded_vocab_size(8)
    assert _job_terms(job).output == 2 * 2 * tokens * w.hidden_size + kept * tokens * vocab // 8


# Recomputation.

def test_full_recompute_uniform_and_block():
    base = dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=8)  # 12 layers per stage
    none = activation_bytes_per_layer(resolve_job(GPT3, L(**base)))
    full = dict(recompute_granularity="full", recompute_num_layers=4)
    inp = activation_bytes_per_layer(resolve_job(GPT3, L(recompute_method="uniform", **full, **base)))
    uniform = estimate_memory(resolve_job(GPT3, L(recompute_method="uniform", **full, **base)), H100).stages[3]
    block = estimate_memory(resolve_job(GPT3, L(recompute_method="block", **full, **base)), H100).stages[3]
    assert uniform.activation_bytes == 5 * 3 * inp  # rank 3 holds 5 micro-batches, 3 groups of 4
    assert block.activation_bytes == 5 * (4 * inp + 8 * none)
    assert uniform.transient_bytes > block.transient_bytes  # 4 layers recomputed at once, not 1


# Properties.

PRESETS = ["gpt3-1.3b", "gpt3-13b", "gpt3-175b", "llama2-7b", "llama2-70b", "llama3-8b"]
RECOMPUTE = [dict(), dict(recompute_granularity="selective"),
             dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)]


@st.composite
def cases(draw):
    w = workload_from_preset(draw(st.sampled_from(PRESETS)))
    if draw(st.booleans()):
        w = dataclasses.replace(w, attention_backend="local")
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if w.query_groups % t == 0]))
    pps = [p for p in (1, 2, 4, 8) if w.num_layers % p == 0]
    kw = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=draw(st.sampled_from(pps)),
              micro_batch_size=draw(st.sampled_from([1, 2])), sequence_parallel=tp > 1 and draw(st.booleans()),
              **draw(st.sampled_from(RECOMPUTE)))
    return w, kw


def peak(w, **kw) -> int:
    return estimate_memory(resolve_job(w, L(**kw)), H100, overheads=NO_COMM).peak_bytes


# A new parallel dimension adds a communicator (a constant); NO_COMM leaves it out.
@given(cases())
@settings(max_examples=60, deadline=None)
def test_doubling_pp_never_grows_memory(case):
    w, kw = case
    pp = 2 * kw["pipeline_model_parallel_size"]
    if w.num_layers % pp == 0:
        assert peak(w, **{**kw, "pipeline_model_parallel_size": pp}) <= peak(w, **kw)


@given(cases())
@settings(max_examples=60, deadline=None)
def test_doubling_tp_never_grows_memory(case):
    w, kw = case
    tp = 2 * kw["tensor_model_parallel_size"]
    if tp <= 8 and w.query_groups % tp == 0:
        assert peak(w, **{**kw, "tensor_model_parallel_size": tp}) <= peak(w, **kw)


@given(cases(), st.sampled_from([1, 2, 8]))
@settings(max_examples=40, deadline=None)
def test_distributed_optimizer_grows_memory_by_its_grad_stats_communicator_at_most(case, dp):
    w, kw = case
    plain = estimate_memory(resolve_job(w, L(data_parallel_size=dp, **kw)), H100).stages
    dist = estimate_memory(resolve_job(w, L(data_parallel_size=dp, use_distributed_optimizer=True, **kw)), H100).stages
    extra = DEFAULT_OVERHEADS.comm_buffer_bytes_per_group
    assert all(d.total_bytes <= p.total_bytes + extra for d, p in zip(dist, plain))
    assert all(d.optimizer_bytes < p.optimizer_bytes for d, p in zip(dist, plain)) or dp == 1


@given(cases())
@settings(max_examples=40, deadline=None)
def test_recompute_never_grows_activations(case):
    w, kw = case
    kw = {k: v for k, v in kw.items() if not k.startswith("recompute")}
    none = estimate_memory(resolve_job(w, L(**kw)), H100).stages
    for recompute in RECOMPUTE[1:]:
        stages = estimate_memory(resolve_job(w, L(**kw, **recompute)), H100).stages
        assert all(r.activation_bytes <= n.activation_bytes for r, n in zip(stages, none))


@given(cases())
@settings(max_examples=30, deadline=None)
def test_stage_zero_holds_most_layer_activations_under_1f1b(case):
    w, kw = case
    est = estimate_memory(resolve_job(w, L(**kw)), H100)
    counts = in_flight_microbatches(resolve_job(w, L(**kw)))
    assert counts[0] == max(counts)
    assert all(est.stages[0].activation_bytes >= s.activation_bytes for s in est.stages[1:-1])


# Known answers.

def test_gpt3_175b_fits_with_sequence_parallel_and_selective_recompute():
    """Korthikanti et al. 2022 train 175B on 64 80-GB GPUs with TP 8, PP 8, micro-batch 1, sequence
    parallelism and selective recomputation (no distributed optimizer: DP 1)."""
    layout = L(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, micro_batch_size=1,
               sequence_parallel=True, recompute_granularity="selective")
    est = estimate_memory(resolve_job(GPT3_PAPER, layout), H100)
    assert est.fits, est.worst_stage
    assert misfit_reason(est) is None
    assert est.worst_stage.stage == 0
    # Without either technique the activations no longer fit: the paper's reason for both.
    bare = estimate_memory(resolve_job(GPT3_PAPER, L(tensor_model_parallel_size=8, pipeline_model_parallel_size=8)),
                           H100)
    assert not bare.fits


def test_llama2_70b_does_not_fit_one_gpu():
    est = estimate_memory(resolve_job(workload_from_preset("llama2-70b"), L()), H100)
    assert not est.fits
    assert est.stages[0].weight_bytes + est.stages[0].gradient_bytes + est.stages[0].optimizer_bytes > 1000 * GiB
    assert re.match(r"^stage 0 needs \d+\.\d GiB of 79\.2 GiB \(weights \d+\.\d GiB, "
                    r"gradients .*optimizer .*activations \d+\.\d GiB.*overheads", misfit_reason(est))


def test_misfit_reason_names_the_worst_stage():
    def stage(i, act):
        return StageMemory(stage=i, parameters=1, weight_bytes=GiB, gradient_bytes=0, optimizer_bytes=0,
                           activation_bytes=act, transient_bytes=0, overhead_bytes=0)
    est = MemoryEstimate(stages=(stage(0, 2 * GiB), stage(1, 50 * GiB), stage(2, 90 * GiB)), capacity_bytes=80 * GiB)
    assert est.peak_bytes == 91 * GiB and est.worst_stage.stage == 2 and not est.fits
    assert misfit_reason(est).startswith("stage 2 needs 91.0 GiB of 80.0 GiB (weights 1.0 GiB")


def groups(job, stage, domain=1) -> list[str]:
    return [c.group for c in communicators(job, stage, domain)]


def test_overheads_are_counted():
    layout = L(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, data_parallel_size=2)
    assert groups(resolve_job(GPT3, layout), 3) == ["tp", "pp", "dp", "mp", "world"]
    assert groups(resolve_job(GPT3, layout), 0) == groups(resolve_job(GPT3, layout), 7) == [
        "tp", "pp", "dp", "mp", "world", "embedding"]                   # the tied embedding at the ends
    untied = dataclasses.replace(GPT3, untie_embeddings_and_output_weights=True)
    assert len(communicators(resolve_job(untied, layout), 0)) == 5 and communicators(resolve_job(GPT3, L()), 0) == ()
    default = estimate_memory(resolve_job(GPT3, layout), H100).stages[3]
    none = RuntimeOverheads(cuda_context_bytes=0, comm_buffer_bytes_per_group=0, fragmentation=0.0)
    bare = estimate_memory(resolve_job(GPT3, layout), H100, overheads=none).stages[3]
    assert bare.overhead_bytes == 0
    assert default.overhead_bytes == (DEFAULT_OVERHEADS.cuda_context_bytes
                                      + 5 * DEFAULT_OVERHEADS.comm_buffer_bytes_per_group
                                      + round(DEFAULT_OVERHEADS.fragmentation
                                              * (bare.activation_bytes + bare.transient_bytes)))


def test_world_and_grad_stats_groups_are_communicators():
    """Every rank uses the world group (barriers, timers) and, with the distributed optimizer,
    its grad-stats group (all ranks of the optimizer instance: Megatron's intra_dist_opt_group),
    each a communicator of its own even where its ranks are another group's."""
    assert groups(resolve_job(GPT3, L(data_parallel_size=8)), 0) == ["dp", "world"]
    assert groups(resolve_job(GPT3, L(data_parallel_size=8, use_distributed_optimizer=True)), 0) == [
        "dp", "world", "grad-stats"]


def test_nvls_buffers_are_an_overhead_of_the_bulk_groups_with_peers_in_the_nvlink_domain():
    """NVLS (on by default on Hopper NVSwitch) costs each bulk communicator (TP, DP, embedding)
    nvls_bytes_per_local_rank per rank it has in the device's NVLink domain; not p2p (PP), not
    the small reductions (mp, world, grad-stats), not a group with one local rank."""
    job = resolve_job(GPT3, L(tensor_model_parallel_size=2, pipeline_model_parallel_size=8, data_parallel_size=4))
    assert [c.local_ranks for c in communicators(job, 3, 8)] == [2, 1, 4, 2, 8]     # tp pp dp mp world
    on, off = (estimate_memory(job, H100, nvls_domain=d).stages[3] for d in (8, 0))
    assert on.overhead_bytes - off.overhead_bytes == (2 + 4) * DEFAULT_OVERHEADS.nvls_bytes_per_local_rank
    h100 = preset_cluster("dgx-h100", num_nodes=4)
    assert h100.nvls and not preset_cluster("dgx-a100", num_nodes=4).nvls
    assert CostModel(h100).memory(job).stages[3] == on
    assert CostModel(dataclasses.replace(h100, nvls=False)).memory(job).stages[3] == off


def test_h100_capacity_is_what_torch_reports():
    """torch's total_memory (the allocator's ceiling) is 81,085 MiB on an H100 80GB, where nvidia-smi
    shows 81,559 MiB; the planner must fit in the former."""
    assert lookup_gpu("H100").memory_bytes == 81085 * 2**20
    assert lookup_gpu("H200").memory_bytes == 143297 * 2**20     # nvidia-smi's 143,771 less the same 474


def test_profile_replaces_the_formula():
    layout = L(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, sequence_parallel=True,
               recompute_granularity="selective")
    measured = 123_456_789
    entry = ProfileEntry(tensor_model_parallel_size=8, micro_batch_size=1, forward_s=1.0, backward_s=2.0,
                         activation_bytes=measured, sequence_parallel=True, recompute_granularity="selective")
    profile = LayerProfile(device_name="H100", rank=0, layers=(entry,), embedding=(), output_layer=(),
                           model=ProfiledModel())
    with_profile = estimate_memory(resolve_job(GPT3, layout), H100, profile=profile).stages[3]
    formula = estimate_memory(resolve_job(GPT3, layout), H100).stages[3]
    layers_in_flight = 5 * 12  # rank 3 of 8 holds 5 micro-batches of 12 layers
    assert with_profile.activation_bytes - formula.activation_bytes == layers_in_flight * (
        measured - activation_bytes_per_layer(resolve_job(GPT3, layout)))
    unprofiled = dataclasses.replace(layout, sequence_parallel=False)  # no such entry: the formula
    job = resolve_job(GPT3, unprofiled)
    assert estimate_memory(job, H100, profile=profile) == estimate_memory(job, H100)


# Bad inputs.

@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, None])
def test_bad_capacity(capacity):
    with pytest.raises(PipetteError, match="capacity"):
        estimate_memory(resolve_job(GPT3, L()), capacity)


@pytest.mark.parametrize("kw", [dict(fragmentation=1.0), dict(fragmentation=-0.1), dict(cuda_context_bytes=-1),
                                dict(comm_buffer_bytes_per_group=0.5)])
def test_bad_overheads(kw):
    with pytest.raises(PipetteError):
        dataclasses.replace(DEFAULT_OVERHEADS, **kw)


def test_layout_megatron_rejects_is_infeasible():
    with pytest.raises(Infeasible, match="--num-attention-heads"):
        estimate_memory(resolve_job(GPT3, L(tensor_model_parallel_size=5)), H100)
    with pytest.raises(Infeasible, match="--recompute-method"):
        estimate_memory(resolve_job(GPT3, L(recompute_granularity="full")), H100)


TINY = dataclasses.replace(GPT3, num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64,
                           max_position_embeddings=64, vocab_size=1024, global_batch_size=16)


@pytest.mark.parametrize("layers, lay", [
    (4, L(pipeline_model_parallel_size=2, data_parallel_size=2, micro_batch_size=2,
          num_layers_per_virtual_pipeline_stage=1, account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True)),      # chunk 0 of stage 0 and the last chunk: no layer
    (7, L(pipeline_model_parallel_size=2, data_parallel_size=2, micro_batch_size=1,
          num_layers_per_virtual_pipeline_stage=2, account_for_embedding_in_pipeline_split=True)),
    (8, L(pipeline_model_parallel_size=2, data_parallel_size=1, micro_batch_size=1,
          num_layers_per_virtual_pipeline_stage=2)),      # every chunk alike
], ids=["emb-and-loss-chunks-empty", "emb-chunk-short", "even"])
def test_interleaved_stage_holds_each_chunk_at_its_own_size(layers, lay):
    """The end ranks of an interleaved pipeline: the activations are the most, over the rank's
    simulated program, of every in-flight chunk at its own layers' bytes (a chunk the embedding or
    the loss shortened holds less), plus the embedding's and the output layer's own."""
    job = resolve_job(dataclasses.replace(TINY, num_layers=layers), lay)
    estimate = estimate_memory(job, 80 * 2**30)
    one_layer = _chunk_activations(job, 1, 0, None).stored
    terms = _job_terms(job)
    for stage in (0, lay.pp - 1):
        sizes = [n * one_layer for n in job.chunk_sizes[stage]]
        extra = [0] * job.virtual_stages
        extra[0] += terms.embedding if stage == 0 else 0
        extra[-1] += terms.output if stage == lay.pp - 1 else 0
        live, peak = [0] * job.virtual_stages, 0
        for op in simulator.program_interleaved(lay.pp, job.num_microbatches, job.virtual_stages)[stage]:
            if op[0] == simulator.COMPUTE:
                live[op[2]] += 1 if op[1] == simulator.FORWARD else -1
                peak = max(peak, sum(k * (b + x) for k, b, x in zip(live, sizes, extra)))
        assert estimate.stages[stage].activation_bytes == peak, (stage, job.chunk_sizes)
