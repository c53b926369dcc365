"""Descriptions of the three planner inputs: workload, hardware, layout."""
