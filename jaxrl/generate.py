"""`python -m jaxrl.generate [--config FILE] [key=value ...]`: prompts JSONL -> completions JSONL.

Reads every prompt (see `GenerateConfig`), runs the rollout service, and writes one line per sample in
input order (prompt `index`, then `sample`): each line is written as soon as it and every line before
it are done, so a long run's output grows while it runs. Lines go to `OUTPUT.partial`, renamed over
`output` at the end; on an error or Ctrl-C the partial file is removed (one line says so), so nothing
truncated is ever left. Prompt i samples with its own seed, `prompt_seed(sampling.seed, i)`: two equal
prompts get different samples, and a prompt's samples do not depend on the other lines of the file.
Bad input lines and prompts longer than `engine.max_seq_len` allows stop the run before any
compilation, naming the line; paths in messages are absolute. With `engine.adaptive_tp.enabled=true` (PAT)
the layout may switch mid-generation; the decisions go to `OUTPUT.pat_decisions.jsonl`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
from tqdm import tqdm

from jaxrl.config import CONFIGS_DIR, GenerateConfig, parse_cli
from jaxrl.rollout.params import SamplingParams, prompt_seed
from jaxrl.rollout.service import RolloutService
from jaxrl.runtime import request_cpu_devices
from models import load_tokenizer
from models.peft_io import load_weights


def read_prompts(path: str, tokenizer, chat: bool, max_len: int | None = None) -> list[tuple[dict, list[int]]]:
    """(row, prompt ids) per non-empty line; `max_len`: the longest prompt allowed (SystemExit otherwise)."""
    rows = []
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise SystemExit(f"input={path}: no such file")
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
            if max_len is not None and len(ids) > max_len:
                raise SystemExit(f"{path}:{lineno}: prompt of {len(ids)} tokens + sampling.max_new_tokens > "
                                 f"engine.max_seq_len (prompts up to {max_len} tokens fit); raise engine.max_seq_len")
            rows.append((row, ids))
    if not rows:
        raise SystemExit(f"{path}: no prompts")
    return rows


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(GenerateConfig, argv, default_yaml=CONFIGS_DIR / "generate.yaml", prog="python -m jaxrl.generate")
    e, s = cfg.engine, cfg.sampling
    request_cpu_devices(e.num_devices)   # fake devices on a CPU host only
    if cfg.model.hf_path is not None and not os.path.isfile(os.path.join(cfg.model.hf_path, "config.json")):
        raise SystemExit(f"model.hf_path={os.path.abspath(cfg.model.hf_path)}: no config.json there (not a Hugging "
                         "Face checkpoint directory)")
    tok_path = cfg.tokenizer or cfg.model.hf_path or "char"
    try:
        tokenizer = load_tokenizer(tok_path)
    except (OSError, ValueError) as err:
        raise SystemExit(f"tokenizer {os.path.abspath(tok_path) if tok_path != 'char' else tok_path}: {err}; "
                         "set tokenizer=DIR (a directory with tokenizer.json) or tokenizer=char") from None
    rows = read_prompts(cfg.input, tokenizer, cfg.chat, max_len=e.max_seq_len - s.max_new_tokens)
    model_cfg = cfg.model.model_config()
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise SystemExit(f"tokenizer {tok_path} has {tokenizer.vocab_size} tokens, the model only {model_cfg.vocab_size}")
    weights = load_weights(model_cfg, key=jax.random.key(0), dtype=cfg.model.jnp_dtype(), hf_path=cfg.model.hf_path,
                           adapter=cfg.model.lora.adapter)      # (a PEFT adapter on the base: model.lora.adapter=DIR)
    svc = RolloutService.from_config(e, model_cfg, weights)
    order = []                                    # (prompt index, sample) of each request id, in input order
    owner = {}
    for i, (row, ids) in enumerate(rows):
        params = SamplingParams.from_config(s, stop_token_ids=tokenizer.eos_ids, seed=prompt_seed(s.seed, i))
        for j, rid in enumerate(svc.add(ids, params)):
            owner[rid] = len(order)
            order.append((i, j))
    out = Path(cfg.output).absolute()
    tmp = out.with_name(out.name + ".partial")
    done: dict[int, str] = {}
    written = 0
    try:
        with open(tmp, "w") as f, tqdm(total=len(order), desc="generate", unit="seq", file=sys.stderr) as bar:
            for c in svc.stream():
                k = owner[c.request_id]
                i, j = order[k]
                done[k] = json.dumps({"index": i, "sample": j,
                                      **{key: v for key, v in rows[i][0].items() if key != "prompt_ids"},
                                      "completion": tokenizer.decode(c.tokens), "tokens": c.tokens,
                                      "logprobs": c.logprobs, "finish_reason": c.finish_reason})
                while written in done:            # every line up to here is complete: write them in order
                    f.write(done.pop(written) + "\n")
                    written += 1
                f.flush()
                bar.update(1)
                bar.set_postfix(tok_s=f"{sum(st['tokens_per_s'] for st in svc.stats()):.0f}")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        print(f"generate stopped after {written} of {len(order)} completions; nothing written to {out}",
              file=sys.stderr)
        raise
    print(f"wrote {len(order)} completions to {out}", file=sys.stderr)
    if svc.adaptive is not None:            # PAT (engine.adaptive_tp): its decisions beside the output
        pat = out.with_name(out.name + ".pat_decisions.jsonl")
        pat.write_text("".join(json.dumps(r) + "\n" for r in svc.adaptive.records()))
        m = svc.adaptive.metrics()
        print(f"PAT: {m['pat/decisions']} decisions, {m['pat/switches']} switches ({m['pat/switch_s']:.2f} s), "
              f"largest TP {m['pat/max_tp']}; records in {pat}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
