"""The GEMM table (benchmarks/calibration/gemm_efficiency.py) times the shapes megatron-core's own layer has."""


import torch

from benchmarks.calibration import gemm_efficiency
from megatron_pipette.profile import build
from megatron_pipette.profile.runtime import single_device_megatron
from megatron_pipette.spec.workload import workload_from_preset

MODULES = {"qkv": "layers.0.self_attention.linear_qkv", "proj": "layers.0.self_attention.linear_proj",
           "fc1": "layers.0.mlp.linear_fc1", "fc2": "layers.0.mlp.linear_fc2"}


def test_linears_are_the_weight_shapes_of_one_tp_rank():
    w = workload_from_preset("llama3-8b", hidden_size=128, num_attention_heads=8, num_query_groups=2,
                             ffn_hidden_size=256, seq_length=16, vocab_size=1000, precision="fp32")
    cpu = torch.device("cpu")
    for tp in (1, 2):
        expected = gemm_efficiency.layer_linears(w, tp)
        with single_device_megatron(cpu) as env:
            layer = build.layer_step(w, tp, 1, None, env, te=False).module
            output = build.output_step(w, tp, 1, env, te=False).module
        weights = dict(layer.named_parameters())
        assert {k: tuple(weights[f"{m}.weight"].shape) for k, m in MODULES.items()} == {
            k: expected[k] for k in MODULES}
        assert tuple(output.output_layer.weight.shape) == expected["output"]


def test_each_linear_is_timed_forward_and_for_both_gradients():
    (fwd, dgrad, wgrad) = gemm_efficiency.linear_gemms(4096, 3072, 1024, "bf16").values()
    assert (fwd.m, fwd.n, fwd.k, dgrad.m, dgrad.n, dgrad.k, wgrad.m, wgrad.n, wgrad.k) == (
        4096, 3072, 1024, 4096, 1024, 3072, 3072, 1024, 4096)
    assert [g.layout for g in (fwd, dgrad, wgrad)] == ["NT", "NN", "TN"]
