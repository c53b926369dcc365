"""The planner's GPU prices held against one GPU, one part at a time.

    python -m benchmarks.validation.cost_check PART --out FILE.json [--dry-run] [--gpu NAME]

Why: the GEMM table was measured in short bursts (5-30 runs of a few ms each, L2 flushed) and the
sustained fraction that corrects it was fitted on published runs, not measured; the MoE experts'
per-expert prices and the roofline floor of GEMMs with a small dimension come from physics, not
from timings; and a whole training step has only been predicted on a GPU, never timed there.
Each part measures one of these and writes its rows as it goes, each with
`measured`, `predicted` (the planner's price, from the functions the planner itself calls) and
their `ratio`, plus `meta` (GPU, versions, clocks).

Parts:
  sustained  an 8192^3 GEMM, bf16 (torch.matmul) and fp8 (torch._scaled_mm), back to back for
             --duration-s each: TFLOP/s per --window-s window of device time, over the first
             second (the short burst), and over the whole run, against the planner's price of
             that GEMM (cluster.gemm_flops x the table's efficiency at 8192^3, 0.85 in bf16) and
             against the catalog's 8192^3 rate itself (gemm_flops: measured in short bursts);
             nvidia-smi's SM clock, power and throttle reasons sampled every window.
  grouped    MoE expert GEMMs (forward fc1 and fc2, SwiGLU) of E local experts x rows each: a
             loop of per-expert matmuls (what the local spec's SequentialMLP runs),
             torch._grouped_mm where this torch has it, and one merged GEMM of E x rows rows,
             against the planner's price (cost.experts: each expert's GEMM at its own shape,
             linear_work(curve, rows, n, k, count=E)) and the roofline max(FLOPs / dense peak,
             bytes / HBM bandwidth).
  skinny     GEMMs with K of 64-256 and large M, N, and with M of 16-256: measured against the
             roofline and the planner's price.
  loss       megatron-core's vocab-parallel cross-entropy, plain and --cross-entropy-loss-fusion
             (torch.compile'd), forward and backward over bf16 logits of 8192 and 16384 tokens x
             one rank's vocabulary (16384-128256): against the planner's price, its bytes
             (cost.compute.cross_entropy_bytes) over the share of the cluster's memory bandwidth
             these kernels attain (CROSS_ENTROPY_BANDWIDTH_SHARE, measured by this part), and the
             price of the bytes it used before 2026-11-26 (18 forward, 10 backward, full rate);
             `bytes_per_logit_attained` is the time in bytes at the full rate.
  moe        megatron-core's MoE layer whole (router, alltoall dispatcher with EP 1, the local
             spec's experts, SwiGLU, bf16), forward and backward, at the tokens of micro-batches 1-4
             (MOE_LAYER_TOKENS) for Qwen3's two expert shapes and 8 or 16 local experts, dropless
             and dropping and padding to capacity (MOE_LAYER_DISPATCH); a line fitted through
             each pass's times splits it into a per-micro-batch cost (the intercept) and a
             per-token one, against the planner: its price of the layer's kernels
             (cost.experts.moe_mlp) and Execution.moe_layer_fixed_s, the per-micro-batch cost it
             fitted on published runs without telling the two apart; the two dispatches'
             intercepts differ by the dropless host wait. Megatron's router and dispatcher need
             CUDA: the dry run prices the shapes only.
  train      one Megatron training step of a ~1.3B GPT (24 layers, hidden 2048, 16 heads, seq
             2048, vocab 32000, mbs 2, gbs 8; bf16, TP1 PP1, local spec, torch's AdamW as
             Megatron falls back to without Apex or TE, mock data) through
             examples/pretrain_gpt.py under torchrun: the median iteration time after warm-up
             and the last `max allocated` Megatron reports, against `pipette estimate` on a
             one-GPU cluster of this GPU given the same flags (allocated peak = predicted peak
             less the runtime overheads: CUDA context, NCCL, fragmentation, which sit outside
             torch's allocated count).
GEMM timing is gemm_efficiency.py's (CUDA events, L2 flushed before each run, median of 5-30).
`--dry-run` runs tiny shapes for a second or two on the CPU, priced as if on an H100, to check
the script: its ratios mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

from benchmarks.gpu import Gemm, Timer, device_metadata, gemm_step, nvidia_smi, sig, write_json  # noqa: E402
from megatron_pipette.cli.main import main as pipette  # noqa: E402
from megatron_pipette.cost.compute import CROSS_ENTROPY_BANDWIDTH_SHARE, cross_entropy_bytes  # noqa: E402
from megatron_pipette.cost.execution import DEFAULT_EXECUTION  # noqa: E402
from megatron_pipette.cost.experts import moe_mlp  # noqa: E402
from megatron_pipette.cost.gemm import fp8_curve, gemm_curve, linear_work  # noqa: E402
from megatron_pipette.cost.memory import environment_overheads  # noqa: E402
from megatron_pipette.errors import PipetteError  # noqa: E402
from megatron_pipette.profile.runtime import resolve_device, single_device_megatron  # noqa: E402
from megatron_pipette.spec.hardware import GPU, lookup_gpu, preset_cluster  # noqa: E402
from megatron_pipette.spec.job import resolve_job  # noqa: E402
from megatron_pipette.spec.layout import Layout  # noqa: E402
from megatron_pipette.spec.workload import Workload  # noqa: E402

PRESET = "dgx-h100"
"""The preset a one-GPU cluster is made from; with one GPU only its --gpu entry prices anything."""
STAND_IN = "H100-80GB"
"""What a dry run on the CPU is priced as."""
SMI_QUERY = "clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"
MOE_SHAPES = ((2048, 768), (4096, 1536), (7168, 2048))
"""(hidden, expert ffn): Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3."""
EXPERTS, ROWS = (8, 32, 4), (512, 2048, 128)
"""Local experts and rows per expert, in measuring order (a budget cut drops the last)."""
SKINNY = [(m, m, k) for m in (8192, 16384) for k in (64, 128, 256)] + \
         [(m, n, k) for m in (16, 64, 256) for n, k in ((8192, 8192), (14336, 4096))]
"""(m, n, k): small K with large M and N, then small M (one weight read for few rows)."""
LOSS = [(t, v) for t in (8192, 16384) for v in (16384, 32000, 64000, 128256)]
"""(tokens, one rank's vocabulary): 128256 is Llama 3's at TP 1, 16384 at TP 8; 64000 Nemotron's 256000 at TP 4."""
LOSS_BEFORE = (18, 10)
"""The bytes per bf16 logit the planner priced the cross-entropy at before 2026-11-26."""
MOE_LAYER_SHAPES = ((2048, 768), (4096, 1536))
"""(hidden, expert ffn) of the MoE layers timed whole: Qwen3-30B-A3B's and Qwen3-235B-A22B's."""
MOE_LAYER_EXPERTS, MOE_LAYER_TOPK = (16, 8), 8
"""Local experts (what EP 8 and EP 16 leave of Qwen3's 128) and the router's top-k, Qwen3's."""
MOE_LAYER_TOKENS = (2048, 4096, 8192, 16384)
"""Tokens a micro-batch brings the layer: micro-batches 1-4 at s 4096, TP 1."""
MOE_LAYER_DISPATCH = ("dropless", "drop-and-pad")
"""How the alltoall dispatcher sizes its output (megatron-core 0.19,
MoEAlltoAllTokenDispatcher.preprocess): dropless, it copies the token counts to the host and the
host waits for them (its cuda_sync_point); dropping and padding to capacity (factor 1.0, what
25.09's Qwen3 runs used) fixes every size on the host, with no wait. Execution.moe_layer_fixed_s
charges both alike: the difference of their intercepts is what it should not charge the second."""
QUICK = dict(n=256, moe_shapes=((64, 24), (128, 48)), experts=(4, 2), rows=(16, 32),
             skinny=[(256, 256, 16), (256, 256, 64), (16, 512, 512)], train=(2, 3), loss=[(64, 1000)],
             moe_layer=dict(shapes=((64, 32),), experts=(4,), topk=2, tokens=(32, 64, 128),
                            dispatch=MOE_LAYER_DISPATCH))
"""The dry run's shapes, and its (warm-up, timed) training iterations."""
TRAIN_MODEL = ("--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
               "--max-position-embeddings 2048 --vocab-size 32000 --micro-batch-size 2 --global-batch-size 8")
TRAIN_TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
              "--max-position-embeddings 64 --vocab-size 1000 --micro-batch-size 2 --global-batch-size 4")
