"""`torchrun --nproc_per_node N -m megatron_pipette.probe --out cluster.json`: `pipette probe`, as a module
torchrun can start on every rank."""

import sys

from megatron_pipette.cli.main import main

sys.exit(main(["probe", *sys.argv[1:]]))
