import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "megatron_pipette_autoload.pth"


class build_py_with_pth(build_py):
    """Ship the .pth that makes --auto-parallel work in unmodified Megatron scripts
    (it imports megatron_pipette.integration.autoload, which does nothing unless asked)."""

    def run(self):
        super().run()
        shutil.copy(PTH, Path(self.build_lib) / PTH)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(
    name="megatron-pipette",
    version="0.1.0",
    description="Measured, link-aware parallel-layout planning for Megatron-LM, inside the job",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_pipette", "megatron_pipette.*"]),
    package_data={"megatron_pipette.data": ["*.json"]},
    # The planner needs numpy only; the probe, profile and Megatron hook need torch and megatron-core.
    install_requires=["numpy>=1.26", "matplotlib>=3.8"],
    extras_require={"job": ["torch>=2.4", "megatron-core>=0.17", "psutil"]},
    cmdclass={"build_py": build_py_with_pth},
    entry_points={"console_scripts": ["pipette=megatron_pipette.cli.main:main"]},
)
