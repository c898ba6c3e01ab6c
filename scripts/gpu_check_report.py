"""`scripts/gpu_check.py`'s summary and Markdown: every figure in gpu_check.md is rendered from gpu_check.json (the
page docs/gpu.md holds once a GPU run exists), never typed by hand."""

from __future__ import annotations

from gpu_check_pat import targets_table

OK = ("ok", "partial")


def _f(x, spec: str = ".3g", scale: float = 1.0) -> str:
    if x is None or isinstance(x, str):
        return "-" if x is None else x
    try:
        return format(x * scale, spec)
    except (TypeError, ValueError):
        return str(x)


def _verdict(passed) -> str:
    return {True: "pass", False: "**FAIL**", None: "recorded"}[passed]


def failed_checks(result: dict) -> list[str]:
    """`section/case/check: error > tolerance` for every judged check that failed."""
    out = []
    for sec, rec in result["sections"].items():
        for case, c in (rec.get("cases") or {}).items():
            for check, v in (c.get("checks") or {}).items():
                if v.get("passed") is False:
                    out.append(f"{sec}/{case}/{check}: {_f(v.get('max_err'))} > {_f(v.get('tolerance'))}")
    return out


def failures(result: dict) -> list[str]:
    """`section[/case]: status: last traceback line` for every section or sub-case that did not run to the end."""
    out = []
    for sec, rec in result["sections"].items():
        if rec.get("status") not in OK:
            last = (rec.get("error") or "").strip().splitlines()[-1:] or [""]
            out.append(f"{sec}: {rec.get('status')} {last[0]}".rstrip())
        for case, c in (rec.get("cases") or {}).items():
            if c.get("status") == "failed":
                out.append(f"{sec}/{case}: {(c.get('error') or '').strip().splitlines()[-1]}")
    return out


def summary(result: dict) -> dict:
    secs = result["sections"]
    skipped = [f"{s}/{c}: {v.get('reason')}" for s, r in secs.items() for c, v in (r.get("cases") or {}).items()
               if v.get("status") == "skipped"]
    return {"sections_ok": [s for s, r in secs.items() if r.get("status") in OK],
            "sections_not_ok": {s: r.get("status") for s, r in secs.items() if r.get("status") not in OK},
            "failures": failures(result), "failed_checks": failed_checks(result), "skipped": skipped,
            "targets": targets_table(secs)}


def markdown(result: dict) -> str:
    secs = result["sections"]
    env = (secs.get("env") or {}).get("info") or {}
    dev, ver = env.get("device") or {}, env.get("versions") or {}
    plugin = ver.get("jax-cuda13-plugin") or ver.get("jax-cuda12-plugin")
    summ = result["summary"]
    lines = [f"### GPU check: {dev.get('device_kind', '?')} ({result['mode']}), {result['started'][:10]}", "",
             f"`{result['command']}`: {_f(result['wall_s'], '.0f')} s of a {result['total_budget_s']} s budget; "
             f"jax {ver.get('jax')}, jaxlib {ver.get('jaxlib')}, CUDA plugin {plugin or '-'}; "
             f"{len(summ['sections_ok'])}/{len(secs)} sections ran to the end.", ""]
    notes = ([f"- not ok: {s} ({st})" for s, st in summ["sections_not_ok"].items()]
             + [f"- failed: {x}" for x in summ["failures"]] + [f"- check failed: {x}" for x in summ["failed_checks"]]
             + [f"- skipped: {x}" for x in summ["skipped"]])
    lines += notes or ["- every section ran, every judged check passed"]
    pk = env.get("peak_gflops") or {}
    lines += ["", "#### Versions and device", "", "| | |", "|---|---|",
              f"| device | {dev.get('device_kind')} x{dev.get('device_count')} ({dev.get('platform')}, memory "
              f"{_f(dev.get('memory_bytes'), '.1f', 2**-30)} GiB, compute capability "
              f"{dev.get('compute_capability') or '-'}) |",
              f"| jax / jaxlib / plugin | {ver.get('jax')} / {ver.get('jaxlib')} / {plugin or '-'} |",
              f"| torch / transformers / triton | {ver.get('torch')} / {ver.get('transformers')} / "
              f"{ver.get('triton') or '-'} |",
              f"| bf16 matmul peak, measured | {_f(pk.get('bfloat16'), '.1f', 1e-3)} TFLOP/s |",
              f"| f32 matmul, measured | {_f(pk.get('float32'), '.1f', 1e-3)} TFLOP/s |",
              f"| copy bandwidth, measured (read + write) | {_f(env.get('copy_gbs'), '.0f')} GB/s "
              f"(read only {_f(env.get('read_gbs'), '.0f')}) |",
              "", "#### Sections", "", "| section | status | seconds | budget s |", "|---|---|---:|---:|"]
    lines += [f"| {s} | {r.get('status')} | {_f(r.get('seconds'), '.1f')} | {_f(r.get('budget_s'), '.0f')} |"
              for s, r in secs.items()]
    lines += _kernels(secs.get("kernels")) + _programs(secs.get("programs")) + _engine(secs.get("engine"))
    lines += _train(secs.get("train"))
    lines += _memory(secs.get("memory")) + _profile(secs.get("profile")) + _targets(summ["targets"])
    return "\n".join(lines) + "\n"


