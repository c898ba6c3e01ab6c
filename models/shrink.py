"""A smaller student from a checkpoint: its first N decoder layers, the same embedding, final norm, head and
tokenizer (on-policy distillation's "a few layers of the teacher", docs/opd.md).

    python -m models.shrink SRC DST --layers 6
    from models.shrink import shrink; shrink(SRC, DST, layers=6)       # -> Path(DST)

The result is an HF directory (config.json with num_hidden_layers=N, safetensors, the source's tokenizer files)
that `model.hf_path=DST` trains and transformers loads. The layers kept are the source's, unchanged: the model
they make is a different (worse) model, which a short supervised warm start on the teacher's samples
(`warm_start.response_key`) brings back towards the teacher.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import jax

from .hf import load_hf, save_hf
from .tokenizer import TOKENIZER_FILES


def shrink(src: str | Path, dst: str | Path, *, layers: int) -> Path:
    """Write the first `layers` decoder layers of the HF checkpoint `src` as a checkpoint at `dst`."""
    src, dst = Path(src), Path(dst)
    cfg, weights = load_hf(src)
    if not 1 <= layers <= cfg.num_layers:
        raise ValueError(f"--layers {layers}: {src} has {cfg.num_layers} decoder layers; keep 1..{cfg.num_layers}")
    small = dataclasses.replace(cfg, num_layers=layers)
    kept = dataclasses.replace(weights, layers=jax.tree.map(lambda x: x[:layers], weights.layers))
    save_hf(dst, small, kept)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="an HF checkpoint directory")
    ap.add_argument("dst", help="where the smaller checkpoint goes")
    ap.add_argument("--layers", type=int, required=True, help="decoder layers to keep (the first N)")
    args = ap.parse_args(argv)
    try:
        out = shrink(args.src, args.dst, layers=args.layers)
    except (ValueError, OSError) as e:
        print(f"models.shrink: {e}", file=sys.stderr)
        return 2
    print(f"{out}: the first {args.layers} layers of {args.src}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
