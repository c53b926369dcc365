"""torchrun worker for test_reinit: renumber ranks, build Megatron's groups, report them.

Writes, per case, the physical (torchrun) ranks of each of this process's groups (tensor-,
pipeline-, data-, context- and expert-parallel, and the combined ones), and the sum of physical
ranks all-reduced over each group.
"""

import functools
import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_pipette.integration.reinit import (  # noqa: E402
    init_from_torchrun_env,
    reinit_with_ranks,
)

BACKEND = "gloo"
TIMEOUT = timedelta(seconds=60)


def group_report(group: dist.ProcessGroup, physical_of: list[int], me: int) -> dict:
    """Members of `group` as physical ranks, and an all-reduce over it as a liveness check."""
    total = torch.tensor([me], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    members = sorted(physical_of[r] for r in dist.get_process_group_ranks(group))
    return {"ranks": members, "sum": int(total.item())}


def main() -> None:
    out_dir, cases = sys.argv[1], json.loads(sys.argv[2])
    store, physical, world = init_from_torchrun_env(BACKEND, TIMEOUT, "probe/")
    # Probe work on the first group.
    probe = torch.ones(1)
    dist.all_reduce(probe)
    assert probe.item() == world

    results = []
    for i, case in enumerate(cases):
        # new_rank_of is indexed by the *current* rank: gather who is who first.
        physical_of = [None] * world
        dist.all_gather_object(physical_of, physical)
        new_rank_of = [case["logical_of_physical"][p] for p in physical_of]
        rank = reinit_with_ranks(store, new_rank_of, BACKEND, TIMEOUT, f"case{i}/")
        assert os.environ["RANK"] == str(rank)
        physical_of = [None] * world
        dist.all_gather_object(physical_of, physical)

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"],
            context_parallel_size=case.get("cp", 1), expert_model_parallel_size=case.get("ep", 1),
            expert_tensor_parallel_size=case.get("etp"),
        )
        ps = parallel_state
        getters = {"tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
                   "dp": ps.get_data_parallel_group, "cp": ps.get_context_parallel_group,
                   "dp-cp": functools.partial(ps.get_data_parallel_group, with_context_parallel=True),
                   "ep": ps.get_expert_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group,
                   "edp": ps.get_expert_data_parallel_group}
        results.append({"rank": rank, **{kind: group_report(get(), physical_of, physical)
                                          for kind, get in getters.items()}})
        parallel_state.destroy_model_parallel()

    with open(os.path.join(out_dir, f"rank{physical}.json"), "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
