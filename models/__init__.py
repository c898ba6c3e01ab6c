"""Decoder LLM family (Llama-3.x, Qwen2.5, Qwen3): configs, weight pytrees, pure forward functions, HF I/O.

    from models import load_hf, save_hf, forward
    cfg, weights = load_hf("path/to/hf_dir", dtype=jnp.float32)
    logits = forward(weights, cfg, tokens)            # [B, T] int32 -> [B, T, vocab]
    save_hf("out_dir", cfg, weights)
"""

from .config import PRESETS, ModelConfig, RopeScaling, preset
from .weights import (KV_CACHE_AXES, LOGICAL_AXES, ArraySpec, Layers, Weights, abstract, attach_lora, fit_vocab, init,
                      is_spec, kv_cache_spec, logical_axes, padded_vocab, vocab_rows, weight_specs)

__all__ = [
    "PRESETS", "ModelConfig", "RopeScaling", "preset",
    "KV_CACHE_AXES", "LOGICAL_AXES", "kv_cache_spec", "ArraySpec", "Layers", "Weights", "abstract", "attach_lora", "init", "is_spec", "logical_axes",
    "weight_specs",
    "fit_vocab", "padded_vocab", "vocab_rows",
]

from .forward import (ATTENTION_IMPLS, REMAT_POLICIES, decoder_layer, decoder_stack, forward,  # noqa: E402
                      forward_block, inv_freq, lm_head)
from .hf import CheckpointError, config_from_hf, config_to_hf, load_hf, save_hf  # noqa: E402

__all__ += ["ATTENTION_IMPLS", "REMAT_POLICIES", "decoder_layer", "decoder_stack", "forward", "forward_block",
            "inv_freq", "lm_head", "CheckpointError", "config_from_hf", "config_to_hf", "load_hf", "save_hf"]
from .tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer, save_tokenizer  # noqa: E402

__all__ += ["CharTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "save_tokenizer"]
from .gguf import GGUFError, convert_gguf  # noqa: E402

__all__ += ["GGUFError", "convert_gguf"]