TRAIN_COMMON = ("--bf16 --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
                "--no-masked-softmax-fusion --mock-data --tokenizer-type NullTokenizer --num-workers 0 "
                "--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1 "
                "--log-interval 1 --eval-iters 0 --eval-interval 100000")
"""No Transformer Engine or Apex on the GPU machine: the local spec, and no fusion that needs them."""
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: "
                    r"([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)")
PARAMETERS = re.compile(r"number of parameters on .*?: (\d+)")
MEGATRON_THEORY = re.compile(r"Theoretical memory footprints: .*total=([0-9.]+) MB")


# -- the planner's prices --------------------------------------------------------------------------

def target_gpu(device: torch.device, name: str | None) -> GPU:
    """The catalog GPU the prices are for: --gpu, else the device's own name (the stand-in on a CPU)."""
    if name is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else STAND_IN
    return lookup_gpu(name)


def large_gemm_flops(gpu: GPU, precision: str = "bf16") -> float:
    """The planner's gemm_flops for `gpu` training in `precision`: the catalog's 8192^3 rate."""
    return float(preset_cluster(PRESET, num_nodes=1, gpus_per_node=1, gpu=gpu.name, precision=precision).gemm_flops[0])


def planner_gemm_s(gpu: GPU, dtype: str, m: float, n: float, k: float, count: int = 1) -> float:
    """Seconds the planner prices `count` (m x k) @ (k x n) GEMMs at on a one-GPU cluster of `gpu`
    training in bf16 (fp8: Transformer Engine's GEMMs under --fp8-format), as cost.experts does
    (each expert's GEMM at its own shape: linear_work's forward)."""
    curve = fp8_curve(gpu, "bf16") if dtype == "fp8" else gemm_curve(gpu, "bf16")
    return linear_work(curve, m, n, k, count=count)[0] / large_gemm_flops(gpu)


