"""On-policy distillation against GRPO on the CPU (issue 71's recipe, docs/opd.md): SmolLM2-135M-Instruct teaches
a student made of its own first `--layers` decoder layers, on the built-in `arith` task.

    scripts/venv.sh python -m models.fetch smollm2-135m-instruct checkpoints/smollm2-135m-instruct
    scripts/venv.sh python scripts/bench_opd.py [--budget-min 10] [--layers 8]   # -> scripts/results/bench_opd.json
    scripts/venv.sh python scripts/bench_opd.py --quick                          # the pipeline on a tiny random teacher

1. The teacher answers `--prompts` training prompts greedily (`python -m jaxrl.eval`); its responses become the
   column `teacher` of the training file.
2. The student (`python -m models.shrink`) gets a supervised warm start on them (`warm_start.response_key`);
   both arms start from that one warm-started checkpoint.
3. Two runs of `python -m jaxrl.train`, one after the other, each for the same wall-clock budget of RL
   (`time_budget_min`: the warm-up's compilation is not counted, the teacher's passes are): GRPO on the task
   reward, and OPD (`algo.advantage=opd`, the teacher's per-token log-probs, `algo.opd.reward_weight`). The same
   100 held-out prompts (never trained, never in the warm start) are evaluated greedily every `--eval-every` steps.
4. Before (the warm-started student) and after each arm: the held-out reverse KL to the teacher, the mean over
   response tokens of log pi_S - log pi_T on the student's own samples at temperature 1 (`python -m jaxrl.eval`
   samples, re-encoded from their text: an estimate), computed with the models' own forward.

Writes the JSON (each arm's eval curve against its RL minutes, step times, the evaluations before and after, the
reverse KL) and a PNG of the curves. Only meaningful on an otherwise idle machine; the two arms run one after the
other, not interleaved (each is a whole training run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402

OUT = ROOT / "scripts" / "results" / "bench_opd.json"
OUTPUTS = ("bench_opd.json", "bench_opd.png")   # its files in scripts/results/ (tests/test_docs.py)
TEACHER = ROOT / "checkpoints" / "smollm2-135m-instruct"
# the RL arms' shared settings: configs/smollm2_arith.yaml's shape (8 prompts x 4, <= 48 new tokens), a constant lr
COMMON = ["data.chat=true", "data.max_prompt_len=48", "rollout.max_new_tokens=48", "engine.max_batch=32",
          "engine.max_seq_len=96", "engine.page_buckets=2", "engine.prefill_tokens=1024", "algo.group_size=4",
          "algo.prompts_per_step=8", "algo.kl_coef=0.0", "optim.warmup_steps=0", "optim.schedule=constant",
          "optim.weight_decay=0.0", "warm_start.steps=0", "eval.samples=1", "eval.temperature=0.0", "steps=10000",
          "save_every=null", "curves=false", "log_completions=2"]


def run(cmd: list[str], log: Path) -> None:
    """A CLI of the project to completion, its output to `log`; stops with the log's tail when it fails."""
    t = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed ({p.returncode}); {log}:\n" + log.read_text()[-3000:])
    print(f"[bench_opd] {' '.join(cmd[:2])} ... {time.perf_counter() - t:.0f} s", flush=True)


def rows(n: int, seed: int) -> list[dict]:
    from jaxrl.data.tasks import make_suite

    return [{"prompt": e.prompt, "answer": e.answer, "task": e.task} for e in make_suite(["arith"], n, seed)]


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def evaluate(model: Path, data: Path, out: Path, work: Path, *, temperature: float, samples: int = 1) -> dict:
    run(["-m", "jaxrl.eval", f"model.hf_path={model}", f"data.source={data}", f"eval.samples={samples}",
         f"eval.temperature={temperature}", "max_new_tokens=48", "data.max_prompt_len=48", "engine.max_seq_len=96",
         "engine.max_batch=32", f"output={out}"], work / f"{out.stem}.log")
    return json.loads(out.read_text())


