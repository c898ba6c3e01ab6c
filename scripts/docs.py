"""Render the docs' measured tables from the JSON files in scripts/results/, and serve the docs with MkDocs.

    scripts/venv.sh python scripts/docs.py            # rewrite every rendered block in README.md and docs/
    scripts/venv.sh python scripts/docs.py --check    # exit 1, naming each page that differs from its JSON
    scripts/venv.sh mkdocs serve                      # the site (mkdocs.yml; this file is its hook)

A rendered block is everything between `<!-- render:NAME -->` and `<!-- /render:NAME -->` in a page; NAME
is one of `RENDERERS` below, each a function of the JSON files a benchmark script wrote. A block ends with
the machine that measured it, from the JSON's `provenance` record (`scripts/bench_harness.py`) or its own
`machine` / `environment` fields, or "machine: not recorded" where the JSON has none (tests/test_docs.py fails
on that, but for the JSONs it lists as measured before the harness). Never edit a block by hand: re-run the
benchmark (its command is in the page), then this script. `tests/test_docs.py` fails when a page differs from
what its JSON renders to.

As a MkDocs hook (`hooks:` in mkdocs.yml) this module serves README.md as the site's home page and the
figures in scripts/results/ at `results/`, and rewrites the pages' repository-relative links
(`../scripts/results/X.png` in docs/, `docs/X.md` and `scripts/results/X.png` in README.md) to those
locations. The figures therefore have one copy, in scripts/results/, and the links also work on GitHub.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "scripts" / "results"
DOCS = ROOT / "docs"
MARK = re.compile(r"(<!-- render:(?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /render:(?P=name) -->)", re.S)

RENDERERS: dict[str, Callable[[], str]] = {}


def renders(name: str):
    def register(fn):
        RENDERERS[name] = fn
        return fn
    return register


# ----------------------------------------------------------------------------------------------- helpers

def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _load_module(name: str, path: Path):
    """Import a file by path, without running its package's __init__ (jaxrl.sim's imports JAX)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def machine_record(d: dict):
    """The machine a result records: its provenance record's (`scripts/bench_harness.py`), else its own
    `machine` (or `environment`) fields; None where it has none."""
    return (d.get("provenance") or {}).get("machine") or d.get("machine", d.get("environment"))


def machine(d: dict) -> str:
    """Which machine measured `d` (`machine_record`), else "not recorded"."""
    m = machine_record(d)
    if isinstance(m, str):
        return m
    parts = []
    if isinstance(m, dict):
        cores = m.get("cores") or m.get("cpus") or m.get("cpu_cores")
        parts = [str(m[k]) for k in ("cpu", "platform") if m.get(k)] + ([f"{cores} cores"] if cores else [])
    if parts:
        return ", ".join(parts)
    backend = d.get("backend") or d.get("device")
    return "not recorded" + (f" (backend: {backend})" if backend else "")


def footer(*files: str, who: str | None = None) -> str:
    srcs = ", ".join(f"`scripts/results/{f}`" for f in files)
    who = who if who is not None else "; ".join(dict.fromkeys(machine(load(f)) for f in files))
    return f"*Machine: {who}. Rendered from {srcs} by `scripts/docs.py`.*"


def table(head: list[str], align: str, rows: list[list]) -> str:
    """A Markdown table; `align` has one character per column: l (left) or r (right)."""
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join(["| " + " | ".join(head) + " |", sep] + ["| " + " | ".join(str(c) for c in r) + " |"
                                                             for r in rows])


def spaced(n: int) -> str:
    return f"{n:,}".replace(",", " ")


def pct(x: float, digits: int = 0) -> str:
    return f"{100 * x:.{digits}f}%"


# ------------------------------------------------------------------------------------------- quickstart

QUICKSTART = "quickstart.json"


