"""Simulate every row of a `SimConfig` (and every point of its sweep): the table behind summary.json.

    result = simulate(cfg, out=Path("runs/sim"))     # {"rows": [...], "workload": {...}, "cost": ...}

The baseline row runs first (every row's `speedup_vs_baseline` is the baseline's seconds per trained prompt
over the row's). A disaggregated row splits the GPUs with StreamRL's `balance.best_split`, fed the
baseline's measured stage times scaled by device count (`balance.scaled`), or with `split=simulated` its own
rollout simulated on each candidate generation pool (`balance.searched_split`). PAT needs a latency profile:
with the analytic cost model the profiler runs against it (`profile.simulated_profile`), written to
`out/pat_profile.json`; with a measured profile (`cluster.profile`) that file is used.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from jaxrl.config.base import ConfigError
from jaxrl.config.loading import load_config, to_yaml
from jaxrl.rollout.adaptive_tp import Profile
from jaxrl.train.balance import best_split, scaled, searched_split
from models import preset

from .config import SimConfig, mechanisms_of
from .cost import AnalyticCost, ProfileCost, StageRates
from .hardware import gpu
from .profile import simulated_profile
from .records import busy, summarize
from .run import RowSim


def build_cost(cfg: SimConfig, model):
    c = cfg.cluster
    if c.profile is None:
        return AnalyticCost(model, gpu(c.gpu), dtype_bytes=c.dtype_bytes, num_pages=cfg.engine.num_pages,
                            kv_bytes_per_device=cfg.engine.kv_bytes_per_device)
    path = Path(c.profile).expanduser()
    if not path.is_file():
        raise ConfigError("cluster.profile", f"{path.absolute()}: no such file (python -m jaxrl.rollout.profile writes one)")
    return ProfileCost(Profile.load(path), model, dtype_bytes=c.dtype_bytes, num_pages=cfg.engine.num_pages,
                       kv_bytes_per_device=cfg.engine.kv_bytes_per_device,
                       stages=StageRates(c.train_s_per_token, c.forward_s_per_token, c.sync_s))


def _pat_profile(cfg: SimConfig, model, cost, out: Path) -> str:
    if cfg.cluster.profile is not None:
        return str(Path(cfg.cluster.profile).expanduser())
    node = min(8, cfg.cluster.gpus)
    prof = simulated_profile(cost, model, cfg.engine, node, candidates=cfg.engine.adaptive_tp.candidates or None)
    prof.key["devices"] = None                 # a TP group's latency: valid for a pool of any size
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pat_profile.json"
    prof.save(path)
    return str(path)


def simulate(cfg: SimConfig, *, out: Path, progress: bool = True) -> dict:
    """Every row's summary (see the module docstring); with `progress` a line per simulated step on stderr."""
    model = preset(cfg.model)
    cost = build_cost(cfg, model)
    workload = cfg.workload.build(cfg.rollout.max_new_tokens)
    rows = list(dict.fromkeys(("baseline",) + tuple(cfg.rows)))
    profile = _pat_profile(cfg, model, cost, out) if any("pat" in mechanisms_of(r) for r in rows) else None
    if cfg.prompts_per_gpu is not None:
        cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, prompts_per_step=cfg.prompts_per_gpu * cfg.cluster.gpus))
    results, base, timelines, records_by_row, splits = [], None, {}, {}, {}
    for row in rows:
        t0 = time.perf_counter()
        split = None
        m = set(mechanisms_of(row))
        if m & {"disaggregated", "async_steps"}:
            split = _split(cfg, base, row, lambda x, row=row: _rollout_s(cfg, row, cost, workload, profile, x, progress),
                           splits)
        sim = RowSim(cfg, row, cost, workload, profile=profile, split=split)

        def show(rec, row=row):
            if progress:
                print(f"[sim] {row:>14} step {rec.step:3d} {rec.kind:5s} {rec.step_s:9.2f} s (rollout {rec.rollout_s:8.2f} s, "
                      f"{rec.engine_steps} engine steps, {rec.preemptions} preemptions, {rec.switches} switches)",
                      file=sys.stderr, flush=True)

        records = sim.run(show)
        summary = summarize(records, mechanisms_of(row)) | {"row": row, "gen_gpus": sim.gen_gpus,
                                                            "train_gpus": sim.train_gpus,
                                                            "wall_s": time.perf_counter() - t0}
        summary |= busy(sim.timeline, sim.gen_gpus, sim.train_gpus, summary["seconds"], sim.disagg)
        if split is not None and cfg.split == "simulated":
            summary["split_rollout_s"] = {str(x): t for x, t in splits[_split_key(row)][2].items()}
        if row == "baseline":
            base = summary
        summary["speedup_vs_baseline"] = base["s_per_prompt"] / summary["s_per_prompt"] if base else 1.0
        results.append(summary)
        timelines[row] = sim.timeline
        records_by_row[row] = [dataclasses.asdict(r) for r in records]
    return {"rows": results, "workload": workload.summary(), "cost": cost.name, "model": cfg.model,
            "gpus": cfg.cluster.gpus, "steps": cfg.steps, "prompts_per_step": cfg.algo.prompts_per_step,
            "group_size": cfg.algo.group_size, "timelines": timelines, "steps_by_row": records_by_row}


