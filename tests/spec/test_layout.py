import dataclasses
import re

import pytest

from megatron_pipette.errors import Infeasible, PipetteError
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import (
    VIRTUAL_STAGES,
    Layout,
    chunk_sizes,
    stage_layers,
    validate_layout,
    virtual_stages_as_layers,
)
from megatron_pipette.spec.workload import workload_from_preset

W = workload_from_preset("gpt3-175b")  # 96 layers, 96 heads, gbs 1536


def L(**kw):
    return Layout(**kw)


def test_even_and_uneven_stage_split():
    assert stage_layers(W, L(pipeline_model_parallel_size=8)) == [12] * 8
    uneven = L(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=18,
               decoder_last_pipeline_num_layers=18)
    assert stage_layers(W, uneven) == [18, 30, 30, 18]
    assert stage_layers(W, L(pipeline_model_parallel_size=5, decoder_last_pipeline_num_layers=16)) == [20] * 4 + [16]
    with pytest.raises(Infeasible, match="--num-layers 96"):
        stage_layers(W, L(pipeline_model_parallel_size=5))


def test_megatron_layout():
    layout = L(tensor_model_parallel_size=8, pipeline_model_parallel_size=16, data_parallel_size=8,
               micro_batch_size=1, num_layers_per_virtual_pipeline_stage=3, sequence_parallel=True)
    validate_layout(W, layout, 1024)
    assert resolve_job(W, layout).virtual_stages == 2
    assert resolve_job(W, layout).num_microbatches == 192
    assert "--num-layers-per-virtual-pipeline-stage 3" in layout.megatron_args()
    assert "--sequence-parallel" in layout.megatron_args()


@pytest.mark.parametrize("kw, flag", [
    (dict(tensor_model_parallel_size=5, data_parallel_size=1), "--num-attention-heads"),
    (dict(data_parallel_size=7), "--global-batch-size"),
    (dict(sequence_parallel=True), "--sequence-parallel"),
    (dict(pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=4), "--num-layers-per-virtual"),
    (dict(pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=5), "--num-layers-per-virtual"),
    (dict(pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=12), "two or more chunks"),
    (dict(recompute_granularity="full"), "--recompute-method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers"),
    (dict(recompute_method="block"), "--recompute-granularity full"),
    (dict(overlap_param_gather=True), "--use-distributed-optimizer"),
    (dict(overlap_param_gather=True, use_distributed_optimizer=True), "--overlap-grad-reduce"),
    (dict(overlap_param_gather_with_optimizer_step=True), "--overlap-param-gather and the interleaved"),
    (dict(pipeline_model_parallel_size=8, data_parallel_size=1, use_distributed_optimizer=True,
          overlap_grad_reduce=True, overlap_param_gather=True, overlap_param_gather_with_optimizer_step=True),
     "interleaved schedule"),
])
def test_megatron_rules_are_infeasible_with_flag(kw, flag):
    with pytest.raises(Infeasible, match=flag):
        validate_layout(W, L(**kw))


def test_interleaved_needs_microbatches_multiple_of_pp():
    layout = L(pipeline_model_parallel_size=8, data_parallel_size=1, micro_batch_size=1,
               num_layers_per_virtual_pipeline_stage=6)
    validate_layout(W, layout)  # 1536 micro-batches, a multiple of 8
    odd = workload_from_preset("gpt3-175b", global_batch_size=12)
    with pytest.raises(Infeasible, match="multiple of --pipeline-model-parallel-size 8"):
        validate_layout(odd, layout)


def test_world_size_mismatch():
    with pytest.raises(Infeasible, match="= 8 GPUs, not the 16 given"):
        validate_layout(W, L(tensor_model_parallel_size=8), 16)


def test_nonsense_values_are_user_errors():
    with pytest.raises(PipetteError, match="--micro-batch-size"):
        validate_layout(W, L(micro_batch_size=0))
    with pytest.raises(PipetteError, match="--recompute-granularity"):
        validate_layout(W, L(recompute_granularity="some"))


def test_embedding_and_loss_counted_in_the_pipeline_split():
    """megatron-core's get_num_layers_to_build: (layers + counted) / PP per stage, one fewer on the
    first (embedding) and last (loss) stage; Megatron's own split is checked in tests/integration."""
    w = workload_from_preset("llama3-70b", num_layers=126)
    both = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert stage_layers(w, L(pipeline_model_parallel_size=8, **both)) == [15] + [16] * 6 + [15]
    assert stage_layers(w, L(pipeline_model_parallel_size=127, account_for_loss_in_pipeline_split=True)) \
        == [1] * 126 + [0]
    with pytest.raises(Infeasible, match="--account-for-embedding-in-pipeline-split is not divisible"):
        stage_layers(w, L(pipeline_model_parallel_size=4, account_for_embedding_in_pipeline_split=True))
    with pytest.raises(Infeasible, match="cannot be combined"):
        stage_layers(w, L(pipeline_model_parallel_size=8, decoder_last_pipeline_num_layers=14, **both))
    interleaved = L(pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=4, **both)
    sizes = chunk_sizes(w, interleaved)
    assert sizes[0] == [3, 4, 4, 4] and sizes[-1] == [4, 4, 4, 3] and all(s == [4] * 4 for s in sizes[1:-1])
    job = resolve_job(w, interleaved)
    assert job.virtual_stages == 4 and job.stage_layers == (15,) + (16,) * 6 + (15,)
    assert [c[0] for c in job.chunk_layers()[1]] == [3, 35, 67, 99]        # after stage 0's chunk c
    with pytest.raises(Infeasible, match="--num-layers-per-virtual-pipeline-stage 5 must divide the 16"):
        chunk_sizes(w, L(pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=5, **both))
    flags = L(pipeline_model_parallel_size=8, **both).megatron_args()
    assert "--account-for-embedding-in-pipeline-split" in flags and "--account-for-loss-in-pipeline-split" in flags


