#!/usr/bin/env bash
# The in-job path on one GPU (in_job.py; README.md here) in one command of under 8 minutes:
# h100_run.sh's setup, limits and recap with the injob part only.
#
#   OUT=/tmp/out bash benchmarks/device/in_job.sh                    # on the GPU machine
#   OUT=/tmp/out DEVICE_DRY_RUN=1 bash benchmarks/device/in_job.sh   # locally: CPU, tiny GPT
export PARTS=${PARTS:-injob} DEVICE_TOTAL_S=${DEVICE_TOTAL_S:-470}
exec bash "$(dirname "$0")/h100_run.sh"