@renders("quickstart")
def quickstart() -> str:
    if not (RESULTS / QUICKSTART).exists():
        return ("**Not measured on this release yet:** run `scripts/venv.sh python scripts/quickstart_results.py "
                "quickstart` (it runs `python -m jaxrl.train` and copies `runs/quickstart/summary.json` to "
                "`scripts/results/quickstart.json`), then `scripts/venv.sh python scripts/docs.py`. (The last "
                "hand-typed figures are in the [changelog](docs/CHANGELOG.md).)")
    q = load(QUICKSTART)
    k, n = q["window_steps"], q["steps"]
    wall = q["wall_s"]
    wall_s = f"{int(wall // 60)} min {wall % 60:.0f} s" if wall is not None else "not recorded"
    f3 = lambda x: "–" if x is None else f"{x:.3f}"                     # noqa: E731
    f2 = lambda x: "–" if x is None else f"{x:.2f}"                     # noqa: E731
    gain = ("" if None in (q["reward_mean_first"], q["reward_mean_last"])
            else f" ({q['reward_mean_last'] - q['reward_mean_first']:+.2f})")
    rows = [
        [f"wall time, `{q['command']}` (compile, warm start, {n} RL steps, checkpoints, HF export; not the "
         "venv check)" + (" — last invocation of a resumed run" if q.get("resumed") else ""), wall_s],
        [f"RL step, median (rollout {f2(q['rollout_s_median'])} s with rewards scored meanwhile + update "
         f"{f2(q['train_s_median'])} s)", f"{f2(q['step_seconds_median'])} s"],
        [f"mean reward, first 20% of RL steps ({k}) → last 20% ({k})",
         f"{f3(q['reward_mean_first'])} → {f3(q['reward_mean_last'])}{gain}"],
        ["pass rate (exact answers), first 20% → last 20%", f"{f3(q['pass_rate_first'])} → {f3(q['pass_rate_last'])}"],
        ["response length, mean / max over the run",
         f"{q['response_len_mean']:.1f} / {q['response_len_max']:.0f} tokens" if q["response_len_mean"] is not None
         else "–"],
        ["XLA compilations after RL step 0", f"{q.get('compiles_after_step0', 0):.0f}"],
    ]
    return table(["figure", "value"], "ll", rows) + "\n\n" + footer(QUICKSTART)


@renders("quickstart-output")
def quickstart_output() -> str:
    """The end of the quickstart's console output, its first line from the same summary as the table."""
    q = load(QUICKSTART)
    k, first, last = q["window_steps"], q["first_step"], q["last_step"]
    run = "/home/me/jaxrl/runs/quickstart"
    lines = [f"[train] reward mean: first {k} steps {q['reward_mean_first']:.3f} -> last {k} steps "
             f"{q['reward_mean_last']:.3f} (steps {first}-{last})",
             f"[train] outputs in {run}:",
             f"[train]   metrics.jsonl          per-step metrics ({q['steps']} steps)",
             "[train]   curves.png             reward and response-length curves",
             "[train]   config.yaml            the config this run started with",
             f"[train]   checkpoints/{q['steps']}        newest checkpoint; the same command resumes from it",
             f"[train]   hf                     Hugging Face checkpoint: python -m jaxrl.generate model.hf_path={run}/hf",
             f"[train]   TensorBoard            tensorboard --logdir {run}/tb"]
    return "```text\n" + "\n".join(lines) + "\n```"


PPO_QUICKSTART = "ppo_quickstart.json"

@renders("ppo-quickstart")
def ppo_quickstart() -> str:
    """PPO (`algo.advantage=gae`) beside GRPO (the quickstart): both summaries from scripts/quickstart_results.py."""
    p, g = load(PPO_QUICKSTART), load(QUICKSTART)
    f = lambda x, spec: "–" if x is None else format(x, spec)        # noqa: E731

    def span(q, key, spec):
        return f"{f(q.get(key + '_first'), spec)} → {f(q.get(key + '_last'), spec)}"

    def step(q):
        return (f"{f(q['step_seconds_median'], '.2f')} s (rollout {f(q['rollout_s_median'], '.2f')} s + update "
                f"{f(q['train_s_median'], '.2f')} s)")

    rows = [["command", f"`{p['command']}`", f"`{g['command']}`"],
            ["RL steps (steps in each 20% window)", f"{p['steps']} ({p['window_steps']})",
             f"{g['steps']} ({g['window_steps']})"],
            ["mean reward, first 20% → last 20%", span(p, "reward_mean", ".3f"), span(g, "reward_mean", ".3f")],
            ["pass rate (exact answers), first 20% → last 20%", span(p, "pass_rate", ".3f"),
             span(g, "pass_rate", ".3f")],
            ["critic explained variance, first 20% → last 20%", span(p, "critic_explained_var", ".2f"),
             "– (no critic)"],
            ["RL step, median", step(p), step(g)],
            ["XLA compilations after RL step 0", f(p.get("compiles_after_step0"), ".0f"),
             f(g.get("compiles_after_step0"), ".0f")]]
    note = f"\n\n`{PPO_QUICKSTART}`: {p['note']}" if p.get("note") else ""
    return (table(["figure", "PPO", "GRPO (the quickstart)"], "lll", rows) + note + "\n\n"
            + footer(PPO_QUICKSTART, QUICKSTART, who=f"PPO: {machine(p)}; GRPO: {machine(g)}"))


