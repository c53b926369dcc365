"""The self-check's CPU tensor counts: saved bytes held across interleaved forwards and backwards,
and the tensors alive in the process."""

import gc
import weakref

import torch

from megatron_pipette.profile.measure import LiveSavedBytes, count_saved_tensors, live_tensor_bytes, storage_keys


def test_saved_bytes_rise_with_each_forward_and_fall_with_its_backward() -> None:
    """Two micro-batches in flight hold twice what one saves (the weights left out, as a one-forward
    count leaves them out); each backward returns its own; the peak stays."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x1, x2 = torch.randn(16, 32), torch.randn(16, 32)
    with count_saved_tensors(model) as one:
        y = model(x1).sum()
    y.backward()
    counter = LiveSavedBytes(storage_keys(model.parameters()))
    with counter.hooks():
        y1 = model(x1).sum()
    assert counter.live == one.total > 0
    with counter.hooks():
        y2 = model(x2).sum()
    assert counter.live == counter.peak == 2 * one.total
    y1.backward()
    assert counter.live == one.total
    y2.backward()
    assert counter.live == 0 and counter.peak == 2 * one.total


def test_a_storage_saved_twice_counts_once() -> None:
    """Two views of one tensor saved by two operations: one storage, counted once until both go."""
    base = torch.randn(64, 64, requires_grad=True)
    counter = LiveSavedBytes(set())
    with counter.hooks():
        h = base * 2                   # saves nothing of h's storage; h is saved below twice
        out = (h[:32].sin() + h[32:].cos()).sum()
    assert counter.live == h.untyped_storage().nbytes()
    out.backward()
    assert counter.live == 0


def test_live_tensor_bytes_sees_a_new_tensor() -> None:
    before = live_tensor_bytes()
    big = torch.empty(1 << 20, dtype=torch.float32)
    assert live_tensor_bytes() - before >= big.untyped_storage().nbytes()
    del big
    assert live_tensor_bytes() - before < 1 << 22


def test_live_tensor_bytes_steps_over_a_dead_weak_proxy() -> None:
    """gc.get_objects() hands back weakref proxies, whose referent may be gone (any library may
    hold one); isinstance() would ask a dead proxy for its class and raise ReferenceError, so the
    count depended on what ran before it in the process."""

    class Referent:
        pass

    target = Referent()
    dead = weakref.proxy(target)
    del target
    assert any(type(o) is weakref.ProxyType for o in gc.get_objects())
    before = live_tensor_bytes()
    kept = torch.ones(1024, dtype=torch.float32)
    assert live_tensor_bytes() - before == kept.nbytes
    del dead
