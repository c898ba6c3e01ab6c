"""PAT's latency profile of a simulated node: the real profiler run against the cost model.

PAT's controller needs a `Profile` (its predictor interpolates measured points). On real hardware
`python -m jaxrl.rollout.profile` measures one. For a GPU the simulator models analytically, this module
runs the same profiler functions (`profile.batch_grid`, `context_grid`, `fits`, `measure_layout`: the grid,
the prefill of a random-token prefix, the averaged decode steps) on a `SimService` whose clock is the
virtual one, so the profile is what the profiler would measure on that node if the cost model were the
hardware; the predictor then interpolates it, with its own error, as on a real profile. Between layouts:
the migration bandwidth, the weight reshard seconds and the control overhead come from the cost model. The
grid is coarser than on hardware (8 batch sizes, 4 decode steps a point): the model is smooth and exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.rollout.adaptive_tp import Profile
from jaxrl.rollout.planner import candidate_tps
from jaxrl.rollout.profile import batch_grid, context_grid, measure_layout

from .cost import kv_bytes_per_token
from .engine import Clock, SimService


def simulated_profile(cost, model, engine, devices: int, *, decode_steps: int = 4, batches: int = 8,
                      candidates=None, seed: int = 0) -> Profile:
    """The profile of every candidate TP layout of `devices` GPUs (`engine`: an `EngineSection`: page size,
    batch and length limits; instances = devices / tp)."""
    tps = sorted(candidates) if candidates else [t for t in candidate_tps(devices, model) if t <= 8]
    total_batch = engine.max_batch * max(1, devices // engine.tp)
    rng = np.random.default_rng(seed)
    ctx = context_grid(engine.max_seq_len - decode_steps - 2)
    layouts = {}
    for tp in tps:
        clock = Clock()
        svc = SimService(model, cost, clock, devices=devices, tp=tp, instances=devices // tp,
                         lengths=lambda prompt, params: [params.max_new_tokens] * params.n,
                         max_batch=max(1, total_batch // (devices // tp)), max_seq_len=engine.max_seq_len,
                         page_size=engine.page_size, prefill_chunk=engine.prefill_chunk,
                         prefill_tokens=engine.prefill_tokens, overlap=False)
        grid = batch_grid(svc.instances[0].max_batch, batches)
        layouts[tp] = measure_layout(svc, tp, grid, ctx, decode_steps, model.vocab_size, rng, timer=clock,
                                     contention=cost.contention(tp) > 0)
        layouts[tp] = dataclasses.replace(layouts[tp], shapes=None)     # a paged kernel: the paper's Σ-context measure
    reshard = {f"{a}->{b}": cost.reshard_s(model, a, b) for a in tps for b in tps if a != b}
    key = {"device": getattr(cost, "name", "sim"), "devices": devices, "model": model.architecture,
           "decode_steps": decode_steps}
    per_rank_bw = cost.kv_move_s(1.0) and 1.0 / cost.kv_move_s(1.0)
    return Profile(key, layouts, per_rank_bw, reshard, model.num_layers,
                   kv_bytes_per_token(model, cost.dtype_bytes) // model.num_layers, cost.control_s)
