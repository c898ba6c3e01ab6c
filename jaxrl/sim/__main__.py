"""`python -m jaxrl.sim [--config FILE.yaml] [key=value ...] [--out DIR]`: simulate RL steps of each
mechanism set on a virtual clock and write DIR/summary.json, DIR/table.md, a Gantt PNG per row and the
breakdown bars (with `sweep`: one sub-directory per value and DIR/sweep.png).

    python -m jaxrl.sim                                             # configs/sim/default.yaml
    python -m jaxrl.sim --config configs/sim/rollpacker_14b.yaml --out runs/sim14b
    python -m jaxrl.sim sweep=cluster.gpus 'values=[8, 16, 32, 64]' prompts_per_gpu=16
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxrl.config import CONFIGS_DIR, parse_cli

from .config import SimConfig


def _out_flag(argv: list[str]) -> list[str]:
    """`--out DIR` (the issue's spelling) as the override `out=DIR`."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--out":
            if i + 1 == len(argv):
                raise SystemExit("python -m jaxrl.sim: error: --out needs a directory")
            out.append(f"out={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _out_flag(list(sys.argv[1:] if argv is None else argv))
    cfg = parse_cli(SimConfig, argv, default_yaml=CONFIGS_DIR / "sim" / "default.yaml", prog="python -m jaxrl.sim",
                    flags="[--out DIR]")
    from jaxrl.runtime import request_cpu_devices

    request_cpu_devices(8)          # `sharding.reuse` counts a relayout's weight bytes over one node's devices
    from jaxrl.config.base import ConfigError

    from . import report
    from .simulate import apply_sweep, simulate

    out = Path(cfg.out).absolute()
    title = f"{cfg.model}, {cfg.cluster.gpus} x {cfg.cluster.gpu if cfg.cluster.profile is None else 'profiled'}"
    try:
        if cfg.sweep is None:
            result = simulate(cfg, out=out)
            report.write(result, out, title=title)
            print(report.table(result["rows"]), end="")
        else:
            points = []
            for value in cfg.values:
                point_cfg = apply_sweep(cfg, value)
                sub = out / f"{cfg.sweep}={value}"
                result = simulate(point_cfg, out=sub)
                report.write(result, sub, title=f"{title} ({cfg.sweep}={value})")
                points.append({"value": json.loads(value) if _is_json(value) else value, "rows": result["rows"]})
                print(f"[sim] {cfg.sweep}={value}\n{report.table(result['rows'])}", end="")
            out.mkdir(parents=True, exist_ok=True)
            (out / "summary.json").write_text(json.dumps({"sweep": cfg.sweep, "points": points}, indent=1))
            report.sweep_curve(points, cfg.sweep, out / "sweep.png")
    except ConfigError as e:
        print(f"python -m jaxrl.sim: error: {e}", file=sys.stderr)
        return 2
    print(f"[sim] wrote {out}/summary.json and figures", file=sys.stderr)
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