def roofline_s(gpu: GPU, dtype: str, m: float, n: float, k: float, count: float = 1) -> float:
    """max(FLOPs / dense datasheet peak, bytes / datasheet HBM bandwidth): operands read once, a
    bf16 output written once."""
    operand = 1 if dtype == "fp8" else 2
    moved = count * ((m * k + k * n) * operand + 2 * m * n)
    return max(2.0 * m * n * k * count / gpu.peak(dtype), moved / gpu.memory_bandwidth_Bps)


def ratio(measured: float | None, predicted: float | None) -> float | None:
    return sig(measured / predicted) if measured and predicted else None


# -- sustained -------------------------------------------------------------------------------------

class SmiSampler(threading.Thread):
    """nvidia-smi 1 s into the load, then every `every_s` seconds, in the background (none on a CPU);
    without the throttle reasons where the driver does not know the field."""

    def __init__(self, every_s: float, active: bool) -> None:
        super().__init__(daemon=True)
        self.every_s, self.active, self.samples, self.halt = every_s, active, [], threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        delay = min(1.0, self.every_s)
        while self.active and not self.halt.wait(delay):
            delay = self.every_s
            for query in (SMI_QUERY, SMI_QUERY.rsplit(",", 1)[0]):
                if text := nvidia_smi(query):
                    values = text.splitlines()[-1].split(",")
                    self.samples.append({"t_s": round(time.monotonic() - self.t0, 1),
                                         **dict(zip(query.split(","), (v.strip() for v in values)))})
                    break


def sustain(g: Gemm, device: torch.device, duration_s: float, window_s: float, burst_s: float) -> dict:
    """Runs g back to back for duration_s, a time mark after every chunk of ~50 ms of GEMMs (at most
    three chunks queued ahead), and returns TFLOP/s per window of device time, over the first
    burst_s and over the whole run, with nvidia-smi's samples."""
    cuda = device.type == "cuda"
    step, noop = gemm_step(g, device), lambda: None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def mark() -> torch.cuda.Event | float:
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    for _ in range(3):
        step(noop)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        step(noop)
    sync()
    chunk = max(1, int(0.05 / ((time.perf_counter() - t0) / 5)))
    smi = SmiSampler(window_s, cuda)
    smi.start()
    start, marks, queued = mark(), [], deque()
    stop = time.monotonic() + duration_s
    while time.monotonic() < stop:
        for _ in range(chunk):
            step(noop)
        marks.append(mark())
        if cuda:
            queued.append(marks[-1])
            if len(queued) > 3:
                queued.popleft().synchronize()
    sync()
    smi.halt.set()
    smi.join()
    ends = [start.elapsed_time(m) / 1e3 for m in marks] if cuda else [m - start for m in marks]
    per_chunk = g.flops * chunk / 1e12
    windows, begin, done = [], 0.0, 0
    for i, end in enumerate(ends):     # a window closes with the last chunk that ends inside it
        if i == len(ends) - 1 or ends[i + 1] // window_s != end // window_s:
            windows.append({"end_s": round(end, 2), "tflops": sig((i + 1 - done) * per_chunk / (end - begin))})
            begin, done = end, i + 1
    in_burst = [e for e in ends if e <= burst_s] or ends[:1]
    return {"gemms": chunk * len(ends), "elapsed_s": round(ends[-1], 2), "windows": windows,
            "burst_tflops": sig(len(in_burst) * per_chunk / in_burst[-1]),
            "sustained_tflops": sig(len(ends) * per_chunk / ends[-1]), "nvidia_smi": smi.samples}


