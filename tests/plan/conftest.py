"""Clusters with uneven links, for placement and planner tests."""

import dataclasses

import numpy as np
import pytest

from megatron_pipette.spec.hardware import Cluster, preset_cluster


def make_slow_node_cluster(num_nodes: int = 4, gpus_per_node: int = 8, slow_node: int = 1, factor: float = 10.0,
                      preset: str = "dgx-a100") -> Cluster:
    """A preset cluster whose node `slow_node` has every inter-node link `factor` times slower."""
    c = preset_cluster(preset, num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    node = np.arange(c.world_size) // gpus_per_node
    touches = (node[:, None] == slow_node) ^ (node[None, :] == slow_node)
    bw = np.where(touches, c.bandwidth_Bps / factor, c.bandwidth_Bps)
    return dataclasses.replace(c, name=f"{c.name}-slow{slow_node}", bandwidth_Bps=bw)


@pytest.fixture
def slow_node_cluster():
    """`slow_node_cluster(num_nodes=4, gpus_per_node=8, slow_node=1, factor=10.0, preset="dgx-a100")`."""
    return make_slow_node_cluster
