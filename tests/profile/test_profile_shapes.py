"""The profiler's pure planning: measurement order, interpolation, SP derivation, budget estimates."""

import pytest

from megatron_pipette.profile.shapes import Measured, Shape, estimate_wall_s, layer_entries, part_entries, plan_shapes


def measured(part="layer", tp=1, mbs=1, rc=None, fwd=1.0, bwd=2.0, act=100, sharded=0, wall=1.0, run=1.0, cp=1):
    return Measured(shape=Shape(part=part, tensor_model_parallel_size=tp, micro_batch_size=mbs,
                                recompute_granularity=rc, context_parallel_size=cp),
                    forward_s=fwd, backward_s=bwd, activation_bytes=act, sequence_sharded_bytes=sharded, wall_s=wall,
                    run_s=run)


def test_plan_puts_one_layer_per_tp_first_and_the_extreme_micro_batches_before_the_middles():
    order = plan_shapes([2, 1], [1, 2, 4], [None, "selective", "full"])
    assert [(s.part, s.tensor_model_parallel_size, s.micro_batch_size) for s in order[:2]] == [
        ("layer", 1, 1), ("layer", 2, 1)]
    first_middle = next(i for i, s in enumerate(order) if s.micro_batch_size == 2)
    assert {s.micro_batch_size for s in order[:first_middle]} == {1, 4}
    assert {s.micro_batch_size for s in order[first_middle:]} == {2}
    layers = [s for s in order if s.part == "layer"]
    assert len(layers) == 2 * 3 * 3
    assert len(order) == len(set(order)) == 18 + 2 * 2 * 3
    # Among the extremes, recompute variants come after every plain layer shape.
    first_variant = next(i for i, s in enumerate(order) if s.recompute_granularity)
    assert all(s.recompute_granularity is None for s in order[:first_variant])


def test_middle_micro_batches_come_each_intervals_middle_first():
    order = plan_shapes([1], [1, 2, 4, 8, 16, 32], [None])
    plain = [s.micro_batch_size for s in order if s.part == "layer"]
    assert plain == [1, 32, 8, 4, 16, 2]


def test_single_micro_batch_size_plans_each_shape_once():
    order = plan_shapes([1], [2], [None, "full"])
    assert [(s.part, s.recompute_granularity) for s in order] == [
        ("layer", None), ("embedding", None), ("output_layer", None), ("layer", "full")]


def test_middle_micro_batch_sizes_are_interpolated_linearly_and_flagged():
    results = [measured(mbs=1, fwd=1.0, bwd=2.0, act=100), measured(mbs=4, fwd=2.5, bwd=5.0, act=400)]
    rows = layer_entries(results, tp_sizes=[1], micro_batch_sizes=[1, 2, 4], recompute=[None],
                         sequence_parallel=[False, True], seq_length=32)
    assert [(r["micro_batch_size"], r["measured"]) for r in rows] == [(1, True), (2, False), (4, True)]
    middle = rows[1]
    assert middle["forward_s"] == pytest.approx(1.5) and middle["backward_s"] == pytest.approx(3.0)
    assert middle["activation_bytes"] == 200


def test_one_measured_size_scales_proportionally():
    rows = part_entries([measured(part="embedding", mbs=2, fwd=1.0, bwd=1.0, act=64)], "embedding",
                        tp_sizes=[1], micro_batch_sizes=[1, 2, 8])
    assert [(r["micro_batch_size"], r["activation_bytes"], r["measured"]) for r in rows] == [
        (1, 32, False), (2, 64, True), (8, 256, False)]


def test_sequence_parallel_entries_divide_only_the_sharded_bytes_and_need_tp_over_one():
    results = [measured(tp=1, act=1000, sharded=600), measured(tp=4, act=700, sharded=400)]
    rows = layer_entries(results, tp_sizes=[1, 4], micro_batch_sizes=[1], recompute=[None],
                         sequence_parallel=[False, True], seq_length=32)
    assert [(r["tensor_model_parallel_size"], r["sequence_parallel"]) for r in rows] == [
        (1, False), (4, False), (4, True)]
    assert rows[2]["activation_bytes"] == 700 - 400 + 100
    assert rows[2]["forward_s"] == rows[1]["forward_s"]


def test_sequence_parallel_is_left_out_when_tp_does_not_divide_the_sequence():
    rows = layer_entries([measured(tp=3)], tp_sizes=[3], micro_batch_sizes=[1], recompute=[None],
                         sequence_parallel=[False, True], seq_length=32)
    assert [r["sequence_parallel"] for r in rows] == [False]


def test_combinations_never_measured_have_no_entries():
    rows = layer_entries([measured(tp=1)], tp_sizes=[1, 2], micro_batch_sizes=[1], recompute=[None, "full"],
                         sequence_parallel=[False], seq_length=32)
    assert [(r["tensor_model_parallel_size"], r["recompute_granularity"]) for r in rows] == [(1, None)]


def test_estimates_scale_the_nearest_running_time_plus_the_median_overhead():
    done = [measured(tp=1, mbs=1, wall=2.0, run=1.5)]
    assert estimate_wall_s(Shape(part="layer", tensor_model_parallel_size=1, micro_batch_size=4), done) == 6.5
    assert estimate_wall_s(Shape(part="layer", tensor_model_parallel_size=2, micro_batch_size=1), done) == 1.25
    assert estimate_wall_s(Shape(part="embedding", tensor_model_parallel_size=1, micro_batch_size=1), done) == 2.0
    assert estimate_wall_s(Shape(part="layer", tensor_model_parallel_size=1, micro_batch_size=1), []) is None
    # A first shape that compiled kernels for 30 s does not make every later estimate 30 s.
    done = [measured(tp=1, wall=31.0, run=1.0), measured(tp=2, wall=1.6, run=0.5),
            measured(part="embedding", wall=0.2, run=0.1)]
    assert estimate_wall_s(Shape(part="layer", tensor_model_parallel_size=2, micro_batch_size=2),
                           done) == pytest.approx(1.0 + 1.1)


def test_context_parallel_shards_come_last_without_recompute_at_the_smallest_micro_batch():
    order = plan_shapes([1, 2], [1, 4], [None, "full"], cp_sizes=[1, 4, 2])
    shards = [s for s in order if s.context_parallel_size > 1]
    assert order[-len(shards):] == shards
    assert [(s.context_parallel_size, s.tensor_model_parallel_size) for s in shards] == [(2, 1), (2, 2), (4, 1),
                                                                                          (4, 2)]
    assert {(s.part, s.micro_batch_size, s.recompute_granularity) for s in shards} == {("layer", 1, None)}
    assert plan_shapes([1], [1], [None]) == plan_shapes([1], [1], [None], cp_sizes=[1])


def test_shard_entries_carry_their_cp_size_and_need_the_shard_divisible_by_tp():
    results = [measured(tp=2, act=800), measured(tp=2, act=300, cp=2), measured(tp=2, act=100, cp=8)]
    rows = layer_entries(results, tp_sizes=[2], micro_batch_sizes=[1], recompute=[None],
                         sequence_parallel=[False, True], seq_length=8)
    assert [(r.get("context_parallel_size", 1), r["sequence_parallel"], r["activation_bytes"]) for r in rows] == [
        (1, False, 800), (1, True, 800), (2, False, 300), (2, True, 300), (8, False, 100)]   # 8 / 8 tokens: no SP
