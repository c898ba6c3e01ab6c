"""Logit parity with `transformers` for Qwen3, Qwen2 and Llama-3 (float32, max abs diff <= 1e-4)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config_from_hf, forward, load_hf, save_hf
from tests.hf_util import PARITY_CASES, hf_logits, hf_model

ATOL_F32 = 1e-4


@pytest.fixture(scope="module", params=sorted(PARITY_CASES))
def case(request, tmp_path_factory):
    cfg = PARITY_CASES[request.param]
    model = hf_model(cfg)
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24))
    return request.param, cfg, model, d, tokens


def test_load_hf_logits_match(case):
    name, cfg, model, d, tokens = case
    got_cfg, weights = load_hf(d, dtype=jnp.float32)
    assert got_cfg == cfg
    ours = np.asarray(forward(weights, got_cfg, jnp.asarray(tokens, jnp.int32)))
    diff = np.abs(ours - hf_logits(model, tokens)).max()
    print(f"PARITY {name}: max abs diff {diff:.2e}")
    assert diff <= ATOL_F32


def test_save_hf_loads_in_transformers(case, tmp_path):
    import transformers

    name, cfg, model, d, tokens = case
    cfg2, weights = load_hf(d)
    save_hf(tmp_path, cfg2, weights)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32").eval()
    diff = np.abs(hf_logits(reloaded, tokens) - hf_logits(model, tokens)).max()
    print(f"SAVE_HF {name}: max abs diff {diff:.2e}")
    assert diff <= ATOL_F32
    # and our own round trip is exact
    _, again = load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_transformers5_config_form(case):
    """transformers 5 writes rope_theta (and scaling) under rope_parameters; both forms parse alike."""
    name, cfg, model, d, _ = case
    raw = json.loads((d / "config.json").read_text())
    assert config_from_hf(raw) == cfg
    v4 = {k: v for k, v in raw.items() if k != "rope_parameters"}
    rp = raw.get("rope_parameters") or {}
    v4["rope_theta"] = rp.get("rope_theta", cfg.rope_theta)
    if rp.get("rope_type", "default") != "default":
        v4["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    assert config_from_hf(v4) == cfg


def test_packed_segments_match_separate_rows(case):
    """Two sequences packed in one row (segment ids + restarted positions) == each run alone."""
    name, cfg, model, d, tokens = case
    _, weights = load_hf(d)
    a, b = tokens[0, :10], tokens[1, :14]
    packed = jnp.asarray(np.concatenate([a, b])[None], jnp.int32)
    seg = jnp.asarray([[1] * 10 + [2] * 14], jnp.int32)
    pos = jnp.asarray([list(range(10)) + list(range(14))], jnp.int32)
    out = np.asarray(forward(weights, cfg, packed, positions=pos, segment_ids=seg))[0]
    np.testing.assert_allclose(out[:10], hf_logits(model, a[None])[0], atol=ATOL_F32, rtol=0)
    np.testing.assert_allclose(out[10:], hf_logits(model, b[None])[0], atol=ATOL_F32, rtol=0)


def test_rope_scaling_is_exercised(tmp_path):
    """Negative control: dropping the llama3 rope scaling must break parity (so the case tests it)."""
    import dataclasses

    cfg = PARITY_CASES["llama3-rope-scaling"]
    model = hf_model(cfg)
    model.save_pretrained(tmp_path)
    _, weights = load_hf(tmp_path)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 64))
    unscaled = dataclasses.replace(cfg, rope_scaling=None)
    diff = np.abs(np.asarray(forward(weights, unscaled, jnp.asarray(tokens, jnp.int32))) - hf_logits(model, tokens)).max()
    assert diff > 100 * ATOL_F32


def test_sliding_window_is_exercised(tmp_path):
    """Negative control: the windowed checkpoint loads with its window, and dropping it breaks parity."""
    import dataclasses

    cfg = PARITY_CASES["qwen3-window"]
    model = hf_model(cfg)
    model.save_pretrained(tmp_path)
    got_cfg, weights = load_hf(tmp_path)
    assert got_cfg.sliding_window == 7
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 24))
    full = dataclasses.replace(cfg, sliding_window=None)
    diff = np.abs(np.asarray(forward(weights, full, jnp.asarray(tokens, jnp.int32))) - hf_logits(model, tokens)).max()
    assert diff > 100 * ATOL_F32


def test_partly_windowed_checkpoint_is_refused():
    from models.hf import CheckpointError, config_to_hf

    d = config_to_hf(PARITY_CASES["qwen3-window"], np.float32)
    d["max_window_layers"] = 1                      # layer 0 full, layer 1 windowed
    with pytest.raises(CheckpointError, match="some layers only"):
        config_from_hf(d)
    d["use_sliding_window"] = False
    assert config_from_hf(d).sliding_window is None
