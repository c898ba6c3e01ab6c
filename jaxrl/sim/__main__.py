"""`python -m jaxrl.sim [--config FILE.yaml] [key=value ...] [--out DIR]`: simulate RL steps of each
mechanism set on a virtual clock and write DIR/summary.json, DIR/table.md, a Gantt PNG per row and the
breakdown bars (with `sweep`: one sub-directory per value and DIR/sweep.png).

    python -m jaxrl.sim                                             # configs/sim/default.yaml
    python -m jaxrl.sim --config configs/sim/rollpacker_qwen25_14b_h800.yaml --out runs/sim14b
    python -m jaxrl.sim sweep=cluster.gpus 'values=[8, 16, 32, 64]' prompts_per_gpu=16
    python -m jaxrl.sim --config ... sweep=... 'values=[...]' --resume   # keep the points already simulated

A sweep writes DIR/summary.json after every point and each point's config (DIR/KEY=VALUE/config.yaml);
with `--resume`, a point whose directory holds a summary made from the same config is read, not re-run
(a long sweep that was interrupted, or one extended by more values, loses nothing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxrl.config import CONFIGS_DIR, parse_cli
from jaxrl.config.base import ConfigError
from jaxrl.config.loading import to_yaml
from jaxrl.runtime import request_cpu_devices

from . import report
from .config import SimConfig
from .simulate import apply_sweep, simulate


def _out_flag(argv: list[str]) -> tuple[list[str], bool]:
    """`--out DIR` (the issue's spelling) as the override `out=DIR`; `--resume` taken out."""
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
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
    return out, resume


def main(argv: list[str] | None = None) -> int:
    argv, resume = _out_flag(list(sys.argv[1:] if argv is None else argv))
    cfg = parse_cli(SimConfig, argv, default_yaml=CONFIGS_DIR / "sim" / "default.yaml", prog="python -m jaxrl.sim",
                    flags="[--out DIR] [--resume]")
    request_cpu_devices(8)          # `sharding.reuse` counts a relayout's weight bytes over one node's devices
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
                text = to_yaml(point_cfg)
                if resume and (sub / "summary.json").exists() and (sub / "config.yaml").exists() \
                        and (sub / "config.yaml").read_text() == text:
                    result = json.loads((sub / "summary.json").read_text())
                    print(f"[sim] {cfg.sweep}={value}: read from {sub} (--resume)", file=sys.stderr)
                else:
                    result = simulate(point_cfg, out=sub)
                    report.write(result, sub, title=f"{title} ({cfg.sweep}={value})")
                    (sub / "config.yaml").write_text(text)
                points.append({"value": json.loads(value) if _is_json(value) else value, "rows": result["rows"]})
                print(f"[sim] {cfg.sweep}={value}\n{report.table(result['rows'])}", end="")
                out.mkdir(parents=True, exist_ok=True)
                (out / "summary.json").write_text(json.dumps({"sweep": cfg.sweep, "points": points,
                                                              "complete": len(points) == len(cfg.values)}, indent=1))
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
