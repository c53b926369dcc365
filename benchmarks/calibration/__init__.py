"""The calibration pipeline: from measurements on a GPU to the package's data, in this order.

1. `gemm_efficiency` and `attention_efficiency` time, on the GPU machine (benchmarks/device/h100_run.sh),
   the GEMMs and the attention kernels one TP rank of a Megatron layer runs.
2. `gemm_table` fits megatron_pipette/data/gemm_efficiency.json from those measurements and scores it
   on held-out shapes.
3. `fit_execution` fits the time model's execution constants (megatron_pipette/cost/execution.py) on the
   development set of published H100 runs only, through the validation suite's pricing of its rows.
4. `launch_floor_sweep` bounds Transformer Engine's host cost per kernel (cost/launch.py) by the cost
   at which a row of either development set moves away from its measurement.

Each step is `python -m benchmarks.calibration.STEP --help`; its raw output goes to a folder under
benchmarks/results/ that the docs cite.
"""
