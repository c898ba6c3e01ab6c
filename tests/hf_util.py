"""Helpers for tests that use `transformers` (torch CPU) as the reference implementation."""

from __future__ import annotations

import dataclasses

import numpy as np

from models import PRESETS, config_to_hf

# Tiny configs that exercise every family feature: tied embeddings (qwen3), Llama-3 rope scaling and
# head_dim != hidden/heads (llama: 64/8=8 vs head_dim 16), q/k/v bias (qwen2), q/k norm (qwen3).
PARITY_CASES = {
    "qwen3-tied": PRESETS["tiny-qwen3"],
    "qwen3-untied": dataclasses.replace(PRESETS["tiny-qwen3"], tie_embeddings=False, num_layers=3),
    "llama3-rope-scaling": PRESETS["tiny-llama"],
    "qwen2-bias": PRESETS["tiny-qwen2"],
}


def hf_model(cfg, seed: int = 0):
    """A random transformers model with `cfg`'s shapes, float32, eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg, np.float32))
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits some tensors (biases) and ones-inits norms: randomise all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
