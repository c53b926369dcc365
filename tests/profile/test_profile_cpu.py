"""profile_layers on one CPU process: a small GPT layer, every recompute and SP variant.

One module-scoped profile serves most tests (building and timing megatron-core
layers is the slow part). Timing assertions compare sums over shapes, where
the effect (a whole re-run forward) is far larger than the noise of a shared machine.
"""

import dataclasses
import json

import pytest
import torch

from megatron_pipette.errors import PipetteError
from megatron_pipette.profile import profile_layers
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import ProfileFile, check_profile_matches, profile_from_json
from megatron_pipette.spec.workload import Workload

S, H, A, V = 32, 64, 4, 1000
WORKLOAD = Workload(num_layers=2, hidden_size=H, num_attention_heads=A, seq_length=S, global_batch_size=8,
                    vocab_size=V, precision="fp32")
TPS, MBS = (1, 2), (1, 2, 4)


@pytest.fixture(scope="module")
def doc():
    return profile_layers(WORKLOAD, tp_sizes=TPS, micro_batch_sizes=MBS, device="cpu", budget_s=300,
                          warmup=2, iters=5).to_json()


def entry(doc, tp, mbs, rc=None, sp=False):
    (row,) = [e for e in doc["layers"] if (e["tensor_model_parallel_size"], e["micro_batch_size"],
                                           e["recompute_granularity"], e["sequence_parallel"]) == (tp, mbs, rc, sp)]
    return row


def test_document_validates_and_matches_the_workload(doc):
    profile = profile_from_json(doc)
    check_profile_matches(profile, WORKLOAD)
    assert profile.device_name == "cpu" and profile.rank == 0 and doc["device"]["host"]
    assert profile.gemm_flops > 1e8 and doc["device"]["gemm_precision"] == "fp32"   # the reference rate
    # every combination: tp1 (no SP) 3 rc x 3 mbs, tp2 2 SP x 3 rc x 3 mbs
    assert len(doc["layers"]) == 9 + 18
    assert len(doc["embedding"]) == len(doc["output_layer"]) == 6
    assert doc["measurement"]["skipped"] == []
    assert profile.layer(2, 4, True, "full") is not None and profile.output_entry(2, 1) is not None


def test_activation_bytes_grow_with_micro_batch_and_shrink_with_tp_and_sp(doc):
    for rc in (None, "selective", "full"):
        for tp in TPS:
            sizes = [entry(doc, tp, m, rc)["activation_bytes"] for m in MBS]
            assert sizes[0] < sizes[1] < sizes[2]
            # every saved tensor is per token, but for a 4-byte flag selective recompute saves
            assert abs(sizes[2] - 4 * sizes[0]) <= 16
        for m in MBS:
            if rc != "full":  # full recompute keeps only the layer input, which TP does not shard
                assert entry(doc, 2, m, rc)["activation_bytes"] < entry(doc, 1, m, rc)["activation_bytes"]
            assert entry(doc, 2, m, rc, sp=True)["activation_bytes"] < entry(doc, 2, m, rc)["activation_bytes"]
    for part in ("embedding", "output_layer"):
        sizes = [e["activation_bytes"] for e in doc[part] if e["tensor_model_parallel_size"] == 1]
        assert sizes == sorted(sizes) and sizes[0] > 0
    out = {e["tensor_model_parallel_size"]: e["activation_bytes"] for e in doc["output_layer"]
           if e["micro_batch_size"] == 1}
    assert out[2] < out[1]  # the vocab/TP logits dominate


def test_full_recompute_keeps_only_the_input_and_pays_in_backward(doc):
    for tp in TPS:
        for m in MBS:
            full, plain = entry(doc, tp, m, "full"), entry(doc, tp, m)
            assert full["activation_bytes"] == S * m * H * 4  # the layer input, fp32
            assert full["activation_bytes"] < plain["activation_bytes"] / 10
    measured = [(tp, m) for tp in TPS for m in (1, 4)]
    full_backward = sum(entry(doc, tp, m, "full")["backward_s"] for tp, m in measured)
    plain_backward = sum(entry(doc, tp, m)["backward_s"] for tp, m in measured)
    assert full_backward > plain_backward, (full_backward, plain_backward)


