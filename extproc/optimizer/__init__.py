"""The GPU optimizer: request traces + per-GPU profiles → the cheapest replica mix, served to autoscalers."""

from extproc.optimizer.solver import CellSplit, Demand, Plan, PlanError, solve

__all__ = ["CellSplit", "Demand", "Plan", "PlanError", "solve"]
