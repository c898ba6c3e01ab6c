"""End to end against TRL: the same GRPO run through TRL's `GRPOTrainer` and `python -m jaxrl.train`, one after
the other on this machine, each as a user runs it (a fresh process, figures from its own logs).

    python scripts/bench_e2e.py                          # -> scripts/results/bench_e2e.json (~25 min)
    python scripts/bench_e2e.py --real                   # -> scripts/results/bench_real_e2e.json (~16 min)
    python scripts/bench_e2e.py --quick --out /tmp/e.json   # tiny model, 1 step each (the smoke test)

**The real model** (`--real`, workload "smollm2"; `bench_e2e_workload.build_real`): SmolLM2-135M-Instruct
(float32), the `arith` task's chat prompts and reward, 5 steps of 8 prompts x 4 samples, <= 48 new tokens,
lr 1e-6, clip 0.2 both ways, no KL. jaxrl runs with REAL_ARGS + REAL_TRAIN (below), then once more with the
train section's defaults (`jaxrl_default_train`, warm cache), after the interleaved four. Its entry adds
`limits` (`real_model_limits`): the train phase's fraction of the float32 peak, ideal and as computed (the
padded rows each side runs), and the rollout's seconds per engine step against the decode roofline.

**What both run** (`bench_e2e_workload.build`): one HF directory (Qwen3 weights whose next token is
end-of-sequence with probability 1/66, so responses are long-tailed, capped at `max_new`), the same prompts
(24 words, no chat template) and the same reward (a text function), 7 GRPO steps of 4 prompts x 8 samples,
sampling at temperature 1 (no top-k/top-p), stop at EOS, one on-policy update per batch: token-mean loss,
clip 0.2 / 0.28, no KL, AdamW at a constant lr (small: these weights' lengths drift under larger steps,
and a drifting length would make the two runs' work differ), gradient clip 1.0, float32.

- TRL 1.16 (`scripts/bench_e2e_trl.py`): `transformers.generate` for rollouts, torch on `--threads` threads.
- jaxrl: `python -m jaxrl.train model.hf_path=DIR data.source=prompts.jsonl rewards.fn=... ` on the
  quickstart's defaults otherwise (`JAXRL_ARGS`); its step, rollout and train seconds come from its
  metrics.jsonl. Cold: an empty compilation cache (a user's first run); warm: the same command again.

Order, per workload: jaxrl cold, TRL, jaxrl warm, TRL (interleaved, the machine idle otherwise). Reported per
system: median step seconds over every measured step (step 0 included; jaxrl compiles nothing in a step),
its rollout/train split, the whole process's seconds (start to exit), and the fraction of the machine's
float32 peak (a 2048³ matmul measured at the start) the steps reach:

    FLOPs of a step (ideal counts, not what either system computes: causal attention per sequence, one
    sequence per row, no padding or chunking; the same count for both, from the step's own lengths):
      rollout: prefill 2·N·p + causal attention per prompt + the LM head on its last token (2·E·V),
               decode 2·(N + E·V) + 4·layers·heads·d·context per generated token
      train:   3 x the forward of every prompt and response token (2·N per token, causal attention
               per sequence) + the LM head on response tokens only (6·E·V each)

N: the decoder layers' matmul weights; p: prompt tokens; attention from the step's mean response length
(the sum over sequences of (p + r)² is estimated from the mean r: an underestimate by the length variance).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import bench_e2e_workload as workload  # noqa: E402
from bench_harness import write_result  # noqa: E402

from jaxrl.train.summary import machine  # noqa: E402

DEFAULT_OUT = HERE / "results" / "bench_e2e.json"
REAL_OUT = HERE / "results" / "bench_real_e2e.json"      # --real: the real model's workload
OUTPUTS = ("bench_e2e*.json", "bench_real_e2e*.json")   # the latest runs; runs on other CPUs kept as <name>_<machine>.json
HYPER = dict(steps=7, prompts_per_step=4, group=8, lr=1e-7, temperature=1.0, clip_low=0.2, clip_high=0.28, seed=0)
WORKLOADS = {"3.2m": dict(max_new=512), "58m": dict(max_new=128),
             "smollm2": dict(max_new=48, real=True, hyper=dict(steps=5, prompts_per_step=8, group=4, lr=1e-6,
                                                               clip_high=0.2))}
QUICK = {"tiny": dict(max_new=16)}
# The real model's overrides beside the common ones: chat prompts (40 tokens with the template), an engine sized
# to the batch, and the train phase run as one micro-batch of the whole batch (32 rows x pack_len 96) with
# layer remat: measured 1.4-1.6x faster than the defaults (2048-token micro-batches: 2 of 21 rows, and dots
# remat) on this workload (docs/benchmarks.md, "Real model: the profile"). `default_train` drops the last two.
REAL_PROMPT_LEN = 48      # data.max_prompt_len of the real model's chat prompts (40 tokens with the template)
REAL_ARGS = ("data.chat=true", f"data.max_prompt_len={REAL_PROMPT_LEN}", "engine.max_batch=32", "engine.page_buckets=2",
             "engine.prefill_tokens=1024")
REAL_TRAIN = ("trainer.micro_batch_tokens=3072", "trainer.remat=layer")


def jaxrl_args(paths: dict, run_dir: Path, max_new: int, h: dict, extra: tuple[str, ...] = ()) -> list[str]:
    """The overrides a user gives `python -m jaxrl.train` for this workload (the quickstart's defaults else);
    `extra` (the real model's REAL_ARGS) comes last, so it wins."""
    module, fn = paths["reward"].rsplit(":", 1)
    prompt_len = REAL_PROMPT_LEN if extra else workload.PROMPT_LEN + 8
    return [f"run_dir={run_dir}", f"model.hf_path={paths['model']}", f"data.source={paths['prompts']}",
            "data.chat=false", f"data.max_prompt_len={prompt_len}", f"rewards.fn={Path(module).stem}:{fn}",
            f"algo.group_size={h['group']}", f"algo.prompts_per_step={h['prompts_per_step']}",
            f"algo.clip_low={h['clip_low']}", f"algo.clip_high={h['clip_high']}", "algo.agg=token-mean",
            "algo.kl_coef=0.0", f"rollout.max_new_tokens={max_new}", f"rollout.temperature={h['temperature']}",
            f"engine.max_seq_len={prompt_len + max_new}", "warm_start.steps=0", f"optim.lr={h['lr']}",
            "optim.warmup_steps=0", "optim.weight_decay=0.0", "optim.clip_norm=1.0", f"steps={h['steps']}",
            f"seed={h['seed']}", "save_every=null", "export_hf=false", *extra]


def run_jaxrl(paths: dict, work: Path, max_new: int, h: dict, cache: Path, threads: int,
              extra: tuple[str, ...] = ()) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="jaxrl-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(paths["reward"].rsplit(":", 1)[0]).parent), str(ROOT)]),
               JAXRL_COMPILATION_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-m", "jaxrl.train", *jaxrl_args(paths, run_dir, max_new, h, extra)]
    started = time.time()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"jaxrl run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [dict(step=r["step"], step_s=r["step_seconds"], generate_s=r["rollout_s"], train_s=r["train_s"],
                  completion_len_mean=r["response_len_mean"], completion_len_max=r["response_len_max"],
                  reward_mean=r["reward_mean"], compiles=r["compiles"], engine_steps=r.get("engine_steps"))
             for r in rows]
    warm = next((line for line in p.stdout.splitlines() if "warm-up:" in line), "")
    return dict(steps=steps, process_s=process_s, first_step_done_s=rows[0]["time"] - started,
                warm_up=warm.split("] ", 1)[-1], command=" ".join(cmd[1:]))