def part_sustained(ns: argparse.Namespace, device: torch.device, gpu: GPU, doc: dict) -> None:
    n = QUICK["n"] if ns.dry_run else 8192
    for dtype in ("bf16", "fp8"):
        g = Gemm(n, n, n, "NN" if dtype == "bf16" else "NT", dtype)   # the table's reference GEMMs
        predicted = sig(g.flops / planner_gemm_s(gpu, dtype, n, n, n) / 1e12)
        catalog = sig(large_gemm_flops(gpu, dtype) / 1e12)
        row = {"dtype": dtype, "n": n, "predicted": predicted, "catalog_tflops": catalog}
        try:
            run = sustain(g, device, ns.duration_s, ns.window_s, ns.burst_s)
            row.update(run, measured=run["sustained_tflops"], ratio=ratio(run["sustained_tflops"], predicted),
                       burst_ratio=ratio(run["burst_tflops"], predicted),
                       catalog_ratio=ratio(run["sustained_tflops"], catalog),
                       last_window_over_burst=ratio(run["windows"][-1]["tflops"], run["burst_tflops"]))
        except (RuntimeError, torch.OutOfMemoryError) as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        doc["rows"].append(row)
        write_json(Path(ns.out), doc)


# -- grouped and skinny GEMMs ----------------------------------------------------------------------

def as_step(run):
    """Timer.measure's step: `run` between two marks."""
    def step(mark) -> None:
        mark()
        run()
        mark()
    return step


def grouped_row(timer: Timer, device: torch.device, gpu: GPU, experts: int, rows: int, n: int, k: int) -> dict:
    """One expert GEMM (rows x k) @ (k x n) on each of `experts` experts, three ways."""
    x = torch.randn(experts * rows, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16)     # Megatron's [out, in] weights
    runs = {"loop": lambda: [torch.matmul(x[e * rows:(e + 1) * rows], w[e].t()) for e in range(experts)],
            "merged": lambda: torch.matmul(x, w[0].t())}
    if hasattr(torch, "_grouped_mm"):
        offs = torch.arange(rows, experts * rows + 1, rows, device=device, dtype=torch.int32)
        runs["grouped_mm"] = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    measured, errors = {}, {}
    for name, run in runs.items():
        try:
            (measured[name],) = timer.measure(as_step(run))
        except (RuntimeError, torch.OutOfMemoryError) as e:
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    predicted = planner_gemm_s(gpu, "bf16", rows, n, k, experts)
    roof = roofline_s(gpu, "bf16", rows, n, k, experts)
    return {"experts": experts, "rows": rows, "n": n, "k": k, "measured_s": measured, "predicted_s": predicted,
            "roofline_s": roof, "ratio": {m: ratio(t, predicted) for m, t in measured.items()},
            "over_roofline": {m: ratio(t, roof) for m, t in measured.items()}, **({"errors": errors} if errors else {})}


def part_grouped(ns: argparse.Namespace, device: torch.device, gpu: GPU, doc: dict) -> None:
    timer, deadline = Timer(device), time.monotonic() + ns.budget_s
    shapes, experts, rows = ((QUICK["moe_shapes"], QUICK["experts"], QUICK["rows"]) if ns.dry_run
                             else (MOE_SHAPES, EXPERTS, ROWS))
    plan = [(e, r, h, f, gemm, n, k) for r in rows for e in experts for h, f in shapes
            for gemm, n, k in (("fc1", 2 * f, h), ("fc2", h, f))]
    doc["planned"] = len(plan)
    for e, r, h, f, gemm, n, k in plan:
        if time.monotonic() > deadline:
            break
        doc["rows"].append({"hidden": h, "ffn": f, "gemm": gemm, **grouped_row(timer, device, gpu, e, r, n, k)})
        write_json(Path(ns.out), doc)


def part_skinny(ns: argparse.Namespace, device: torch.device, gpu: GPU, doc: dict) -> None:
    timer, deadline = Timer(device), time.monotonic() + ns.budget_s
    shapes = QUICK["skinny"] if ns.dry_run else SKINNY
    doc["planned"] = len(shapes)
    for m, n, k in shapes:
        if time.monotonic() > deadline:
            break
        row = {"m": m, "n": n, "k": k}
        try:
            (t,) = timer.measure(gemm_step(Gemm(m, n, k, "NN", "bf16"), device))
        except (RuntimeError, torch.OutOfMemoryError) as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            t = None
        roof, predicted = roofline_s(gpu, "bf16", m, n, k), planner_gemm_s(gpu, "bf16", m, n, k)
        row.update(measured_s=t, predicted_s=predicted, roofline_s=roof, ratio=ratio(t, predicted),
                   over_roofline=ratio(t, roof))
        doc["rows"].append(row)
        write_json(Path(ns.out), doc)