def test_selective_recompute_drops_exactly_the_attention_scores(doc):
    b = 4  # bytes per fp32 element; CPU dropout keeps its mask in the activation dtype
    for tp in TPS:
        scores = (A // tp) * S * S * (2 * b + b)  # softmax output, dropout mask, dropout output
        dropped = entry(doc, tp, 1)["activation_bytes"] - entry(doc, tp, 1, "selective")["activation_bytes"]
        assert dropped == pytest.approx(scores, abs=16)  # plus a 4-byte flag the checkpoint saves


def test_every_micro_batch_is_measured_within_the_budget_and_derived_entries_are_flagged(doc):
    for part in ("layers", "embedding", "output_layer"):
        flags = {e["micro_batch_size"]: e["measured"] for e in doc[part] if not e.get("sequence_parallel")}
        assert flags == {1: True, 2: True, 4: True}
    sp = [e for e in doc["layers"] if e["sequence_parallel"]]
    assert sp and not any(e["measured"] for e in sp)        # derived from the non-SP run, never timed
    assert {(m["part"], m["micro_batch_size"]) for m in doc["measurement"]["measured"]} == {
        (p, m) for p in ("layer", "embedding", "output_layer") for m in (1, 2, 4)}


def korthikanti_bytes(s, b, h, a, tp, sp, act_bytes, mask_bytes):
    """Per-layer activations of Korthikanti et al. 2022 (Eq. 1-5) for any element sizes.

    With 2-byte activations and 1-byte masks: sbh(10 + 24/t + 5as/(ht)), or sbh/t (34 + 5as/h) with SP.
    Replicated without SP: both norm inputs, QKV and FC1 inputs (4 act), two dropout masks (2 mask).
    Sharded by TP: Q, K, V, projection input, GeLU input and FC2 input (12 act), and the
    attention scores: softmax output and dropout output (2 act) plus their dropout mask.
    """
    replicated = s * b * h * (4 * act_bytes + 2 * mask_bytes)
    sharded = s * b * h * 12 * act_bytes + a * s * s * b * (2 * act_bytes + mask_bytes)
    return replicated / (tp if sp else 1) + sharded / tp


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_measured_activations_match_the_korthikanti_count(doc, tp, sp):
    """Tolerance: 1% against the count with CPU-sized dropout masks. The only extra bytes
    expected are the two LayerNorms' fp32 mean and rstd (4 x s x b x 4 bytes, 0.26% here).

    Against Korthikanti's 1-byte masks the CPU measurement is ~15% higher (ratio printed):
    on CPU torch's dropout keeps its mask as a float tensor of the activation dtype (4 bytes
    in fp32); CUDA's fused dropout keeps a 1-byte bool mask.
    """
    measured = entry(doc, tp, 1, sp=sp)["activation_bytes"]
    cpu_masks = korthikanti_bytes(S, 1, H, A, tp, sp, act_bytes=4, mask_bytes=4)
    byte_masks = korthikanti_bytes(S, 1, H, A, tp, sp, act_bytes=4, mask_bytes=1)
    print(f"tp{tp} sp={sp}: measured {measured} B, Korthikanti {byte_masks:.0f} B (1-byte masks) "
          f"ratio {measured / byte_masks:.4f}; with CPU float masks {cpu_masks:.0f} B ratio {measured / cpu_masks:.4f}")
    assert 1.0 <= measured / cpu_masks < 1.01
    norm_stats = 2 * 2 * S * 4 / (tp if sp else 1)
    assert measured == cpu_masks + norm_stats


def test_budget_cuts_shapes_and_lists_what_was_measured():
    doc = profile_layers(WORKLOAD, tp_sizes=(1, 2), micro_batch_sizes=(1, 4), device="cpu", budget_s=1e-3,
                         warmup=1, iters=2).to_json()
    m = doc["measurement"]
    # The first layer shape is always measured; every other one would overrun the budget.
    assert [(s["part"], s["tensor_model_parallel_size"], s["micro_batch_size"]) for s in m["measured"]] == [
        ("layer", 1, 1)]
    assert len(m["skipped"]) == 2 * 2 * 3 + 2 * 2 * 2 - 1
    assert all(s["reason"].startswith("budget") for s in m["skipped"])
    assert m["elapsed_s"] <= m["measured"][0]["wall_s"] + 0.5  # skipping costs next to nothing
    profile = profile_from_json(doc)
    assert [(e.micro_batch_size, e.measured) for e in profile.layers] == [(1, True), (4, False)]
    assert profile.embedding == () and profile.layer(2, 1, False, None) is None


def test_a_context_parallel_shard_is_the_layer_over_its_share_of_the_sequence():
    """CP 2: the layer over S/2 tokens keeps half the per-token bytes and a quarter of the local
    spec's unfused scores (fp32 softmax output, CPU float dropout mask, dropout output: 12 bytes
    an element); the planner reads it for a CP-2 job."""
    doc = profile_layers(WORKLOAD, tp_sizes=(1,), micro_batch_sizes=(1,), recompute=(None,),
                         sequence_parallel=(False,), device="cpu", warmup=1, iters=2, cp_sizes=(1, 2)).to_json()
    profile = profile_from_json(doc)
    whole, shard = profile.layer(1, 1, False, None), profile.layer(1, 1, False, None, cp=2)
    assert shard.context_parallel_size == 2 and shard.measured
    scores = 12 * A * S * S
    assert shard.activation_bytes == (whole.activation_bytes - scores) / 2 + scores / 4
    from megatron_pipette.spec.layout import Layout
    assert profile.covers(resolve_job(WORKLOAD, Layout(context_parallel_size=2, data_parallel_size=1)))
    assert not profile.covers(resolve_job(WORKLOAD, Layout(context_parallel_size=4, data_parallel_size=1)))
    with pytest.raises(PipetteError, match="--cp sizes must divide --seq-length 32 into 2 x CP chunks, got \\[32\\]"):
        profile_layers(WORKLOAD, tp_sizes=(1,), micro_batch_sizes=(1,), device="cpu", cp_sizes=(32,))


def test_profiling_leaves_the_process_as_it_found_it():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    before = torch.get_rng_state(), tp_random._CUDA_RNG_STATE_TRACKER, tp_random._get_cuda_rng_state
    profile_layers(WORKLOAD, tp_sizes=(1,), micro_batch_sizes=(1,), recompute=("full",), device="cpu",
                   warmup=0, iters=1)
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    assert torch.equal(torch.get_rng_state(), before[0])
    assert (tp_random._CUDA_RNG_STATE_TRACKER, tp_random._get_cuda_rng_state) == before[1:]



def test_a_shape_out_of_device_memory_is_skipped_and_the_rest_measured(monkeypatch):
    from megatron_pipette.profile import profiler

    measure = profiler._measure

    def small_only(workload, shape, *args):
        if shape.micro_batch_size > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return measure(workload, shape, *args)

    monkeypatch.setattr(profiler, "_measure", small_only)
    doc = profile_layers(WORKLOAD, tp_sizes=(1,), micro_batch_sizes=(1, 2), recompute=(None,),
                         sequence_parallel=(False,), device="cpu", warmup=0, iters=1).to_json()
    m = doc["measurement"]
    assert {s["micro_batch_size"] for s in m["measured"]} == {1}
    assert {s["reason"] for s in m["skipped"]} == {"out of memory"} and len(m["skipped"]) == 3


def test_gpu_config_runs_softmax_as_megatron_lm_does_without_its_fused_kernels():
    """A GPU without Apex has no masked-softmax kernels: megatron-core would import them
    mid-forward and fail. Softmax stays in bf16 (Megatron-LM's --attention-softmax-in-fp32 is off)."""
    from megatron_pipette.profile import build

    bf16 = dataclasses.replace(WORKLOAD, precision="bf16")
    config = build.layer_config(bf16, 1, None, torch.device("cuda", 0), te=False)
    assert not config.masked_softmax_fusion and not config.attention_softmax_in_fp32


@pytest.mark.parametrize("kwargs,message", [
    ({"tp_sizes": (3,)}, "--tp 3: --num-attention-heads 4 is not divisible"),
    ({"micro_batch_sizes": (0,)}, "--mbs must be positive"),
    ({"recompute": ("block",)}, "--recompute must be"),
    ({"sequence_parallel": (True,)}, "--sequence-parallel needs a --tp size > 1"),
    ({"budget_s": 0}, "--budget-s must be positive"),
    ({"device": "tpu"}, "--device must be cuda or cpu"),
])
def test_user_errors_are_one_clear_message(kwargs, message):
    args = {"tp_sizes": (1,), "micro_batch_sizes": (1,), "device": "cpu", **kwargs}
    with pytest.raises(PipetteError, match=message.replace("(", r"\(")):
        profile_layers(WORKLOAD, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_user_error():
    with pytest.raises(PipetteError, match="no CUDA device"):
        profile_layers(WORKLOAD, tp_sizes=(1,), micro_batch_sizes=(1,), device="cuda")


def test_compare_with_the_planner_formula(doc, tmp_path, capsys):
    """The planner's activation formula (1-byte masks) vs the CPU measurement (float masks)."""
    from megatron_pipette.cli.main import main
    from megatron_pipette.report.profile_compare import compare
    from megatron_pipette.spec.hardware import lookup_gpu

    rows = compare(ProfileFile.from_json(doc), None)
    assert len(rows) == len(doc["layers"]) and "forward_ratio" not in rows[0]
    for r in rows:
        if r["recompute"] == "full":
            assert r["activation_ratio"] == 1.0  # only the layer input: no masks, no norm statistics
        else:
            assert 1.0 < r["activation_ratio"] < 1.2
    timed = compare(ProfileFile.from_json(doc), lookup_gpu("H100-80GB"))
    assert all(r["model_forward_s"] > 0 and r["backward_ratio"] > 0 for r in timed)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    assert main(["compare", str(path)]) == 0 and "not a catalog GPU" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("pipette compare: error: compare ")


def test_llama_style_layer_gqa_swiglu_rmsnorm_rope():
    """The other build paths. Against the planner's formula the CPU measurement has exactly two
    extras: torch's RMSNorm on CPU is composite and also keeps its normalised output and rstd
    (per norm s*b*h + s*b fp32 values), and RoPE keeps cos/sin tables per call (4 x s*d)."""
    from megatron_pipette.cost.memory import activation_bytes_per_layer
    from megatron_pipette.spec.layout import Layout
    from megatron_pipette.spec.workload import workload_from_preset

    w = workload_from_preset("llama3-8b", hidden_size=128, num_attention_heads=8, num_query_groups=2,
                             ffn_hidden_size=256, seq_length=64, vocab_size=1000, precision="fp32")
    doc = profile_layers(w, tp_sizes=(1, 2), micro_batch_sizes=(1,), recompute=(None,), sequence_parallel=(False,),
                         device="cpu", warmup=0, iters=1).to_json()
    profile = profile_from_json(doc)
    check_profile_matches(profile, w)
    for tp in (1, 2):
        measured = profile.layer(tp, 1, False, None).activation_bytes
        # unfused attention (the local spec) stores K and V repeated to all heads, as the formula says
        unfused = dataclasses.replace(w, attention_backend="unfused")
        formula = activation_bytes_per_layer(resolve_job(unfused, Layout(tensor_model_parallel_size=tp)))
        extras = 2 * (64 * 128 + 64) * 4 + 4 * 64 * 16 * 4
        print(f"llama-style tp{tp}: measured {measured} B, planner formula {formula} B, ratio "
              f"{measured / formula:.4f}; formula + RMSNorm/RoPE extras ratio {measured / (formula + extras):.4f}")
        assert measured == formula + extras


def test_a_yarn_layer_keeps_what_a_rope_layer_keeps():
    """YaRN scales RoPE's cosines and sines (megatron-core then runs RoPE unfused, which the planner
    prices as traffic): the layer builds with the factor and keeps the same activations."""
    from megatron_pipette.spec.workload import workload_from_preset

    kept = {}
    for kind, extra in (("rope", {}), ("yarn", {"rotary_scaling_factor": 32.0})):
        w = workload_from_preset("llama3-8b", hidden_size=128, num_attention_heads=8, num_query_groups=2,
                                 ffn_hidden_size=256, seq_length=64, vocab_size=1000, precision="fp32",
                                 position_embedding_type=kind, **extra)
        assert (w.rope_concentration_factor != 1.0) == (kind == "yarn")
        doc = profile_layers(w, tp_sizes=(1,), micro_batch_sizes=(1,), recompute=(None,), sequence_parallel=(False,),
                             device="cpu", warmup=0, iters=1).to_json()
        kept[kind] = profile_from_json(doc).layer(1, 1, False, None).activation_bytes
    assert kept["yarn"] == kept["rope"]


@pytest.mark.parametrize("two, four, call", [(10.87, 18.62, 3.876), (42.86, 85.38, 21.26), (10.0, 10.0, 5.0),
                                             (10.0, 9.0, 5.0), (10.0, 31.0, 5.0)])
def test_a_layer_in_a_chain_is_half_the_difference_of_chains_of_four_and_two(two, four, call):
    """On a GPU a call alone pays for the idle GPU waiting on the host's first launches, which a stack
    pays once (benchmarks/results/h200-2026-11-28-layer-chain, its mbs 1 and 8 rows): half the
    difference of chains of four and two holds none of it; where noise puts it outside (0, two / 2],
    half the chain of two."""
    from megatron_pipette.profile.measure import call_in_chain

    assert call_in_chain(two, four) == pytest.approx(call, rel=1e-3)


def test_on_the_cpu_a_layer_is_timed_alone():
    """Every call runs synchronously on the CPU, a stack's too: no chain (its `again` is never called)."""
    from megatron_pipette.profile.build import Step
    from megatron_pipette.profile.measure import time_step

    x = torch.ones(4, requires_grad=True)

    def chained(_):
        raise AssertionError("chained on the CPU")

    t = time_step(Step(module=torch.nn.Identity(), forward=lambda: x * 2, output_grad=lambda out: torch.ones(4),
                       again=chained), torch.device("cpu"), warmup=1, iters=3)
    assert t.iteration_s == pytest.approx(t.forward_s + t.backward_s)