# ---------------------------------------------------------------------------------------------- training

@renders("train-memory")
def train_memory() -> str:
    d = load("bench_train_memory.json")
    by = {(r["tokens"], r["remat"]): r["temp_gib"] for r in d["rows"]}
    toks = sorted({t for t, _ in by})
    rows = [[t] + [f"{by[(t, m)]:.2f} GiB" if (t, m) in by else "–" for m in ("none", "layer", "dots")] for t in toks]
    return (table(["tokens", "remat none", "remat layer", "remat dots"], "rrrr", rows) + "\n\n"
            + footer("bench_train_memory.json"))


@renders("train-throughput")
def train_throughput() -> str:
    d = load("bench_train.json")
    models, seen, rows = d["settings"]["models"], set(), []
    for r in d["rows"]:
        m = models[r["shape"]]
        label = r["shape"].upper() if r["shape"][-1].isalpha() else r["shape"]
        if r["shape"] not in seen:
            label += f" (hidden {m['hidden_size']}, {m['num_layers']} layers)"
            seen.add(r["shape"])
        rows.append([label, f"{r['rows']} × {r['seq_len']}", f"{r['jaxrl_s']:.2f}", f"{r['torch_s']:.2f}",
                     f"{r['ratio']:.2f}×", f"{r['jaxrl_gflops']:.0f}", pct(r["peak_fraction"])])
    load_avg = lambda x: "not recorded" if x is None else f"{x[0]:.2f}"      # noqa: E731
    how = (f"GFLOP/s = FLOPs per step ÷ jaxrl s, FLOPs as the JSON's `flops_formula` says (attention: the causal "
           f"(query, key) entries the chunked kernel computes, {d['rows'][0]['flops']['attention_block_q']}-row "
           f"query chunks); of peak = GFLOP/s ÷ {d['peak_gflops_float32']:.1f} GFLOP/s (float32, `bench_peak.py`). "
           f"Load average (1 min) before / after the run: {load_avg(d['loadavg_before'])} / "
           f"{load_avg(d['loadavg_after'])}.") if d["rows"] else ""
    return (table(["model", "batch (rows × tokens)", "jaxrl s", "torch s", "speed-up", "jaxrl GFLOP/s", "of peak"],
                  "llrrrrr", rows) + "\n\n" + how + "\n\n" + footer("bench_train.json"))


# The Throughput issue's targets for the train step, at the 58M shape.
TRAIN_TARGETS = {"shape": "58m", "ratio": 1.5, "peak_fraction": 0.70}


@renders("train-targets")
def train_targets() -> str:
    """Each target met or not, and the fraction of peak jaxrl would need to be `ratio` × torch (same FLOPs)."""
    d, t = load("bench_train.json"), TRAIN_TARGETS
    ok = lambda good: "✓" if good else "✗"                               # noqa: E731
    rows = [[f"{r['rows']} × {r['seq_len']}", f"{r['ratio']:.2f}× {ok(r['ratio'] >= t['ratio'])}",
             f"{pct(r['peak_fraction'])} {ok(r['peak_fraction'] >= t['peak_fraction'])}",
             pct(t["ratio"] * r["torch_gflops"] / d["peak_gflops_float32"])]
            for r in d["rows"] if r["shape"] == t["shape"]]
    return (table([f"{t['shape'].upper()}, batch", f"speed-up (target ≥ {t['ratio']:g}×)",
                   f"of peak (target ≥ {pct(t['peak_fraction'])})", f"of peak {t['ratio']:g}× torch would need"],
                  "lrrr", rows) + "\n\n" + footer("bench_train.json"))