def _split(cfg: SimConfig, base: dict | None, row: str, rollout_s, cache: dict) -> tuple[int, int]:
    """StreamRL's static split of the cluster: max(T_g(x), T_t(y)) smallest, T_t the baseline's training
    (forwards + update) scaled by GPU count; T_g the baseline's generation (rollout + reward) scaled the same
    way (`split=scaled`), or `rollout_s(x)`, the row's rollout simulated on x GPUs (`split=simulated`, found by
    `balance.searched_split`; one search per row's generation mechanisms, kept in `cache`)."""
    G, tp = cfg.cluster.gpus, cfg.engine.tp
    if base is None:
        raise ValueError("the baseline row runs first")
    t_train = scaled(base["forward_s"] + base["train_s"], G)
    sizes = [s for s in range(tp, G, tp)]
    if cfg.split == "scaled":
        x, y, _ = best_split(G, tp, sizes, scaled(base["rollout_s"] + base["reward_s"], G), t_train)
        return x, y
    key = _split_key(row)
    if key not in cache:
        x, y, _, seen = searched_split(G, tp, sizes, rollout_s, t_train)
        cache[key] = (x, y, seen)
    return cache[key][:2]


def _split_key(row: str) -> tuple[str, ...]:
    """What a row's first rollout depends on: its mechanisms but async_steps (no older weights at step 0)."""
    return tuple(sorted(set(mechanisms_of(row)) - {"async_steps"}))


def _rollout_s(cfg: SimConfig, row: str, cost, workload, profile, x: int, progress: bool) -> float:
    """T_g(x) for `split=simulated`: the row's first rollout (and the rewards it waits for), simulated with x GPUs
    generating; StreamRL models generation time as a function of its resources, here by the same engine."""
    sim = RowSim(dataclasses.replace(cfg, steps=1), row, cost, workload, profile=profile,
                 split=(x, cfg.cluster.gpus - x))
    rec = sim.step(0)
    t = rec.rollout_s + rec.reward_s
    if progress:
        print(f"[sim] {row:>14} split: rollout on {x} of {cfg.cluster.gpus} GPUs {t:.2f} s ({rec.engine_steps} "
              f"engine steps, {rec.preemptions} preemptions)", file=sys.stderr, flush=True)
    return t


def apply_sweep(cfg: SimConfig, value: str) -> SimConfig:
    """`cfg` with its sweep key set to `value` (read by the key's type, as on the command line)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(to_yaml(dataclasses.replace(cfg, sweep=None, values=())))
    try:
        return load_config(SimConfig, ["--config", f.name, f"{cfg.sweep}={value}"])
    finally:
        Path(f.name).unlink()
