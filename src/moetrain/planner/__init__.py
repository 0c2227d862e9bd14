"""Planner: a validated training simulator and parallel-strategy search (numpy only, torch-free)."""
