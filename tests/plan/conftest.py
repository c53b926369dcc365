"""Clusters with uneven links, for placement and planner tests."""

import pytest

from helpers.clusters import slow_node_cluster as make_slow_node_cluster


@pytest.fixture
def slow_node_cluster():
    """`slow_node_cluster(num_nodes=4, gpus_per_node=8, slow_node=1, factor=10.0, preset="dgx-a100")`."""
    return make_slow_node_cluster
