"""`python -m jaxrl.train [--config FILE] [--run-dir DIR] [--profile-steps A:B] [dotted.key=value ...]`.

With no arguments: configs/quickstart.yaml (tiny model, built-in tasks, warm start, then GRPO).
Reads like a table of contents: config -> devices/distributed -> Trainer (data, rollout, rewards,
trainer) -> run. A config error stops here, before JAX initialises or anything compiles.
"""

from __future__ import annotations

import logging
import sys

from jaxrl.config import CONFIGS_DIR, parse_cli
from jaxrl.config.train import TrainConfig


def _flags(argv: list[str]) -> list[str]:
    """Map the friendly flags onto dotted overrides (`--run-dir D` -> `run_dir=D`, `--profile-steps 3:5`
    or `profile_steps=3:5` -> `profile_steps=[3, 5]`)."""
    out, it = [], iter(argv)
    for a in it:
        for flag, key in (("--run-dir", "run_dir"), ("--profile-steps", "profile_steps")):
            if a == flag:
                a = f"{key}={next(it, '')}"
            elif a.startswith(flag + "="):
                a = f"{key}={a.split('=', 1)[1]}"
        key, _, value = a.removeprefix("--").partition("=")
        if key == "profile_steps" and ":" in value:
            start, _, stop = value.partition(":")
            a = f"profile_steps=[{start.strip()}, {stop.strip()}]"
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _flags(list(sys.argv[1:] if argv is None else argv))
    cfg = parse_cli(TrainConfig, argv, default_yaml=CONFIGS_DIR / "quickstart.yaml", prog="python -m jaxrl.train")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge"):      # orbax logs every save at INFO through absl
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxrl.train.distributed import initialize, settings

    _, n_proc, _ = settings(cfg.distributed)
    local = max(cfg.engine.tp * cfg.engine.instances, cfg.train_layout.num_devices // n_proc)
    initialize(cfg.distributed, local)
    from jaxrl.runtime import enable_compilation_cache

    enable_compilation_cache()

    from jaxrl.train.trainer import Trainer

    history = Trainer(cfg).run()
    if history:
        k = max(1, len(history) // 5)
        first = sum(h["reward_mean"] for h in history[:k]) / k
        last = sum(h["reward_mean"] for h in history[-k:]) / k
        print(f"[train] reward mean: first {k} steps {first:.3f} -> last {k} steps {last:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
