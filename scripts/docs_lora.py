"""docs/lora.md's rendered blocks, from scripts/results/bench_lora.json and the LoRA quickstart's summary
(registered into `scripts/docs.py`'s RENDERERS by `register`)."""

from __future__ import annotations

BENCH, QUICK, LORA_QUICK = "bench_lora.json", "quickstart.json", "lora_quickstart.json"


def register(renders, load, table, footer, machine):
    gib = lambda b: f"{b / 2**30:.2f}"            # noqa: E731
    mib = lambda b: f"{b / 2**20:.1f}"            # noqa: E731

    @renders("lora-memory")
    def lora_memory() -> str:
        d = load(BENCH)
        rows = [[r["model"], "LoRA r=%d" % r["rank"] if r["rank"] else "full", gib(r["weight_bytes"]),
                 gib(r["trainable_bytes"]), gib(r["adam_bytes"]), gib(r["grad_bytes"]), gib(r["reference_bytes"]),
                 gib(r["total_bytes"])] for r in d["memory"]]
        return (table(["model (bf16)", "training", "weights", "trained", "AdamW moments", "gradient sums",
                       "reference policy", "total"], "llrrrrrr", rows)
                + "\n\nGiB, from the abstract weights (exact shapes, nothing allocated); activations not included.\n\n"
                + footer(BENCH))

    @renders("lora-train")
    def lora_train() -> str:
        d = load(BENCH)
        f = lambda x, spec: "–" if x is None else format(x, spec)        # noqa: E731
        rows = [[r["model"], r["dtype"], f"{r['rows']} × {r['seq_len']}", f(r["full_s"], ".3f"), f(r["lora_s"], ".3f"),
                 f(r["time_ratio"], ".2f"), gib(r["full_mem"]["argument"]), gib(r["lora_mem"]["argument"]),
                 gib(r["full_mem"]["temp"]), gib(r["lora_mem"]["temp"]), f"{r['peak_ratio']:.2f}×"] for r in d["train"]]
        return (table(["model", "dtype", "batch", "full s", "LoRA s", "LoRA / full", "full args GiB", "LoRA args GiB",
                       "full temp GiB", "LoRA temp GiB", "peak full / LoRA"], "llrrrrrrrrr", rows)
                + f"\n\nRank {d['train'][0]['rank']} on all seven projections; one fused step (gradients + AdamW); "
                  "args = weights + optimizer state + batch (XLA's memory analysis); time: median of interleaved "
                  "repeats (58M only; qwen3-0.6b is compiled, not run).\n\n" + footer(BENCH))

    @renders("lora-sync")
    def lora_sync() -> str:
        d = load(BENCH)
        rows = [[r["kind"] if not r["rank"] else f"LoRA r={r['rank']}", mib(r["weight_bytes"]), mib(r["trainable_bytes"]),
                 mib(r["bytes_moved"]), f"{1e3 * r['seconds']:.1f}"] for r in d["sync"]]
        return (table(["training", "weights MiB", "trained MiB", "sync moved MiB", "sync ms"], "lrrrr", rows)
                + f"\n\n{d['sync'][0]['model'].upper()} shape; 2 rollout instances of tp=2 fed from an fsdp=4 train "
                  "mesh (8 CPU devices on 2 cores: the bytes are exact, the milliseconds only relative). Bytes "
                  "moved count every device's receipt (a replicated adapter reaches each device of an "
                  "instance).\n\n" + footer(BENCH))

    @renders("lora-decode")
    def lora_decode() -> str:
        d = load(BENCH)
        rows = [[r["kind"], r["model"].upper(), f"{r['batch']} × {r['new_tokens']}", f"{r['seconds']:.3f}",
                 f"{r['tokens_per_s']:.0f}", f"{r['sequences_identical']} of {r['sequences']}"] for r in d["decode"]]
        return (table(["adapters in decode", "model", "sequences × new tokens", "s (median)", "tokens/s",
                       "greedy sequences equal to the other's"], "llrrrr", rows) + "\n\n" + footer(BENCH))

    @renders("lora-blockwise")
    def lora_blockwise() -> str:
        d = load(BENCH)
        f = lambda x, spec: "–" if x is None else format(x, spec)        # noqa: E731
        rows = [[r["seq_len"], r["block"], gib(r["full_bytes"]), gib(r["blockwise_bytes"]), f"{r['ratio']:.2f}×",
                 f(r["paper_full_gib"], ".1f"), f(r["paper_blockwise_gib"], ".1f"), f(r["paper_ratio"], ".2f") + "×"]
                for r in d["blockwise"]]
        return (table(["tokens", "T", "full GiB", "blockwise GiB", "ratio", "paper full GiB", "paper blockwise GiB",
                       "paper ratio"], "rrrrrrrr", rows)
                + "\n\nQwen3-0.6B shapes, bfloat16, LoRA rank 4, one sequence per micro-batch (ours: compiled peak "
                  "on XLA:CPU, K/V cache and history gradient included; the paper's: measured on one MI300X with "
                  "PyTorch and RMSprop, its Table 1).\n\n" + footer(BENCH))

    @renders("lora-quickstart")
    def lora_quickstart() -> str:
        q, g = load(LORA_QUICK), load(QUICK)
        span = lambda s, k: f"{s[k + '_first']:.3f} → {s[k + '_last']:.3f}"     # noqa: E731
        rows = [["command", f"`{q['command']}`", f"`{g['command']}`"],
                ["mean reward, first 20% → last 20%", span(q, "reward_mean"), span(g, "reward_mean")],
                ["pass rate, first 20% → last 20%", span(q, "pass_rate"), span(g, "pass_rate")],
                ["RL step, median", f"{q['step_seconds_median']:.2f} s", f"{g['step_seconds_median']:.2f} s"],
                ["XLA compilations after RL step 0", q["compiles_after_step0"], g["compiles_after_step0"]]]
        note = f"\n\n`{LORA_QUICK}`: {q['note']}" if q.get("note") else ""
        return (table(["figure", "LoRA", "full fine-tuning (the quickstart)"], "lll", rows) + note + "\n\n"
                + footer(LORA_QUICK, QUICK, who=f"LoRA: {machine(q)}; full: {machine(g)}"))
