"""(issue 32) Every choice field of the specs is typed as the Literal of the values its check accepts:
each value the type lists is accepted, one outside it is refused naming the flag and every listed
value, so the type and the check cannot drift apart."""

import typing

import pytest

from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.layout import Layout, check_user_layout
from megatron_pipette.spec.workload import (
    BYTES_PER_ELEMENT,
    OPTIMIZER_DTYPES,
    PRECISIONS,
    OptimizerStateDtype,
    Workload,
    megatron_flag,
    workload_from_preset,
)

BESIDE = {"fp8": {"precision": "bf16"}, "fp4": {"precision": "bf16"},
          **{f: {"use_precision_aware_optimizer": True, "precision": "bf16"}
             for f in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")}}
"""What a value needs beside it to be a workload Megatron runs (FP8 and FP4 train in bf16, the
optimizer's dtypes need the precision-aware optimizer)."""


def choices(cls: type) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Each Literal-typed field: its values, and whether it holds a tuple of them."""
    found = {}
    for name, kind in typing.get_type_hints(cls).items():
        for option in typing.get_args(kind) if typing.get_origin(kind) is not typing.Literal else (kind,):
            words = typing.get_origin(option) is tuple
            if typing.get_origin(typing.get_args(option)[0] if words else option) is typing.Literal:
                found[name] = typing.get_args(typing.get_args(option)[0] if words else option), words
    return found


WORKLOAD, LAYOUT = choices(Workload), choices(Layout)


def test_the_choice_fields_are_the_ones_with_a_fixed_set() -> None:
    assert set(WORKLOAD) == {"position_embedding_type", "normalization", "softmax_type", "attention_backend",
                             "precision", "cross_entropy_fusion_impl", "fp8", "fp8_recipe", "fp4", "fp4_recipe",
                             "main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
                             "moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_router_dtype",
                             "cuda_graph_impl", "cuda_graph_modules"}
    assert set(LAYOUT) == {"recompute_granularity", "recompute_method", "recompute_modules", "cp_comm_type",
                           "data_parallel_sharding_strategy"}
    assert set(OPTIMIZER_DTYPES) == set(typing.get_args(OptimizerStateDtype))   # the tables priced by them
    assert set(BYTES_PER_ELEMENT) == set(PRECISIONS)


def workload(**fields) -> Workload:
    return workload_from_preset("mixtral-8x7b", **fields)


def layout(**fields) -> None:
    check_user_layout(Layout(**fields))


@pytest.mark.parametrize("build, field", [(workload, f) for f in WORKLOAD] + [(layout, f) for f in LAYOUT])
def test_each_listed_value_is_accepted_and_one_outside_is_refused(build, field: str) -> None:
    values, words = (WORKLOAD if build is workload else LAYOUT)[field]
    for value in values:
        build(**BESIDE.get(field, {}), **{field: (value,) if words else value})
    with pytest.raises(PipetteError) as refused:
        build(**BESIDE.get(field, {}), **{field: ("no-such-choice",) if words else "no-such-choice"})
    assert megatron_flag(field) in str(refused.value) and all(v in str(refused.value) for v in values), refused.value
