"""GGUF import: a llama.cpp GGUF file of a Llama-family model -> an HF checkpoint directory `load_hf` reads.

    from models.gguf import convert_gguf
    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out_dir", dtype="float32")
    cfg, weights = models.load_hf("out_dir")

    python -m models.gguf FILE.gguf OUT_DIR [--dtype bfloat16]

What is written: `config.json` (from the GGUF metadata, through `models.hf.config_to_hf`), `model.safetensors`
(or index-sharded files past `max_shard_bytes`) with the HF tensor names, `tokenizer.json` (byte-level BPE built
with the `tokenizers` library from the GGUF's tokens and merges), `tokenizer_config.json` (chat template,
bos/eos/pad/unk tokens) and `generation_config.json`. No torch: the `gguf` package reads the file and
dequantizes every tensor to float32 (`gguf.quants.dequantize`), then each is cast to `dtype`.

Two things llama.cpp's `convert_hf_to_gguf.py` changes and this module undoes:
  * q_proj / k_proj rows are permuted per head from HF's rotate-half RoPE layout (the two halves of a head)
    to llama.cpp's interleaved pairs: `permute_qk` is that permutation, `unpermute_qk` its inverse (the
    same as transformers' `LlamaTensorProcessor._reverse_permute_weights`);
  * a tied model has no `output.weight`: `tie_word_embeddings` is set from its absence.

Simplified, and refused with a one-line `GGUFError` rather than converted wrongly:
  * only `general.architecture = llama` (Mistral/Qwen GGUFs name and permute tensors differently);
  * no RoPE scaling: a `rope_freqs.weight` tensor (llama.cpp's form of Llama-3.1 scaling), a
    `rope.scaling.type` other than none, or partial rotary (`rope.dimension_count` != head_dim);
  * only byte-level BPE tokenizers (`tokenizer.ggml.model = gpt2`) with a pre-tokenizer mapped in
    `PRE_TOKENIZERS` (llama.cpp names its split regexes; gpt2 and smollm are mapped, others are refused);
  * quantization types `gguf.quants` cannot dequantize (Q8_1, Q8_K, integer tensors ...). A dequantized
    model is the quantized model's weights exactly, not the original float checkpoint's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import gguf
import jax
import ml_dtypes
import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tok_models
from tqdm import tqdm

from . import safetensors_io as st
from .config import ModelConfig
from .hf import config_to_hf, tensor_map
from .weights import is_spec, weight_specs

CONVERTER_VERSION = 1           # bump when the files written for the same GGUF change (models.fetch re-converts)
ARCHITECTURES = ("llama",)
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
MAX_SHARD_BYTES = 4 << 30

# llama.cpp tensor names -> HF names ("{i}": the block index)
_BLOCK_TENSORS = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "attn_q": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_output": "model.layers.{i}.self_attn.o_proj.weight",
    "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "ffn_up": "model.layers.{i}.mlp.up_proj.weight",
    "ffn_down": "model.layers.{i}.mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight",
                "output": "lm_head.weight"}

# llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`, its `llama-vocab.cpp` regexes) -> the HF pre-tokenizer.
# Only these two are mapped and tested; another name (llama-bpe, qwen2 ...) is refused, not guessed.
PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    # SmolLM's: every digit alone ("\p{N}"), then GPT-2's regex (HF: Digits(individual) + ByteLevel)
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}
_CONTROL, _USER_DEFINED = 3, 4          # llama.cpp token types (gguf.TokenType)


class GGUFError(ValueError):
    """A GGUF file this importer cannot convert (one line: what and why)."""


# ------------------------------------------------------------------------------------------- reading

def _open(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise GGUFError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises bare ValueError/struct errors on foreign files
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def metadata(reader: gguf.GGUFReader) -> dict:
    """The GGUF key/value metadata as Python values (strings, numbers, lists)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _req(meta: dict, key: str, where: str):
    if key not in meta:
        raise GGUFError(f"{where}: missing metadata key {key}")
    return meta[key]


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def config_from_gguf(meta: dict, tensor_names, where: str = "gguf") -> ModelConfig:
    """The `ModelConfig` a Llama GGUF's metadata describes (`tensor_names`: to tell a tied model)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{where}: general.architecture={arch!r} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES)})")
    k = lambda name: f"{arch}.{name}"
    names = set(tensor_names)
    if "rope_freqs.weight" in names or meta.get(k("rope.scaling.type"), "none") != "none":
        raise GGUFError(f"{where}: RoPE scaling (rope_freqs.weight / {k('rope.scaling.type')}) is not supported")
    heads = int(_req(meta, k("attention.head_count"), where))
    hidden = int(_req(meta, k("embedding_length"), where))
    head_dim = int(meta.get(k("attention.key_length"), hidden // heads))
    if int(meta.get(k("attention.value_length"), head_dim)) != head_dim:
        raise GGUFError(f"{where}: key_length {head_dim} != value_length {meta[k('attention.value_length')]}")
    if int(meta.get(k("rope.dimension_count"), head_dim)) != head_dim:
        raise GGUFError(f"{where}: partial rotary (rope.dimension_count={meta[k('rope.dimension_count')]}, "
                        f"head_dim={head_dim}) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(k("vocab_size"), len(tokens) if tokens else 0))
    return ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(_req(meta, k("feed_forward_length"), where)),
        num_layers=int(_req(meta, k("block_count"), where)), num_heads=heads,
        num_kv_heads=int(meta.get(k("attention.head_count_kv"), heads)), head_dim=head_dim,
        rope_theta=_f32(meta.get(k("rope.freq_base"), 10000.0)),
        rms_norm_eps=_f32(_req(meta, k("attention.layer_norm_rms_epsilon"), where)),
        max_position_embeddings=int(meta.get(k("context_length"), 4096)),
        tie_embeddings="output.weight" not in names)


def hf_name(name: str, where: str = "gguf") -> str:
    """The HF tensor name of a llama.cpp one ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    parts = name.split(".")
    if len(parts) == 2 and parts[1] == "weight" and parts[0] in _TOP_TENSORS:
        return _TOP_TENSORS[parts[0]]
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in _BLOCK_TENSORS:
        return _BLOCK_TENSORS[parts[2]].format(i=int(parts[1]))
    raise GGUFError(f"{where}: tensor {name!r} has no HF equivalent in a llama model (biases, MoE experts and "
                    f"rope_freqs are not supported)")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (`convert_hf_to_gguf.py` `LlamaModel.permute`): per head, rows
    [first half; second half] (HF rotate-half) -> interleaved pairs. w: [n_head * head_dim, in]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_qk`: llama.cpp's GGUF q/k rows back to HF's order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_type(t, where: str) -> None:
    """Refuse `t` unless its type dequantizes: tried on its first block only (cheap)."""
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    _dequantize(t.name, np.asarray(t.data).reshape(-1).view(np.uint8)[:type_size], qtype, where)


def _dequantize(name: str, data: np.ndarray, qtype, where: str) -> np.ndarray:
    if qtype.name.startswith("I") and qtype.name[1:].isdigit():        # I8 ... I64: integer tensors
        raise GGUFError(f"{where}: tensor {name} has integer type {qtype.name}; a weight must be a float "
                        f"or quantized float type")
    try:
        return gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        raise GGUFError(f"{where}: tensor {name} has quantization type {qtype.name}, which the gguf "
                        f"package cannot dequantize") from None


def dequantize(t, where: str = "gguf") -> np.ndarray:
    """One reader tensor as float32 in HF's [out, in] layout (numpy order: GGUF lists dims innermost first)."""
    x = _dequantize(t.name, t.data, gguf.GGMLQuantizationType(t.tensor_type), where)
    shape = tuple(int(n) for n in reversed(t.shape))
    return np.asarray(x, np.float32).reshape(shape)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, exactly what `models.hf.load_hf` checks (`tensor_map` x `weight_specs`)."""
    out = {}
    maps = jax.tree.leaves(tensor_map(cfg))             # `_Map`s are leaves; absent tensors (None) drop out
    for spec, m in zip(jax.tree.leaves(weight_specs(cfg), is_leaf=is_spec), maps, strict=True):
        stacked = "{i}" in m.name
        for i in range(spec.shape[0] if stacked else 1):
            out[m.name.format(i=i)] = m.hf_shape(spec.shape[1:] if stacked else spec.shape)
    return out


# ----------------------------------------------------------------------------------------- tokenizer

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


def tokenizer_from_gguf(meta: dict, where: str = "gguf") -> Tokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE) from the GGUF's tokens, merges, token types and pre-tokenizer.

    Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added tokens, both
    matched whole before the BPE model, as llama.cpp does. A token outside the byte alphabet that is not an
    added token is re-spelled in it (transformers' GGUF loader does the same)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"{where}: tokenizer.ggml.model={model!r}; only byte-level BPE ('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported (supported: "
                        f"{', '.join(PRE_TOKENIZERS)})")
    tokens = list(_req(meta, "tokenizer.ggml.tokens", where))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in _req(meta, "tokenizer.ggml.merges", where)]
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise GGUFError(f"{where}: malformed tokenizer metadata ({len(tokens)} tokens, {len(types)} token types, "
                        f"merges must be 'a b' pairs)")
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    added = {_CONTROL, _USER_DEFINED}
    vocab = {t if ty in added or set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
             for i, (t, ty) in enumerate(zip(tokens, types))}
    if len(vocab) != len(tokens):
        raise GGUFError(f"{where}: the vocabulary has duplicate tokens ({len(tokens) - len(vocab)})")
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], int(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                    if ty == _USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError(f"{where}: the tokenizer built has {tok.get_vocab_size(with_added_tokens=True)} tokens, "
                        f"the file lists {len(tokens)}")
    return tok


def _special(meta: dict) -> dict[str, int]:
    """bos/eos/pad/unk token ids the file names."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
    return {name: int(meta[f"tokenizer.ggml.{k}"]) for name, k in keys.items() if f"tokenizer.ggml.{k}" in meta}


def tokenizer_config(meta: dict, cfg: ModelConfig) -> dict:
    """tokenizer_config.json: the chat template and the special tokens (as strings, as transformers writes them)."""
    tokens = meta["tokenizer.ggml.tokens"]
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_max_length": cfg.max_position_embeddings,
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    conf.update({f"{name}_token": tokens[i] for name, i in _special(meta).items()})
    if "tokenizer.chat_template" in meta:
        conf["chat_template"] = meta["tokenizer.chat_template"]
    return conf


# ------------------------------------------------------------------------------------------ writing

def _plan_shards(names: list[str], shapes: dict, itemsize: int, max_bytes: int) -> list[list[str]]:
    shards, size = [[]], 0
    for n in names:
        b = int(np.prod(shapes[n])) * itemsize
        if shards[-1] and size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += b
    return shards


def _weights(reader, cfg: ModelConfig, dtype, progress: bool, where: str):
    """(HF name, array in `dtype`) for every tensor, in file order: dequantized, q/k rows un-permuted."""
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        w = dequantize(t, where)
        if ".attn_q." in t.name:
            w = unpermute_qk(w, cfg.num_heads)
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, cfg.num_kv_heads)
        yield hf_name(t.name, where), w.astype(dtype)


def _check_tensors(reader, cfg: ModelConfig, where: str) -> tuple[list[str], dict]:
    expected = _expected_shapes(cfg)
    names = [hf_name(t.name, where) for t in reader.tensors]
    extra = sorted(set(names) - set(expected))
    missing = sorted(set(expected) - set(names))
    if extra or missing:
        raise GGUFError(f"{where}: tensors do not fit the {cfg.num_layers}-layer config: missing {missing[:3]}, "
                        f"unexpected {extra[:3]}")
    for t, n in zip(reader.tensors, names):
        got = tuple(int(d) for d in reversed(t.shape))
        if got != expected[n]:
            raise GGUFError(f"{where}: tensor {t.name} has shape {got}, the config implies {expected[n]}")
    return names, expected


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32", *,
                 max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False) -> Path:
    """Convert a Llama GGUF into an HF checkpoint directory `out_dir` (created; must not hold files yet).
    Everything is checked (architecture, tokenizer, every tensor's name, shape and type) before a file is
    written. `dtype`: "float32" (default: the dequantized values exactly) or "bfloat16"."""
    path, out = Path(path), Path(out_dir)
    if dtype not in DTYPES:
        raise GGUFError(f"dtype={dtype!r}; valid choices: {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFError(f"{out} exists and is not an empty directory")
    reader = _open(path)
    meta, where = metadata(reader), str(path)
    cfg = config_from_gguf(meta, [t.name for t in reader.tensors], where)
    tok = tokenizer_from_gguf(meta, where)
    for t in reader.tensors:            # unsupported types fail before any work
        _check_type(t, where)
    names, shapes = _check_tensors(reader, cfg, where)
    np_dtype = DTYPES[dtype]
    shards = _plan_shards(names, shapes, np_dtype.itemsize, max_shard_bytes)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    out.mkdir(parents=True, exist_ok=True)
    stream = _weights(reader, cfg, np_dtype, progress, where)
    for shard, fname in zip(shards, files):
        st.write(out / fname, dict(next(stream) for _ in shard))
    if len(shards) > 1:
        weight_map = {n: f for shard, f in zip(shards, files) for n in shard}
        total = sum(int(np.prod(shapes[n])) * np_dtype.itemsize for n in names)
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    special = _special(meta)
    ids = {f"{k}_token_id": special[k] for k in ("bos", "eos", "pad") if k in special}
    (out / "config.json").write_text(json.dumps({**config_to_hf(cfg, np_dtype), **ids}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta, cfg), indent=2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.gguf", description="Convert a Llama GGUF to an HF directory.")
    p.add_argument("gguf", help="the .gguf file")
    p.add_argument("out_dir", help="the directory to write (must not exist or be empty)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    try:
        out = convert_gguf(args.gguf, args.out_dir, args.dtype, progress=True)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
