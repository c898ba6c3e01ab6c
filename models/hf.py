"""Hugging Face checkpoints: config.json <-> ModelConfig, safetensors <-> Weights.

`load_hf(path, dtype, shardings=None, vocab_size=None)` reads config.json (transformers 4 and 5 forms) and
single or index-sharded safetensors. With `shardings` (a `Weights` tree of `jax.sharding.Sharding`, e.g. from
`sharding.shardings_for`) every leaf is built with `jax.make_array_from_callback`: each device (and in
multi-host runs, each process) reads only its own slice from memory-mapped files, so an 8B model never
sits whole on one device. `save_hf` writes a directory `transformers` loads.

Padded vocabulary (`models.padded_vocab`): `load_hf(..., vocab_size=Vp)` builds `embed` [Vp, E] and `lm_head`
[E, Vp] with zeros past the checkpoint's vocabulary (with shardings, each device's read callback returns zeros
for its rows/columns >= the file's vocabulary and reads only the real part of its slice); `save_hf` accepts
padded weights and writes only the real vocabulary (`cfg.vocab_size`), so the files are what transformers expects.

HF stores projections as [out, in]; ours are [in, heads, head_dim] etc. Each of our leaves is
`reshape(transpose?(hf_tensor))`, and a slice of ours maps back to a contiguous row range of the HF
tensor, which is what `_read_block` reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from . import lora
from . import safetensors_io as st
from .config import ARCHITECTURES, ModelConfig, RopeScaling
from .tokenizer import save_tokenizer
from .weights import Layers, Weights, is_spec, vocab_rows, weight_specs

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unknown architecture, missing tensor, wrong shape."""


# ----------------------------------------------------------------------------------------- config

def config_from_hf(path_or_dict: str | os.PathLike | dict) -> ModelConfig:
    """ModelConfig from an HF config.json (path to it, to its directory, or the parsed dict)."""
    if isinstance(path_or_dict, dict):
        d, where = path_or_dict, "config"
    else:
        p = Path(path_or_dict)
        p = p / "config.json" if p.is_dir() else p
        if not p.exists():
            raise CheckpointError(f"no config.json at {p}")
        d, where = json.loads(p.read_text()), str(p)
    arch = d.get("model_type")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: unsupported model_type {arch!r} (architectures={d.get('architectures')}); "
                              f"supported: {', '.join(ARCHITECTURES)}")
    if d.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    window = _sliding_window(d, where)
    # transformers 5 moves rope_theta and the scaling dict into `rope_parameters`; 4 has them top level.
    rope = dict(d.get("rope_parameters") or {})
    scaling = rope if rope else dict(d.get("rope_scaling") or {})
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "llama3":
        rope_scaling = RopeScaling(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                                   high_freq_factor=float(scaling["high_freq_factor"]),
                                   original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    elif rope_type == "default":
        rope_scaling = None
    else:
        raise CheckpointError(f"{where}: rope type {rope_type!r} is not supported (supported: default, llama3)")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise CheckpointError(f"{where}: missing config keys {missing}")
    heads = d["num_attention_heads"]
    return ModelConfig(
        architecture=arch, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"], num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads, head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rope_theta=float(theta), rope_scaling=rope_scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)), qk_norm=arch == "qwen3",
        sliding_window=window)


def _sliding_window(d: dict, where: str) -> int | None:
    """W when every layer is windowed, None when none is; a per-layer mix is refused (one W for all layers).
    transformers' Qwen2/Qwen3 window layer i when use_sliding_window and i >= max_window_layers (5.x: the
    `layer_types` list says it per layer)."""
    if not d.get("use_sliding_window"):
        return None
    n = d["num_hidden_layers"]
    types = d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", n) else "full_attention"
                                     for i in range(n)]
    if all(t == "full_attention" for t in types):
        return None
    if any(t != "sliding_attention" for t in types) or not d.get("sliding_window"):
        raise CheckpointError(f"{where}: sliding window on some layers only (layer_types={types}, max_window_layers="
                              f"{d.get('max_window_layers')}) is not supported: one window for every layer or none")
    return int(d["sliding_window"])


