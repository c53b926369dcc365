"""One reader and one writer per document, checked on the source: outside a document's codec, code
holds its typed record, so a raw subscript of the document (`doc["candidates"][0]`) or a call of the
codec's `*_from_json` functions fails here, the way a wrong import fails test_layers."""

import ast
from types import SimpleNamespace

import pytest
from test_layers import PACKAGE, modules

from megatron_pipette.calibration.document import CalibrationRecord
from megatron_pipette.calibration.fit import Factors, Fit
from megatron_pipette.cost.model import CostModel
from megatron_pipette.plan.placement import Placement
from megatron_pipette.plan.planner import plan
from megatron_pipette.probe.twin import run_twin
from megatron_pipette.report.plan_document import plan_json
from megatron_pipette.spec.hardware import preset_cluster
from megatron_pipette.spec.layout import Layout
from megatron_pipette.spec.workload import workload_from_preset


def _plan_keys() -> set[str]:
    """The plan document's own keys (its top level, a candidate, its memory and placement) taken from a
    document its writer wrote, with the keys the in-job hook adds; not the fields of the model or the
    layout inside it, which are the dataclasses' names and used as such everywhere."""
    doc = plan_json(plan(workload_from_preset("tiny-gpt"), CostModel(preset_cluster("dgx-a100", num_nodes=1)),
                         top_k=1))
    best = doc["candidates"][0]
    return {*doc, "phases_s", "calibration", "self_check", *best, *best["memory"], *best["placement"]} - SHARED


def _cluster_keys() -> set[str]:
    """The cluster file's keys and its probe report's, from a document the probe (its twin) wrote."""
    doc = run_twin(preset_cluster("dgx-a100", num_nodes=2), budget_s=5, small_bytes=4096, large_bytes=2 ** 20,
                   repeats=1).doc
    return {*doc, *doc["probe"]} - SHARED


def _profile_keys() -> set[str]:
    """The layer profile's top-level keys, from the dict its writer, profile.profiler.profile_layers,
    returns (read from the source: profiling needs torch)."""
    tree = ast.parse((PACKAGE / "profile" / "profiler.py").read_text())
    writer = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "profile_layers")
    returned = [n.value for n in ast.walk(writer) if isinstance(n, ast.Return)]
    documents = [v.args[0] if isinstance(v, ast.Call) and v.args else v for v in returned]   # a dict, or read back
    keys = {k.value for d in documents if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}
    assert {"layers", "measurement"} <= keys, keys
    return keys - SHARED


def _calibration_keys() -> set[str]:
    """The calibration document's keys, its factors' and what it was fitted on, from its writer; less
    those the plan document has too (it carries a calibration's id and factors, its candidates a
    layout and node order), which its codec reads."""
    fitted = Fit(factors=Factors(link_bandwidth={"intra_node": 1.0}), predicted_s=1.0, calibrated_s=1.0,
                 measured_s=1.0, predicted_passes_s=(), calibrated_passes_s=())
    check = SimpleNamespace(iterations=(2, 6))
    doc = CalibrationRecord.of(fitted, Layout(), Placement(node_order=(0,), gpus_per_node=1), check).to_json()
    return {*doc, *doc["factors"], *doc["fitted_on"]} - SHARED - _plan_keys() - {"id", "factors"}


SHARED = {"schema", "version", "model", "cluster", "world_size", "gpus_per_node", "name", "gpu", "num_nodes",
          "device_name", "probe", "skipped", "device", "iterations", "predicted_s", "measured_s"}
"""Keys that other documents (the layer profile, a calibration, the catalog's presets, a plan's self-check: its
CheckResult's field names), a rank's identity, the phase names or Megatron's own arguments use too: a subscript
of one does not say which document it reads."""
CODECS = {"report.plan_document": _plan_keys(), "spec.cluster_file": _cluster_keys(),
          "spec.layer_profile": _profile_keys(), "calibration.document": _calibration_keys()}
"""Codec module -> the keys of its document, which only it subscripts."""


def _readers(codec: str) -> set[str]:
    """The codec's functions named *_from_json, its own business."""
    tree = ast.parse((PACKAGE / (codec.replace(".", "/") + ".py")).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_from_json")}


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_only_the_codec_reads_its_document(codec):
    keys, readers = CODECS[codec], _readers(codec)
    wrong = []
    for _, name, tree in modules():
        if name == codec:
            continue
        where = f"megatron_pipette/{name.replace('.', '/')}.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in keys:
                wrong.append(f"{where}:{node.lineno} subscripts [{node.slice.value!r}]: use the typed record")
            elif isinstance(node, ast.Call) and _called_name(node) in readers:
                wrong.append(f"{where}:{node.lineno} calls {_called_name(node)}: only {codec} may")
    assert not wrong, f"{codec}'s document read outside it:\n" + "\n".join(wrong)