def run_trl(paths: dict, work: Path, max_new: int, h: dict, threads: int, chat: bool = False) -> dict:
    out = Path(tempfile.mkdtemp(dir=work, prefix="trl-")) / "trl.json"
    cmd = [sys.executable, str(HERE / "bench_e2e_trl.py"), "--model", str(paths["model"]), "--prompts",
           str(paths["prompts"]), "--reward", paths["reward"], "--out", str(out), "--steps", str(h["steps"]),
           "--prompts-per-step", str(h["prompts_per_step"]), "--group", str(h["group"]), "--max-new", str(max_new),
           "--lr", str(h["lr"]), "--temperature", str(h["temperature"]), "--seed", str(h["seed"]),
           "--clip-low", str(h["clip_low"]), "--clip-high", str(h["clip_high"]), "--threads", str(threads), *(["--chat"] if chat else [])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"TRL run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    res = json.loads(out.read_text())
    return dict(res, process_s=process_s, own_process_s=res.get("process_s"))


def step_flops(cfg, n: int, prompt: int, response_mean: float) -> dict:
    """FLOPs of one step's rollout and train phases (module docstring), n sequences of `prompt` + mean
    `response_mean` tokens."""
    E, V, d, L = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_layers
    layer = E * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * E * cfg.intermediate_size
    N = L * layer
    att = 4 * L * cfg.num_heads * d                      # per (query, key) pair
    p, r = prompt, response_mean
    prefill = n * (2 * N * p + att * p * (p + 1) / 2 + 2 * E * V)
    decode = n * r * (2 * N + 2 * E * V) + n * att * (p * r + r * (r + 1) / 2)
    s = p + r
    train = 3 * n * (2 * N * s + att * s * (s + 1) / 2) + 6 * E * V * n * r
    return dict(rollout=prefill + decode, train=train, total=prefill + decode + train)


def peak_gflops(min_seconds: float = 1.0, repeats: int = 3) -> dict:
    """This machine's float32 matmul rate now (scripts/bench_peak.py's square 2048³ dot, best of `repeats`)."""
    import bench_peak

    g = dict(name="square 2048", model=None, op="square", phase="reference", m=2048, k=2048, n=2048)
    bench_peak.gemm(g, "float32", "native", min_seconds=min_seconds, repeats=1)   # untimed: a process's first
    return bench_peak.gemm(g, "float32", "native", min_seconds=min_seconds, repeats=repeats)   # large dots run slower


def summarise(system: str, runs: list[dict], cfg, h: dict, prompt_len: float = workload.PROMPT_LEN) -> dict:
    steps = [s for r in runs for s in r["steps"]]
    n = h["prompts_per_step"] * h["group"]
    flops = [step_flops(cfg, n, prompt_len, s["completion_len_mean"]) for s in steps]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = dict(step_s=med([s["step_s"] for s in steps]), generate_s=med([s["generate_s"] for s in steps]),
               train_s=med([s["train_s"] for s in steps]),
               completion_len_mean=statistics.fmean(s["completion_len_mean"] for s in steps),
               step_gflop=med([f["total"] for f in flops]) / 1e9,
               achieved_gflops=med([f["total"] / s["step_s"] for f, s in zip(flops, steps)]) / 1e9,
               process_s=[r["process_s"] for r in runs])
    out["train_gflops"] = med([f["train"] / s["train_s"] for f, s in zip(flops, steps)]) / 1e9
    return out


def _matmul_weights(cfg) -> int:
    """N: the decoder layers' matmul weights (the module docstring's N)."""
    E, d = cfg.hidden_size, cfg.head_dim
    return cfg.num_layers * (E * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * E * cfg.intermediate_size)


def train_flops(cfg, rows: int, length: float, head_tokens: float) -> float:
    """3 x the forward of `rows` rows of `length` tokens (causal attention within a row) + the LM head's
    forward and backward on `head_tokens` loss positions."""
    att = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return 3 * rows * (2 * _matmul_weights(cfg) * length + att * length * (length + 1) / 2) \
        + 6 * cfg.hidden_size * cfg.vocab_size * head_tokens


def real_model_limits(entry: dict, cfg, h: dict, peak: dict, prompt: dict) -> dict:
    """The real model's fractions of the machine's limits: the train phase's FLOP/s against the float32
    matmul peak, ideal (`summarise`'s count: the real tokens) and as computed (the padded rows each system
    runs: jaxrl's micro-batch of one row per sequence x pack_len, TRL's batch padded to its longest prompt +
    completion; the LM head on the response tokens for both); the rollout's seconds per engine step (prefill
    included: an upper bound on a decode step) against the decode roofline at the batch's rows, the larger of
    reading the float32 weights once (read bandwidth) and the step's matmuls at the peak."""
    n = h["prompts_per_step"] * h["group"]
    E, V = cfg.hidden_size, cfg.vocab_size
    weight_bytes = 4 * (_matmul_weights(cfg) + E * V)
    context = prompt["mean"] + entry["max_new"] / 2
    decode_flops = n * (2 * _matmul_weights(cfg) + 2 * E * V + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context)
    roofline = max(weight_bytes / (peak["read_gbs"] * 1e9), decode_flops / (peak["gflops"] * 1e9))
    out = dict(peak_gflops=peak["gflops"], read_gbs=peak["read_gbs"], decode_rows=n,
               decode_roofline_ms=roofline * 1e3, weight_read_ms=weight_bytes / peak["read_gbs"] / 1e6,
               decode_matmul_ms=decode_flops / peak["gflops"] / 1e6)
    jaxrl_runs = entry["runs"]["jaxrl_cold"] + entry["runs"]["jaxrl_warm"]
    pack = REAL_PROMPT_LEN + entry["max_new"]
    steps = {"jaxrl": [(pack, s) for r in jaxrl_runs for s in r["steps"]],
             "trl": [(prompt["max"] + s["completion_len_max"], s) for r in entry["runs"]["trl"] for s in r["steps"]]}
    for side, xs in steps.items():
        f = [train_flops(cfg, n, length, n * s["completion_len_mean"]) / s["train_s"] for length, s in xs]
        out[side] = dict(train_ideal_fraction=entry[side]["train_gflops"] / peak["gflops"],
                         train_computed_fraction=statistics.median(f) / 1e9 / peak["gflops"])
    per_step = [s["generate_s"] / s["engine_steps"] for _, s in steps["jaxrl"] if s.get("engine_steps")]
    out["jaxrl"]["rollout_ms_per_engine_step"] = statistics.median(per_step) * 1e3
    out["jaxrl"]["decode_roofline_ratio"] = out["jaxrl"]["rollout_ms_per_engine_step"] / out["decode_roofline_ms"]
    return out


def read_bandwidth_gbs(mib: int = 256, min_seconds: float = 1.0, repeats: int = 3) -> float:
    """This machine's read bandwidth now (scripts/bench_peak.py's `sum` over `mib` MiB, best of `repeats`)."""
    import bench_peak

    return bench_peak.bandwidth(mib, min_seconds, repeats)["read"]


def run_workload(name: str, w: dict, h: dict, work: Path, args, peak: dict | None) -> dict:
    """One workload's runs, interleaved (module docstring), and its summary. The real model adds a last warm
    jaxrl run with the train section's defaults (`jaxrl_default_train`: what REAL_TRAIN changes)."""
    real = w.get("real", False)
    if real:
        built = workload.build_real(work / name)
        paths, cfg = built, built["cfg"]
        prompt = dict(mean=built["prompt_len"], max=built["prompt_len_max"])
    else:
        paths, cfg, prompt = workload.build(work / name, name), workload.MODELS[name], None
    cache = args.cache or work / f"xla-cache-{name}"
    runs = {"jaxrl_cold": [], "jaxrl_warm": [], "trl": [], **({"jaxrl_default_train": []} if real else {})}
    order = ["jaxrl_cold", "trl"] if args.quick else ["jaxrl_cold", "trl", "jaxrl_warm", "trl"]
    order += ["jaxrl_default_train"] if real else []
    for which in order:
        print(f"[bench_e2e] {name}: {which} ...", flush=True)
        if which == "trl":
            runs[which].append(run_trl(paths, work, w["max_new"], h, args.threads, chat=real))
        else:
            extra = (REAL_ARGS + (() if which == "jaxrl_default_train" else REAL_TRAIN)) if real else ()
            runs[which].append(run_jaxrl(paths, work, w["max_new"], h, cache, args.threads, extra))
        r = runs[which][-1]
        print(f"[bench_e2e] {name}: {which}: process {r['process_s']:.1f} s, steps "
              + " ".join(f"{s['step_s']:.2f}" for s in r["steps"]), flush=True)
    plen = prompt["mean"] if real else workload.PROMPT_LEN
    jax_runs = runs["jaxrl_cold"] + runs["jaxrl_warm"]
    entry = dict(max_new=w["max_new"], sequences=h["prompts_per_step"] * h["group"], hyper=h, runs=runs,
                 jaxrl=summarise("jaxrl", jax_runs, cfg, h, plen), trl=summarise("trl", runs["trl"], cfg, h, plen))
    if real:
        entry["model"], entry["prompt_len"] = workload.REAL_MODEL, prompt
        entry["jaxrl_args"] = list(REAL_ARGS + REAL_TRAIN)
        entry["jaxrl_default_train"] = summarise("jaxrl", runs["jaxrl_default_train"], cfg, h, plen)
    entry["step_ratio"] = entry["jaxrl"]["step_s"] / entry["trl"]["step_s"]
    trl_proc = statistics.median(entry["trl"]["process_s"])
    entry["process_ratio_cold"] = runs["jaxrl_cold"][0]["process_s"] / trl_proc
    if runs["jaxrl_warm"]:
        entry["process_ratio_warm"] = runs["jaxrl_warm"][0]["process_s"] / trl_proc
    if peak:
        for side in ("jaxrl", "trl"):
            entry[side]["peak_fraction"] = entry[side]["achieved_gflops"] / peak["gflops"]
        if real:
            entry["limits"] = real_model_limits(entry, cfg, h, peak, prompt)
    print(f"[bench_e2e] {name}: step jaxrl {entry['jaxrl']['step_s']:.2f} s / TRL {entry['trl']['step_s']:.2f} s "
          f"= {entry['step_ratio']:.2f}; process cold {entry['process_ratio_cold']:.2f}", flush=True)
    return entry


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 1 step, one run each (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT.name}, with --real {REAL_OUT.name}")
    ap.add_argument("--workloads", nargs="*", help="names of WORKLOADS to run (default the two toy ones)")
    ap.add_argument("--real", action="store_true", help="the real model's workload (smollm2) alone")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the machine's cores)")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default a temporary one)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="jaxrl's compilation cache (default: an empty one per workload, so the first run is cold)")
    args = ap.parse_args(argv)
    h = dict(HYPER, steps=1, prompts_per_step=2, group=2) if args.quick else HYPER
    names = ["smollm2"] if args.real else (args.workloads or [k for k, w in WORKLOADS.items() if not w.get("real")])
    chosen = QUICK if args.quick else {k: WORKLOADS[k] for k in names}
    args.out = args.out or (REAL_OUT if args.real else DEFAULT_OUT)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    peak = None if args.quick else dict(peak_gflops(), read_gbs=read_bandwidth_gbs())
    result = dict(machine=machine(), hyper=h, loadavg_before=list(os.getloadavg()), peak=peak, workloads={})
    for name, w in chosen.items():
        result["workloads"][name] = run_workload(name, w, dict(h, **w.get("hyper", {})), work, args, result["peak"])
    result["loadavg_after"] = list(os.getloadavg())
    write_result(args.out, result)
    print(f"[bench_e2e] wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