@renders("blockwise")
def blockwise() -> str:
    d = load("bench_blockwise.json")
    g = lambda b: "–" if b is None else f"{b / 2**30:.2f}"             # noqa: E731
    f = lambda x, spec: "–" if x is None else format(x, spec)          # noqa: E731
    rows = []
    for r in d["rows"]:
        tr = r.get("time_ratio")
        if tr is None and r["full_s"] and r["blockwise_s"] is not None:
            tr = r["blockwise_s"] / r["full_s"]
        rows.append([r["seq_len"], r["block"], g(r["full_bytes"]), g(r["blockwise_bytes"]), f(r["ratio"], ".2f"),
                     f(r["full_s"], ".1f"), f(r["blockwise_s"], ".1f"), f(tr, ".2f")])
    return (table(["tokens per row", "T", "full GiB", "blockwise GiB", "memory ratio", "full s", "blockwise s",
                   "time ratio"], "rrrrrrrr", rows) + "\n\n" + footer("bench_blockwise.json"))


# ---------------------------------------------------------------------------------------------- rollout

# The end-to-end speed issue's targets for decode against transformers' generate(), per batch.
ROLLOUT_TARGETS = {1: 2.0, 16: 1.5, 64: 1.5}


@renders("rollout")
def rollout() -> str:
    d = load("bench_rollout.json")
    rows = []
    for r in d["rows"]:
        want = ROLLOUT_TARGETS.get(r["batch"])
        target = f"≥ {want:g} {'✓' if r['ratio'] >= want else '✗'}" if want else "–"
        frac = pct(r["peak_fraction"]) if r.get("peak_fraction") else "–"
        p = r["parts"]
        rows.append([r["batch"], f"{r['ours_tok_s']:.1f}", f"{r['hf_tok_s']:.1f}", f"**{r['ratio']:.2f}**", frac,
                     f"{p['step_ms']:.1f}", f"{p['dense_ms']:.1f}", f"{p['matmuls_ms']:.1f}", f"{p['sampler_ms']:.1f}",
                     f"{p['attention_kv_ms']:.1f}", f"{r['greedy_token_agreement']:.3f}", target])
    out = table(["batch", "ours tok/s", "transformers tok/s", "ratio", "of peak", "step ms", "dense part ms",
                 "its matmuls in place ms", "sampler ms", "attention + KV ms", "greedy token agreement", "target"],
                "rrrrrrrrrrrl", rows)
    one = next((r for r in d["rows"] if r["batch"] == 1), None)
    if one:
        p = one["parts"]
        out += (f"\n\nAt batch 1 the dense part reads the {p['weight_bytes'] / 1e6:.0f} MB of float32 weights once per "
                f"step: {p['dense_gb_s']:.1f} GB/s, against this machine's read bandwidth of {d['read_gb_s']:.1f} GB/s "
                f"measured in the same run (a {p['read_floor_ms']:.1f} ms floor for the step); its matmuls over "
                f"separate per-layer buffers take {p['matmuls_ms']:.1f} ms "
                f"(the layer scan's dense part takes {p['dense_ms'] / p['matmuls_ms']:.2f}× that). A prototype of the "
                f"step without the scan (one layer program the host runs per layer over that layer's own weights, "
                f"the stacked KV pool donated through each) takes {p['layer_loop_ms']:.1f} ms against the engine "
                f"step's {p['step_ms']:.1f} ms, with {'the same' if p['layer_loop_same_tokens'] else 'other'} tokens; "
                f"with a KV pool per layer, {p['layer_loop_own_pools_ms']:.1f} ms "
                f"({'the same' if p['layer_loop_own_pools_same_tokens'] else 'other'} tokens).")
    pk = d["peak"]
    out += (f" Of peak: GFLOP/s (2 per weight per token plus causal attention) ÷ {pk['gflops']:.0f} GFLOP/s, the "
            f"float32 {pk['name']} matmul measured at the start. Step parts: one decode step at the mean context "
            f"({d['rows'][0]['parts']['context']} tokens), each part compiled and timed alone, in turn (medians): "
            f"the engine's step; its dense part (the same layer scan and LM head, attention replaced by its query: no KV written or read); "
            f"the dense part's matmuls over separate per-layer buffers (no norms or RoPE); the sampler; attention + "
            f"KV = step − dense − sampler. Load average at the end: {d['loadavg'][0]:.2f}.")
    wd = d.get("widths")
    if wd:
        ps = d["settings"]["page_size"]
        ms = ", ".join(f"{w} pages {v:.1f}" for w, v in sorted(wd["step_ms"].items(), key=lambda kv: int(kv[0])))
        out += (f"\n\nThe engine's decode step alone at batch {wd['batch']} by page-table width (pages of {ps} tokens, "
                f"every row's table full; ms, medians, the widths in turn): {ms}. This run's decode buckets are "
                f"{' and '.join(map(str, wd['buckets']))} pages: each step runs on the narrowest that fits its "
                f"longest row, and the XLA path gathers and attends over every page of that width.")
    gpu = d.get("gpu")
    out += ("\n\nGPU: not measured (`\"gpu\": null` in the JSON)." if not gpu else
            f"\n\nGPU ({gpu['device']}), llama3.1-8b bf16, batch 1: {gpu['decode_ms_per_token']:.2f} ms/token, "
            f"floor {gpu['floor_ms_measured']:.2f} ms (measured bandwidth), {pct(gpu['fraction_of_floor'])} of floor.")
    return out + "\n\n" + footer("bench_rollout.json") + "\n\n" + rollout_machines()


