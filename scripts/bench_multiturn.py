"""Multi-turn rollouts: continuing a live sequence (`RolloutService.add_tokens`) vs re-prefilling the whole
conversation every turn, side by side in one run on one warmed engine.

    python scripts/bench_multiturn.py --out scripts/results/bench_multiturn.json     # ~5 min on 2 cores
    python scripts/bench_multiturn.py --out /tmp/m.json --quick                       # smoke sizes

`--trajectories` greedy trajectories, each a `--prompt`-token prompt, then `turns` turns of exactly `--gen`
sampled tokens (`turn_max_tokens`) with a `--obs`-token observation (a tool's answer, fixed random tokens)
appended after every turn but the last. Two ways to run the same conversations:
  * continuation — one request per trajectory; after each turn its observation is appended to the live
    sequence, whose KV is kept: each turn prefills only the observation;
  * re-prefill  — what a trainer driving an external engine does: every turn is a fresh request whose prompt is
    the whole conversation so far, prefilled from position 0.
Both produce the same tokens (checked: `tokens_identical`). Reported per turn count, per mode: prefilled
positions (the engine's counter), decode steps, wall seconds (median of `--repeats`, the modes interleaved).
The prefill saving is exact arithmetic the engine must meet: re-prefill repeats every earlier turn's context.
Model: bench_rollout's hidden-512, 8-layer Qwen3 shape (random weights, float32); tiny with --quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

from bench_harness import interleaved, write_result  # noqa: E402

MODES = ("continuation", "reprefill")
OUTPUTS = ("bench_multiturn.json",)  # its files in scripts/results/ (tests/test_docs.py)


def observations(n: int, turns: int, length: int, vocab: int, seed: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(10, vocab, length).tolist() for _ in range(turns - 1)] for _ in range(n)]


def continuation(svc, prompts, obs, params) -> tuple[list[list[int]], int]:
    """Each trajectory one live request; every observation appended to it. Returns each trajectory's tokens
    after its prompt and the engine steps taken."""
    rids = [svc.add(p, params)[0] for p in prompts]
    index = {r: i for i, r in enumerate(rids)}
    turn, out, steps = [0] * len(prompts), [None] * len(prompts), 0
    while svc.has_work():
        steps += 1
        for c in svc.step():
            i = index[c.request_id]
            if c.finish_reason == "turn" and turn[i] < len(obs[i]):
                svc.add_tokens(c.request_id, obs[i][turn[i]])
                turn[i] += 1
                continue
            if c.finish_reason == "turn":
                svc.finish(c.request_id)
            out[i] = list(c.tokens)
    return out, steps


def reprefill(svc, prompts, obs, params, turns: int) -> tuple[list[list[int]], int]:
    """Every turn a fresh request with the whole conversation as its prompt (its budget what is left)."""
    conv, steps = [[] for _ in prompts], 0
    for t in range(turns):
        rids = [svc.add(p + c, dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(c)))[0]
                for p, c in zip(prompts, conv)]
        got = {}
        while svc.has_work():
            steps += 1
            for c in svc.step():
                got[c.request_id] = c
                if c.finish_reason == "turn":
                    svc.finish(c.request_id)
        for i, r in enumerate(rids):
            conv[i] += got[r].tokens + (obs[i][t] if t < turns - 1 else [])
    return conv, steps


def run(args) -> dict:
    import jax

    from bench_rollout import bench_config
    from jaxrl.rollout import RolloutService, SamplingParams
    from jaxrl.train.summary import machine
    from models import init

    cfg = bench_config(args.quick)
    weights = init(jax.random.key(0), cfg)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(10, cfg.vocab_size, args.prompt).tolist() for _ in range(args.trajectories)]
    longest = args.prompt + max(args.turns) * args.gen + (max(args.turns) - 1) * args.obs
    page = 16
    svc = RolloutService(cfg, weights, page_size=page, max_batch=args.trajectories, max_seq_len=longest,
                         num_pages=args.trajectories * -(-longest // page) + 1)
    out = {"model": "quick" if args.quick else "hidden-512 x 8 layers (58M, qwen3 shape)",
           "trajectories": args.trajectories, "prompt": args.prompt, "gen": args.gen, "obs": args.obs,
           "repeats": args.repeats, "seed": args.seed, "machine": machine(), "jax": jax.__version__, "turns": {}}
    for turns in args.turns:
        # max_new_tokens = the whole trajectory after the prompt (observations included)
        params = SamplingParams(max_new_tokens=turns * args.gen + (turns - 1) * args.obs, temperature=0.0,
                                turn_max_tokens=args.gen)
        svc.warm([params])
        obs = observations(args.trajectories, turns, args.obs, cfg.vocab_size, args.seed + turns)
        def mode(m: str, before: dict) -> dict:
            """One mode's trajectories: their tokens, engine steps, and the engine's counters since `before`
            (the counter reads are timed with it: a few dict look-ups)."""
            tokens, steps = (continuation(svc, prompts, obs, params) if m == "continuation"
                             else reprefill(svc, prompts, obs, params, turns))
            after = svc.stats()[0]
            return {"tokens": tokens, "engine_steps": steps,
                    "prefilled": after["prefilled_tokens"] - before["prefilled_tokens"],
                    "generated": after["generated_tokens"] - before["generated_tokens"]}

        runs = interleaved(                              # round 0 compiles what warm() does not: discarded
            {m: functools.partial(mode, m) for m in MODES}, args.repeats, warmup=1,
            prepare={m: lambda: (svc.stats()[0],) for m in MODES},
            on_call=lambda m, r, s, got: print(f"[{turns} turns] {m} round {r}: {got['engine_steps']} engine steps, "
                                               f"{s:.2f} s", flush=True))
        last = {m: runs.results[m][-1]["tokens"] for m in MODES}
        row = {"tokens_identical": last["continuation"] == last["reprefill"]}
        for m in MODES:
            secs = runs.seconds[m]
            row[m] = {**{k: runs.results[m][0][k] for k in ("prefilled", "generated", "engine_steps")},
                      "seconds_median": float(np.median(secs)), "seconds": secs}
        c, f = row["continuation"], row["reprefill"]
        row["prefill_ratio"] = f["prefilled"] / c["prefilled"]
        row["speedup"] = f["seconds_median"] / c["seconds_median"]
        # what each mode must prefill: continuation each prompt once and each observation (minus the position
        # fed to decode); re-prefill every turn's whole conversation
        n, p, g, o = args.trajectories, args.prompt, args.gen, args.obs
        row["prefill_expected"] = {"continuation": n * (p - 1 + (turns - 1) * o),
                                   "reprefill": n * sum(p + t * (g + o) - 1 for t in range(turns))}
        out["turns"][str(turns)] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_multiturn.json"))
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (a smoke test)")
    ap.add_argument("--trajectories", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=None, help="tokens sampled per turn")
    ap.add_argument("--obs", type=int, default=None, help="observation tokens appended after a turn")
    ap.add_argument("--turns", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    q = args.quick
    args.trajectories = args.trajectories or (2 if q else 8)
    args.prompt = args.prompt or (8 if q else 64)
    args.gen = args.gen or (3 if q else 16)
    args.obs = args.obs or (4 if q else 32)
    args.turns = args.turns or ([2, 3] if q else [2, 4, 8])
    args.repeats = args.repeats or (1 if q else 3)
    out = run(args)
    path = write_result(args.out, out)
    for t, row in out["turns"].items():
        print(f"{t} turns: re-prefill / continuation = {row['prefill_ratio']:.2f}x prefilled positions, "
              f"{row['speedup']:.2f}x wall; tokens identical: {row['tokens_identical']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