def _cases(rec, prefix: str = ""):
    return [(k, v) for k, v in ((rec or {}).get("cases") or {}).items() if k.startswith(prefix)]


def _kernels(rec) -> list[str]:
    out = ["", "#### Kernels vs references", "",
           "| case | check | max error | tolerance | result |", "|---|---|---:|---:|---|"]
    for name, c in _cases(rec):
        if c.get("status") != "ok":
            out.append(f"| {name} | - | - | - | {c.get('status')} |")
            continue
        for check, v in c["checks"].items():
            out.append(f"| {name} | {check} | {_f(v['max_err'], '.2e')} | {_f(v['tolerance'], '.1e')} | "
                       f"{_verdict(v['passed'])} |")
    return out


def _programs(rec) -> list[str]:
    """Every program CI lowered for CUDA (the section's list), with what this run did with it."""
    info, cases = (rec or {}).get("info") or {}, (rec or {}).get("cases") or {}
    names = info.get("programs") or []
    out = ["", "#### Programs CI lowers for CUDA", ""]
    if not names:
        return out + [f"programs: {(rec or {}).get('status', 'not run')}."]
    done = sum(1 for n in names if (cases.get(n) or {}).get("status") == "ok")
    out += [f"{len(names)} programs (`jaxrl.train.gpu_programs`, tests/test_cuda_export.py), {done} "
            f"{'lowered' if info.get('backend') == 'cpu' else 'compiled'} here:", "",
            "| program | status | seconds | note |", "|---|---|---:|---|"]
    for n in names:
        c = cases.get(n)
        if c is None:       # (the CPU smoke lowers two; a GPU run reaches every one, compiled or skipped)
            out.append(f"| {n} | {'listed' if info.get('backend') == 'cpu' else 'not reached'} | - | |")
            continue
        note = c.get("reason") or (c.get("error") or "").strip().splitlines()[-1:] or [""]
        note = note if isinstance(note, str) else note[0]
        if c.get("status") == "ok":
            note = c.get("mode", "") + (f", {c['triton_calls']} Triton calls" if "triton_calls" in c else "")
        out.append(f"| {n} | {c.get('status')} | {_f(c.get('seconds'), '.1f')} | {note} |")
    return out


