"""Activation CPU offloading (--cpu-offloading-num-layers): memory kept, copies' exposed time, refusals."""

import dataclasses

import pytest

from megatron_pipette.cost import offload
from megatron_pipette.cost.memory import chunk_stored_bytes, estimate_memory
from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import Infeasible
from megatron_pipette.plan.planner import evaluate
from megatron_pipette.spec.hardware import lookup_gpu, preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout, validate_layout
from megatron_pipette.spec.megatron_flags import refusals
from megatron_pipette.spec.workload import workload_from_preset

LLAMA = dataclasses.replace(workload_from_preset("llama3-8b"), global_batch_size=64)
H100 = lookup_gpu("H100").memory_bytes


def _activations(n: int) -> int:
    return estimate_memory(resolve_job(LLAMA, Layout(data_parallel_size=8, cpu_offloading_num_layers=n)),
                           H100).stages[0].activation_bytes


def test_offloaded_layers_leave_the_device_the_rest_stays():
    """TE keeps at most L - N layers' activations on the device: N layers' worth less."""
    job = resolve_job(LLAMA, Layout(data_parallel_size=8))
    layer = chunk_stored_bytes(job, 1, 0)
    assert _activations(0) - _activations(12) == 12 * layer
    assert _activations(31) - _activations(0) == -31 * layer


def test_copies_shorter_than_the_layers_hide():
    f, b = offload.microbatch_exposed(32, 16, 1.0, 2.0, copy_s=0.9)
    assert (float(f), float(b)) == (0.0, 0.0)


def test_all_but_one_layer_offloaded_waits_for_every_copy():
    """N = L - 1: each layer's forward waits for the previous layer's copy out, each backward for its own copy back."""
    f, b = offload.microbatch_exposed(4, 3, 1.0, 1.0, copy_s=0.5)
    assert float(f) == pytest.approx(3 * 0.5)
    assert float(b) == pytest.approx(3 * 0.5)


def test_copies_longer_than_the_window_are_exposed_by_the_excess():
    """8 layers, 4 offloaded, copies of 2 s beside 1 s layers: copy 3 ends at 1 + 4 x 2 = 9 s, layer 7
    (which waits for it) would start at 7 s: 2 s exposed."""
    f, _ = offload.microbatch_exposed(8, 4, 1.0, 1.0, copy_s=2.0)
    assert float(f) == pytest.approx(2.0)


def test_priced_time_grows_on_a_slow_host_link():
    job = resolve_job(LLAMA, Layout(data_parallel_size=8, cpu_offloading_num_layers=31))
    fast = preset_cluster("dgx-h100", num_nodes=1)
    slow = dataclasses.replace(fast, host_link_Bps=1e9)
    assert evaluate(CostModel(slow), job)[0].iteration_time_s > evaluate(CostModel(fast), job)[0].iteration_time_s


def test_megatron_refusals_by_name():
    for layout, words in ((Layout(data_parallel_size=8, cpu_offloading_num_layers=32), "less than --num-layers 32"),
                          (Layout(pipeline_model_parallel_size=2, data_parallel_size=4, cpu_offloading_num_layers=4),
                           "--pipeline-model-parallel-size 2"),
                          (Layout(data_parallel_size=8, recompute_granularity="selective", cpu_offloading_num_layers=4),
                           "--recompute-granularity selective")):
        with pytest.raises(Infeasible, match="--cpu-offloading-num-layers"):
            validate_layout(LLAMA, layout)
        with pytest.raises(Infeasible, match=words):
            validate_layout(LLAMA, layout)


def test_the_flag_is_no_longer_refused():
    assert not any("cpu_offloading_num_layers" in str(r) for r in refusals({"cpu_offloading_num_layers": 4}))
