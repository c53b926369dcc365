"""A torch_dist checkpoint as Megatron's save leaves it, for tests whose job does not train."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from megatron_pipette.integration.checkpoint import CHECKPOINT_TRACKER
from megatron_pipette.spec.layout import Layout

# Megatron's own writer in a process of its own (a gloo world of one, CPU rehearsal): the common state
# holds the arguments a resume reads what the checkpoint fixes from.
WRITER = """
import argparse, json, sys, tempfile
from megatron_pipette.integration.rehearsal import enable_cpu_rehearsal
enable_cpu_rehearsal()
import torch.distributed as dist
from megatron.core import dist_checkpointing
if __name__ == "__main__":
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(tempfile.mktemp(), 1))
    args = argparse.Namespace(**json.loads(sys.argv[2]))
    dist_checkpointing.save({"args": args, "iteration": int(sys.argv[3])}, sys.argv[1], content_metadata={})
    dist.destroy_process_group()
"""


def write_checkpoint(load: Path, iteration: int, layout: Layout, world_size: int) -> None:
    """Checkpoint `iteration` in `load`, saved under `layout` on `world_size` processes, and the tracker."""
    args = {k: v for k, v in dataclasses.asdict(layout).items() if k != "data_parallel_size"}
    directory = load / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    subprocess.run([sys.executable, "-c", WRITER, str(directory), json.dumps({**args, "world_size": world_size}),
                    str(iteration)], check=True, capture_output=True, timeout=120)
    (load / CHECKPOINT_TRACKER).write_text(str(iteration))
