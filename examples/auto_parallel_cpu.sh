#!/usr/bin/env bash
# `make demo`: Megatron's own training loop with --auto-parallel, 4 gloo processes on CPU (NPROC=N for N).
# The hook probes the 4 processes' links, profiles one layer, plans the layout and rank
# placement, re-ranks the processes, and hands over to Megatron, which trains a tiny GPT
# for 20 iterations. No layout flag is given: the planner chooses them all. Nor is any CPU setting
# (gloo, the local layer spec, ...): without a GPU the hook supplies them, and says so. After the
# first iteration the self-check times 5 more, compares them with the plan and calibrates the
# model for the next start (a second `make demo` plans with it). TORCHRUN_ARGS replaces
# `--standalone` (say, an elastic launch: docs/elastic.md).
set -euo pipefail
cd "$(dirname "$0")/.."

# One thread per rank: 4 ranks share the cores.
export OMP_NUM_THREADS=1

# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of words
exec "${PYTHON:-.venv/bin/python}" -m torch.distributed.run ${TORCHRUN_ARGS:---standalone} --nproc-per-node "${NPROC:-4}" \
  examples/pretrain_gpt.py \
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
  --seq-length 64 --max-position-embeddings 64 --untie-embeddings-and-output-weights \
  --global-batch-size 16 --train-iters 20 \
  --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 2 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --num-workers 0 \
  --log-interval 1 --eval-iters 0 --eval-interval 1000 \
  --auto-parallel --auto-parallel-budget-s 60 --auto-parallel-cache-dir "${PIPETTE_CACHE_DIR:-out/pipette-cache}" \
  "$@"
