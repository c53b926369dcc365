import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pipette.errors import PipetteError
from megatron_pipette.plan.search import _pipeline_splits, enumerate_layouts
from megatron_pipette.spec.layout import Layout, stage_layers, validate_layout
from megatron_pipette.spec.workload import Workload, workload_from_preset

GPT3 = workload_from_preset("gpt3-175b")


def layouts_of(*args, **kwargs) -> list:
    """The layouts of the jobs the search yields."""
    return [job.layout for job in enumerate_layouts(*args, **kwargs)]


def test_megatron_paper_layout_is_among_the_candidates():
    layouts = set(layouts_of(GPT3, 1024, 8))
    paper = Layout(tensor_model_parallel_size=8, pipeline_model_parallel_size=16, data_parallel_size=8,
                   micro_batch_size=1, num_layers_per_virtual_pipeline_stage=3, sequence_parallel=True,
                   use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    assert paper in layouts


@settings(max_examples=25, deadline=None)
@given(layers=st.sampled_from([4, 6, 12, 30]), heads=st.sampled_from([4, 8, 12]),
       nodes=st.integers(1, 4), gpn=st.sampled_from([1, 2, 4, 8]), gbs=st.sampled_from([8, 12, 32]))
def test_every_layout_is_valid_and_uses_every_gpu(layers, heads, nodes, gpn, gbs):
    w = Workload(num_layers=layers, hidden_size=heads * 16, num_attention_heads=heads, seq_length=64,
                 global_batch_size=gbs)
    world = nodes * gpn
    seen = set()
    for layout in layouts_of(w, world, gpn):
        validate_layout(w, layout, world)
        assert gpn % layout.tp == 0, "tensor parallel must stay inside a node by default"
        assert layout not in seen
        seen.add(layout)


def test_constraints_fix_fields():
    layouts = list(layouts_of(GPT3, 64, 8, {"tensor_model_parallel_size": 4, "sequence_parallel": True,
                                                    "recompute_granularity": "full"}))
    assert layouts
    assert all(lay.tp == 4 and lay.sequence_parallel and lay.recompute_granularity == "full"
               and lay.recompute_method == "uniform" for lay in layouts)


def test_a_typed_sequence_parallel_leaves_tp_1_open_without_it():
    """Megatron turns --sequence-parallel off at TP 1 (validate_args) rather than refusing it: typed without
    a TP size, it kept every TP 1 layout out of the search."""
    layouts = layouts_of(workload_from_preset("llama3-8b"), 16, 8, {"sequence_parallel": True})
    assert {lay.tp for lay in layouts} >= {1, 2, 8}
    assert all(lay.sequence_parallel == (lay.tp > 1) for lay in layouts)


def test_param_gather_overlap_is_searched_both_ways():
    """--overlap-param-gather can cost time (1F1B: cost.timing), so the search tries it off too."""
    layouts = layouts_of(GPT3, 1024, 8, {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 8})
    dopt = {lay for lay in layouts if lay.use_distributed_optimizer}
    assert {lay.overlap_param_gather for lay in dopt} == {True, False}
    assert all(lay.overlap_grad_reduce for lay in dopt)
    assert not any(lay.overlap_param_gather for lay in layouts if not lay.use_distributed_optimizer)


def test_first_chunk_gather_behind_the_optimizer_step_only_where_typed():
    """--overlap-param-gather-with-optimizer-step: Megatron 0.19 rejects it under distributed
    checkpointing, its default checkpoint format, so the search leaves it off; typed, it is kept
    where Megatron's other rules allow it (interleaved, --overlap-param-gather)."""
    grid = {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 8}
    assert not any(lay.overlap_param_gather_with_optimizer_step for lay in layouts_of(GPT3, 1024, 8, grid))
    typed = layouts_of(GPT3, 1024, 8, {**grid, "overlap_param_gather_with_optimizer_step": True})
    assert typed and all(lay.overlap_param_gather_with_optimizer_step and lay.overlap_param_gather
                         and lay.num_layers_per_virtual_pipeline_stage for lay in typed)
    spelt = layouts_of(GPT3, 1024, 8, {**grid, "pipeline_model_parallel_layout": "E(t*6|)*15t*6L",
                                       "overlap_param_gather_with_optimizer_step": True})
    assert spelt and all(lay.overlap_param_gather_with_optimizer_step for lay in spelt)


def test_distributed_optimizer_without_data_parallelism_overlaps_nothing():
    """--use-distributed-optimizer asked for at DP 1: no grad-reduce overlap, so no param-gather
    overlap either (Megatron asserts the pair)."""
    w = workload_from_preset("gpt3-1.3b", global_batch_size=64)
    layouts = list(layouts_of(w, 8, 8, {"use_distributed_optimizer": True,
                                               "tensor_model_parallel_size": 8}))
    assert layouts and all(lay.dp == 1 and not lay.overlap_grad_reduce and not lay.overlap_param_gather
                           for lay in layouts)


def test_tensor_parallel_across_nodes_only_when_allowed():
    w = workload_from_preset("gpt3-1.3b")
    assert max(lay.tp for lay in layouts_of(w, 16, 8)) == 8
    assert max(lay.tp for lay in layouts_of(w, 16, 8, allow_tp_across_nodes=True)) == 16
    # An explicit user constraint is honoured even across nodes (Megatron accepts it).
    assert all(lay.tp == 16 for lay in layouts_of(w, 16, 8, {"tensor_model_parallel_size": 16}))


def test_uneven_pipeline_splits_use_megatron_flags():
    w = workload_from_preset("gpt3-175b", num_layers=30)
    layouts = list(layouts_of(w, 32, 8, {"pipeline_model_parallel_size": 4}))
    splits = {(lay.decoder_first_pipeline_num_layers, lay.decoder_last_pipeline_num_layers,
               lay.account_for_embedding_in_pipeline_split) for lay in layouts}
    assert (None, None, False) not in splits  # 30 is not divisible by 4; 32 is, with embedding and loss counted
    assert splits and all(sum(stage_layers(w, lay)) == 30 for lay in layouts)
    assert (None, None, True) in splits
    # A lighter last stage offsets the output layer.
    assert (None, 5, False) in _pipeline_splits(96, 8) and (6, 6, False) in _pipeline_splits(96, 8)


def test_unknown_constraint_is_a_user_error():
    with pytest.raises(PipetteError, match="tensor_parallel"):
        list(layouts_of(GPT3, 64, 8, {"tensor_parallel": 2}))


def test_embedding_and_loss_in_the_split_are_kept_and_set_the_stages():
    """--account-for-loss-in-pipeline-split given: every layout keeps it and splits by its rule (so
    only PP dividing layers + 1), interleaved ones too (the last stage's last chunk one shorter)."""
    w = workload_from_preset("gpt3-1.3b", num_layers=23, global_batch_size=64)
    jobs = list(enumerate_layouts(w, 32, 8, {"account_for_loss_in_pipeline_split": True}))
    assert jobs
    for job in jobs:
        lay = job.layout
        assert lay.account_for_loss_in_pipeline_split
        assert 24 % lay.pp == 0 and job.stage_layers[-1] == 24 // lay.pp - 1
        if lay.num_layers_per_virtual_pipeline_stage:
            assert job.chunk_sizes[-1][-1] == lay.num_layers_per_virtual_pipeline_stage - 1
    assert {job.layout.pp for job in jobs} >= {1, 2, 4, 8}
    assert any(job.virtual_stages > 1 for job in jobs)


def test_interleaved_layouts_are_also_tried_with_embedding_and_loss_in_the_split():
    """Left to the search, every interleaved layout comes also with the embedding and loss counted
    in the split (lighter first and last chunks), non-interleaved ones never (first/last-stage
    splits cover them); a split the user gives stops both."""
    w = workload_from_preset("gpt3-1.3b", num_layers=30, global_batch_size=64)
    jobs = list(enumerate_layouts(w, 32, 8, {"tensor_model_parallel_size": 8}))
    counted = [j for j in jobs if j.layout.account_for_embedding_in_pipeline_split]
    assert counted and all(j.layout.account_for_loss_in_pipeline_split and j.virtual_stages > 1 for j in counted)
    assert {(j.layout.pp, j.layout.num_layers_per_virtual_pipeline_stage) for j in counted} >= {(4, 2), (2, 8)}
    assert all(j.chunk_sizes[0][0] == j.layout.num_layers_per_virtual_pipeline_stage - 1 for j in counted)
    fixed = enumerate_layouts(w, 32, 8, {"tensor_model_parallel_size": 8, "decoder_last_pipeline_num_layers": 6})
    assert not any(j.layout.account_for_embedding_in_pipeline_split for j in fixed)


def test_fields_the_search_does_not_vary_keep_the_users_value():
    """--cp-comm-type, --recompute-modules, --pipeline-model-parallel-layout and --tp-comm-overlap are
    not searched: a typed value reaches every layout (--cp-comm-type a2a was once dropped for p2p),
    none otherwise."""
    llama = workload_from_preset("llama3-8b", global_batch_size=16)
    typed = layouts_of(llama, 16, 8, {"context_parallel_size": 2, "cp_comm_type": "a2a",
                                      "recompute_modules": ("core_attn", "mlp"), "tp_comm_overlap": True})
    assert typed and all(lay.cp_comm_type == "a2a" and lay.recompute_modules == ("core_attn", "mlp")
                         and lay.recompute_granularity == "selective" and lay.tp_comm_overlap
                         and lay.sequence_parallel for lay in typed)
    spelt = layouts_of(llama, 16, 8, {"pipeline_model_parallel_size": 2,
                                      "pipeline_model_parallel_layout": "Et*7|(t*8|)*2t*9L"})
    assert spelt and all(lay.pipeline_model_parallel_layout == "Et*7|(t*8|)*2t*9L"
                         and lay.num_layers_per_virtual_pipeline_stage is None for lay in spelt)
    plain = layouts_of(llama, 16, 8, {"context_parallel_size": 2})
    assert all(lay.cp_comm_type == "p2p" and lay.recompute_modules is None and not lay.tp_comm_overlap
               and lay.pipeline_model_parallel_layout is None for lay in plain)


@pytest.mark.parametrize("constraints, world, gbs, reason", [
    ({"tensor_model_parallel_size": 3}, 32, 64, "--tensor-model-parallel-size 3 does not divide the 32 GPUs"),
    ({"tensor_model_parallel_size": 2, "context_parallel_size": 3}, 8, 64,
     "--tensor-model-parallel-size 2 x --context-parallel-size 3 does not divide the 8 GPUs"),
    ({"pipeline_model_parallel_size": 5}, 8, 64,
     "--tensor-model-parallel-size 1 x --context-parallel-size 1 x --pipeline-model-parallel-size 5 does not"),
    ({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}, 32, 24,
     "--global-batch-size 24 is not divisible by the data-parallel size 32 (32 GPUs / TP 1 x CP 1 x PP 1)"),
    ({"expert_model_parallel_size": 2}, 8, 64, "--expert-model-parallel-size and --expert-tensor-parallel-size need"),
])
def test_a_search_that_yields_nothing_says_which_rule_each_grid_broke(constraints, world, gbs, reason):
    """A typed size that does not divide the GPUs, a batch no data-parallel size divides, expert flags on
    a dense model: each is a rejection with its reason (once skipped without one, and
    `pipette plan --tensor-model-parallel-size 3` said "check the divisibility messages above" above
    nothing; a typed --expert-model-parallel-size on a dense model was silently dropped)."""
    from megatron_pipette.plan.search import Rejections

    w = workload_from_preset("gpt3-1.3b", global_batch_size=gbs)
    rejected = Rejections()
    assert layouts_of(w, world, 8, constraints, rejected=rejected) == []
    assert any(example.startswith(reason) for example in rejected.examples.values()), rejected.examples
