"""Mixture-of-experts and context parallelism in the cost model: parameters, memory, dispatch and
the key/value exchange, checked against counts done by hand."""

import dataclasses

import numpy as np
import pytest

from megatron_pipette.cost import experts
from megatron_pipette.cost.comm import all_to_all, expert_dispatch, group_links
from megatron_pipette.cost.execution import Execution
from megatron_pipette.cost.gemm import GemmCurve
from megatron_pipette.cost.memory import estimate_memory
from megatron_pipette.cost.model import CostModel
from megatron_pipette.cost.parameters import stage_parameters
from megatron_pipette.errors import Infeasible
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload, workload_from_preset
from megatron_pipette.units import GiB

MOE = Workload(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=4096, global_batch_size=64,
               ffn_hidden_size=4096, swiglu=True, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048,
               moe_layer_freq="([0]+[1]*7)", add_bias_linear=False, normalization="RMSNorm",
               position_embedding_type="rope", vocab_size=32000, untie_embeddings_and_output_weights=True,
               moe_token_dispatcher_type="alltoall", precision="bf16")
H100 = 80 * GiB


def job(workload=MOE, **layout):
    return resolve_job(workload, Layout(**{"data_parallel_size": 1, **layout}))


@pytest.mark.parametrize("ep, pp", [(1, 1), (8, 1), (4, 2)])
def test_parameters_over_the_expert_grid_add_up_to_the_model(ep, pp):
    """TP 1: every device of a stage holds its dense parameters whole and 1/EP of its experts, so
    dense summed over stages plus experts x EP summed over stages is the model."""
    params = stage_parameters(job(expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
                                  data_parallel_size=8 // pp))
    assert params.dense.sum() + ep * params.expert.sum() == MOE.total_parameters()
    assert params.expert.sum() == 7 * 8 // ep * MOE.mlp_parameters(2048)


def test_expert_tensor_parallelism_splits_the_experts_not_the_router():
    one, two = (stage_parameters(job(tensor_model_parallel_size=2, sequence_parallel=True,
                                     expert_tensor_parallel_size=etp, data_parallel_size=4)) for etp in (1, 2))
    assert one.expert[0] == 2 * two.expert[0] and one.dense[0] == two.dense[0]


def test_distributed_optimizer_shards_experts_over_expert_data_parallel():
    """8 GPUs, EP 4: dense state over DP 8, expert state over EDP 2 (12 bytes a parameter)."""
    j = job(expert_model_parallel_size=4, data_parallel_size=8, use_distributed_optimizer=True)
    params, stage = stage_parameters(j), estimate_memory(j, H100).stages[0]
    assert stage.optimizer_bytes == -(-12 * params.dense[0] // 8) - (-12 * params.expert[0] // 2)
    assert stage.parameters == params.dense[0] + params.expert[0]


def test_routed_rows_and_dispatch_volume():
    """T = b s / CP / TP tokens enter; each goes to k experts; ETP gathers its group's rows."""
    j = job(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=4,
            data_parallel_size=4, micro_batch_size=2)
    t = 2 * 4096 / 2
    assert experts.routed_rows(j) == t * 2 * 2
    assert experts.dispatch_bytes(j) == {"a2a": t * 2 * 1024 * 2, "etp": t * 2 * 2 * 1024 * 2, "etp-ep": 0.0,
                                         "flex": 0.0}
    padded = dataclasses.replace(MOE, moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)
    assert experts.routed_rows(job(padded, expert_model_parallel_size=4, data_parallel_size=4)) == 4096 * 2 * 1.5


def test_all_to_all_adds_up_each_ranks_peers_per_link_kind():
    """16 ranks over two 8-GPU nodes: each sends 1/16 of S to 7 NVLink peers and 8 over the NIC,
    at once: the slower of 7 / B_nvlink and 8 / B_nic per byte of a share."""
    c = preset_cluster("dgx-h100", num_nodes=2)
    summary = all_to_all(np.arange(16)[None], c)
    _, nv = c.link(np.array(0), np.array(1), two_way=True)
    _, nic = c.link(np.array(0), np.array(8), two_way=True)
    assert summary.inv_bw_s_per_B[0] == pytest.approx(max(7 / nv, 8 / nic))
    assert summary.all_to_all_s(16e6)[0] == pytest.approx(summary.alpha_s[0] + 1e6 * max(7 / nv, 8 / nic))


def test_the_all_to_all_factor_slows_the_traffic_between_nodes_only():
    """At a factor f the NIC part costs 1/f as much; the NVLink part does not change (one node)."""
    c = preset_cluster("dgx-h100", num_nodes=2)
    slowed = dataclasses.replace(c, all_to_all_bandwidth_factor=0.5)
    one, half = all_to_all(np.arange(16)[None], c, split=True), all_to_all(np.arange(16)[None], slowed, split=True)
    assert half.far_inv_bw_s_per_B[0] == pytest.approx(2 * one.far_inv_bw_s_per_B[0])
    assert half.near_inv_bw_s_per_B[0] == pytest.approx(one.near_inv_bw_s_per_B[0])
    inside = np.arange(8)[None]
    assert all_to_all(inside, slowed).inv_bw_s_per_B[0] == pytest.approx(all_to_all(inside, c).inv_bw_s_per_B[0])


def test_dispatch_across_nodes_costs_more_than_inside_one():
    """EP 8 inside a node against EP 8 spread over 8 nodes (the placement puts each expert group's
    ranks on different nodes): the all-to-alls cross the NICs."""
    c = preset_cluster("dgx-h100", num_nodes=8)
    model = CostModel(c, execution=Execution())                 # the layers' fixed cost aside
    j = job(expert_model_parallel_size=8, data_parallel_size=64)
    inside = model.time(j).breakdown.ep_comm_s
    spread = np.arange(64).reshape(8, 8).T.ravel()            # logical rank r on node r % 8
    across = model.time(j, spread).breakdown.ep_comm_s
    assert 0 < inside < across / 3


def test_moe_layers_without_shared_experts_have_no_mlp_tp_collectives():
    """TP 2 with SP: a dense layer runs four TP collectives forward, an MoE layer without shared
    experts only attention's two (its tokens reach the experts through the dispatcher)."""
    dense = dataclasses.replace(MOE, num_experts=None, moe_layer_freq=1)
    c = preset_cluster("dgx-h100", num_nodes=1)
    model = CostModel(c)
    base = dict(tensor_model_parallel_size=2, sequence_parallel=True, data_parallel_size=4)
    t_dense = model.time(job(dense, **base)).breakdown.tp_comm_s
    t_moe = model.time(job(**base)).breakdown.tp_comm_s
    assert t_moe < t_dense * 0.7


def test_context_parallelism_splits_tokens_and_activations():
    """CP 2 halves the tokens a rank holds: the per-layer activations halve, the optimizer shards
    over DP x CP, and the p2p ring's exchange hides behind long-sequence attention."""
    w = workload_from_preset("llama3-8b", seq_length=32768, max_position_embeddings=32768, global_batch_size=8)
    c = preset_cluster("dgx-h100", num_nodes=2)
    model = CostModel(c)
    base = dict(tensor_model_parallel_size=8, sequence_parallel=True, use_distributed_optimizer=True,
                recompute_granularity="selective")
    one = resolve_job(w, Layout(**base, data_parallel_size=2))
    two = resolve_job(w, Layout(**base, context_parallel_size=2, data_parallel_size=1))
    assert two.tokens_per_microbatch == one.tokens_per_microbatch // 2
    m1, m2 = model.memory(one).stages[0], model.memory(two).stages[0]
    assert m2.activation_bytes == pytest.approx(m1.activation_bytes / 2, rel=0.01)
    assert m2.optimizer_bytes == m1.optimizer_bytes
    # Hidden behind the attention: only the compute the ring's kernels take beside it shows.
    assert CostModel(c, execution=Execution(nccl_compute_share=0.0)).time(two).breakdown.cp_comm_s == 0.0
    assert model.time(two).breakdown.cp_comm_s > 0.0
    gathered = resolve_job(w, Layout(**base, context_parallel_size=2, cp_comm_type="allgather", data_parallel_size=1))
    assert model.time(gathered).breakdown.cp_comm_s > 0


def test_context_parallel_ring_shows_when_attention_is_short():
    """At 4k tokens over 4 ranks, each on its own node (TP 8 fills a node), the K/V blocks over the
    NICs outlast the attention they hide behind; at 8k the attention (quadratic) covers them."""
    w = workload_from_preset("llama3-8b", seq_length=4096, global_batch_size=8)
    c = preset_cluster("dgx-a100", num_nodes=4)
    model = CostModel(c, execution=Execution())          # hidden means free here: the ring's share aside
    j = resolve_job(w, Layout(tensor_model_parallel_size=8, sequence_parallel=True, context_parallel_size=4,
                              data_parallel_size=1))
    spread = group_links(8, 1, 1, c, cp=4).devices        # identity: each CP rank on its own node
    assert spread.shape == (1, 4, 8)
    assert model.time(j).breakdown.cp_comm_s > 0
    longer = resolve_job(dataclasses.replace(w, seq_length=8192), j.layout)
    assert model.time(longer).breakdown.cp_comm_s == 0


def test_context_parallel_rules():
    w = workload_from_preset("llama3-8b", seq_length=8192, global_batch_size=8)
    with pytest.raises(Infeasible, match="a2a splits the heads"):
        resolve_job(w, Layout(tensor_model_parallel_size=8, sequence_parallel=True, context_parallel_size=2,
                              cp_comm_type="a2a", data_parallel_size=1))
    with pytest.raises(Infeasible, match="divisible by 2 x --context-parallel-size"):
        resolve_job(dataclasses.replace(w, seq_length=8190), Layout(context_parallel_size=4, data_parallel_size=1))


def test_moe_on_an_uneven_cluster_prices_every_replica():
    """A slow GPU makes a later replica the critical one; the dispatch is priced for every replica."""
    c = preset_cluster("dgx-a100", num_nodes=2)
    rates = c.gemm_flops.copy()
    rates[13] /= 2
    c = dataclasses.replace(c, gemm_flops=rates)
    t = CostModel(c).time(job(expert_model_parallel_size=4, data_parallel_size=16))
    assert t.breakdown.ep_comm_s > 0 and t.iteration_time_s > 0


def flex_job(nodes: int, ep: int, **workload):
    w = dataclasses.replace(MOE, num_experts=128, moe_router_topk=8, moe_token_dispatcher_type="flex", **workload)
    return resolve_job(w, Layout(expert_model_parallel_size=ep, data_parallel_size=8 * nodes))


def test_flex_dispatcher_sends_a_token_once_per_remote_node():
    """DeepEP / HybridEP: beyond the node, E[distinct nodes a token's experts are on] / k of an
    all-to-all's copies; inside it every copy, fanned out. Top-8 of 128 experts over 2 nodes: a
    token reaches both nodes nearly always (1 - C(64,8)/C(128,8)), 2 of its 8 copies' worth;
    node-limited routing (8 groups on 8 nodes, 4 chosen) reaches 4 of 8 nodes: half the copies."""
    far, near = experts.flex_shares(flex_job(2, 16), 8)
    assert far == pytest.approx(2 * (1 - 4426165368 / 1429702652400) / 8) and near == 2.0
    far, near = experts.flex_shares(flex_job(8, 64, moe_router_num_groups=8, moe_router_group_topk=4), 8)
    assert far == pytest.approx(0.5) and near == 8.0
    assert experts.flex_shares(flex_job(1, 8), 8) == (1.0, 1.0)


def test_flex_dispatch_across_nodes_costs_about_what_alltoall_does_inside_one():
    """NVIDIA's Qwen3-30B-A3B ran EP 8 inside a node and EP 16 over two within 2% (HybridEP):
    priced with the flex dispatcher the two dispatches are within a factor of 1.5, where the
    alltoall dispatcher's cross-node one costs over twice its in-node one."""
    c = preset_cluster("dgx-h100", num_nodes=2)
    model = CostModel(c, execution=Execution())
    inside = model.time(flex_job(2, 8)).breakdown.ep_comm_s
    across = model.time(flex_job(2, 16)).breakdown.ep_comm_s
    plain = model.time(resolve_job(dataclasses.replace(flex_job(2, 16).workload, moe_token_dispatcher_type="alltoall"),
                                   flex_job(2, 16).layout)).breakdown.ep_comm_s
    assert across < 1.5 * inside and plain > 2 * inside and across < plain


def test_nvl72_expert_parallel_groups_of_64_stay_inside_a_rack():
    """Issue 31: DeepSeek-V3's EP 64 on 256 GB200 (Megatron's expert order tp-ep-dp-pp: 64 consecutive
    ranks a group) dispatches over NVLink only, each group as a job of one rack would; packed 18 trays
    a rack, three of its four groups crossed the racks' InfiniBand and were priced 10-14x slower."""
    c = preset_cluster("gb200-nvl72", num_nodes=64)
    flex = expert_dispatch(np.arange(256), 64, 1, c, flex=True)
    assert (flex.far_inv_bw_s_per_B == 0).all()
    one_rack = expert_dispatch(np.arange(64), 64, 1, preset_cluster("gb200-nvl72", num_nodes=16), flex=True)
    assert flex.inv_bw_s_per_B == pytest.approx(np.repeat(one_rack.inv_bw_s_per_B, 4, axis=0))


def test_flex_dispatcher_needs_expert_parallelism():
    with pytest.raises(Infeasible, match="flex needs"):
        flex_job(1, 1)


def test_biased_experts_add_their_fc2_bias_in_a_pass_of_their_own():
    """TEGroupedMLP._apply_bias (megatron-core 0.19): each expert's fc2 output adds bias x probability
    (read, written), the pieces are concatenated (read, written) and, with wider probabilities, cast
    back: 4 x 2 bytes an element in bf16, 2 + 3 x 4 + 6 with fp32 probabilities; none without biases."""
    biased = dataclasses.replace(MOE, add_bias_linear=True, swiglu=False, bias_gelu_fusion=False)
    elements = experts.routed_rows(job(biased)) * MOE.hidden_size
    assert experts.expert_bias_bytes(job(MOE)) == 0
    assert experts.expert_bias_bytes(job(biased)) == 8 * elements
    assert experts.expert_bias_bytes(job(dataclasses.replace(biased, moe_router_dtype="fp32"))) == 20 * elements
    bw = 1e12
    plain = experts.moe_mlp(job(dataclasses.replace(biased, add_bias_linear=False)), bw, GemmCurve(None, 0.0))
    with_bias = experts.moe_mlp(job(biased), bw, GemmCurve(None, 0.0))
    assert with_bias.forward.mem_s - plain.forward.mem_s == pytest.approx(8 * elements / bw)


HYBRIDEP = dataclasses.replace(MOE, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                               use_transformer_engine_op_fuser=True)
BUDGET = dataclasses.replace(HYBRIDEP, moe_expert_rank_capacity_factor=1.3)
STASH = dataclasses.replace(BUDGET, moe_paged_stash=True, moe_paged_stash_buffer_size_factor_cuda=1.2)


@pytest.mark.megatron
def test_the_budget_is_the_one_hybridep_sizes_its_buffers_by():
    """megatron-core 0.19.2's _HybridEPManager.setup_metadata on the 4096 tokens a rank routes: int(4096 x
    2 x 1.3) = 10649 rows, rounded up to the op fuser's 256: 10752."""
    import torch
    from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager
    from megatron.core.transformer.transformer_config import TransformerConfig

    manager = object.__new__(_HybridEPManager)    # its __init__ needs the HybridEP kernels; setup_metadata does not
    manager.config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                                       moe_router_topk=2, moe_token_dispatcher_type="flex",
                                       moe_flex_dispatcher_backend="hybridep", use_transformer_engine_op_fuser=True,
                                       moe_expert_rank_capacity_factor=1.3)
    manager.num_experts, manager.drop_and_pad = 8, False
    manager.moe_expert_rank_capacity_factor = manager.config.moe_expert_rank_capacity_factor
    manager.setup_metadata(torch.zeros(4096, 8, dtype=torch.bool), torch.zeros(4096, 8))
    j = job(BUDGET, expert_model_parallel_size=4, data_parallel_size=4)
    assert experts.tokens_in(j) == 4096 and experts.budget_rows(j) == manager.num_permuted_tokens == 10752


def test_the_budget_sizes_what_the_experts_keep_and_the_stash_the_rows_in_flight():
    """Kept per row (bf16, SwiGLU, h 1024, expert FFN 2048): fc1 input 2 x 1024, fc1 output 2 x 4096, fc2
    input 2 x 2048, the probability 2: 14338 bytes; the router's scores 8 x 4096 x 8. Dropless HybridEP keeps
    the 8192 rows received; the budget 10752; the stash 1.2 x (10752 // 1.3 = 8270) rows, and its layer in
    the backward is reloaded into 10752-row buffers beside their gradients (fc1 + fc2 wide)."""
    plain, budget, stash = (job(w, expert_model_parallel_size=4, data_parallel_size=4)
                            for w in (HYBRIDEP, BUDGET, STASH))
    row, router = 14338, 8 * 4096 * 8
    assert experts.expert_row_bytes(plain, frozenset()) == row
    assert experts.moe_activation_bytes(plain) == router + 8192 * row
    assert experts.moe_activation_bytes(budget) == router + 10752 * row
    assert experts.moe_activation_bytes(stash) == round(router + 1.2 * 8270 * row)
    assert experts.moe_backward_bytes(plain) == 2 * 8192 * (4096 + 2048)
    assert experts.moe_backward_bytes(budget) == 2 * 10752 * (4096 + 2048)
    assert experts.moe_backward_bytes(stash) == 2 * 10752 * (4096 + 2048) + 10752 * row


def test_the_experts_compute_the_rows_received_whatever_their_buffers():
    """HybridEP's budget sizes buffers, not work: the fused grouped MLP runs its GEMMs on the split sizes
    (the rows received), and the stash's copies overlap on their own stream."""
    bw, gemm = 3e12, GemmCurve(None, 0.0)
    works = [experts.moe_mlp(job(w, expert_model_parallel_size=4, data_parallel_size=4), bw, gemm)
             for w in (HYBRIDEP, BUDGET, STASH)]
    assert works[0] == works[1] == works[2]
