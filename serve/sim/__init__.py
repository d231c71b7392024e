"""Policies on a cost profile instead of a GPU: the simulator (the engine's own scheduler, block
manager and step planner, with the profile's step and switch times), policy sweeps over generated
workloads (`evaluate`) and their tables and plots (`report`). Torch-free, like the parts it drives.
"""

from .evaluate import METRIC_COLUMNS, EvalJob, aggregate, points, run_sweeps
from .simulate import SimConfig, SimResult, StepEvent, SwitchEvent, simulate

__all__ = ["SimConfig", "SimResult", "StepEvent", "SwitchEvent", "simulate", "EvalJob", "METRIC_COLUMNS", "aggregate",
           "points", "run_sweeps"]
