"""Write the composition table (`jaxrl.config.composition`): every mechanism's declaration and, for every pair,
whether the trainer's config checks accept it or the key and reason of the refusal.

    scripts/venv.sh python scripts/composition.py                 # -> scripts/results/composition.json,
                                                                  #    configs/all_mechanisms{,_async}.yaml
    scripts/venv.sh python scripts/docs.py                        # -> docs/composition.md

tests/test_composition.py recomputes the table from the code and fails when the JSON differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))     # (bench_harness, when loaded by the tests)

from bench_harness import write_result  # noqa: E402
from jaxrl.config.composition import BASE, MECHANISMS, RECIPES, pair_matrix, recipe_yaml  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "composition.json"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"

OUTPUTS = ("composition.json",)  # its files in scripts/results/ (tests/test_docs.py)


def table() -> dict:
    pairs = pair_matrix()
    return {"base": list(BASE),
            "mechanisms": {n: {"overrides": list(m.overrides), "decides": m.decides, "needs": m.needs,
                               "paper": m.paper} for n, m in MECHANISMS.items()},
            "pairs": [{"a": a, "b": b, "accepted": r is None, "key": None if r is None else r[0],
                       "reason": None if r is None else r[1]} for (a, b), r in pairs.items()],
            "refused": sum(r is not None for r in pairs.values()), "total": len(pairs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    t = table()
    write_result(args.out, t)
    print(f"{t['refused']} of {t['total']} pairs refused -> {args.out}")
    for name in RECIPES:
        (CONFIGS / f"{name}.yaml").write_text(recipe_yaml(name))
        print(f"recipe {name} -> {CONFIGS / name}.yaml")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