def cpu_model(d: dict) -> str:
    """The CPU of a result's `machine` with its family and model numbers (two VMs sold under one name differ)."""
    m = machine_record(d) or {}
    m = m if isinstance(m, dict) else {"cpu": m}
    fam = re.search(r"family (\d+) model (\d+)", m.get("cpu_id", ""))
    return m.get("cpu", "not recorded") + (f" (family {fam[1]} model {fam[2]})" if fam else "")


def per_machine(name: str, head: list[str], cells, intro: str = "On each machine this benchmark ran on (the same "
                "script; the table above is the first row's latest run)") -> str:
    """A table with one row per machine a benchmark ran on: `name` (its latest run, e.g. bench_e2e.json) and
    every `<stem>_<machine>.json` kept from runs on other CPUs; `cells(d)` gives a row's cells after the
    machine's (`cpu_model`), the JSON's name last."""
    stem = name.removesuffix(".json")
    files = sorted(f.name for f in RESULTS.glob(f"{stem}*.json") if f.name == name or f.name.startswith(stem + "_"))
    rows = [[cpu_model(load(f)), *cells(load(f)), f"`{f}`"] for f in files]
    return (f"{intro}:\n\n" + table(["machine", *head, "JSON"], "l" + "r" * len(head) + "l", rows) + "\n\n"
            + footer(*files, who="each row's, as its JSON records it"))


def rollout_machines() -> str:
    """Issue 37's decode targets on every machine `bench_rollout.py` ran on."""
    def cells(d):
        by = {r["batch"]: r for r in d["rows"]}
        out = ["–" if (r := by.get(b)) is None else f"{r['ratio']:.2f} {'✓' if r['ratio'] >= want else '✗'}"
               for b, want in ROLLOUT_TARGETS.items()]
        one, sixty = by.get(1, {}).get("parts"), by.get(64, {}).get("parts")
        return out + [f"{one['dense_ms'] / one['matmuls_ms']:.2f}×" if one else "–",
                      pct(sixty["attention_kv_ms"] / sixty["step_ms"]) if sixty else "–"]

    return per_machine("bench_rollout.json",
                       [*(f"batch {b} (≥ {w:g})" for b, w in ROLLOUT_TARGETS.items()),
                        "batch 1: dense part ÷ its matmuls in place", "batch 64: attention + KV of the step"], cells,
                       intro="Ratio to `generate()` on each machine this benchmark ran on (the same script, idle "
                             "2-core VMs)")


# ----------------------------------------------------------------------------------------------- PAT