# -- the cross-entropy -----------------------------------------------------------------------------

def part_loss(ns: argparse.Namespace, device: torch.device, gpu: GPU, doc: dict) -> None:
    """The cross-entropy over the one-rank tensor-parallel group the profiler's runtime makes."""
    with single_device_megatron(device) as env:
        _time_losses(ns, device, gpu, doc, env.pg_collection.tp)


def _time_losses(ns: argparse.Namespace, device: torch.device, gpu: GPU, doc: dict, group) -> None:
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    timer, deadline = Timer(device), time.monotonic() + ns.budget_s
    bandwidth = preset_cluster(PRESET, num_nodes=1, gpus_per_node=1, gpu=gpu.name).memory_bandwidth_Bps
    kernels = {"plain": lambda x, y: vocab_parallel_cross_entropy(x, y, tp_group=group),
               "fused": lambda x, y: fused_vocab_parallel_cross_entropy(x, y, group)}
    shapes = QUICK["loss"] if ns.dry_run else LOSS
    doc["planned"] = len(shapes) * len(kernels)
    for tokens, vocab in shapes:
        logits = torch.randn(tokens // 2, 2, vocab, device=device, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (tokens // 2, 2), device=device)
        for name, loss_of in kernels.items():
            if time.monotonic() > deadline:
                return
            row = {"kernel": name, "tokens": tokens, "vocab": vocab}

            def step(mark, loss_of=loss_of, logits=logits, target=target) -> None:
                logits.grad = None
                mark()
                loss = loss_of(logits, target)
                mark()
                loss.sum().backward()
                mark()

            try:
                forward, backward = timer.measure(step, phases=2)
            except (RuntimeError, torch.OutOfMemoryError) as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                forward = backward = None
            now, before = cross_entropy_bytes(2, "native" if name == "fused" else None), LOSS_BEFORE
            for i, (pass_, t) in enumerate((("forward", forward), ("backward", backward))):
                predicted = now[i] * tokens * vocab / (CROSS_ENTROPY_BANDWIDTH_SHARE * bandwidth)
                row[pass_] = {"measured_s": t, "predicted_s": predicted, "ratio": ratio(t, predicted),
                              "ratio_before": ratio(t, before[i] * tokens * vocab / bandwidth),
                              "bytes_per_logit_attained": sig(t * bandwidth / (tokens * vocab)) if t else None}
            doc["rows"].append(row)
            write_json(Path(ns.out), doc)


# -- a whole MoE layer -----------------------------------------------------------------------------

def moe_layer_price(gpu: GPU, hidden: int, ffn: int, experts: int, topk: int, tokens: int,
                    padded: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds the planner prices one MoE layer's MLP at on one GPU of `gpu` (EP 1,
    bf16, SwiGLU, alltoall dispatcher; `padded`: dropping and padding to capacity 1.0): its kernels
    (cost.experts.moe_mlp) at the tables' rate, without the fixed cost (Execution.moe_layer_fixed_s)
    or any dispatch collective."""
    workload = Workload(num_layers=1, hidden_size=hidden, num_attention_heads=max(1, hidden // 128),
                        seq_length=tokens, global_batch_size=1, ffn_hidden_size=4 * hidden, swiglu=True,
                        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn, moe_layer_freq=1,
                        add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
                        vocab_size=32000, untie_embeddings_and_output_weights=True,
                        moe_token_dispatcher_type="alltoall", precision="bf16",
                        moe_expert_capacity_factor=1.0 if padded else None, moe_pad_expert_input_to_capacity=padded)
    job = resolve_job(workload, Layout(data_parallel_size=1))
    cluster = preset_cluster(PRESET, num_nodes=1, gpus_per_node=1, gpu=gpu.name)
    work = moe_mlp(job, cluster.memory_bandwidth_Bps, gemm_curve(gpu, "bf16"))
    rate = large_gemm_flops(gpu)
    return work.forward.seconds(rate), work.backward.seconds(rate)


def split_fixed(tokens: list[int], seconds: list[float]) -> dict | None:
    """A least-squares line through (tokens, seconds): the per-micro-batch cost (its intercept) and
    the cost per token (its slope); None with fewer than two points."""
    if len(tokens) < 2:
        return None
    per_token, fixed = np.polyfit(np.asarray(tokens, dtype=float), np.asarray(seconds), 1)
    return {"fixed_s": sig(float(fixed)), "per_token_s": sig(float(per_token))}


def moe_layer_config(hidden: int, ffn: int, experts: int, topk: int, padded: bool):
    """megatron-core's TransformerConfig of the timed MoE layer, bf16; `padded`: capacity 1.0, padded."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=max(1, hidden // 128),
                             num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=ffn,
                             gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
                             params_dtype=torch.bfloat16, moe_token_dispatcher_type="alltoall",
                             moe_aux_loss_coeff=0.0, moe_expert_capacity_factor=1.0 if padded else None,
                             moe_pad_expert_input_to_capacity=padded)


