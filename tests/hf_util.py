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
    # sliding window on every layer (HF: use_sliding_window, max_window_layers=0), shorter than the rows
    "qwen3-window": dataclasses.replace(PRESETS["tiny-qwen3"], sliding_window=7),
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


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_bpe_tokenizer(directory, vocab_size: int = 300):
    """A small byte-level BPE tokenizer.json + tokenizer_config.json (ChatML template, EOS <|im_end|>)."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["what is 2 + 3? the answer is 5.", "system user assistant hello world"] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def write_tiny_checkpoint(directory, preset: str = "tiny-qwen3", dtype="float32", seed: int = 0):
    """A tiny HF checkpoint directory (config.json, safetensors, a BPE tokenizer) as a user would bring."""
    import jax
    import jax.numpy as jnp

    from models import init, save_hf

    cfg = PRESETS[preset]
    save_hf(directory, cfg, init(jax.random.key(seed), cfg, jnp.dtype(dtype)))
    write_bpe_tokenizer(directory)
    return directory
