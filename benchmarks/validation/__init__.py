"""The validation suite: each module reproduces figures the README or docs/validation.md quote, from
the planner as it stands, into a results folder named after it (benchmarks/results/MODULE-DATE[-variant]).

Planner only (any machine): `published_runs_h100`, `published_runs` (A100) and `published_runs_blackwell`
(the development sets at their published layouts), `plan_scaling`, `probe_twin`, `summary` (the README's
table from the kept folders). CPU processes: `cpu_memory`, `calibration_loop`, `probe_time`; root and tc:
`emulated_cluster`. One GPU (through benchmarks/device/): `cost_check`, `in_job`, `layer_chain`,
`attention_prices`.

Run each as `python -m benchmarks.validation.MODULE --help` from the repository root.
"""
