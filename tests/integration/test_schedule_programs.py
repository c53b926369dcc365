"""The simulator's programs are megatron-core's schedules, call by call.

megatron-core's own forward_backward_pipelining_without_interleaving and _with_interleaving
run here, one pipeline rank after another, with a P2PCommunicator whose `_communicate` records
each p2p call (what it posts, and when Megatron waits for it) instead of sending; tiny one-weight
model chunks record each forward and backward with its micro-batch. Each rank's record must equal
the program `cost.simulator` times for it: a wrong order, a missing wait or a misnumbered
micro-batch in a program shows up as a difference at a named step. (tests/cost/test_memory.py
counts the activations each rank holds on these programs.)
"""

import itertools

import pytest
import torch
from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import schedules
from megatron.core.pipeline_parallel import utils as pp_utils
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_pipette.cost import simulator
from megatron_pipette.integration.rehearsal import _CudaToCpuMode

SHAPE = (2, 1, 3)   # (sequence, micro-batch, hidden): what the schedules derive from the arguments below
NAMES = {(simulator.FORWARD, True): "send_next", (simulator.FORWARD, False): "recv_prev",
         (simulator.BACKWARD, True): "send_prev", (simulator.BACKWARD, False): "recv_next"}


class _Group:
    """The pipeline group as the schedules query it: a size and this rank's place in it."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Handle:
    """An async request; waiting on it is an event of the rank's record."""

    def __init__(self, log: list, call: int, name: str):
        self.log, self.key = log, (call, name)

    def wait(self) -> None:
        self.log.append(("wait", frozenset({self.key})))


class _Recorder(P2PCommunicator):
    """One pipeline rank's communicator: records each p2p call, receives zeros at once. The
    public calls (send_forward, send_forward_recv_backward, ...) are megatron-core's; only the
    transport underneath is replaced, and __init__, which asks torch.distributed for peer ranks."""

    def __init__(self, rank: int, p: int, config: ModelParallelConfig, log: list):
        self.pp_group, self.config, self.log, self.calls = _Group(rank, p), config, log, 0
        self.next_rank, self.prev_rank = (rank + 1) % p, (rank - 1) % p
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs=True):
        names = [name for name, on in (("send_next", tensor_send_next is not None), ("recv_prev", recv_prev),
                                       ("send_prev", tensor_send_prev is not None), ("recv_next", recv_next))
                 if on]
        received = [torch.zeros(SHAPE, requires_grad=True) if on else None for on in (recv_prev, recv_next)]
        if not names:           # nothing posted, nothing on the wire
            return *received, {}
        call, self.calls = self.calls, self.calls + 1
        self.log.append(("post", call, frozenset(names)))
        if wait_on_reqs:
            self.log.append(("wait", frozenset((call, name) for name in names)))
            return *received, None
        return *received, {name: _Handle(self.log, call, name) for name in names}


class _Tag(torch.autograd.Function):
    """Identity whose backward records which (chunk, micro-batch) it belongs to."""

    @staticmethod
    def forward(ctx, x, log, chunk, microbatch):
        ctx.tag = (log, chunk, microbatch)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        log, chunk, microbatch = ctx.tag
        log.append(("B", chunk, microbatch))
        return grad, None, None, None


class _Chunk(torch.nn.Module):
    """A model chunk of one weight; its data iterator yields micro-batch numbers."""

    def __init__(self, chunk: int, config: ModelParallelConfig, log: list):
        super().__init__()
        self.chunk, self.config, self.log, self.input = chunk, config, log, None
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.ones(()))

    def set_input_tensor(self, tensors) -> None:
        self.input = tensors[0]


def _forward_step(data_iterator, model: _Chunk):
    microbatch = next(data_iterator)
    x = torch.ones(SHAPE) if model.input is None else model.input
    model.log.append(("F", model.chunk, microbatch))
    out = _Tag.apply(x * model.weight, model.log, model.chunk, microbatch)
    return out, lambda output: (output.sum(), {})


