"""LoRA (`models.lora`): adapters with B = 0 are the base model exactly; the adapter gradients are the
full-weight gradient projected through the adapters (closed form); the low-rank path equals the merged weights;
the optimizer and the update touch the adapters only; a sharded train layout, the blockwise backward and the
rollout's weight sync (adapters only) equal their unsharded / whole-tree twins; PEFT files round-trip and
transformers + peft compute our logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.rollout import RolloutService, SamplingParams
from jaxrl.train.blockwise import BlockwiseUpdater
from jaxrl.train.optim import init_state, make_optimizer
from jaxrl.config.train import OptimSection
from jaxrl.train.step import make_grad_step, make_train_step
from models import PRESETS, forward, init, logical_axes, lora, save_hf
from models.config import LoraConfig
from models.peft_io import AdapterError, load_peft, load_weights, lora_config_from_peft, save_peft
from sharding import Layout, ShardingRules, reshard_bytes, shardings_for

from .test_blockwise import PACKED, SPEC, assert_grads_close, rl_batch

ATOL_F32 = 1e-5
LORA = LoraConfig(rank=4, alpha=8.0)
MODELS = {"qwen3": PRESETS["tiny-qwen3"], "qwen2": PRESETS["tiny-qwen2"], "llama": PRESETS["tiny-llama"]}


def _with_lora(cfg, lc=LORA):
    return dataclasses.replace(cfg, lora=lc)


def _randomise_b(params, seed=3, scale=0.05):
    """Adapters with B != 0 (a trained adapter), so every term of the low-rank path matters."""
    t, f = lora.split(params)
    leaves, tree = jax.tree.flatten(t)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return lora.join(jax.tree.unflatten(tree, leaves), f)


def _tokens(cfg, shape=(2, 12), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, shape), jnp.int32)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zero_b_is_the_base_model_exactly(name):
    cfg = MODELS[name]
    base, with_lora = init(jax.random.key(0), cfg), init(jax.random.key(0), _with_lora(cfg))
    assert float(jnp.abs(with_lora.layers.wq.lora_b).max()) == 0.0
    assert float(jnp.abs(with_lora.layers.wq.lora_a).max()) > 0.0
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(lora.base(with_lora))):
        assert a.dtype == b.dtype and bool((a == b).all())
    tok = _tokens(cfg)
    # bitwise at this process's level 0 (tests/conftest.py); at LLVM level 1 with XLA's passes the two forwards
    # fuse differently and part by float32 rounding (measured ~1e-7 relative)
    assert bool((forward(base, cfg, tok) == forward(with_lora, _with_lora(cfg), tok)).all())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_low_rank_path_equals_merged_weights(name):
    cfg = _with_lora(MODELS[name])
    params = _randomise_b(init(jax.random.key(0), cfg))
    tok = _tokens(cfg)
    got, want = forward(params, cfg, tok), forward(lora.merge(params), cfg, tok)
    assert float(jnp.abs(forward(lora.base(params), cfg, tok) - want).max()) > 1e-3      # the adapters matter
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL_F32, rtol=0)


def test_adapter_gradients_are_the_full_gradient_projected():
    """dL/dA = s · G Bᵀ and dL/dB = s · Aᵀ G, G = dL/dW at the merged weights (every target, every layer)."""
    cfg = _with_lora(MODELS["qwen3"])
    params = _randomise_b(init(jax.random.key(0), cfg))
    tok = _tokens(cfg)
    r = jax.random.normal(jax.random.key(5), (2, 12, cfg.vocab_size))
    loss = lambda w: jnp.sum(forward(w, cfg, tok) * r)          # noqa: E731
    t, f = lora.split(params)
    g_ad = jax.grad(lambda t: loss(lora.join(t, f)))(t)
    g_full = jax.grad(loss)(lora.merge(params))
    s = cfg.lora.scale
    for field in cfg.lora.fields:
        node, ga = getattr(params.layers, field), getattr(g_ad.layers, field)
        G = getattr(g_full.layers, field)
        L, rk = node.lora_a.shape[0], cfg.lora.rank
        A, B, Gm = node.lora_a.reshape(L, -1, rk), node.lora_b.reshape(L, rk, -1), G.reshape(L, node.lora_a[0, ..., 0].size, -1)
        want_a = s * jnp.einsum("lio,lro->lir", Gm, B)
        want_b = s * jnp.einsum("lir,lio->lro", A, Gm)
        for got, want in ((ga.lora_a.reshape(want_a.shape), want_a), (ga.lora_b.reshape(want_b.shape), want_b)):
            scale = float(jnp.abs(want).max())
            assert scale > 0
            assert float(jnp.abs(got - want).max()) <= ATOL_F32 * max(scale, 1.0), field
        assert ga.w is None      # no gradient of the frozen weight exists


def _opt(tx, params, shardings=None, mesh=None):
    if mesh is None:
        mesh = Layout().make_mesh(jax.devices()[:1])
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    return init_state(tx, params, shardings, mesh)


def test_update_trains_the_adapters_only_and_the_optimizer_holds_only_them():
    cfg = _with_lora(MODELS["qwen3"])
    params = init(jax.random.key(1), cfg)
    batch = rl_batch(cfg, params, PACKED)
    tx = make_optimizer(OptimSection(lr=1e-2), 10)[0]
    opt = _opt(tx, params)
    n_adapter = len(jax.tree.leaves(lora.split(params)[0]))
    assert n_adapter == 2 * len(cfg.lora.fields)
    adam = [x for x in jax.tree.leaves(opt) if x.ndim > 0]
    assert len(adam) == 2 * n_adapter                        # mu and nu of each adapter, nothing else
    before = jax.tree.map(np.asarray, params)
    new, _, m = make_train_step(cfg, SPEC, tx, 2)(jax.tree.map(jnp.copy, params), opt, batch)
    assert int(m["skipped"]) == 0
    for a, b in zip(jax.tree.leaves(lora.split(before)[1]), jax.tree.leaves(lora.split(new)[1])):
        assert np.array_equal(a, np.asarray(b))              # the frozen weights bitwise
    for f in cfg.lora.fields:       # B moves on the first step (A's gradient s·G Bᵀ is zero while B = 0)
        assert not np.array_equal(getattr(before.layers, f).lora_b, np.asarray(getattr(new.layers, f).lora_b))


@pytest.mark.parametrize("layout", [Layout(fsdp=4), Layout(fsdp=2, tp=2)], ids=lambda l: l.name)
def test_sharded_train_layout_equals_one_device(layout):
    cfg = _with_lora(MODELS["qwen3"])
    params = _randomise_b(init(jax.random.key(1), cfg))
    batch = rl_batch(cfg, params, PACKED)
    tx = make_optimizer(OptimSection(lr=1e-2), 10)[0]
    want, _, wm = make_train_step(cfg, SPEC, tx, 2)(jax.tree.map(jnp.copy, params), _opt(tx, params), batch)
    mesh = layout.make_mesh(jax.devices()[:layout.size])
    shardings = shardings_for(logical_axes(cfg), mesh, ShardingRules.train(cfg, layout))
    assert shardings.layers.wq.lora_a.spec[1:] == ("fsdp", None)          # A as W's input, B as its output
    assert shardings.layers.wq.lora_b.spec[1:3] == (None, "tp")
    sp = jax.device_put(params, shardings)
    sb = {k: jax.device_put(v, NamedSharding(mesh, P(("dp", "fsdp"), None))) for k, v in batch.items()}
    got, _, gm = make_train_step(cfg, SPEC, tx, 2)(sp, _opt(tx, sp, shardings, mesh), sb)
    assert float(gm["loss"]) == pytest.approx(float(wm["loss"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL_F32, rtol=0)


def test_blockwise_backward_with_lora_equals_the_full_backward():
    cfg = _with_lora(MODELS["qwen3"])
    params = _randomise_b(init(jax.random.key(1), cfg))
    batch = rl_batch(cfg, params, PACKED)
    full = make_grad_step(cfg, SPEC)(params, batch)
    up = BlockwiseUpdater(cfg, SPEC, make_optimizer(OptimSection(lr=1e-2), 10)[0], block_size=8)
    got = up.gradients(params, [batch])
    assert jax.tree.structure(got[0]) == jax.tree.structure(full[0])
    assert_grads_close(got, full)


def test_weight_sync_moves_the_adapters_only_and_equals_a_fresh_copy():
    """Two tp=2 instances; the train weights on an fsdp=4 mesh. After a sync of new adapters the instances hold
    their old base arrays and the new adapters, the sync moved the adapter bytes only, and greedy decoding
    equals a service built from the same weights from scratch (and differs from the old adapters')."""
    cfg = _with_lora(MODELS["qwen3"])
    layout = Layout(fsdp=4)
    mesh = layout.make_mesh(jax.devices()[:4])
    shardings = shardings_for(logical_axes(cfg), mesh, ShardingRules.train(cfg, layout))
    params = jax.device_put(init(jax.random.key(1), cfg), shardings)
    devices = jax.devices()[4:8]
    svc = RolloutService(cfg, params, tp=2, instances=2, devices=devices, max_batch=8, max_seq_len=64)
    base_before = [lora.split(i.weights)[1] for i in svc.instances]
    new = jax.device_put(_randomise_b(params, scale=0.5), shardings)
    reports = svc.update_weights(new, adapters_only=True)
    for inst, old in zip(svc.instances, base_before):
        for a, b in zip(jax.tree.leaves(lora.split(inst.weights)[1]), jax.tree.leaves(old)):
            assert a is b                                    # the base stayed where it was
    moved = sum(r.bytes_moved for r in reports)
    src = jax.tree.map(lambda x: x.sharding, new)
    cost = lambda part: sum(reshard_bytes(part(new), part(src), part(svc.weight_shardings(i.mesh)))   # noqa: E731
                            for i in svc.instances)
    assert moved == cost(lambda t: lora.split(t)[0]) > 0
    assert moved < cost(lambda t: t) / 10                   # a whole-tree sync would move > 10x more
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = [_tokens(cfg, (1, 6), seed=s)[0].tolist() for s in range(4)]

    def run(service):
        for p in prompts:
            service.add(p, sp)
        return sorted((tuple(c.prompt), tuple(c.tokens)) for c in service.run())

    fresh = RolloutService(cfg, new, tp=2, instances=2, devices=devices, max_batch=8, max_seq_len=64)
    got = run(svc)
    assert got == run(fresh)
    old = RolloutService(cfg, params, tp=2, instances=2, devices=devices, max_batch=8, max_seq_len=64)
    assert got != run(old)
    # a changed base (a warm start, a resume) is synced whole unless the caller vouches for the base
    rebased = jax.device_put(lora.rebase(new, jax.tree.map(lambda x: x * 1.5, lora.base(new))), shardings)
    svc.update_weights(rebased)
    for inst in svc.instances:
        for a, b in zip(jax.tree.leaves(lora.base(inst.weights)), jax.tree.leaves(lora.base(rebased))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_peft_files_round_trip_and_transformers_peft_computes_our_logits(tmp_path):
    import peft
    import torch
    import transformers

    cfg = _with_lora(dataclasses.replace(MODELS["qwen3"], tie_embeddings=False),
                     LoraConfig(rank=4, alpha=16.0, targets=("q_proj", "v_proj", "o_proj", "down_proj")))
    params = _randomise_b(init(jax.random.key(2), cfg), scale=0.1)
    save_hf(tmp_path / "base", dataclasses.replace(cfg, lora=None), lora.base(params))
    save_peft(tmp_path / "adapter", cfg, params)
    assert lora_config_from_peft(tmp_path / "adapter") == cfg.lora
    back = load_peft(tmp_path / "adapter", cfg, lora.base(params))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()
    tok = _tokens(cfg, (2, 10))
    with torch.no_grad():
        theirs = model(torch.as_tensor(np.array(tok), dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(params, cfg, tok)), theirs, atol=ATOL_F32, rtol=0)
    merged = tmp_path / "merged"
    save_hf(merged, cfg, params)                            # the HF export of a LoRA run: merged weights
    m2 = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(m2(torch.as_tensor(np.array(tok), dtype=torch.long)).logits.numpy(), theirs,
                                   atol=ATOL_F32, rtol=0)
    other = _with_lora(cfg, LoraConfig(rank=8))
    with pytest.raises(AdapterError, match="the adapter is"):
        load_peft(tmp_path / "adapter", other, lora.base(params))


def test_config_errors():
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="dropout"):
        LoraConfig(dropout=0.1)
    with pytest.raises(ValueError, match="targets"):
        LoraConfig(targets=("qkv",))


def test_generate_with_a_peft_adapter_equals_the_merged_checkpoint(tmp_path):
    """`python -m jaxrl.generate model.hf_path=BASE model.lora.adapter=DIR` decodes (greedy) what the merged
    export decodes; and a run can start from the adapter (model.lora.adapter in the train config)."""
    import json

    from jaxrl.config.loading import load_config
    from jaxrl.config.train import TrainConfig
    from jaxrl.generate import main

    cfg = _with_lora(dataclasses.replace(PRESETS["tiny-char"], tie_embeddings=True), LoraConfig(rank=4, alpha=8.0))
    params = _randomise_b(init(jax.random.key(4), cfg), scale=0.3)
    save_hf(tmp_path / "base", cfg, lora.base(params))
    save_hf(tmp_path / "merged", cfg, params)
    save_peft(tmp_path / "adapter", cfg, params)
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("copy abc", "rev hello", "sum 3 4")))
    common = [f"input={inp}", "sampling.max_new_tokens=10", "sampling.temperature=0.0", "tokenizer=char"]
    outs = {}
    for name, extra in (("adapter", [f"model.hf_path={tmp_path / 'base'}", f"model.lora.adapter={tmp_path / 'adapter'}"]),
                        ("merged", [f"model.hf_path={tmp_path / 'merged'}"]),
                        ("base", [f"model.hf_path={tmp_path / 'base'}"])):
        out = tmp_path / f"{name}.jsonl"
        assert main([*common, *extra, f"output={out}"]) == 0
        outs[name] = [json.loads(line)["tokens"] for line in out.read_text().splitlines()]
    assert outs["adapter"] == outs["merged"] != outs["base"]
    train = load_config(TrainConfig, [f"model.hf_path={tmp_path / 'base'}", f"model.lora.adapter={tmp_path / 'adapter'}"])
    model_cfg = train.model.model_config()
    assert model_cfg.lora == cfg.lora
    start = load_weights(model_cfg, key=jax.random.key(0), dtype=jnp.float32, hf_path=str(tmp_path / "base"),
                         adapter=str(tmp_path / "adapter"))           # what the trainer starts from
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_section_checks_its_keys_also_while_off():
    from jaxrl.config.base import ConfigError
    from jaxrl.config.loading import load_config
    from jaxrl.config.train import TrainConfig

    for arg, key in (("model.lora.targets=[qq]", "targets"), ("model.lora.rank=-1", "model.lora.rank"),
                     ("model.lora.dropout=0.1", "dropout")):
        with pytest.raises(ConfigError, match=key):
            load_config(TrainConfig, [arg])
