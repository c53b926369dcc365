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


def test_each_blackwell_gpu_has_the_fraction_its_kept_fit_adopted_within_the_physical_range():
    """A fit is adopted only where it carries to the models it was not fitted on; the others keep 1."""
    fits = json.loads(KEPT.read_text())["gpus"]
    assert {"gb200-nvl72", "gb300-nvl72"} <= set(fits)
    for cluster in ("dgx-b200", "dgx-b300", "gb200-nvl72", "gb300-nvl72"):
        fit = fits.get(cluster, {"adopted": False})
        expected = fit["step_gemm_fraction"] if fit["adopted"] else 1.0
        assert min(STEP_FRACTIONS) <= expected <= max(STEP_FRACTIONS) == 1.0
        assert preset_cluster(cluster, num_nodes=1).gpu.step_gemm_fraction == expected
