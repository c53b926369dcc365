"""Each shipped Megatron-LM patch applies to the matching megatron/training of the pinned megatron-core."""

import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest

PATCHES = Path(__file__).resolve().parents[2] / "patches"


def installed_megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


@pytest.mark.torchrun
@pytest.mark.parametrize("patch", sorted(PATCHES.glob("megatron-lm-core_r*.patch")), ids=lambda p: p.stem)
def test_patch_applies_to_pinned_megatron(patch: Path, tmp_path: Path) -> None:
    import megatron.training

    release = patch.stem.removeprefix("megatron-lm-core_r")
    if not installed_megatron_version().startswith(release + "."):
        pytest.skip(f"{patch.name} is for megatron-core {release}, installed is {installed_megatron_version()}")
    target = tmp_path / "megatron" / "training"
    shutil.copytree(Path(megatron.training.__file__).parent, target)
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    patched = (target / "arguments.py").read_text()
    assert "from megatron_pipette.integration.install import install" in patched
    py_compile.compile(str(target / "arguments.py"), doraise=True)
