"""The expert activations and biases the workload refuses are the ones megatron-core cannot run.

Every combination of --swiglu, --disable-bias-linear, --no-bias-gelu-fusion and
--no-bias-swiglu-fusion, with Megatron-LM's derived bias_activation_fusion, builds megatron-core's
MoE layer (the local layers: no Transformer Engine here) and runs its first forward on CPU. The
workload refuses the combination exactly when that forward raises, so the refusal cannot drift
from megatron-core's conditions (`--num-experts 4 --moe-router-topk 2` alone once planned in full,
then failed with "Only support fusion of swiglu and quick_gelu ...").
"""

import itertools

import pytest
import torch

from megatron_pipette.errors import UnrunnableFlags
from megatron_pipette.profile.runtime import single_device_megatron
from megatron_pipette.spec.workload import Workload

pytestmark = pytest.mark.megatron
SWITCHES = ("swiglu", "add_bias_linear", "bias_gelu_fusion", "bias_swiglu_fusion")


def first_forward(w: Workload) -> str | None:
    """The error of megatron-core's MoE layer's first forward for this workload's activation, or None."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=w.hidden_size, num_attention_heads=w.num_attention_heads, ffn_hidden_size=w.ffn,
        gated_linear_unit=w.swiglu, activation_func=torch.nn.functional.silu if w.swiglu else torch.nn.functional.gelu,
        add_bias_linear=w.add_bias_linear, bias_activation_fusion=w.bias_activation_fusion,
        num_moe_experts=w.num_experts, moe_router_topk=w.moe_router_topk, moe_ffn_hidden_size=w.moe_ffn,
        params_dtype=torch.float32, use_cpu_initialization=True)
    layer = build_module(get_gpt_layer_local_spec(num_experts=w.num_experts, moe_grouped_gemm=False), config=config,
                         layer_number=1)
    try:
        layer.mlp(torch.randn(8, 2, w.hidden_size))
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_the_workload_refuses_what_megatron_core_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")   # the router moves itself to the GPU
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, global_batch_size=2,
                attention_backend="local", moe_router_topk=2)
    outcomes = {}
    with single_device_megatron(torch.device("cpu")):
        for values in itertools.product((False, True), repeat=len(SWITCHES)):
            switches = dict(zip(SWITCHES, values))
            try:
                Workload(**base, **switches, num_experts=4)
                refused = None
            except UnrunnableFlags as e:
                refused = str(e)
            outcomes[values] = (refused, first_forward(_unchecked(base, switches)))
    wrong = {v: o for v, o in outcomes.items() if (o[0] is None) != (o[1] is None)}
    assert not wrong, wrong
    assert sum(o[1] is None for o in outcomes.values()) == 8      # no biases: every activation and fusion runs


def _unchecked(base: dict, switches: dict) -> Workload:
    """The MoE workload built past its check, for megatron-core to try whatever the check says."""
    w = Workload(**base, **switches, num_experts=None)
    object.__setattr__(w, "num_experts", 4)
    return w