def megatron_record(p: int, m: int, v: int, overlap_p2p_comm: bool) -> list[list[tuple]]:
    """Run megatron-core's schedule for every pipeline rank; return each rank's record.

    Megatron-LM's settings (core_transformer_config_from_args): deallocate_pipeline_outputs,
    batch_p2p_comm exactly when p2p communication is not overlapped; --overlap-p2p-communication
    applies to the interleaved schedule only."""
    records = []
    for rank in range(p):
        config = ModelParallelConfig(pipeline_model_parallel_size=p,
                                     virtual_pipeline_model_parallel_size=v if v > 1 else None,
                                     pipeline_dtype=torch.float32, overlap_p2p_comm=overlap_p2p_comm,
                                     batch_p2p_comm=not overlap_p2p_comm, deallocate_pipeline_outputs=True)
        config.hidden_size = SHAPE[2]
        log: list = []
        chunks = [_Chunk(c, config, log) for c in range(v)]
        run = (schedules.forward_backward_pipelining_with_interleaving if v > 1
               else schedules.forward_backward_pipelining_without_interleaving)
        run(forward_step_func=_forward_step, data_iterator=[itertools.count() for _ in chunks],
            model=chunks, num_microbatches=m, seq_length=SHAPE[0], micro_batch_size=SHAPE[1],
            p2p_communicator=_Recorder(rank, p, config, log),
            pg_collection=ProcessGroupCollection(tp=_Group(0, 1), cp=_Group(0, 1)))
        records.append(log)
    return records


def program_record(program: tuple) -> list[list[tuple]]:
    """A simulator program in the recorder's terms: (F|B, chunk, micro-batch), (post, call,
    endpoints), (wait, {(call, endpoint)})."""
    records = []
    for rank, ops in enumerate(program):
        log, where, calls = [], {}, 0
        for op in ops:
            if op[0] == simulator.COMPUTE:
                log.append(("F" if op[1] == simulator.FORWARD else "B", op[2], op[3]))
            elif op[0] == simulator.POST:
                names = set()
                for key, sender, _ in op[1]:
                    src, dst, direction, _ = key
                    assert (src if sender else dst) == rank, f"rank {rank} posts {key}"
                    where[key] = (calls, NAMES[direction, sender])
                    names.add(NAMES[direction, sender])
                log.append(("post", calls, frozenset(names)))
                calls += 1
            else:
                log.append(("wait", frozenset(where[key] for key in op[1])))
        records.append(log)
    return records


def assert_same(got: list[list[tuple]], want: list[list[tuple]]) -> None:
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        step = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        assert g == w, (f"rank {rank} differs at step {step}: megatron-core {g[step:step + 3]}, "
                        f"program {w[step:step + 3]}")


@pytest.fixture(autouse=True)
def recording_pipeline(monkeypatch):
    """Ranks come from the stub groups (no process group is initialized); CUDA tensors the
    schedules allocate (a token counter) land on the CPU."""
    monkeypatch.setattr(pp_utils, "get_pg_rank", lambda group=None: group.rank())
    monkeypatch.setattr(pp_utils, "get_pg_size", lambda group=None: group.size())
    with _CudaToCpuMode():
        yield


ONE_F_ONE_B = [(2, 1), (4, 2), (4, 3), (4, 4), (4, 6), (3, 7), (2, 5)]   # m < p, p <= m < 2p-1, m >= 2p-1
INTERLEAVED = [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 3), (3, 3, 4)]


@pytest.mark.parametrize("p,m", ONE_F_ONE_B)
def test_1f1b_program_is_megatrons(p, m):
    assert_same(megatron_record(p, m, 1, overlap_p2p_comm=False), program_record(simulator.program_1f1b(p, m)))


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_program_is_megatrons(p, m, v):
    assert_same(megatron_record(p, m, v, overlap_p2p_comm=True),
                program_record(simulator.program_interleaved(p, m, v)))


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (3, 6, 3), (3, 3, 2)])
def test_interleaved_program_without_p2p_overlap_is_megatrons(p, m, v):
    assert_same(megatron_record(p, m, v, overlap_p2p_comm=False),
                program_record(simulator.program_interleaved(p, m, v, overlap_p2p_comm=False)))