@renders("pat-switch")
def pat_switch() -> str:
    d = load("bench_adaptive_tp.json")
    labels = {"pat_migrate": "PAT, KV migrated (warm)", "pat_recompute": "PAT, KV recomputed (warm)",
              "pat_migrate_cold": "PAT, KV migrated, first switch to the layout (cold)",
              "pat_recompute_cold": "PAT, KV recomputed, cold",
              "naive_restart": "naive restart (teardown, weights from host, compile, re-prefill)"}
    rows = [[label] + [f"{d['switch'][k][f]:.2f}" for f in ("seconds", "weights_s", "kv_s", "compile_s", "control_s")]
            for k, label in labels.items() if k in d["switch"]]
    src, dst = d["switch_from_to"]
    return (table(["path", "seconds", "weights", "KV (move / re-prefill)", "compile", "control"], "lrrrrr", rows)
            + f"\n\nTP{src} → TP{dst}; `switch_speedup` (naive ÷ PAT migrate, warm) {d['switch_speedup']:.1f}×.\n\n"
            + footer("bench_adaptive_tp.json"))


@renders("pat-predictor")
def pat_predictor() -> str:
    d = load("bench_adaptive_tp_predictor.json")
    rows = [[f"TP{tp}", pct(d["predictor_mape_sum"][tp], 1), pct(d["predictor_mape_padded"][tp], 1),
             pct(d["noise"][tp], 1)] for tp in sorted(d["predictor_mape_sum"], key=int)]
    return (table(["layout", "MAPE, T = Σ context (paper)", "MAPE, padded shape", "one run's own noise"], "lrrr", rows)
            + "\n\n" + footer("bench_adaptive_tp_predictor.json"))


# ------------------------------------------------------------------------------------------- RollPacker

@renders("tail-batching")
def tail_batching() -> str:
    d = load("bench_tail_batching.json")
    roof = d["roofline"]
    rows = []
    for key, label in (("sync", "synchronous"),
                       ("tail_batching", f"tail batching (η {d['eta_prompts']:g} / {d['eta_responses']:g})"),
                       ("carry", "tail batching + carried partials (slime)")):
        if key not in d:       # (a JSON from before the carry schedule)
            continue
        s = d[key]
        rows.append([label, f"{s['seconds']:.1f}", f"{s['seconds_per_trained_prompt']:.3f}", s["engine_steps"],
                     f"{s['decode_rows_per_step']:.1f}", f"{1000 * s['seconds_per_engine_step']:.1f}",
                     f"{spaced(s['decoded_tokens'])} ({spaced(s['wasted_tokens'])})",
                     f"{s['decoded_tokens'] / s['seconds']:.0f}", f"{roof['cpu'][key + '_decode_s']:.1f}",
                     f"{roof['h100'][key + '_decode_s']:.3f}"])
    return (table(["schedule", "rollout s", "s / trained prompt", "engine steps", "decode rows / step", "ms / step",
                   "decoded tokens (wasted)", "tok/s", "decode s at this CPU's roofline", "at an H100's"],
                  "llllllllll", rows)
            + f"\n\n`speedup` {d['speedup']:.2f}×; {d['engine_step_ratio']:.2f}× fewer engine steps; at the roofline "
              f"{roof['cpu']['speedup']:.2f}× (this CPU), {roof['h100']['speedup']:.2f}× (H100)."
            + (f" With carried partials: {d['carry_speedup']:.2f}×; {d['carry_engine_step_ratio']:.2f}× fewer engine "
               f"steps; at the roofline {roof['cpu']['carry_speedup']:.2f}× (this CPU), "
               f"{roof['h100']['carry_speedup']:.2f}× (H100)." if "carry" in d else "")
            + "\n\n" + footer("bench_tail_batching.json"))


@renders("code-rewards")
def code_rewards() -> str:
    d = load("bench_code_rewards.json")
    c, s = d["config"], d["summary"]
    labels = {"fixed": f"fixed (every case {c['t_max']:g} s)",
              "adaptive": f"adaptive (λ {c['lam']:g}, {c['t_min']:g}–{c['t_max']:g} s)"}
    rows = [[labels[m], f"{s[m]['cold_wall_s']:.1f} s", f"{s[m]['warm_mean_wall_s']:.1f} s",
             f"{s[m]['mean_wall_s']:.1f} s"] for m in ("fixed", "adaptive")]
    n = c["steps"]
    return (table(["mode", "step 1 (no anchors yet)", f"steps 2–{n} (mean)", f"mean over {n} steps"], "llll", rows)
            + f"\n\nAdaptive ÷ fixed: {s['speedup_warm']:.1f}× per step once anchored, {s['speedup_all']:.1f}× over "
              f"all {n} steps.\n\n" + footer("bench_code_rewards.json"))