def config_to_hf(cfg: ModelConfig, dtype) -> dict:
    """config.json contents (transformers-4 layout, which transformers 5 also reads)."""
    d = {
        "architectures": [_HF_ARCH[cfg.architecture]], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": jnp.dtype(dtype).name, "initializer_range": 0.02, "use_cache": True,
    }
    if cfg.architecture != "qwen2":
        d["attention_bias"] = cfg.qkv_bias
    if cfg.architecture == "llama":
        d["mlp_bias"] = False
    if cfg.architecture in ("qwen2", "qwen3"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        if cfg.sliding_window is not None:
            d.update(sliding_window=cfg.sliding_window, max_window_layers=0)
    elif cfg.sliding_window is not None:
        raise ValueError(f"{cfg.architecture}: transformers' Llama has no sliding window; sliding_window="
                         f"{cfg.sliding_window} cannot be exported")
    if cfg.rope_scaling is not None:
        d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return d


# ----------------------------------------------------------------------------------- tensor names

@dataclasses.dataclass(frozen=True)
class _Map:
    """How one of our leaves relates to an HF tensor.

    `name` has `{i}` for the layer index when our leaf is stacked. Per layer, our leaf equals
    `transpose?(hf).reshape(ours)`, where the (transposed) HF tensor is 2-D with its first dim made of
    our first `lead` dims and its second of the rest, or 1-D when `lead` covers all of ours.
    """

    name: str
    transpose: bool = False
    lead: int = 1

    def hf_t_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        if self.lead >= len(ours):
            return (math.prod(ours),)
        return (math.prod(ours[:self.lead]), math.prod(ours[self.lead:]))

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        t = self.hf_t_shape(ours)
        return t[::-1] if self.transpose else t

    def to_hf(self, arr: np.ndarray) -> np.ndarray:
        arr = arr.reshape(self.hf_t_shape(arr.shape))
        return arr.T if self.transpose else arr


def tensor_map(cfg: ModelConfig) -> Weights:
    """A `Weights` tree of `_Map` (None where the architecture has no such tensor)."""
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    proj = lambda name, lead=1: _Map(name, transpose=True, lead=lead)
    bias = lambda p: _Map(a + p + ".bias", lead=2) if cfg.qkv_bias else None
    norm = lambda p: _Map(a + p + ".weight") if cfg.qk_norm else None
    layers = Layers(
        attn_norm=_Map("model.layers.{i}.input_layernorm.weight"),
        wq=proj(a + "q_proj.weight"), wk=proj(a + "k_proj.weight"), wv=proj(a + "v_proj.weight"),
        wo=proj(a + "o_proj.weight", lead=2), mlp_norm=_Map("model.layers.{i}.post_attention_layernorm.weight"),
        w_gate=proj(m + "gate_proj.weight"), w_up=proj(m + "up_proj.weight"), w_down=proj(m + "down_proj.weight"),
        bq=bias("q_proj"), bk=bias("k_proj"), bv=bias("v_proj"), q_norm=norm("q_norm"), k_norm=norm("k_norm"))
    return Weights(embed=_Map("model.embed_tokens.weight"), layers=layers, final_norm=_Map("model.norm.weight"),
                   lm_head=None if cfg.tie_embeddings else proj("lm_head.weight"))


def _is_map(x) -> bool:
    return isinstance(x, _Map)


# ------------------------------------------------------------------------------------------ loading

class _Checkpoint:
    """The safetensors files of one HF directory, by tensor name."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        self.where = {}
        for fname in files:
            f = st.TensorFile(path / fname)
            for k in f.keys():
                self.where[k] = f

    def check(self, name: str, expected: tuple[int, ...]):
        if name not in self.where:
            raise CheckpointError(f"missing tensor {name} (expected shape {expected})")
        got = self.where[name].shape(name)
        if got != expected:
            raise CheckpointError(f"tensor {name} has shape {got}, expected {expected}")

    def block(self, name: str, m: _Map, ours: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """`ours[index]` for one per-layer leaf: reads only the HF rows that cover `index`."""
        self.check(name, m.hf_shape(ours))
        idx = [slice(*s.indices(n)[:2]) for s, n in zip(index, ours)]
        groups = [g for g in (range(0, m.lead), range(m.lead, len(ours))) if len(g)]
        hf_idx, shape, inner_idx = [], [], []
        for g in groups:
            inner = math.prod(ours[d] for d in g[1:])
            first = idx[g[0]]
            hf_idx.append(slice(first.start * inner, first.stop * inner))
            shape += [first.stop - first.start] + [ours[d] for d in g[1:]]
            inner_idx += [slice(None)] + [idx[d] for d in g[1:]]
        arr = self.where[name].read(name, tuple(hf_idx[::-1] if m.transpose else hf_idx))
        arr = arr.T if m.transpose else arr
        return arr.reshape(shape)[tuple(inner_idx)]


def load_hf(path: str | os.PathLike, dtype=jnp.float32, shardings: Weights | None = None,
            vocab_size: int | None = None) -> tuple[ModelConfig, Weights]:
    """Load config and weights from an HF directory, optionally straight into `shardings`.

    `vocab_size` (>= the checkpoint's vocabulary; default: equal to it): pad `embed` rows and `lm_head`
    columns with zeros up to it (`models.padded_vocab`); `shardings` must then be for the padded shapes
    (`logical_axes(cfg, vocab_size=...)`). The returned config keeps the real vocabulary.
    """
    path = Path(path)
    cfg = config_from_hf(path)
    ckpt = _Checkpoint(path)
    specs, maps = weight_specs(cfg, dtype), tensor_map(cfg)
    padded = weight_specs(cfg, dtype, vocab_size)
    spec_leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    padded_leaves = jax.tree.leaves(padded, is_leaf=is_spec)
    map_leaves = jax.tree.leaves(maps, is_leaf=_is_map)
    shard_leaves = [None] * len(spec_leaves) if shardings is None else jax.tree.leaves(shardings)
    if len(shard_leaves) != len(spec_leaves):
        raise ValueError(f"shardings tree has {len(shard_leaves)} leaves, weights have {len(spec_leaves)}")

    for spec, m in zip(spec_leaves, map_leaves):  # fail on a bad checkpoint before any device work
        stacked = "{i}" in m.name
        for i in range(spec.shape[0] if stacked else 1):
            ckpt.check(m.name.format(i=i), m.hf_shape(spec.shape[1:] if stacked else spec.shape))

    def leaf(spec, padded_spec, m: _Map, sharding):
        stacked = "{i}" in m.name
        per_layer = spec.shape[1:] if stacked else spec.shape

        def read_real(index):
            index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
            if not stacked:
                return ckpt.block(m.name, m, per_layer, index).astype(dtype)
            layers = range(*index[0].indices(spec.shape[0]))
            return np.stack([ckpt.block(m.name.format(i=i), m, per_layer, index[1:]) for i in layers]
                            ).astype(dtype)

        def read_padded(index):
            """`padded[index]`: the part inside the file's shape read from it, zeros beyond."""
            index = tuple(index) + (slice(None),) * (len(padded_spec.shape) - len(index))
            want = [sl.indices(n)[:2] for sl, n in zip(index, padded_spec.shape)]
            out = np.zeros([b - a for a, b in want], dtype)
            have = [(a, min(b, n)) for (a, b), n in zip(want, spec.shape)]
            if all(b > a for a, b in have):
                out[tuple(slice(0, b - a) for a, b in have)] = read_real(tuple(slice(a, b) for a, b in have))
            return out

        read = read_real if padded_spec.shape == spec.shape else read_padded
        if sharding is None:
            return jnp.asarray(read(()))
        return jax.make_array_from_callback(padded_spec.shape, sharding, read)

    return cfg, jax.tree.unflatten(treedef, [leaf(*x) for x in zip(spec_leaves, padded_leaves, map_leaves,
                                                                   shard_leaves)])


# ------------------------------------------------------------------------------------------ saving

# A stacked leaf up to this size is gathered to the host whole and cut into layers there: slicing layer i on the
# devices (`x[i]`) is an eager op, one program per leaf shape to trace and compile (15 for the tiny model's export).
# A larger leaf still moves one layer at a time, bounding the host's memory.
HOST_WHOLE_LEAF_BYTES = 256 << 20


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def save_hf(out_dir: str | os.PathLike, cfg: ModelConfig, weights: Weights, *, dtype=None,
            max_shard_bytes: int = 2 << 30, tokenizer=None) -> Path:
    """Write config.json + safetensors (index-sharded above `max_shard_bytes`) that transformers loads;
    with `tokenizer`, also its files (`models.tokenizer.save_tokenizer`) and generation_config.json (its
    end-of-sequence, padding and start ids), so the directory is a complete checkpoint for
    `AutoModelForCausalLM`/`AutoTokenizer.from_pretrained` and `python -m jaxrl.generate model.hf_path=DIR`.

    Tensors are gathered to host one layer at a time (a stacked leaf of at most `HOST_WHOLE_LEAF_BYTES` whole,
    then cut into layers on the host). In a multi-process run every process gathers
    and only process 0 writes. Weights with a padded vocabulary (`models.padded_vocab`) are accepted;
    only the first `cfg.vocab_size` rows of `embed` / columns of `lm_head` are written. Weights with LoRA
    adapters are written merged (W + s·A B: `models.lora.merge`); `models.peft_io.save_peft` writes the
    adapters alone.
    """
    out = Path(out_dir)
    if lora.has_adapters(weights):          # LoRA: the merged weights W + s·A B, a plain checkpoint
        weights = lora.merge(weights)
    cfg = dataclasses.replace(cfg, lora=None)
    dtype = jnp.dtype(dtype or jax.tree.leaves(weights)[0].dtype)
    write = jax.process_index() == 0
    specs, maps = weight_specs(cfg, dtype), tensor_map(cfg)
    rows = vocab_rows(weights)
    if rows < cfg.vocab_size:
        raise ValueError(f"weights have {rows} vocabulary rows, fewer than the config's vocab_size {cfg.vocab_size}")
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    padded_leaves = jax.tree.leaves(weight_specs(cfg, dtype, rows), is_leaf=is_spec)
    map_leaves = jax.tree.leaves(maps, is_leaf=_is_map)
    arrays = jax.tree.leaves(weights)
    if len(arrays) != len(spec_leaves):
        raise ValueError(f"weights have {len(arrays)} leaves but {cfg.architecture} config implies {len(spec_leaves)}")
    shards, current, size = [], {}, 0

    def emit(name, arr):
        nonlocal current, size
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = arr
        size += arr.nbytes

    for spec, padded_spec, m, x in zip(spec_leaves, padded_leaves, map_leaves, arrays):
        if tuple(x.shape) != padded_spec.shape:
            raise ValueError(f"{m.name}: weight shape {tuple(x.shape)} != expected {padded_spec.shape}")
        stacked = "{i}" in m.name
        real = tuple(slice(0, n) for n in spec.shape[1 if stacked else 0:])  # drops vocabulary padding
        whole = _to_host(x) if not stacked or x.nbytes <= HOST_WHOLE_LEAF_BYTES else None
        for i in range(spec.shape[0] if stacked else 1):
            if not stacked:
                layer = whole
            else:
                layer = whole[i] if whole is not None else _to_host(x[i])
            arr = m.to_hf(layer[real].astype(dtype))
            emit(m.name.format(i=i), np.ascontiguousarray(arr))
    if current:
        shards.append(current)
    if write:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype), indent=2))
        if len(shards) == 1:
            st.write(out / "model.safetensors", shards[0])
        else:
            weight_map, total = {}, 0
            for k, shard in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                st.write(out / fname, shard)
                weight_map.update({name: fname for name in shard})
                total += sum(a.nbytes for a in shard.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if tokenizer is not None:
            save_tokenizer(tokenizer, out)
            eos = list(tokenizer.eos_ids)
            gen = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": tokenizer.pad_id}
            if getattr(tokenizer, "bos_id", None) is not None:
                gen["bos_token_id"] = tokenizer.bos_id
            (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out
