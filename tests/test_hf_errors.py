"""Bad checkpoints fail with errors that name the tensor and the expected shape."""

import json

import numpy as np
import pytest

from models import PRESETS, CheckpointError, config_from_hf, config_to_hf, init, load_hf, save_hf
from models import hf
from models import safetensors_io as st

import jax


@pytest.fixture()
def ckpt(tmp_path):
    cfg = PRESETS["tiny-qwen2"]
    save_hf(tmp_path, cfg, init(jax.random.key(0), cfg))
    return tmp_path


def _rewrite(path, fn):
    f = st.TensorFile(path / "model.safetensors")
    tensors = {k: f.read(k) for k in f.keys()}
    fn(tensors)
    st.write(path / "model.safetensors", tensors)


def test_missing_tensor_named(ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.bias.*\(32,\)"):
        load_hf(ckpt)


def test_shape_mismatch_named(ckpt):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)
    _rewrite(ckpt, shrink)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight has shape \(100, 64\), expected \(128, 64\)"):
        load_hf(ckpt)


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'mixtral'.*llama, qwen2, qwen3"):
        load_hf(ckpt)


def test_unsupported_rope_type():
    cfg = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        config_from_hf(cfg)


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(CheckpointError, match="missing config keys.*vocab_size"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(PRESETS["tiny-qwen3"], np.float32)))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_hf(tmp_path)


@pytest.mark.parametrize("whole_leaf_bytes", [hf.HOST_WHOLE_LEAF_BYTES, 0], ids=["whole_leaves", "layer_by_layer"])
def test_sharded_index_checkpoint(tmp_path, monkeypatch, whole_leaf_bytes):
    """Multi-file checkpoints with model.safetensors.index.json load identically, whether the stacked leaves
    reach the host whole (a small model's) or one layer at a time (above `models.hf.HOST_WHOLE_LEAF_BYTES`)."""
    monkeypatch.setattr(hf, "HOST_WHOLE_LEAF_BYTES", whole_leaf_bytes)
    cfg = PRESETS["tiny-llama"]
    w = init(jax.random.key(1), cfg)
    save_hf(tmp_path, cfg, w, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    _, again = load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_round_trip(tmp_path):
    import jax.numpy as jnp

    cfg = PRESETS["tiny-qwen3"]
    w = init(jax.random.key(2), cfg, dtype=jnp.bfloat16)
    save_hf(tmp_path, cfg, w)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, again = load_hf(tmp_path, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(w), jax.tree.leaves(again)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