def build_moe_layer(device: torch.device, config):
    """megatron-core's MoELayer as the local spec builds it, one GPU (EP 1)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return spec.submodules.mlp(config=config, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(device)


def part_moe(ns: argparse.Namespace, device: torch.device, gpu: GPU, doc: dict) -> None:
    quick = QUICK["moe_layer"]
    shapes, local, topk, tokens, dispatches = (
        (quick["shapes"], quick["experts"], quick["topk"], quick["tokens"], quick["dispatch"]) if ns.dry_run
        else (MOE_LAYER_SHAPES, MOE_LAYER_EXPERTS, MOE_LAYER_TOPK, MOE_LAYER_TOKENS, MOE_LAYER_DISPATCH))
    doc["planned"] = len(shapes) * len(local) * len(dispatches)
    doc["moe_layer_fixed_s"] = DEFAULT_EXECUTION.moe_layer_fixed_s
    timer, deadline = Timer(device), time.monotonic() + ns.budget_s
    with single_device_megatron(device):
        for (hidden, ffn), experts, dispatch in itertools.product(shapes, local, dispatches):
            padded = dispatch == "drop-and-pad"
            row = {"hidden": hidden, "ffn": ffn, "experts": experts, "topk": topk, "dispatch": dispatch,
                   "points": []}
            doc["rows"].append(row)
            try:
                config = moe_layer_config(hidden, ffn, experts, topk, padded)
                layer = build_moe_layer(device, config) if device.type == "cuda" else None
            except (RuntimeError, torch.OutOfMemoryError, AssertionError, TypeError, ValueError) as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                layer = None
            for t in tokens:
                if time.monotonic() > deadline:
                    break
                forward_price, backward_price = moe_layer_price(gpu, hidden, ffn, experts, topk, t, padded)
                point = {"tokens": t, "predicted_s": {"forward": forward_price, "backward": backward_price}}
                if layer is not None:
                    try:
                        point["measured_s"] = dict(zip(("forward", "backward"), _time_moe_layer(
                            timer, layer, device, t, hidden)))
                    except (RuntimeError, torch.OutOfMemoryError) as e:
                        point["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                row["points"].append(point)
                write_json(Path(ns.out), doc)
            timed = [p for p in row["points"] if "measured_s" in p]
            row["measured"] = {pass_: split_fixed([p["tokens"] for p in timed], [p["measured_s"][pass_] for p in timed])
                               for pass_ in ("forward", "backward")}
            row["priced_kernels"] = {pass_: split_fixed([p["tokens"] for p in row["points"]],
                                                        [p["predicted_s"][pass_] for p in row["points"]])
                                     for pass_ in ("forward", "backward")}
            del layer
            write_json(Path(ns.out), doc)


def _time_moe_layer(timer: Timer, layer, device: torch.device, tokens: int, hidden: int) -> list[float]:
    x = torch.randn(tokens, 1, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(mark) -> None:
        x.grad = None
        mark()
        out, _ = layer(x)
        mark()
        out.sum().backward()
        mark()

    return timer.measure(step, phases=2)


# -- one training step -----------------------------------------------------------------------------

def train_flags(dry_run: bool, iterations: int) -> list[str]:
    """The flags Megatron and `pipette estimate` both get."""
    flags = f"{TRAIN_TINY if dry_run else TRAIN_MODEL} {TRAIN_COMMON} --train-iters {iterations} " \
            f"--log-memory-interval {iterations}"
    return flags.split() + (["--distributed-backend", "gloo"] if dry_run else [])


def estimate(gpu: GPU, flags: list[str]) -> dict:
    """`pipette estimate --json` of these Megatron flags on a one-GPU cluster of `gpu`; its error
    message instead where it refuses them."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pipette(["estimate", "--json", "--cluster", PRESET, "--gpu", gpu.name, "--num-nodes", "1",
                        "--gpus-per-node", "1", *flags])
    return json.loads(out.getvalue()) if code == 0 else {"error": err.getvalue().strip()}