# --------------------------------------------------------------------------------------------- StreamRL

@renders("lpt")
def lpt() -> str:
    d = load("bench_lpt.json")
    labels = {"fcfs": "FCFS", "lpt_oracle": "LPT, true lengths",
              "lpt_predicted": f"LPT, noisy prediction (τ {d['prediction_kendall_tau']:.2f})"}
    rows = [[labels[k], o["engine_steps"], o["list_schedule_steps"], f"{o['seconds_median']:.2f}"]
            for k, o in d["orders"].items()]
    return (table(["admission", "decode steps", "list-schedule steps", "seconds (median)"], "llll", rows)
            + f"\n\nLPT (true lengths) ÷ FCFS: {d['step_ratio_lpt_oracle']:.2f}× fewer decode steps, "
              f"{d['speedup_lpt_oracle']:.2f}× in wall time.\n\n" + footer("bench_lpt.json"))


@renders("pipeline")
def pipeline() -> str:
    d = load("bench_pipeline.json")
    dev = d["devices"]
    n = len(dev["colocated"]["gen"])
    labels = {"colocated": f"colocated ({n} instances, fsdp {len(dev['colocated']['train'])}, shared)",
              "disaggregated": f"disaggregated ({len(dev['disaggregated']['train'])} + "
                               f"{len(dev['disaggregated']['gen'])}), dynamic batches",
              "async": "disaggregated, one-step-async"}
    rows = []
    for k, label in labels.items():
        m = d["modes"][k]
        wait = f"{m['train_wait_s_mean']:.2f} s" if "train_wait_s_mean" in m else "—"
        stale = str(max(m["staleness"])) if m.get("staleness") else "0 (synchronous)"
        rows.append([label, f"{m['seconds_per_step']:.2f}", pct(m["gen_busy_fraction"]),
                     pct(m["train_busy_fraction"]), wait, stale])
    return (table(["mode", "s/step", "generation pool busy", "train pool busy",
                   "train pool's wait after the rollout", "staleness"], "llllll", rows)
            + "\n\n" + footer("bench_pipeline.json"))


@renders("async-learning")
def async_learning() -> str:
    d, rows = load("bench_async.json"), []
    for name, r in d["runs"].items():
        w, wmax, stale = ([x for x in r[k] if x is not None]
                          for k in ("is_weight_mean", "is_weight_max", "staleness_mean"))
        rows.append([name, f"`{r['command'].split('jaxrl.train ', 1)[1].split(' ', 1)[1]}`", r["steps"],
                     f"{r['reward_mean_first']:.3f} → {r['reward_mean_last']:.3f}", f"{sum(stale) / len(stale):.2f}"
                     if stale else "0", f"{sum(w) / len(w):.3f} (max {max(wmax):.2f})" if w else "—",
                     f"{r['wall_s'] / 60:.1f} min"])
    waited = sum(x for x in d["runs"]["k2"]["gen_wait_s"] if x is not None)
    return (table(["run", "overrides (quickstart)", "steps", "reward, first → last 20%", "mean token staleness",
                   "importance weight, mean of steps", "wall"], "lllrrrr", rows)
            + f"\n\nk2's last-20% reward minus sync's: {d['last_reward_gap']:+.3f}, "
              f"{'within' if d['reaches_sync'] else '**not** within'} the stated margin of {d['margin']}. The "
              f"generation waited {waited:.0f} s in all at the swap points for updates not done yet "
              "(`async/gen_wait_s`; on 2 shared cores an update outlasts 16 decode steps).\n\n"
              "![reward curves](../scripts/results/bench_async.png)\n\n" + footer("bench_async.json"))


# --------------------------------------------------------------------------------------------- DistFlow

@renders("flow")
def flow() -> str:
    d = load("bench_flow.json")
    rows = [[r["processes"], r["samples"], f"{r['proc0_sample_bytes']:,}", f"{r['single_controller_proc0_bytes']:,}",
             f"{r['bytes_moved']:,}", pct(r["padding_local"], 1), pct(r["padding_balanced"], 1)] for r in d["rows"]]
    return (table(["processes", "samples", "sample bytes reaching process 0 (ours)",
                   "single-controller twin: bytes into process 0", "bytes moved (all processes)",
                   "padding, each packs its own", "padding, token-balanced"], "rrrrrrr", rows)
            + "\n\n" + footer("bench_flow.json"))


