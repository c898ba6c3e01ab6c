"""LoRA adapters as PEFT files: `adapter_config.json` + `adapter_model.safetensors`, what
`peft.PeftModel.from_pretrained(base, DIR)` loads onto a transformers model of the same base.

Tensor names and layouts are PEFT's for a causal LM:
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out_features, r]
with in/out features flattened the way our HF export flattens the projection (`models.hf.tensor_map`: q_proj's
out features are (heads, head_dim) row-major, o_proj's in features the same). PEFT's scale is lora_alpha / r, ours
(`LoraConfig.scale`) too, so the merged weights and the logits agree.

    save_peft(out_dir, cfg, params)                       -> out_dir   (process 0 writes)
    lora_config_from_peft(dir)                            -> LoraConfig (rank, alpha, targets)
    load_peft(dir, cfg, base_weights, shardings=None)     -> params with the adapter's A and B
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from . import lora
from . import safetensors_io as st
from .config import LORA_TARGETS, LoraConfig, ModelConfig
from .hf import load_hf
from .weights import attach_lora, init

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class AdapterError(ValueError):
    """A PEFT adapter directory that does not fit the model (missing files, names or shapes)."""


def _name(i: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{i}.{_MODULE[target]}.{target}.lora_{which}.weight"


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _place(host: np.ndarray, like: jax.Array) -> jax.Array:
    """`host` as a global array in `like`'s sharding (each process supplies its devices' slices)."""
    return jax.make_array_from_callback(host.shape, like.sharding, lambda index: host[index])


def save_peft(out_dir: str | os.PathLike, cfg: ModelConfig, params, *, base_model: str | None = None) -> Path:
    """Write `params`' adapters as a PEFT LoRA adapter. Every process gathers; process 0 writes."""
    if cfg.lora is None or not lora.has_adapters(params):
        raise ValueError("save_peft: the model has no LoRA adapters (model.lora.rank=0)")
    out, tensors = Path(out_dir), {}
    for target, field in zip(cfg.lora.targets, cfg.lora.fields):
        node = getattr(params.layers, field)
        a, b = _to_host(node.lora_a), _to_host(node.lora_b)
        r = a.shape[-1]
        for i in range(a.shape[0]):
            tensors[_name(i, target, "A")] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            tensors[_name(i, target, "B")] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
              "lora_dropout": cfg.lora.dropout, "target_modules": list(cfg.lora.targets), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
              "modules_to_save": None, "layers_to_transform": None, "init_lora_weights": True,
              "base_model_name_or_path": base_model}
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        st.write(out / WEIGHTS, tensors, metadata={"format": "pt"})
        (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


def lora_config_from_peft(path: str | os.PathLike) -> LoraConfig:
    """The `LoraConfig` a PEFT adapter directory describes; refuses what our LoRA does not compute."""
    f = Path(path) / CONFIG
    if not f.is_file():
        raise AdapterError(f"{path}: no {CONFIG} (a PEFT LoRA adapter directory has it)")
    c = json.loads(f.read_text())
    if c.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{f}: peft_type={c.get('peft_type')!r}; only LORA adapters load")
    for key, ok in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
                    ("modules_to_save", None), ("layers_to_transform", None)):
        if c.get(key, ok) not in (ok, [] if ok is None else ok):
            raise AdapterError(f"{f}: {key}={c.get(key)!r} is not supported (need {ok!r})")
    targets = c.get("target_modules")
    if isinstance(targets, str):
        targets = list(LORA_TARGETS) if targets == "all-linear" else [targets]
    if not targets or any(t not in LORA_TARGETS for t in targets):
        raise AdapterError(f"{f}: target_modules={targets!r}; supported: {', '.join(LORA_TARGETS)}")
    order = [t for t in LORA_TARGETS if t in targets]
    try:
        return LoraConfig(rank=int(c["r"]), alpha=float(c.get("lora_alpha", 8)), dropout=0.0, targets=tuple(order))
    except (KeyError, ValueError) as e:
        raise AdapterError(f"{f}: {e}") from None


def load_peft(path: str | os.PathLike, cfg: ModelConfig, base_weights, shardings=None):
    """`base_weights` (plain) with the adapter at `path` attached; `cfg.lora` must be the adapter's
    (`lora_config_from_peft`). `shardings`: the LoRA tree's shardings (from `logical_axes(cfg)`)."""
    want = lora_config_from_peft(path)
    if cfg.lora is None or (cfg.lora.rank, cfg.lora.scale, set(cfg.lora.targets)) != \
            (want.rank, want.scale, set(want.targets)):
        raise AdapterError(f"{path}: the adapter is {want}; the model config's lora is {cfg.lora}")
    f = Path(path) / WEIGHTS
    if not f.is_file():
        raise AdapterError(f"{path}: no {WEIGHTS}")
    tf = st.TensorFile(f)
    params = attach_lora(base_weights, cfg, jax.random.key(0), shardings)     # shapes and shardings; replaced
    new = {}
    for target, field in zip(cfg.lora.targets, cfg.lora.fields):
        node = getattr(params.layers, field)
        stacked = {"A": [], "B": []}
        for i in range(node.lora_a.shape[0]):
            for which, like in (("A", node.lora_a), ("B", node.lora_b)):
                name = _name(i, target, which)
                if name not in tf.keys():
                    raise AdapterError(f"{f}: missing tensor {name}")
                arr = tf.read(name)
                per_layer = like.shape[1:]
                r = cfg.lora.rank
                want_shape = (r, int(np.prod(per_layer[:-1]))) if which == "A" else (int(np.prod(per_layer[1:])), r)
                if arr.shape != want_shape:
                    raise AdapterError(f"{f}: {name} has shape {arr.shape}, expected {want_shape}")
                stacked[which].append(arr.T.reshape(per_layer))
        a, b = (_place(np.stack(stacked[w]).astype(like.dtype), like) for w, like in
                (("A", node.lora_a), ("B", node.lora_b)))
        new[field] = lora.LoraLinear(node.w, a, b, node.scale)
    return dataclasses.replace(params, layers=dataclasses.replace(params.layers, **new))


def load_weights(cfg: ModelConfig, *, key: jax.Array, dtype, hf_path: str | None = None, adapter: str | None = None,
                 shardings=None, vocab_size: int | None = None):
    """A run's starting weights: the base from `hf_path` (else `models.init` from `key`), with `cfg.lora`'s
    adapters fresh (B = 0) or read from the PEFT `adapter` directory. `shardings` for `cfg`'s tree."""
    if hf_path is None and (cfg.lora is None or adapter is None):
        return init(key, cfg, dtype, shardings=shardings, vocab_size=vocab_size)
    plain = dataclasses.replace(cfg, lora=None)
    base_sh = None if shardings is None else lora.base(shardings)
    if hf_path is not None:
        _, weights = load_hf(hf_path, dtype=dtype, shardings=base_sh, vocab_size=vocab_size)
    else:
        weights = init(key, plain, dtype, shardings=base_sh, vocab_size=vocab_size)
    if cfg.lora is None:
        return weights
    if adapter is not None:
        return load_peft(adapter, cfg, weights, shardings)
    return attach_lora(weights, cfg, jax.random.fold_in(key, lora.ATTACH_KEY), shardings)
