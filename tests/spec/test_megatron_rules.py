"""Megatron's own rules for --overlap-moe-expert-parallel-comm and --delay-wgrad-compute, in one place
(spec.layout), and everyone who asks it (issue 33): a pinned plan that broke them passed the plan check
and the dry run, then every rank died on an AssertionError; `pipette estimate` priced the same layouts."""

import pytest

from helpers.plans import plan_doc
from megatron_pipette.cli.main import main
from megatron_pipette.errors import Infeasible
from megatron_pipette.integration.plan_check import JobRequest, plan_problems, typed_problem
from megatron_pipette.report.plan_document import PlanRecord
from megatron_pipette.spec.layout import Layout, check_implementation, validate_layout
from megatron_pipette.spec.workload import workload_from_preset

DENSE = workload_from_preset("tiny-gpt", precision="bf16")
MOE = workload_from_preset("tiny-gpt", num_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                           precision="bf16", add_bias_linear=False)
OVERLAP = Layout(data_parallel_size=4, micro_batch_size=1, expert_model_parallel_size=2,
                 overlap_moe_expert_parallel_comm=True)
DELAYED = Layout(data_parallel_size=4, micro_batch_size=1, expert_model_parallel_size=2,
                 overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
DENSE_OVERLAP = Layout(data_parallel_size=4, micro_batch_size=1, overlap_moe_expert_parallel_comm=True)
NEEDS_EXPERTS = "--overlap-moe-expert-parallel-comm and --delay-wgrad-compute need --num-experts"
NEEDS_TE = "--delay-wgrad-compute needs Transformer Engine"


@pytest.mark.parametrize("workload, layout, rule", [
    (DENSE, DENSE_OVERLAP, NEEDS_EXPERTS),
    (DENSE, Layout(data_parallel_size=4, micro_batch_size=1, delay_wgrad_compute=True), NEEDS_EXPERTS),
    (workload_from_preset("tiny-gpt", num_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                          precision="fp32", add_bias_linear=False), OVERLAP,
     "--overlap-moe-expert-parallel-comm needs --bf16 or --fp16, not fp32"),
])
def test_the_rules_of_transformer_config(workload, layout: Layout, rule: str) -> None:
    """TransformerConfig.__post_init__ (megatron-core 0.19.2): the overlap needs expert parallelism, so a
    dense model cannot have it, nor the delayed weight gradients that need it; and bf16 or fp16."""
    with pytest.raises(Infeasible, match=rule):
        validate_layout(workload, layout, 4)
    validate_layout(MOE, DELAYED, 4)


def test_delayed_weight_gradients_need_transformer_engine() -> None:
    """megatron/training/arguments.py validate_args: --delay-wgrad-compute asserts --transformer-impl
    transformer_engine."""
    with pytest.raises(Infeasible, match=NEEDS_TE):
        check_implementation(DELAYED, transformer_engine=False)
    check_implementation(DELAYED, transformer_engine=True)
    check_implementation(OVERLAP, transformer_engine=False)


@pytest.mark.parametrize("workload, layout, transformer_engine, rule", [
    (DENSE, DENSE_OVERLAP, True, NEEDS_EXPERTS),
    (MOE, DELAYED, False, NEEDS_TE),
])
def test_a_pinned_plan_megatron_rejects_fails_the_plan_check(workload, layout: Layout, transformer_engine: bool,
                                                            rule: str) -> None:
    plan = PlanRecord.from_json(plan_doc(workload, layout), "pinned")
    request = JobRequest(workload=workload, world_size=4, gpus_per_node=4, transformer_engine=transformer_engine)
    (problem,) = plan_problems(plan, request)
    assert problem.startswith(f"Megatron would reject its layout: {rule}"), problem
    assert plan_problems(PlanRecord.from_json(plan_doc(MOE, DELAYED), "pinned"),
                         JobRequest(workload=MOE, world_size=4, gpus_per_node=4)) == []


def test_typed_delayed_weight_gradients_without_transformer_engine_cannot_run() -> None:
    request = JobRequest(workload=MOE, world_size=4, gpus_per_node=4, transformer_engine=False,
                         typed={"delay_wgrad_compute": True, "overlap_moe_expert_parallel_comm": True})
    assert typed_problem(request).startswith(NEEDS_TE)


@pytest.mark.parametrize("argv, rule", [
    (["--model", "gpt3-1.3b", "--overlap-moe-expert-parallel-comm"], NEEDS_EXPERTS),
    (["--model", "mixtral-8x7b", "--expert-model-parallel-size", "8", "--overlap-moe-expert-parallel-comm",
      "--delay-wgrad-compute", "--transformer-impl", "local"], NEEDS_TE),
])
def test_estimate_refuses_what_megatron_rejects(argv: list[str], rule: str, capsys) -> None:
    assert main(["estimate", *argv, "--num-nodes", "4", "--global-batch-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipette estimate: error: Megatron would reject this layout: {rule}"), err
