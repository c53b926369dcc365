"""Activation offloading to the CPU (--cpu-offloading-num-layers N): what stays on the device, and
the copies over the host link that the layers' compute does not hide.

megatron-core 0.19.2 runs every TransformerBlock layer's forward inside Transformer Engine's
get_cpu_offload_context (extensions/transformer_engine.py; TE 2.x pytorch/cpu_offload.py,
DefaultOffloadSynchronizer) with the model's L layers (PP 1: Megatron refuses a pipeline). The
tensors layer i < N saves for its backward (those of 256k elements or more, not parameters) are
copied to pinned host memory on a side stream, issued at layer i + 1's forward; layer L - N + i's
forward waits until that copy is done and frees layer i's. The backward issues layer i's copy back
at layer L - 1 - N + i's backward (after the work before it) and layer i's backward waits for it.
One stream carries the copies, one after the other. So at most L - N layers' activations are on
the device at once, in the forward and in the backward alike (TE's docstring: (L - N) x T).
"""

from __future__ import annotations

import numpy as np

from megatron_pipette.spec.job import Job


def resident_layers(job: Job, layers: int) -> int:
    """Layers of a chunk of `layers` whose activations are on the device at the peak: L - N
    consecutive ones (every layer without offloading)."""
    n = job.layout.cpu_offloading_num_layers
    return layers - n if n else layers


def microbatch_exposed(layers: int, offloaded: int, forward_layer_s: np.ndarray, backward_layer_s: np.ndarray,
                       copy_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds one micro-batch's copies add to a chunk of `layers` equal layers of
    `forward_layer_s` and `backward_layer_s` each, `offloaded` of them copied out and back in
    `copy_s` each way, replayed as Transformer Engine synchronises them (module docstring): a copy
    runs beside the layers after its own and is exposed only where the layer that must wait for
    it would start before it is done. Arrays of any shape, elementwise."""
    f, b = np.asarray(forward_layer_s, dtype=float), np.asarray(backward_layer_s, dtype=float)
    zero = np.zeros(np.broadcast(f, b).shape)
    if not offloaded:
        return zero, zero
    keep = layers - offloaded
    end, out = zero, {}                 # compute stream's time; copy i's end
    copying = zero                      # the copy stream free from
    for j in range(layers):
        start = end if j - keep < 0 else np.maximum(end, out[j - keep])    # waits for layer j - keep's copy
        end = start + f
        if j < offloaded:               # layer j copied out once done, behind the copies before it
            copying = out[j] = np.maximum(end, copying) + copy_s
    forward = end - layers * f
    end, back, copying = zero, {}, zero
    for j in range(layers - 1, -1, -1):
        i = j - (keep - 1)              # the layer whose copy back is issued before layer j's backward
        if 0 <= i < offloaded:
            copying = back[i] = np.maximum(end, copying) + copy_s
        start = np.maximum(end, back[j]) if j < offloaded else end
        end = start + b
    return forward, end - layers * b