def _engine(rec) -> list[str]:
    out = ["", "#### Engine", ""]
    eq = ((rec or {}).get("cases") or {}).get("pallas_equals_xla", {})
    if eq.get("status") == "ok":
        ch = eq["checks"]
        out.append(f"Pallas engine vs XLA engine ({eq['model']}, {eq['prompts']} prompts x {eq['new_tokens']} greedy "
                   f"tokens): identical tokens {_verdict(ch['tokens_identical']['passed'])} (agreement "
                   f"{_f(eq['token_agreement'], '.3f')}), log-probs max error {_f(ch['logprobs']['max_err'], '.1e')} "
                   f"({_verdict(ch['logprobs']['passed'])}).")
    else:
        out.append(f"Pallas engine vs XLA engine: {eq.get('status', 'not run')}.")
    info = (rec or {}).get("info") or {}
    hf = {c.get("batch"): c for _, c in _cases(rec, "hf/b") if c.get("status") == "ok"}
    hf_skip = next((c.get("reason") for _, c in _cases(rec, "hf/b") if c.get("status") == "skipped"), None)
    out += ["", f"Decode, {info.get('model')}, prompt {info.get('prompt')} + {info.get('new_tokens')} new tokens:", "",
            "| batch | attention | ms/step | tok/s | HBM GB/s | of copy bw | wall tok/s | transformers tok/s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in _cases(rec, "decode/"):
        if c.get("status") != "ok":
            out.append(f"| {name} | | | | | | | {c.get('status')} |")
            continue
        h = hf.get(c["batch"])
        out.append(f"| {c['batch']} | {c['impl']} | {_f(c['decode_step_s'], '.2f', 1e3)} | "
                   f"{_f(c['decode_tok_s'], '.0f')} | {_f(c['achieved_gbs'], '.0f')} | "
                   f"{_f(c['hbm_fraction'], '.0%')} | "
                   f"{_f(c['wall_tok_s'], '.0f')} | "
                   f"{_f(h['wall_tok_s'], '.0f') if h else '-'} |")
    if hf_skip:
        out.append(f"\n{hf_skip}.")
    return out


def _train(rec) -> list[str]:
    cases = (rec or {}).get("cases") or {}
    j, t = cases.get("jax_step", {}), cases.get("torch_step", {})
    out = ["", "#### Train step", ""]
    if j.get("status") != "ok":
        return out + [f"jaxrl train step: {j.get('status', 'not run')}."]
    out += ["| model | tokens | remat | s/step | TFLOP/s (causal) | MFU | torch s/step | torch MFU |",
            "|---|---:|---|---:|---:|---:|---:|---:|",
            f"| {j['model']} {j['dtype']} | {j['tokens']} | {j['remat']} | {_f(j['step_s'], '.3f')} | "
            f"{_f(j['achieved_gflops'], '.1f', 1e-3)} | {_f(j['mfu'], '.1%')} | "
            f"{_f(t.get('step_s'), '.3f') if t.get('status') == 'ok' else t.get('status', '-')} | "
            f"{_f(t.get('mfu'), '.1%') if t.get('status') == 'ok' else '-'} |"]
    if t.get("status") == "skipped":
        out.append(f"\n{t.get('reason')}.")
    return out


def _memory(rec) -> list[str]:
    out = ["", "#### Memory: blockwise vs full backward", "",
           "| tokens | block | full GiB (compiled) | blockwise GiB (compiled) | ratio | full GiB (measured) | "
           "blockwise GiB (measured) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    meas = {(c.get("variant"), c.get("seq_len")): c for _, c in _cases(rec, "measured/") if c.get("status") == "ok"}

    def m(v, L):
        c = meas.get((v, L))
        return "-" if c is None else _f(c["peak_gib"], ".2f") + ("" if c["valid"] else " (bound)")

    for name, c in _cases(rec, "compiled/"):
        if c.get("status") != "ok":
            out.append(f"| {name} | | | | | | {c.get('status')} |")
            continue
        L = c["seq_len"]
        out.append(f"| {L} | {c['block']} | {_f(c['full_gib'], '.2f')} | {_f(c['blockwise_gib'], '.2f')} | "
                   f"{_f(c['ratio'], '.2f')} | {m('full', L)} | {m('blockwise', L)} |")
    note = ((rec or {}).get("info") or {}).get("measured")
    return out + ([f"\n{note}."] if note else [])


def _profile(rec) -> list[str]:
    cases = (rec or {}).get("cases") or {}
    p, ld = cases.get("measure", {}), cases.get("sim_loads", {})
    if p.get("status") != "ok":
        return ["", "#### Latency profile", "", f"profile: {p.get('status', 'not run')}."]
    return ["", "#### Latency profile", "",
            f"PAT profile, TP1, grid=shapes, {p['model']} {p['dtype']}: {p['points']} decode points, "
            f"{_f(p['decode_ms_min'], '.2f')}-{_f(p['decode_ms_max'], '.2f')} ms per step, step set compiled in "
            f"{_f(p['compile_s'], '.0f')} s; `{p['path']}`"
            + (f", read by the simulator: `{ld['sim_command']}`." if ld.get("status") == "ok" else ".")]


def _targets(rows) -> list[str]:
    out = ["", "#### Targets (GPU only)", "", "| target | value | goal | met | status |", "|---|---:|---:|---|---|"]
    for r in rows:
        fmt = ".1%" if r["name"] == "predictor_mape" else ".2f"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        if r["applies"] is False:
            met += " (CPU: not a target here)"
        out.append(f"| {r['what']} | {_f(r['value'], fmt)} | {_f(r['target'], fmt)} | {met} | {r['status']} |")
    return out
