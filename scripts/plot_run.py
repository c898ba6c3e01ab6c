"""Training curves of one run as a PNG (the trainer draws RUN_DIR/curves.png itself at the end of a run).

    python scripts/plot_run.py RUN_DIR                  # writes RUN_DIR/curves.png
    python scripts/plot_run.py RUN_DIR --out plot.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxrl.train.curves import moving_average, plot_run  # noqa: F401  (moving_average: re-exported for tests)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.out)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    print(out)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
