"""Give torchrun's processes new ranks, so Megatron's groups land on chosen processes.

Megatron builds every group from sorted rank lists in its fixed 'tp-cp-ep-dp-pp' order,
so a placement cannot be imposed by rewriting group rank lists. Renumbering the
processes can: the default group is initialised on torchrun's store under one prefix
(probe work runs there), destroyed, and initialised again under a new prefix with
`rank = new_rank_of[old_rank]`. LOCAL_RANK, and so the device, stay as they are.

Megatron's initialize_megatron then finds the default group and keeps it; it also skips
`torch.cuda.set_device`, which `init_from_torchrun_env` therefore does on GPU machines.
"""

import os
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


def init_from_torchrun_env(
    backend: str, timeout: timedelta, prefix: str
) -> tuple[dist.Store, int, int]:
    """Initialise the default group on torchrun's store under `prefix`.

    Returns the unprefixed store (for `reinit_with_ranks`), this process's rank and the
    world size, as torchrun assigned them.
    """
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # torchrun's agent hosts the store; workers join it as clients.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
        wait_for_workers=False,
    )
    dist.init_process_group(
        backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timeout
    )
    return store, rank, world


def reinit_with_ranks(
    store: dist.Store,
    new_rank_of: Sequence[int],
    backend: str,
    timeout: timedelta,
    prefix: str,
) -> int:
    """Replace the default group by one where this process has rank `new_rank_of[old_rank]`.

    `prefix` must differ from every earlier one on `store`. Groups built on the old default
    group (Megatron's: call `parallel_state.destroy_model_parallel()` first) become unusable.
    Sets RANK in os.environ, which Megatron's argument parsing reads. Returns the new rank.
    """
    old_rank = dist.get_rank()
    world = dist.get_world_size()
    if sorted(new_rank_of) != list(range(world)):
        raise ValueError(
            f"new_rank_of must be a permutation of range({world}), got {list(new_rank_of)}"
        )
    new_rank = new_rank_of[old_rank]
    # No rank tears the group down while a peer still has a message in flight to it.
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=new_rank,
        world_size=world,
        timeout=timeout,
    )
    os.environ["RANK"] = str(new_rank)
    return new_rank
