"""moetrain: train large mixture-of-experts models.

configs → planner (simulate, plan) → runtime (train) → profiles → planner calibration.
"""

__version__ = "0.1.0"
