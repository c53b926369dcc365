"""Multi-token prediction (--mtp-num-layers) as megatron-core 0.19 runs it on the last pipeline
stage: placement rules, work, parameters, memory and the embedding's all-reduce."""

import dataclasses

import numpy as np
import pytest

from megatron_pipette.cost import compute
from megatron_pipette.cost.compute import mtp_projection, roofline_embedding, roofline_output, stage_work
from megatron_pipette.cost.experts import moe_mlp
from megatron_pipette.cost.gemm import Work, gemm_curve
from megatron_pipette.cost.memory import estimate_memory
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.parameters import dense_layer_parameters, expert_layer_parameters, stage_parameters
from megatron_pipette.errors import PipetteError
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Infeasible, Layout
from megatron_pipette.spec.workload import Workload
from megatron_pipette.units import GiB

CLUSTER = preset_cluster("dgx-h100", num_nodes=1, precision="bf16")


def model(**kw):
    """A small MoE model, its first layer dense and its last MoE, untied."""
    return Workload(**{**dict(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=2048,
                              global_batch_size=32, precision="bf16", swiglu=True, normalization="RMSNorm",
                              position_embedding_type="rope", add_bias_linear=False,
                              untie_embeddings_and_output_weights=True, num_experts=8, moe_router_topk=2,
                              moe_ffn_hidden_size=512, moe_token_dispatcher_type="alltoall",
                              moe_layer_freq="([0]+[1]*7)"), **kw})


def job(workload, **layout):
    return resolve_job(workload, Layout(**{"data_parallel_size": 1, **layout}))


