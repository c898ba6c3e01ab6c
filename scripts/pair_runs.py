"""The composition table's accepted pairs, run: 2 RL steps of the tiny model on a 4-device train layout.

    scripts/venv.sh python scripts/pair_runs.py                  # every accepted pair (about 100 runs: long)
    scripts/venv.sh python scripts/pair_runs.py pat skew         # the pairs that include any of these mechanisms
    scripts/venv.sh python scripts/pair_runs.py --within pat scale_up   # only pairs of these (here: one)
    scripts/venv.sh python scripts/docs.py                       # then re-render docs/composition.md

`scripts/composition.py` says which pairs the config accepts; this runs each of them, as a user would:
`python -m jaxrl.train` with the pair's declared overrides (`jaxrl.config.composition.overrides`: the
quickstart with `engine.instances=4 train_layout.fsdp=4`) at the tests' tiny size (`tests.train_runs.TINY`,
2 RL steps, no checkpoints, no export). A pair with `two_processes` runs on 2 processes
(`scripts/launch_local.sh 2`, 2 instances each); PAT gets a synthetic latency profile that makes it switch
(`tests.pat_profiles.forcing_profile`). Each run is a fresh process with the devices it needs.

It writes scripts/results/pair_runs.json: per pair, whether the run finished, its seconds and, when it failed,
the last lines it printed (a pair with carry_partial must also have resumed carried responses in its long
round, `tail/carried_samples`). What it does not check: that the pair's result is right (the tests compare the
pairs they cover with their synchronous twins); here a pair only has to run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402

from jaxrl.config.composition import MECHANISMS, overrides, pair_matrix  # noqa: E402
from jaxrl.train.summary import machine  # noqa: E402
from jaxrl.testing import TINY, forcing_profile  # noqa: E402

OUT = ROOT / "scripts" / "results" / "pair_runs.json"
OUTPUTS = ("pair_runs.json",)   # its files in scripts/results/ (tests/test_docs.py)
RUN = ["steps=2", "save_every=null", "export_hf=false"]


def command(a: str, b: str, tmp: Path) -> list[str]:
    """The pair's command line (run directory and PAT profile under `tmp`)."""
    args = overrides(a, b)
    two = "two_processes" in (a, b)
    if two:                                   # each process: 2 of the 4 instances, 2 of the 4 train devices
        args = [x for x in args if not x.startswith("engine.instances=")] + ["engine.instances=2"]
    if "pat" in (a, b):
        prof = forcing_profile("large")
        prof.key["devices"] = 2 if two else 4
        prof.save(tmp / "prof.json")
        args = [x for x in args if not x.startswith("engine.adaptive_tp.profile=")] + [
            f"engine.adaptive_tp.profile={tmp / 'prof.json'}"]
    train = [sys.executable, "-m", "jaxrl.train", f"run_dir={tmp / 'run'}", *TINY, *args, *RUN]
    return [str(ROOT / "scripts" / "launch_local.sh"), "2", *train] if two else train


def run_pair(a: str, b: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"pair_{a}_{b}_") as tmp:
        cmd = command(a, b, Path(tmp))
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            code, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:       # (its output may come back as bytes)
            got = e.stdout or ""
            code, out = "timeout", got.decode(errors="replace") if isinstance(got, bytes) else got
        seconds = time.perf_counter() - t0
        rows = Path(tmp) / "run" / "metrics.jsonl"
        rows = [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []
    steps = sum("reward_mean" in r for r in rows)          # RL steps (a final evaluation is a row of its own)
    evals = sum("eval/accuracy" in r for r in rows)
    carried = sum(r.get("tail/carried_samples", 0) for r in rows)
    long_rounds = sum(r.get("tail/long_round", 0) for r in rows)
    # carry_partial's declared η_p = 2 defers a whole batch in step 0, so step 1 is a long round (unless dynamic
    # sampling dropped the deferred groups) that must resume some of their responses
    ok = code == 0 and steps == 2 and (carried > 0 or not long_rounds or "carry_partial" not in (a, b))
    ok = ok and ("eval" not in (a, b) or evals == 3)         # eval.every=1: before steps 0 and 1, after the last
    return {"a": a, "b": b, "ran": ok, "exit": code, "steps": steps, "seconds": round(seconds, 1),
            **({"long_rounds": long_rounds, "carried_samples": carried} if "carry_partial" in (a, b) else {}),
            **({"evaluations": evals} if "eval" in (a, b) else {}),
            "command": " ".join(["python -m jaxrl.train", *[w for w in cmd if "=" in w and "run_dir=" not in w]]),
            "error": None if ok else "\n".join(out.strip().splitlines()[-15:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("only", nargs="*", help="run only the pairs that include one of these mechanisms")
    ap.add_argument("--within", action="store_true", help="only the pairs whose two mechanisms are both named")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args(argv)
    bad = [m for m in args.only if m not in MECHANISMS]
    if bad:
        raise SystemExit(f"unknown mechanism(s) {bad}; known: {list(MECHANISMS)}")
    accepted = [(a, b) for (a, b), refused in pair_matrix().items() if refused is None]
    named = (lambda a, b: a in args.only and b in args.only) if args.within else \
        (lambda a, b: a in args.only or b in args.only)
    todo = [(a, b) for a, b in accepted if not args.only or named(a, b)]
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    done = {(r["a"], r["b"]): r for r in old.get("pairs", []) if (r["a"], r["b"]) in set(accepted)}
    for i, (a, b) in enumerate(todo, 1):
        r = run_pair(a, b, args.timeout)
        done[a, b] = r
        print(f"[{i}/{len(todo)}] {a} x {b}: {'ran' if r['ran'] else 'FAILED (' + str(r['exit']) + ')'} "
              f"{r['seconds']:.0f} s", flush=True)
        if not r["ran"]:
            print("    " + r["error"].replace("\n", "\n    "), flush=True)
        pairs = [done[p] for p in accepted if p in done]
        write_result(OUT, {"accepted": len(accepted), "run": len(pairs), "ran": sum(p["ran"] for p in pairs),
                           "steps": 2, "train_layout": "fsdp=4", "pairs": pairs, "machine": machine()})
    print(f"-> {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