def parse_megatron_log(text: str, warmup: int) -> dict:
    """Iteration times after `warmup` iterations, the last memory report, the parameter count."""
    times = {int(i): float(ms) / 1e3 for i, ms in ITERATION.findall(text)}
    timed_s = [t for i, t in sorted(times.items()) if i > warmup]
    reports = MEMORY.findall(text)
    params = PARAMETERS.findall(text)
    theory = MEGATRON_THEORY.findall(text)
    return {"iteration_s": [times[i] for i in sorted(times)], "step_s": statistics.median(timed_s) if timed_s else None,
            "max_allocated_bytes": round(float(reports[-1][2]) * 2**20) if reports else None,
            "max_reserved_bytes": round(float(reports[-1][4]) * 2**20) if reports else None,
            "allocated_bytes": round(float(reports[-1][1]) * 2**20) if reports else None,
            "parameters": int(params[-1]) if params else None,
            "megatron_theoretical_bytes": round(float(theory[-1]) * 2**20) if theory else None}


def allocator_loss(got: dict) -> float | None:
    """The caching allocator's loss as the memory model counts it (RuntimeOverheads.fragmentation):
    max reserved less max allocated, over the peak's growth above what stays allocated between steps
    (the model state, which lives in a few contiguous buffers)."""
    keys = ("max_reserved_bytes", "max_allocated_bytes", "allocated_bytes")
    if any(got.get(k) is None for k in keys):
        return None
    reserved, peak, state = (got[k] for k in keys)
    return (reserved - peak) / (peak - state) if peak > state else None


def run_megatron(flags: list[str], log: Path, limit_s: float,
                 script: Path = REPO / "examples" / "pretrain_gpt.py") -> int | None:
    """`script` (examples/pretrain_gpt.py) under torchrun on this one device; the log to `log`. None:
    killed at the limit (the whole process group, so no worker keeps the GPU)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(script), *flags]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            for sig_ in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig_)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
                    break
            return None


def part_train(ns: argparse.Namespace, device: torch.device, gpu: GPU, doc: dict) -> None:
    warmup, timed_steps = QUICK["train"] if ns.dry_run else (3, 10)
    flags = train_flags(ns.dry_run, warmup + timed_steps)
    predicted = estimate(gpu, flags)
    doc.update(flags=" ".join(flags), warmup_iterations=warmup, estimate=predicted)
    write_json(Path(ns.out), doc)
    log = Path(ns.out).with_name("train_megatron.log")
    code = run_megatron(flags, log, ns.budget_s)
    got = parse_megatron_log(log.read_text(errors="replace"), warmup)
    stage = predicted["memory"]["stages"][0] if "memory" in predicted else {}
    doc["rows"] = [
        {"what": "step_s", "measured": got["step_s"], "predicted": predicted.get("iteration_time_s")},
        {"what": "max_allocated_bytes", "measured": got["max_allocated_bytes"],
         "predicted": stage["peak_bytes"] - stage["overhead_bytes"] if stage else None},
        {"what": "parameters", "measured": got["parameters"], "predicted": stage.get("parameters")},
        {"what": "allocator_loss", "measured": allocator_loss(got),
         "predicted": environment_overheads(os.environ).fragmentation}]
    for row in doc["rows"]:
        row["ratio"] = ratio(row["measured"], row["predicted"])
    doc.update(exit_code=code, measured=got)
    write_json(Path(ns.out), doc)


# -- recap -----------------------------------------------------------------------------------------

def sustained_lines(doc: dict) -> list[str]:
    lines = []
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"sustained {r['dtype']} {r['n']}^3: {r['error']}")
            continue
        smi = [f"{s.get('clocks.sm')} {s.get('power.draw')} {s.get('clocks_throttle_reasons.active', '')}".strip()
               for s in r["nvidia_smi"]] or ["-"]
        lines.append(f"sustained {r['dtype']} {r['n']}^3 for {r['elapsed_s']} s: TFLOP/s first second "
                     f"{r['burst_tflops']:.4g}, whole run {r['measured']:.4g}, last window "
                     f"{r['windows'][-1]['tflops']:.4g}; planner {r['predicted']:.4g} (whole run/planner "
                     f"{r['ratio']}, first second/planner {r['burst_ratio']}), catalog 8192^3 rate "
                     f"{r['catalog_tflops']:.4g} (x{r['catalog_ratio']}); SM clock, power, throttle: "
                     f"{smi[0]} -> {smi[-1]}")
    return lines


def grouped_lines(doc: dict) -> list[str]:
    lines = [f"grouped ({len(doc['rows'])} of {doc.get('planned')} shapes): measured / the planner's per-expert "
             "price, and / roofline: median [min, max]"]
    for method in ("loop", "grouped_mm", "merged"):
        for key in ("ratio", "over_roofline"):
            rs = [r[key][method] for r in doc["rows"] if r[key].get(method)]
            if rs:
                lines.append(f"  {method:>10} {key:>13}: {statistics.median(rs):.3g} [{min(rs):.3g}, {max(rs):.3g}]")
    return lines


def skinny_lines(doc: dict) -> list[str]:
    lines = ["skinny:      m      n     k  measured us  /roofline  /planner"]
    lines += [f"  {r['m']:>12} {r['n']:>6} {r['k']:>5} {r['measured_s'] * 1e6:12.1f} {r['over_roofline']:>10} "
              f"{r['ratio']:>9}" for r in doc["rows"] if r["measured_s"]]
    return lines


def loss_lines(doc: dict) -> list[str]:
    lines = ["loss: measured / the planner's price (/ the price before 2026-11-26), median [min, max]"]
    for kernel in ("plain", "fused"):
        for pass_ in ("forward", "backward"):
            rows = [r[pass_] for r in doc["rows"] if r["kernel"] == kernel and r[pass_]["ratio"]]
            if rows:
                now, before = [r["ratio"] for r in rows], [r["ratio_before"] for r in rows]
                lines.append(f"  {kernel} {pass_:>8}: {statistics.median(now):.3g} [{min(now):.3g}, {max(now):.3g}]"
                             f" (before {statistics.median(before):.3g})")
    return lines


def train_lines(doc: dict) -> list[str]:
    if "error" in doc.get("estimate", {}):
        return [f"train: the estimate failed: {doc['estimate']['error']}"]
    return [f"train (exit {doc.get('exit_code')}): " + "; ".join(
        f"{r['what']} measured {r['measured']} predicted {r['predicted']:.4g} (x{r['ratio']})"
        for r in doc["rows"])]


def moe_lines(doc: dict) -> list[str]:
    lines = [f"moe layer: per-micro-batch cost (intercept) and per-token cost, measured and the planner's kernels "
             f"(its fitted fixed cost: {doc['moe_layer_fixed_s'] * 1e3:.2f} ms per pass)"]
    for r in doc["rows"]:
        head = f"  h {r['hidden']} ffn {r['ffn']} E {r['experts']} top-{r['topk']} {r['dispatch']}:"
        if "error" in r:
            lines.append(f"{head} {r['error']}")
            continue
        for pass_ in ("forward", "backward"):
            got, priced = r.get("measured", {}).get(pass_), r["priced_kernels"][pass_]
            measured = (f"{got['fixed_s'] * 1e3:.3f} ms + {got['per_token_s'] * 1e9:.1f} ns/token" if got
                        else "not measured")
            lines.append(f"{head} {pass_} {measured}; kernels priced {priced['fixed_s'] * 1e3:.3f} ms + "
                         f"{priced['per_token_s'] * 1e9:.1f} ns/token" if priced else f"{head} {pass_} {measured}")
    return lines


RECAP = {"sustained": sustained_lines, "grouped": grouped_lines, "skinny": skinny_lines, "loss": loss_lines,
         "moe": moe_lines, "train": train_lines}


def recap(out: Path) -> list[str]:
    """The figures that matter from whichever parts' files are in `out`."""
    lines = []
    for part, describe in RECAP.items():
        with contextlib.suppress(OSError, json.JSONDecodeError):
            lines += describe(json.loads((out / f"{part}.json").read_text()))
    return lines


