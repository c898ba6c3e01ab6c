"""`python -m jaxrl.eval [--config FILE] [key=value ...]`: a model evaluated on held-out prompts.

    python -m jaxrl.eval model.hf_path=runs/smollm2/hf data.source=heldout.jsonl rewards.fn=my_rewards:score \\
        eval.samples=4 eval.temperature=1.0 output=eval.json

The keys are training's: `model.*`, `data.*` (`data=FILE` is short for `data.source=FILE`), `rewards.*`,
`eval.*` (samples, temperature, pass_k, ...), `max_new_tokens` (training's `rollout.max_new_tokens`) and
`engine.*`. It generates with the rollout engine (`jaxrl.eval.core.evaluate`, the same path as training's
evaluations) and writes `output` (JSON: the metrics, the worst and best completions, every sample) through a
temporary file renamed at the end; a bad key, file or reward stops it before any compilation, in one line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax
from tqdm import tqdm

from jaxrl.config import CONFIGS_DIR, EvalConfig, parse_cli, to_yaml
from jaxrl.data import encode_prompts
from jaxrl.rewards import RewardPool, check_rewards, reward_names
from jaxrl.rollout.service import RolloutService
from jaxrl.runtime import request_cpu_devices
from models import load_tokenizer
from models.peft_io import load_weights

from .core import evaluate
from .heldout import indexed, load_rows


def _argv(argv: list[str] | None) -> list[str]:
    """`data=FILE` (the issue's and TRL-style short form) as `data.source=FILE`."""
    args = list(sys.argv[1:] if argv is None else argv)
    return ["data.source=" + a[len("data="):] if a.startswith("data=") else a for a in args]


def _rows(cfg: EvalConfig, tokenizer) -> tuple[list[dict], list[list[int]]]:
    d = cfg.data
    if d.source != "builtin" and not os.path.isfile(d.source):
        raise SystemExit(f"data.source={os.path.abspath(d.source)}: no such file")
    try:
        rows = indexed(load_rows(d, cfg.seed))
    except ValueError as e:
        raise SystemExit(f"data.source: {e}") from None
    prompts = encode_prompts(rows, tokenizer, d.chat)
    kept = [(r, p) for r, p in zip(rows, prompts) if len(p) <= d.max_prompt_len]
    if not kept:
        raise SystemExit(f"no prompt of {d.source} fits data.max_prompt_len={d.max_prompt_len}")
    if len(kept) < len(rows):
        print(f"[eval] skipped {len(rows) - len(kept)} of {len(rows)} prompts longer than data.max_prompt_len="
              f"{d.max_prompt_len}", file=sys.stderr)
    kept = kept[:cfg.eval.max_prompts] if cfg.eval.max_prompts else kept
    return [r for r, _ in kept], [p for _, p in kept]


def _write(out: Path, payload: dict) -> None:
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(EvalConfig, _argv(argv), default_yaml=CONFIGS_DIR / "eval.yaml", prog="python -m jaxrl.eval")
    request_cpu_devices(cfg.engine.num_devices)   # fake devices on a CPU host only
    hf = cfg.model.hf_path
    if hf is not None and not os.path.isfile(os.path.join(hf, "config.json")):
        raise SystemExit(f"model.hf_path={os.path.abspath(hf)}: no config.json there (not a Hugging Face checkpoint)")
    tok_path = cfg.data.tokenizer or hf or "char"
    try:
        tokenizer = load_tokenizer(tok_path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"tokenizer {tok_path}: {err}; set data.tokenizer=DIR or data.tokenizer=char") from None
    rows, prompts = _rows(cfg, tokenizer)
    model_cfg = cfg.model.model_config()
    with RewardPool.from_config(cfg.rewards) as pool:
        try:
            check_rewards(reward_names(rows, cfg.rewards.fn, cfg.rewards.registry), pool)
        except ValueError as e:
            raise SystemExit(f"rewards: {e}") from None
        weights = load_weights(model_cfg, key=jax.random.key(0), dtype=cfg.model.jnp_dtype(), hf_path=hf,
                               adapter=cfg.model.lora.adapter)
        svc = RolloutService.from_config(cfg.engine, model_cfg, weights)
        total = len(rows) * cfg.eval.samples
        with tqdm(total=total, desc="eval", unit="seq", file=sys.stderr) as bar:
            result = evaluate(svc, pool, tokenizer, rows, prompts, cfg.eval, max_new_tokens=cfg.max_new_tokens,
                              rewards=cfg.rewards, progress=lambda done, _: bar.update(done - bar.n))
    worst, best = result.extremes(cfg.eval.log_completions)
    out = Path(cfg.output).absolute()
    _write(out, {"metrics": result.metrics, "worst": worst, "best": best, "samples": result.samples,
                 "model": hf or cfg.model.preset, "data": cfg.data.source, "time": time.time(),
                 "config": to_yaml(cfg)})
    m = result.metrics
    ks = "".join(f", pass@{k} {m[f'eval/pass@{k}']:.3f}" for k in cfg.eval.ks)
    print(f"[eval] accuracy {m['eval/accuracy']:.3f}{ks} over {m['eval/prompts']} prompts x {cfg.eval.samples}, "
          f"mean length {m['eval/len_mean']:.1f} tokens; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
