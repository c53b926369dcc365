"""On a CUDA device, what the CPU tiers can only take on trust: the catalog's figures for it, and
the profiler's measurements on it as the planner uses them. `make test-gpu`; skipped without CUDA.
"""

import dataclasses
import json

import pytest
import torch

from megatron_pipette.cli.main import main
from megatron_pipette.cost.memory import activation_bytes_per_layer
from megatron_pipette.measure.compute import copy_bandwidth, gemm_rate, prepare_copy, prepare_gemm
from megatron_pipette.profile import profile_layers
from megatron_pipette.spec.hardware import GPU, cluster_presets, gpu_catalog, lookup_gpu
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layer_profile import check_profile_matches, profile_from_json
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import Workload

pytestmark = pytest.mark.gpu

S, H, A, V = 128, 256, 4, 1000
WORKLOAD = Workload(num_layers=2, hidden_size=H, num_attention_heads=A, seq_length=S, global_batch_size=8,
                    vocab_size=V, precision="fp32")
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", str(A), "--seq-length", str(S),
               "--global-batch-size", "8", "--vocab-size", str(V), "--fp32"]


def catalog_gpu() -> GPU:
    """This device's catalog entry; skips the test on a device the catalog does not know."""
    name = torch.cuda.get_device_name()
    gpu = gpu_catalog().get(name.lower())
    if gpu is None:
        pytest.skip(f"{name!r} is not in the GPU catalog")
    return gpu


def test_the_catalog_peaks_bound_what_the_probe_measures():
    """Presets price GEMMs and memory traffic from the catalog's datasheet peaks. A large dense
    bf16 GEMM attains 70-90% of its peak, a device copy about 90% of the bandwidth (bytes read
    and written): a peak below the measurement, or far above it, is a wrong catalog entry (or a
    probe that miscounts)."""
    gpu, device = catalog_gpu(), torch.device("cuda")
    step, flops, _ = prepare_gemm(device, "bf16")
    rate = gemm_rate(step, flops, 1.0, device)
    copy, nbytes = prepare_copy(device)
    bandwidth = copy_bandwidth(copy, nbytes, 1.0, device)
    print(f"{gpu.name}: bf16 GEMM {rate / 1e12:.0f} TFLOP/s of {gpu.peak_flops['bf16'] / 1e12:.0f}, "
          f"copy {bandwidth / 1e9:.0f} GB/s of {gpu.memory_bandwidth_Bps / 1e9:.0f}")
    assert 0.5 * gpu.peak_flops["bf16"] < rate <= gpu.peak_flops["bf16"]
    assert 0.5 * gpu.memory_bandwidth_Bps < bandwidth <= 1.05 * gpu.memory_bandwidth_Bps


@pytest.fixture(scope="module")
def cuda_profile() -> dict:
    return profile_layers(WORKLOAD, tp_sizes=(1, 2), micro_batch_sizes=(1, 2), recompute=(None,),
                          sequence_parallel=(False,), device="cuda", warmup=2, iters=5).to_json()


def test_a_cuda_profile_plans_on_the_preset_of_its_device(cuda_profile, tmp_path):
    gpu = catalog_gpu()
    profile = profile_from_json(cuda_profile)
    check_profile_matches(profile, WORKLOAD)
    assert profile.device_name == torch.cuda.get_device_name()
    assert all(e.forward_s > 0 and e.backward_s > 0 for e in profile.layers)
    preset = next((name for name, p in cluster_presets().items() if lookup_gpu(p["gpu"]).name == gpu.name), None)
    if preset is None:
        pytest.skip(f"no cluster preset of {gpu.name}")
    path = tmp_path / "layer_profile.json"
    path.write_text(json.dumps(cuda_profile))
    assert main(["plan", *MODEL_FLAGS, "--cluster", preset, "--num-nodes", "1", "--layer-profile", str(path),
                 "--top", "1"]) == 0


def test_a_cuda_profile_in_bf16():
    """Without Transformer Engine the layer's torch LayerNorm must be cast to bf16 as Megatron's
    Float16Module does (it failed with fp32 weights under a bf16 input until 2026-11-23)."""
    doc = profile_layers(dataclasses.replace(WORKLOAD, precision="bf16"), tp_sizes=(1,), micro_batch_sizes=(1,),
                         recompute=(None,), sequence_parallel=(False,), device="cuda", warmup=0, iters=1).to_json()
    assert profile_from_json(doc).layer(1, 1, False, None).forward_s > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_a_cuda_layer_keeps_what_the_memory_model_charges(cuda_profile, tp):
    """The planner's activation formula counts 1-byte dropout masks, which CUDA's fused dropout
    keeps (on CPU they are floats, tests/profile); the local spec's unfused attention stores its
    scores. Besides, each LayerNorm keeps its fp32 mean and rstd (2 x s x b x 4 bytes)."""
    measured = profile_from_json(cuda_profile).layer(tp, 1, False, None).activation_bytes
    unfused = dataclasses.replace(WORKLOAD, attention_backend="unfused")
    formula = activation_bytes_per_layer(resolve_job(unfused, Layout(tensor_model_parallel_size=tp)))
    norm_statistics = 2 * 2 * S * 4
    print(f"tp{tp}: measured {measured} B, formula {formula} B, ratio {measured / formula:.4f}")
    assert measured == formula + norm_statistics