PARTS = {"sustained": part_sustained, "grouped": part_grouped, "skinny": part_skinny, "loss": part_loss,
         "moe": part_moe, "train": part_train}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--out", required=True, help="JSON file, rewritten as rows come in")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script only")
    p.add_argument("--gpu", help="catalog GPU to price for (default: this device's name)")
    p.add_argument("--budget-s", type=float, default=40.0,
                   help="grouped, skinny, loss, moe: stop starting kernels after this long; "
                        "train: kill Megatron after it")
    p.add_argument("--duration-s", type=float, default=60.0, help="sustained: seconds per dtype")
    p.add_argument("--window-s", type=float, default=5.0, help="sustained: rate and nvidia-smi window")
    p.add_argument("--burst-s", type=float, default=1.0, help="sustained: the short burst")
    ns = p.parse_args(argv)
    device = resolve_device("cpu" if ns.dry_run else "cuda")   # cuda:N: fork_rng needs the index
    try:
        gpu = target_gpu(device, ns.gpu)
    except PipetteError as e:
        print(f"cost_check: error: {e} (name a catalog GPU to price it as with --gpu)", file=sys.stderr)
        return 2
    meta = device_metadata(device)
    meta.update(part=ns.part, priced_as=gpu.name, dry_run=ns.dry_run, method=__doc__.split("Parts:\n", 1)[1])
    doc = {"meta": meta, "rows": []}
    start = time.monotonic()
    PARTS[ns.part](ns, device, gpu, doc)
    meta["elapsed_s"] = round(time.monotonic() - start, 1)
    meta["nvidia_smi_after"] = nvidia_smi() if device.type == "cuda" else None
    write_json(Path(ns.out), doc)
    print("\n".join(RECAP[ns.part](doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