# -------------------------------------------------------------------------------------------- reference

@renders("logprobs")
def logprobs() -> str:
    files = ("bench_logprobs.json", "bench_logprobs_f32.json")
    rows = []
    for f in files:
        d = load(f)
        rows.append([d["dtype"], f"{d['naive_temp_bytes']:,}", f"{d['chunked_temp_bytes']:,}", f"{d['ratio']:.3g}"])
    return (table(["dtype", "naive temp bytes", "chunked temp bytes", "ratio"], "lrrr", rows) + "\n\n"
            + footer(*files))


# ------------------------------------------------------------------------------------------- composition

_load_module("docs_composition", ROOT / "scripts" / "docs_composition.py").register(renders, load, table, footer,
                                                                                 RESULTS)
_load_module("docs_lora", ROOT / "scripts" / "docs_lora.py").register(renders, load, table, footer, machine)
_load_module("docs_suite", ROOT / "scripts" / "docs_suite.py").register(renders, load, table, footer, machine)
_load_module("docs_multiturn", ROOT / "scripts" / "docs_multiturn.py").register(renders, load, table, footer, spaced,
                                                                             lambda: RESULTS)
_load_module("docs_e2e", ROOT / "scripts" / "docs_e2e.py").register(renders, load, table, footer, lambda: RESULTS,
                                                                    per_machine)
_load_module("docs_real_model", ROOT / "scripts" / "docs_real_model.py").register(renders, load, table, footer,
                                                                                 lambda: RESULTS)
_load_module("docs_opd", ROOT / "scripts" / "docs_opd.py").register(renders, load, table, footer, lambda: RESULTS)
_load_module("docs_sim", ROOT / "scripts" / "docs_sim.py").register(renders, load, table, footer, machine, _load_module)
_load_module("docs_config", ROOT / "scripts" / "docs_config.py").register(renders)       # docs/config.md

# ------------------------------------------------------------------------------------------------ pages

def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def render_text(text: str, where: str = "") -> str:
    """`text` with every rendered block replaced by what its JSON renders to now."""
    def sub(m):
        name = m.group("name")
        if name not in RENDERERS:
            raise SystemExit(f"{where}: unknown rendered block {name!r}; known: {', '.join(sorted(RENDERERS))}")
        return f"{m.group(1)}\n{RENDERERS[name]()}\n\n{m.group(4)}"
    opened = re.findall(r"<!-- render:([a-z0-9-]+) -->", text)
    closed = re.findall(r"<!-- /render:([a-z0-9-]+) -->", text)
    if opened != closed:
        raise SystemExit(f"{where}: unbalanced render markers: opened {opened}, closed {closed}")
    return MARK.sub(sub, text)


def stale(paths: list[Path] | None = None) -> list[Path]:
    """The pages whose rendered blocks differ from what the JSON renders to now."""
    return [p for p in (paths or pages()) if render_text(t := p.read_text(), str(p)) != t]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from its JSON")
    args = ap.parse_args(argv)
    bad = stale()
    for p in bad:
        rel = p.relative_to(ROOT) if p.is_relative_to(ROOT) else p
        if args.check:
            print(f"{rel}: differs from scripts/results/ (run: scripts/venv.sh python scripts/docs.py)",
                  file=sys.stderr)
        else:
            p.write_text(render_text(p.read_text(), str(p)))
            print(f"rendered {rel}")
    return 1 if (args.check and bad) else 0


# ---------------------------------------------------------------------------------------- MkDocs hooks

def on_files(files, config):
    """README.md is the home page; scripts/results/*.png are served at results/."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "index.md", abs_src_path=str(ROOT / "README.md")))
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    """Repository-relative links (what GitHub shows) -> the site's locations (see on_files)."""
    if page.file.src_uri == "index.md":                  # README.md
        markdown = markdown.replace("](docs/", "](").replace("](scripts/results/", "](results/")
    return markdown.replace("](../scripts/results/", "](results/")


if __name__ == "__main__":
    sys.exit(main())
