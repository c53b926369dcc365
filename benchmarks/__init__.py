"""Evidence for the planner, kept apart from the product: run from the repository root with `python -m`.

- `benchmarks.calibration`: the pipeline that turns measurements on a GPU into the package's data
  (megatron_pipette/data/) and the time model's fitted constants.
- `benchmarks.validation`: the suite that reproduces every figure the README and docs/validation.md
  quote, each from its kept folder under benchmarks/results/.
- `benchmarks.gpu`: the GEMM operands and timer both use on a GPU, so a measured table and its check
  share one stopwatch; `benchmarks.device`: what a GPU machine runs; `benchmarks.scrub_results`:
  makes a results folder fit to commit.

Dependencies run one way: calibration may use the validation suite's pricing of the development
sets (it fits on them); validation never imports calibration.
"""
