"""`python -m jaxrl.train [--config FILE] [--run-dir DIR] [--profile-steps A:B] [--resume=force] [key=value ...]`.

With no arguments: configs/quickstart.yaml (tiny model, built-in tasks, warm start, then GRPO).
Reads like a table of contents: config -> start-up checks (launcher, paths, tokenizer, resume: `preflight`) ->
the run's processes (`distributed.launch`: settings, else mpirun / srun / Kubernetes) and devices -> Trainer (data,
rewards, rollout, trainer) -> run -> `RUN_DIR/summary.json` (`jaxrl.train.summary`: the figures the README's
quickstart table renders) -> where the outputs are.
A config or start-up error stops here with one line (exit 2), before JAX initialises, anything
compiles or the run directory is created.

An existing run directory is resumed when its saved config matches (or differs only in run-length
keys such as `steps`); otherwise the run stops and names the keys that differ. `--resume=force`
continues it with the new values.
"""

from __future__ import annotations

import logging
import sys
import time

from jaxrl.config import CONFIGS_DIR, parse_cli
from jaxrl.config.train import TrainConfig


PROG = "python -m jaxrl.train"


def _error(message: str) -> SystemExit:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return SystemExit(2)


def _flags(argv: list[str]) -> tuple[list[str], str]:
    """Map the friendly flags onto dotted overrides (`--run-dir D` -> `run_dir=D`, `--profile-steps 3:5`
    or `profile_steps=3:5` -> `profile_steps=[3, 5]`) and take out `--resume=MODE` (returned)."""
    out, it, resume = [], iter(argv), "auto"
    for a in it:
        if a == "--resume" or a.startswith("--resume="):
            resume = a.partition("=")[2] if "=" in a else next(it, "")
            continue
        for flag, key in (("--run-dir", "run_dir"), ("--profile-steps", "profile_steps")):
            if a == flag:
                a = f"{key}={next(it, '')}"
            elif a.startswith(flag + "="):
                a = f"{key}={a.split('=', 1)[1]}"
        key, _, value = a.removeprefix("--").partition("=")
        if key == "profile_steps":
            start, colon, stop = value.partition(":")
            if not (colon and start.strip().isdigit() and stop.strip().isdigit()) and value not in ("null", "~"):
                raise _error(f"--profile-steps expects START:STOP with integers 0 <= START < STOP (e.g. 3:5), "
                             f"got {value!r}")
            if colon:
                a = f"profile_steps=[{start.strip()}, {stop.strip()}]"
        out.append(a)
    return out, resume


def local_devices(cfg: TrainConfig, n_proc: int | None = None) -> int:
    """The devices each process of the run uses: the rollout instances' (colocated: shared with its part of
    the train mesh), or StreamRL's generation pool (+ spare groups) beside its part of the train pool; with
    teacher.placement=pool, the teacher's own devices beside them.
    `n_proc`: the run's processes (default: as many as its settings or its launcher say, `distributed.launch`)."""
    from jaxrl.train.distributed import launch

    from jaxrl.config.distill import teacher_devices

    if n_proc is None:
        n_proc = launch(cfg.distributed).processes or 1
    if cfg.placement == "disaggregated":
        gen = cfg.engine.tp * (cfg.stage_balance.max_instances or cfg.engine.instances)
        return gen + cfg.train_layout.num_devices // n_proc
    return max(cfg.engine.tp * cfg.engine.instances, cfg.train_layout.num_devices // n_proc) + teacher_devices(cfg)


def main(argv: list[str] | None = None) -> int:
    start, raw = time.perf_counter(), list(sys.argv[1:] if argv is None else argv)
    argv, resume = _flags(raw)
    cfg = parse_cli(TrainConfig, argv, default_yaml=CONFIGS_DIR / "quickstart.yaml", prog=PROG, examples=(
        "model.hf_path=/ckpt/Qwen3-0.6B data.source=my.jsonl rewards.fn=my_rewards:score run_dir=runs/mine",
        "steps=20 run_dir=runs/try algo.advantage=rloo optim.lr=3e-4 'profile_steps=[3, 5]'",
        "'train_layout={fsdp: 2, tp: 2}' engine.tp=2 engine.instances=2"),
        flags="[--run-dir DIR] [--profile-steps A:B] [--resume=force]")
    from jaxrl.train.preflight import StartupError, preflight
    from jaxrl.train.summary import commit

    code = commit()       # the code this run starts with (summary.json), before anything can change the tree

    try:
        plan = preflight(cfg, resume)
    except StartupError as e:
        raise _error(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge"):      # orbax logs every save at INFO through absl
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxrl.train.distributed import LaunchError, initialize

    try:        # (launched by mpirun, srun, a Kubernetes Indexed Job, or the distributed.* / JAX_* settings)
        initialize(cfg.distributed, lambda n_proc: local_devices(cfg, n_proc))
    except LaunchError as e:
        raise _error(str(e)) from None
    from jaxrl.train.heartbeat import ExitWatch, Heartbeat

    heartbeat = Heartbeat.start(timeout_s=cfg.distributed.heartbeat_timeout, run_dir=cfg.run_dir)  # (None: 1 process)
    from jaxrl.runtime import enable_compilation_cache

    enable_compilation_cache()

    from jaxrl.train.trainer import Trainer

    try:
        trainer = Trainer(cfg, plan)
    except StartupError as e:
        raise _error(str(e)) from None
    if heartbeat is not None:       # several processes: one stuck after its run says where (heartbeat.ExitWatch)
        trainer.exit_watch = ExitWatch()
    from jaxrl.train.rl import RewardsFailedError

    try:
        trainer.run()
    except RewardsFailedError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except BaseException:
        if heartbeat is not None:    # another process died (a collective failed here), or this one failed
            heartbeat.after_failure()
        raise
    if heartbeat is not None:
        heartbeat.stop()             # done: the others are told this process finished, not lost
    if trainer.is_main:
        from jaxrl.train.metrics import run_summary
        from jaxrl.train.summary import write_summary

        write_summary(cfg.run_dir, time.perf_counter() - start, resumed=plan.resume, argv=raw, code=code)
        print("\n".join(run_summary(cfg.run_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
