"""The cluster simulator: the project's own schedulers and decision functions on a virtual clock.

    python -m jaxrl.sim --config configs/sim/default.yaml --out runs/sim

`engine.SimService` is the rollout engine with a simulated executor (the real `Scheduler`, `Instance` loop
and `RolloutService`); `cost` times its work (a measured PAT profile, or an analytic GPU node from
`hardware`); `workload` gives the response lengths; `run.RowSim` runs RL steps of one mechanism set with
the trainer's own functions (`config.train_config` makes each row a real `TrainConfig`; `records` holds a
step's record and a row's totals); `simulate` compares the rows; `report` writes the tables and figures.
"""

from .config import MECHANISMS, ROWS, SimConfig
from .cost import AnalyticCost, ProfileCost
from .engine import Clock, SimService
from .simulate import simulate
from .workload import Workload

__all__ = ["AnalyticCost", "Clock", "MECHANISMS", "ProfileCost", "ROWS", "SimConfig", "SimService", "Workload",
           "simulate"]
