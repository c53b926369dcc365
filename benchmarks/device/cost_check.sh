#!/usr/bin/env bash
# The planner's prices held against one GPU (cost_check.py; README.md here) in one command of
# under 8 minutes: h100_run.sh's setup, limits and recap with the cost-check parts.
#
#   OUT=/tmp/out bash benchmarks/device/cost_check.sh                    # on the GPU machine
#   OUT=/tmp/out DEVICE_DRY_RUN=1 bash benchmarks/device/cost_check.sh   # locally: CPU, tiny shapes
export PARTS=${PARTS:-sustained grouped skinny loss moe train} DEVICE_TOTAL_S=${DEVICE_TOTAL_S:-470}
exec bash "$(dirname "$0")/h100_run.sh"