def test_the_layout_places_mtp_as_megatron_allows():
    """PipelineParallelLayerLayout.validate_layer_layout: as many m as --mtp-num-layers, after every
    decoder layer; modelled in the last virtual stage only (elsewhere it is --mtp-standalone)."""
    mtp = model(mtp_num_layers=1)
    assert job(mtp, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Etttt|ttttmL").chunk_sizes \
        == ((4,), (4,))
    for text, why in (("Etttt|ttttL", "places 0 multi-token"), ("Ettttm|ttttL", "before the last virtual stage"),
                      ("Etttt|tttmtL", "before the last virtual stage")):
        with pytest.raises(Infeasible, match=why):
            job(mtp, pipeline_model_parallel_size=2, pipeline_model_parallel_layout=text)
    with pytest.raises(Infeasible, match="places 1 multi-token.*without --mtp-num-layers"):
        job(model(), pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Etttt|ttttmL")


@pytest.mark.parametrize("layout", [dict(pipeline_model_parallel_size=2),
                                    dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                         sequence_parallel=True, num_layers_per_virtual_pipeline_stage=2)])
def test_mtp_work_is_on_the_last_chunk_only(layout):
    """Each MTP layer: one more MoE layer, an embedding lookup, the output layer and loss again, and its
    norms, concatenation and 2h-to-h projection, all on the last stage's last chunk."""
    plain, mtp = job(model(), **layout), job(model(mtp_num_layers=2), **layout)
    a, b = stage_work(plain, CLUSTER), stage_work(mtp, CLUSTER)
    more = np.zeros_like(a.layers)
    more[-1, -1] = 2
    np.testing.assert_array_equal(b.layers - a.layers, more)
    np.testing.assert_array_equal(b.moe_layers - a.moe_layers, more)
    bw, gemm = CLUSTER.memory_bandwidth_Bps, gemm_curve(CLUSTER.gpu, "bf16")
    layer = compute.roofline_layer(mtp, bw, gemm, compute.attention_curve(CLUSTER.gpu, "auto"),
                                   moe=moe_mlp(mtp, bw, gemm))
    extras = [roofline_embedding(mtp, bw), roofline_output(mtp, bw, gemm), mtp_projection(mtp, bw, gemm)]
    logits = 2 * 2048 * mtp.workload.padded_vocab_size(layout.get("tensor_model_parallel_size", 1)) \
        // layout.get("tensor_model_parallel_size", 1)
    for part, got, base in (("forward", b.forward, a.forward), ("backward", b.backward, a.backward)):
        added = [getattr(x, part) for x in (layer, *extras)]
        if part == "forward":      # the acceptance count's argmax reads the logits once more
            added.append(Work(mem_s=logits / bw))
        want = np.zeros_like(a.layers)
        want[-1, -1] = 2 * sum(w.flops for w in added)
        np.testing.assert_allclose(got.flops - base.flops, want, rtol=1e-12, atol=1e-3)
        want[-1, -1] = 2 * sum(w.mem_s for w in added)
        np.testing.assert_allclose(got.mem_s - base.mem_s, want, rtol=1e-9, atol=1e-15)


def test_full_recomputation_checkpoints_each_mtp_layer_whole():
    full = dict(pipeline_model_parallel_size=2, recompute_granularity="full", recompute_method="block",
                recompute_num_layers=1)
    a, b = stage_work(job(model(), **full), CLUSTER), stage_work(job(model(mtp_num_layers=1), **full), CLUSTER)
    assert b.recomputed_layers[-1, -1] == a.recomputed_layers[-1, -1] + 1
    assert b.moe_recomputed[-1, -1] == a.moe_recomputed[-1, -1] + 1


@pytest.mark.parametrize("untie", [True, False])
def test_the_last_stage_holds_the_mtp_layers_and_an_embedding(untie):
    """GPTModel builds an embedding where mtp_process, beside the output layer, tied or not; the
    layers' experts, their projection (column-parallel) and norms are the last stage's."""
    layout = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    plain = model(untie_embeddings_and_output_weights=untie)
    mtp = dataclasses.replace(plain, mtp_num_layers=1)
    resolved = job(mtp, **layout)
    a, b = stage_parameters(job(plain, **layout)), stage_parameters(resolved)
    words = mtp.padded_vocab_size(2) * 1024 // 2
    assert b.dense[0] == a.dense[0] and b.expert[0] == a.expert[0]
    assert b.dense[-1] - a.dense[-1] == dense_layer_parameters(mtp, 2, moe=True) + 2 * 1024 * 1024 // 2 \
        + 3 * mtp.norm_parameters() + words
    assert b.expert[-1] - a.expert[-1] == expert_layer_parameters(mtp, resolved.layout.ep, resolved.layout.etp)
    one_stage = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    a1, b1 = stage_parameters(job(plain, **one_stage)), stage_parameters(job(mtp, **one_stage))
    assert b1.dense[0] - a1.dense[0] == dense_layer_parameters(mtp, 2, moe=True) + 2 * 1024 * 1024 // 2 \
        + 3 * mtp.norm_parameters()        # one stage: the embedding is already there


def test_mtp_memory_is_the_last_stages():
    layout = dict(pipeline_model_parallel_size=2)
    a = estimate_memory(job(model(), **layout), 80 * GiB)
    b = estimate_memory(job(model(mtp_num_layers=1), **layout), 80 * GiB)
    assert b.stages[0].activation_bytes == a.stages[0].activation_bytes
    assert b.stages[-1].activation_bytes > a.stages[-1].activation_bytes
    full = dict(layout, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    grown = b.stages[-1].activation_bytes - a.stages[-1].activation_bytes
    af = estimate_memory(job(model(), **full), 80 * GiB)
    bf = estimate_memory(job(model(mtp_num_layers=1), **full), 80 * GiB)
    assert 0 < bf.stages[-1].activation_bytes - af.stages[-1].activation_bytes < grown


def test_an_untied_embedding_is_all_reduced_once_mtp_copies_it():
    """The embedding group (first and last stage) all-reduces the copy MTP needs, as it does a tied one."""
    layout = Layout(pipeline_model_parallel_size=2, data_parallel_size=4)
    cost = CostModel(CLUSTER)
    untied = cost.time(resolve_job(model(), layout)).breakdown
    with_mtp = cost.time(resolve_job(model(mtp_num_layers=1), layout)).breakdown
    assert untied.embedding_allreduce_s == 0 and with_mtp.embedding_allreduce_s > 0


def test_mtp_pays_its_tensor_parallel_collectives():
    """With TP the MTP layer's embedding, projection and output gather and reduce as the first and
    last stages' do, beside the layer's own collectives; without TP there are none."""
    cost = CostModel(CLUSTER)
    tp = Layout(tensor_model_parallel_size=2, sequence_parallel=True, data_parallel_size=4)
    one, two = (cost.time(resolve_job(model(mtp_num_layers=n), tp)).breakdown.tp_comm_s for n in (1, 2))
    zero = cost.time(resolve_job(model(), tp)).breakdown.tp_comm_s
    assert two - one == pytest.approx(one - zero) and one - zero > (zero / 8)   # more than a layer's share
    solo = Layout(data_parallel_size=8)
    assert cost.time(resolve_job(model(mtp_num_layers=1), solo)).breakdown.tp_comm_s == 0


def test_mtp_refuses_yarn_positions_as_megatron_does():
    with pytest.raises(PipetteError, match="--mtp-num-layers with --position-embedding-type yarn"):
        model(mtp_num_layers=1, position_embedding_type="yarn")
