from setuptools import find_packages, setup

setup(
    name="megatron-pipette",
    version="0.1.0",
    description="Measured, link-aware parallel-layout planning for Megatron-LM, inside the job",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_pipette", "megatron_pipette.*"]),
    package_data={"megatron_pipette.data": ["*.json"]},
    # The planner needs numpy only; the probe, profile and Megatron hook need torch and megatron-core.
    install_requires=["numpy>=1.26", "matplotlib>=3.8"],
    extras_require={"job": ["torch>=2.4", "megatron-core>=0.17"]},
    entry_points={"console_scripts": ["pipette=megatron_pipette.cli.main:main"]},
)
