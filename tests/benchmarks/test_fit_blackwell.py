"""benchmarks.calibration.fit_blackwell: the catalog holds the fractions its kept fit chose."""

import json
from pathlib import Path

from benchmarks.calibration.fit_blackwell import STEP_FRACTIONS, best
from megatron_pipette.spec.hardware import preset_cluster

KEPT = Path(__file__).parents[2] / "benchmarks/results/fit_blackwell-2026-11-29/results.json"


def test_the_best_fraction_is_the_least_mean_error_over_the_rows_kept():
    grid = {0.9: [0.1, -0.5], 1.0: [0.2, 0.0]}
    assert best(grid, [True, True]) == 1.0
    assert best(grid, [True, False]) == 0.9


def test_each_blackwell_gpu_has_the_fraction_its_kept_fit_chose_within_the_physical_range():
    fits = json.loads(KEPT.read_text())["gpus"]
    assert set(fits) == {"dgx-b200", "dgx-b300", "gb200-nvl72", "gb300-nvl72"}
    for cluster, fit in fits.items():
        assert fit["step_gemm_fraction"] in STEP_FRACTIONS and max(STEP_FRACTIONS) <= 1.0
        assert preset_cluster(cluster, num_nodes=1).gpu.step_gemm_fraction == fit["step_gemm_fraction"]
