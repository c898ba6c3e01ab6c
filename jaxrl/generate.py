"""`python -m jaxrl.generate [--config FILE] [key=value ...]`: prompts JSONL -> completions JSONL.

Reads every prompt (see `GenerateConfig`), runs the rollout service, and writes one line per
completion as it finishes — to a temporary file renamed over `output` at the end, so an interrupted
run never leaves a truncated file — with a progress bar on stderr. Bad input lines stop the run
before any compilation, naming the line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jaxrl.config import CONFIGS_DIR, GenerateConfig, parse_cli


def read_prompts(path: str, tokenizer, chat: bool) -> list[tuple[dict, list[int]]]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{lineno}: not JSON ({e})")
            if "prompt_ids" in row:
                ids = row["prompt_ids"]
                if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
                    raise SystemExit(f"{path}:{lineno}: prompt_ids must be a non-empty list of ints")
            elif isinstance(row.get("prompt"), str):
                text = row["prompt"]
                if chat:
                    text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
                ids = tokenizer.encode(text)
            else:
                raise SystemExit(f"{path}:{lineno}: needs a string 'prompt' or a list 'prompt_ids'")
            rows.append((row, ids))
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    return rows


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(GenerateConfig, argv, default_yaml=CONFIGS_DIR / "generate.yaml", prog="python -m jaxrl.generate")
    import jax
    from tqdm import tqdm

    from models import init, load_hf, load_tokenizer
    e, s = cfg.engine, cfg.sampling
    from jaxrl.runtime import request_cpu_devices

    request_cpu_devices(e.num_devices)   # fake devices on a CPU host only
    tok_path = cfg.tokenizer or cfg.model.hf_path or "char"
    tokenizer = load_tokenizer(tok_path)
    rows = read_prompts(cfg.input, tokenizer, cfg.chat)
    model_cfg = cfg.model.model_config()
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise SystemExit(f"tokenizer {tok_path} has {tokenizer.vocab_size} tokens, the model only {model_cfg.vocab_size}")
    if cfg.model.hf_path:
        _, weights = load_hf(cfg.model.hf_path, dtype=cfg.model.jnp_dtype())
    else:
        weights = init(jax.random.key(0), model_cfg, cfg.model.jnp_dtype())
    params = s.build(stop_token_ids=tokenizer.eos_ids)
    svc = e.build(model_cfg, weights)
    owner = {}
    for i, (row, ids) in enumerate(rows):
        for j, rid in enumerate(svc.add(ids, params)):
            owner[rid] = (i, j)
    out = Path(cfg.output)
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "w") as f, tqdm(total=len(owner), desc="generate", unit="seq", file=sys.stderr) as bar:
        for c in svc.stream():
            i, j = owner[c.request_id]
            f.write(json.dumps({"index": i, "sample": j, **{k: v for k, v in rows[i][0].items() if k != "prompt_ids"},
                                "completion": tokenizer.decode(c.tokens), "tokens": c.tokens,
                                "logprobs": c.logprobs, "finish_reason": c.finish_reason}) + "\n")
            bar.update(1)
            bar.set_postfix(tok_s=f"{sum(st['tokens_per_s'] for st in svc.stats()):.0f}")
    os.replace(tmp, out)
    print(f"wrote {len(owner)} completions to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