def reverse_kl(student: Path, teacher: Path, samples: list[dict]) -> float:
    """Mean over response tokens of log pi_S(y_t) - log pi_T(y_t) at temperature 1 on `samples` (the student's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.data import encode_prompts
    from jaxrl.train.step import token_logp
    from models import load_hf, load_tokenizer

    tok = load_tokenizer(teacher)
    seqs = []
    for s, p in zip(samples, encode_prompts([{"prompt": s["prompt"]} for s in samples], tok, True)):
        resp = tok.encode(s["completion"]) + ([tok.eos_ids[0]] if s.get("finish_reason") == "stop" else [])
        if resp:
            seqs.append((p, resp))
    L = max(len(p) + len(r) for p, r in seqs)
    B = len(seqs)
    tokens, targets, mask, segments = (np.zeros((B, L), np.int32) for _ in range(4))
    for i, (p, r) in enumerate(seqs):
        ids = p + r
        tokens[i, :len(ids)] = ids
        segments[i, :len(ids)] = 1
        targets[i, :len(ids) - 1] = ids[1:]
        mask[i, len(p) - 1:len(ids) - 1] = 1          # positions whose next token is a response token
    batch = {"tokens": tokens, "positions": np.tile(np.arange(L, dtype=np.int32), (B, 1)),
             "segment_ids": segments, "targets": targets}

    def logp(path: Path) -> np.ndarray:
        cfg, weights = load_hf(path)
        fn = jax.jit(lambda w, b: token_logp(w, cfg, b, 1.0)[0])
        return np.concatenate([np.asarray(fn(weights, {k: jnp.asarray(v[i:i + 16]) for k, v in batch.items()}))
                               for i in range(0, B, 16)])

    diff = (logp(student) - logp(teacher)) * mask
    return float(diff.sum() / mask.sum())


def arm_curve(run_dir: Path) -> dict:
    """An arm's per-step rows and evaluations, with each row's minutes of RL since its first step started."""
    rows_ = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows_ if "reward_mean" in r]
    t, elapsed = 0.0, {}
    for r in steps:
        t += r["step_seconds"]
        elapsed[r["step"]] = t / 60
    evals = [{"step": r["step"], "minutes": elapsed.get(r["step"] - 1, 0.0), "accuracy": r["eval/accuracy"],
              "len_mean": r["eval/len_mean"]} for r in rows_ if "eval/accuracy" in r]
    keys = [k for k in ("opd/reverse_kl", "opd/teacher_logp") if k in steps[0]]
    return {"steps": len(steps), "step_s_median": sorted(r["step_seconds"] for r in steps)[len(steps) // 2],
            "reward_mean": [r["reward_mean"] for r in steps], "evals": evals,
            **{k.replace("/", "_"): [r[k] for r in steps] for k in keys}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, arm in result["arms"].items():
        ax.plot([e["minutes"] for e in arm["evals"]], [e["accuracy"] for e in arm["evals"]], marker="o", label=name)
    ax.set_xlabel("minutes of RL"), ax.set_ylabel("held-out accuracy (greedy)"), ax.legend(), ax.grid(alpha=0.3)
    ax.set_title(f"student: {result['layers']} of the teacher's layers, {result['budget_min']} min each")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tiny_teacher(work: Path) -> Path:
    """--quick: a random 2-layer model with the built-in character tokenizer (the pipeline, not a result)."""
    import jax
    import jax.numpy as jnp

    from models import PRESETS, CharTokenizer, init, save_hf

    cfg = dataclasses.replace(PRESETS["tiny-char"], num_layers=2)
    return save_hf(work / "tiny_teacher", cfg, init(jax.random.key(0), cfg, jnp.float32), tokenizer=CharTokenizer())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", type=Path, default=TEACHER)
    ap.add_argument("--layers", type=int, default=8, help="the student's decoder layers (the teacher's first N)")
    ap.add_argument("--prompts", type=int, default=512, help="training prompts (the teacher answers each once)")
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--budget-min", type=float, default=10.0, help="minutes of RL per arm")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--reward-weight", type=float, default=0.0, help="OPD's algo.opd.reward_weight")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_opd")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--quick", action="store_true", help="a tiny random teacher and minutes of budget: the pipeline")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.quick:
        a.teacher, a.layers, a.prompts, a.sft_steps, a.budget_min, a.eval_every = tiny_teacher(a.work), 1, 32, 2, 0.05, 1
    if not (a.teacher / "config.json").is_file():
        raise SystemExit(f"no teacher at {a.teacher}: python -m models.fetch smollm2-135m-instruct {a.teacher}")
    train, heldout = rows(a.prompts, seed=1), rows(100 if not a.quick else 8, seed=2)
    seen = {r["prompt"] for r in train}
    heldout = [r for r in heldout if r["prompt"] not in seen]
    heldout_path = write_jsonl(a.work / "heldout.jsonl", heldout)
    # 1. the teacher's answers, 2. the student and its warm start
    teacher_out = evaluate(a.teacher, write_jsonl(a.work / "train.jsonl", train), a.work / "teacher_train.json",
                           a.work, temperature=0.0)
    answers = {s["index"]: s["completion"] for s in teacher_out["samples"]}
    data = write_jsonl(a.work / "with_teacher.jsonl", [{**r, "teacher": answers[i]} for i, r in enumerate(train)])
    run(["-m", "models.shrink", str(a.teacher), str(a.work / "student"), "--layers", str(a.layers)],
        a.work / "shrink.log")
    sft = a.work / "sft"
    run(["-m", "jaxrl.train", f"model.hf_path={a.work / 'student'}", f"data.source={data}", f"run_dir={sft}",
         *COMMON, "steps=0", f"warm_start.steps={a.sft_steps}", "warm_start.response_key=teacher",
         "warm_start.batch_size=32", "warm_start.optim.lr=3e-4", "warm_start.optim.warmup_steps=5"], a.work / "sft.log")
    student = sft / "hf"
    # 3. the two arms, from the same warm-started student, for the same RL budget
    arms = {"grpo": ["algo.advantage=grpo"],
            "opd": ["algo.advantage=opd", f"teacher.hf_path={a.teacher}", f"algo.opd.reward_weight={a.reward_weight}"]}
    result = {"teacher": str(a.teacher.relative_to(ROOT) if a.teacher.is_relative_to(ROOT) else a.teacher),
              "layers": a.layers, "prompts": len(train), "heldout": len(heldout), "sft_steps": a.sft_steps,
              "budget_min": a.budget_min, "lr": a.lr, "reward_weight": a.reward_weight, "quick": a.quick,
              "teacher_train_accuracy": teacher_out["metrics"]["eval/accuracy"], "arms": {}}
    before = evaluate(student, heldout_path, a.work / "before.json", a.work, temperature=1.0)
    result["before"] = {"accuracy_sampled": before["metrics"]["eval/accuracy"],
                        "reverse_kl": reverse_kl(student, a.teacher, before["samples"])}
    teacher_heldout = evaluate(a.teacher, heldout_path, a.work / "teacher_heldout.json", a.work, temperature=0.0)
    result["teacher_heldout_accuracy"] = teacher_heldout["metrics"]["eval/accuracy"]
    for name, extra in arms.items():
        run_dir = a.work / name
        run(["-m", "jaxrl.train", f"model.hf_path={student}", f"data.source={data}", f"run_dir={run_dir}", *COMMON,
             f"optim.lr={a.lr}", f"eval.data={heldout_path}", f"eval.every={a.eval_every}",
             f"time_budget_min={a.budget_min}", *extra], a.work / f"{name}.log")
        after = evaluate(run_dir / "hf", heldout_path, a.work / f"after_{name}.json", a.work, temperature=1.0)
        result["arms"][name] = {**arm_curve(run_dir), "after": {
            "accuracy_sampled": after["metrics"]["eval/accuracy"],
            "reverse_kl": reverse_kl(run_dir / "hf", a.teacher, after["samples"])}}
    write_result(a.out, result)
    plot(result, a.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "arms"} | {
        n: {"evals": [(round(e["minutes"], 1), e["accuracy"]) for e in arm["evals"]], "after": arm["after"]}
        for n, arm in result["arms"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
