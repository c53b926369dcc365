"""The timeline picture: its blocks are the simulator's events, and the PNG shows them where they are."""

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from megatron_pipette.cost.model import CostModel
from megatron_pipette.errors import PipetteError
from megatron_pipette.report import timeline as picture
from megatron_pipette.report.figures import DPI
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.job import resolve_job
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset

CLUSTER = preset_cluster("dgx-a100", num_nodes=2)
WORKLOAD = workload_from_preset("gpt3-1.3b", global_batch_size=64)
LAYOUTS = {
    "1f1b with recomputation": Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                                      data_parallel_size=2, micro_batch_size=4, recompute_granularity="full",
                                      recompute_method="uniform", recompute_num_layers=1),
    "interleaved": Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, data_parallel_size=2,
                          micro_batch_size=4, num_layers_per_virtual_pipeline_stage=2),
    "no pipelining": Layout(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, data_parallel_size=8,
                            micro_batch_size=4),
}


def timeline_of(layout: Layout):
    return CostModel(CLUSTER).timeline(resolve_job(WORKLOAD, layout, CLUSTER.world_size))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def drawn(request, tmp_path_factory):
    timeline = timeline_of(LAYOUTS[request.param])
    path = tmp_path_factory.mktemp("timeline") / "timeline.png"
    blocks = picture.write_timeline(timeline, path, request.param)
    return timeline, blocks, imread(path)


def test_the_png_has_the_size_of_its_stages(drawn):
    timeline, _, image = drawn
    stages = timeline.recompute_s.shape[0]
    assert image.shape[:2] == (round((picture.HEADER_IN + picture.ROW_IN * stages) * DPI), picture.WIDTH_IN * DPI)


def test_the_blocks_are_the_simulated_events(drawn):
    """Per stage: one block per forward, wait and transfer of the simulator, a backward split into its
    recomputed forward and the rest at the event's own times, and the blocks back to back from 0 to
    the end of the forward-backward pass (the stages that end early idle until then)."""
    timeline, blocks, _ = drawn
    stages = timeline.recompute_s.shape[0]
    assert {b.stage for b in blocks} == set(range(stages))
    for stage in range(stages):
        events = [e for e in timeline.events if e.rank == stage]
        mine = sorted((b for b in blocks if b.stage == stage), key=lambda b: b.start_s)
        for kind, what in (("forward", "forward"), ("wait", "bubble"), ("p2p", "p2p")):
            spans = sorted((e.start_s, e.end_s, e.chunk, e.microbatch) for e in events if e.what == kind)
            drawn_spans = [(b.start_s, b.end_s, b.chunk, b.microbatch) for b in mine if b.what == what]
            assert [s for s in drawn_spans if s[1] <= events[-1].end_s] == spans
        backward = sorted((e.start_s, e.end_s, e.chunk, e.microbatch) for e in events if e.what == "backward")
        recompute = [b for b in mine if b.what == "recompute"]
        rest = [b for b in mine if b.what == "backward"]
        assert [(b.end_s, b.chunk, b.microbatch) for b in rest] == [(e, c, i) for _, e, c, i in backward]
        if (timeline.recompute_s[stage] > 0).any():
            assert [(b.start_s, b.chunk, b.microbatch) for b in recompute] == [(s, c, i) for s, _, c, i in backward]
            assert all(r.end_s == b.start_s for r, b in zip(recompute, rest))
            assert [r.end_s - r.start_s for r in recompute] == pytest.approx(
                [timeline.recompute_s[stage, b.chunk] for b in recompute])
        else:
            assert not recompute and [b.start_s for b in rest] == [s for s, _, _, _ in backward]
        assert mine[0].start_s == 0 and mine[-1].end_s == timeline.pipeline_s
        assert all(a.end_s == pytest.approx(b.start_s, abs=1e-12) for a, b in zip(mine, mine[1:]))


def _pixel(image: np.ndarray, timeline, x_s: float, y: float) -> np.ndarray:
    """The RGB of the point at `x_s` seconds on the row coordinate `y` (stage s is the row y = s)."""
    height, width = image.shape[:2]
    stages = timeline.recompute_s.shape[0]
    end = max(timeline.estimate.iteration_time_s, timeline.pipeline_s)
    column = (picture.LEFT + (picture.RIGHT - picture.LEFT) * x_s / end) * width
    axes_h = height - (picture.BOTTOM_IN + picture.TOP_IN) * DPI
    row = height - (picture.BOTTOM_IN * DPI + axes_h * (stages - 0.5 - y) / stages)
    return image[int(row), int(column), :3]


def test_each_block_is_drawn_where_it_is_in_its_colour(drawn):
    """The longest block of every kind on every stage, read back from the PNG: its colour (lighter for
    later model chunks, over the white background) inside it, away from its label; blocks a few pixels
    wide are left out."""
    timeline, blocks, image = drawn
    stages, chunks = timeline.recompute_s.shape
    end = max(timeline.estimate.iteration_time_s, timeline.pipeline_s)
    px_per_s = (picture.RIGHT - picture.LEFT) * image.shape[1] / end
    checked = 0
    for stage in range(stages):
        for what in picture.KINDS:
            mine = [b for b in blocks if b.stage == stage and b.what == what]
            if not mine:
                continue
            b = max(mine, key=lambda b: b.end_s - b.start_s)
            if (b.end_s - b.start_s) * px_per_s < 6:    # a sliver: antialiased into its neighbours
                continue
            alpha = 1.0 if b.chunk is None or chunks == 1 else 1.0 - 0.5 * b.chunk / (chunks - 1)
            expected = np.array(to_rgb(picture.COLORS[what])) * alpha + (1 - alpha)
            got = _pixel(image, timeline, b.start_s + 0.3 * (b.end_s - b.start_s), stage + 0.25)
            assert got == pytest.approx(expected, abs=0.03), (stage, what)
            checked += 1
    assert checked >= 2 * stages    # forward and backward at least


def test_the_title_carries_the_predicted_iteration_time():
    timeline = timeline_of(LAYOUTS["interleaved"])
    text = picture.heading(timeline, "gpt3-1.3b")
    assert f"predicted {timeline.estimate.iteration_time_s:.3f} s/iteration" in text
    assert "interleaved schedule, 8 micro-batches, 3 model chunks a stage" in text


def test_a_picture_that_cannot_be_written_names_the_flag(tmp_path):
    with pytest.raises(PipetteError, match="--timeline"):
        picture.write_timeline(timeline_of(LAYOUTS["no pipelining"]), tmp_path / "missing" / "t.png", "x")