@pytest.mark.parametrize("kw, message", [
    (dict(tensor_model_parallel_size=1 << 21), "--tensor-model-parallel-size must be at most 1048576"),
    (dict(micro_batch_size=10 ** 30), "--micro-batch-size must be at most"),
    (dict(recompute_num_layers=0), "--recompute-num-layers must be a positive integer"),
    (dict(decoder_first_pipeline_num_layers=-1), "--decoder-first-pipeline-num-layers must be an integer in 0.."),
    (dict(pipeline_model_parallel_size=2.0), "--pipeline-model-parallel-size must be a positive integer"),
])
def test_layout_sizes_are_bounded(kw, message):
    with pytest.raises(PipetteError, match=message):
        validate_layout(W, L(**kw))


def test_virtual_stages_per_rank_become_the_layers_per_chunk_megatron_builds():
    """--num-virtual-stages-per-pipeline-rank N is Megatron's VP size itself (arguments.py:942-945):
    every chunk holds a stage's layers (embedding and loss counted where the split counts them) over N,
    and the split the flags give is pinned."""
    plain = {"account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False}
    assert virtual_stages_as_layers(96, {"pipeline_model_parallel_size": 16, VIRTUAL_STAGES: 2}) == \
        {"pipeline_model_parallel_size": 16, **plain, "num_layers_per_virtual_pipeline_stage": 3}
    counted = {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}
    assert virtual_stages_as_layers(126, {"pipeline_model_parallel_size": 8, **counted, VIRTUAL_STAGES: 4}) == \
        {"pipeline_model_parallel_size": 8, **counted, "num_layers_per_virtual_pipeline_stage": 4}
    assert virtual_stages_as_layers(96, {"pipeline_model_parallel_size": 4, VIRTUAL_STAGES: 1}) == \
        {"pipeline_model_parallel_size": 4, **plain, "num_layers_per_virtual_pipeline_stage": None}
    assert virtual_stages_as_layers(96, {"tensor_model_parallel_size": 2}) == {"tensor_model_parallel_size": 2}


@pytest.mark.parametrize("typed, message", [
    ({"pipeline_model_parallel_size": 4, "num_layers_per_virtual_pipeline_stage": 2},
     "--num-virtual-stages-per-pipeline-rank 2 cannot be combined with --num-layers-per-virtual-pipeline-stage"),
    ({"pipeline_model_parallel_size": 4, "pipeline_model_parallel_layout": "Et|t|t|tL"},
     "cannot be combined with --pipeline-model-parallel-layout"),
    ({}, "--num-virtual-stages-per-pipeline-rank 2 needs --pipeline-model-parallel-size beside it"),
    ({"pipeline_model_parallel_size": 1}, "needs --pipeline-model-parallel-size > 1"),
    ({"pipeline_model_parallel_size": 5}, "must divide the layers of every pipeline stage"),
    ({"pipeline_model_parallel_size": 8}, "must divide the layers of every pipeline stage"),    # 3 a stage
    ({"pipeline_model_parallel_size": 4, "decoder_first_pipeline_num_layers": 4}, "is not modelled"),
    ({"pipeline_model_parallel_size": 4, VIRTUAL_STAGES: 0}, "--num-virtual-stages-per-pipeline-rank must be a "
                                                             "positive integer, got 0"),
])
def test_virtual_stages_megatron_refuses_are_refused_by_name(typed, message):
    with pytest.raises(PipetteError, match=re.escape(message)):
        virtual_stages_as_layers(24, {VIRTUAL_STAGES: 2, **typed})


STASHED = workload_from_preset("mixtral-8x7b", moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                               use_transformer_engine_op_fuser=True, moe_expert_rank_capacity_factor=1.5,
                               moe_paged_stash=True, moe_paged_stash_buffer_size_factor_cuda=1.2)


@pytest.mark.parametrize("workload, kw, message", [
    (STASHED, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2,
                   expert_model_parallel_size=4), "--moe-expert-rank-capacity-factor 1.5 below the 2 x T k rows"),
    (dataclasses.replace(STASHED, moe_paged_stash_buffer_size_factor_cuda=-0.9), dict(expert_model_parallel_size=8),
     "--moe-paged-stash-buffer-size-factor-cuda -0.9 holds fewer rows than are in flight"),
    (STASHED, dict(expert_model_parallel_size=8, recompute_granularity="selective", recompute_modules=("moe",)),
     "--moe-paged-stash with the routed experts recomputed"),
    (dataclasses.replace(STASHED, moe_paged_stash=False),
     dict(expert_model_parallel_size=8, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=1), None),
    (STASHED, dict(expert_model_parallel_size=8), None),
])
def test_budgets_and_stashes_that_overflow_every_step_are_refused(workload, kw, message):
    """A budget or a device stash below the rows a rank receives under balanced routing drops tokens
    or overflows each step, and Megatron's PagedStashRunner reruns the step dropless."""
    layout = Layout(**{"data_parallel_size": 8 // kw.get("tensor_model_parallel_size", 1), **kw})
    if message is None:
        validate_layout(workload, layout)
    else:
        with pytest.raises(Infeasible, match=re.escape(message)):
            validate_layout(workload, layout)
