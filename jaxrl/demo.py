"""Foundation demo: `python -m jaxrl.demo [--config FILE] [dotted.key=value ...]` (default configs/demo.yaml).

A table of contents of the foundation (models/, sharding/, configs/), end to end on one machine:
  1. model config from a preset (or a local HF checkpoint via model.hf_path), weights created
     directly in the training sharding (FSDP x TP);
  2. HF export (`save_hf`) and a sharded re-import (`load_hf(..., shardings=...)`), checked exact;
  3. layer-wise reshard into `rollout_instances` TP instances on disjoint sub-meshes, then into one
     instance over all rollout devices (PAT's merge), and back to training — values checked exact,
     bytes moved reported;
  4. greedy decoding of a random prompt batch on every layout (a naive re-forward loop, no KV cache:
     the paged engine is the rollout work), checked token-identical across layouts.
Writes RUN_DIR/demo.json with the figures. The RL loop replaces this as the main job.

On a CPU host, fake CPU devices are created to fit the largest layout (set before JAX starts).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.config import CONFIGS_DIR, DemoConfig, parse_cli
from jaxrl.runtime import request_cpu_devices
from models import forward, init, load_hf, logical_axes, save_hf
from sharding import Layout, ShardingRules, reshard, shardings_for, split_devices


def _stage(msg: str):
    print(f"[demo] {msg}", flush=True)


def greedy(weights, cfg, prompts, new_tokens: int, mesh):
    """Greedy continuation by re-running the full forward (reference decoding, O(T^2)).

    The buffer has a fixed length (prompt + new tokens) so the forward compiles once; causal
    attention makes the not-yet-written positions irrelevant to the logits read at `pos - 1`.
    """
    prompt_len = len(prompts[0])
    buf = np.zeros((len(prompts), prompt_len + new_tokens), np.int32)
    buf[:, :prompt_len] = prompts
    tokens = jax.device_put(buf, NamedSharding(mesh, P()))
    for pos in range(prompt_len, prompt_len + new_tokens):
        nxt = jnp.argmax(forward(weights, cfg, tokens)[:, pos - 1], axis=-1).astype(jnp.int32)
        tokens = tokens.at[:, pos].set(nxt)
    return jax.device_get(tokens[:, prompt_len:])


def _trees_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run(cfg: DemoConfig) -> dict:
    model_cfg, dtype = cfg.model.model_config(), cfg.model.jnp_dtype()
    train_layout = cfg.mesh.train.build()
    devices = jax.devices()
    need = max(train_layout.size, cfg.mesh.rollout_devices)
    if len(devices) < need:
        raise SystemExit(f"demo needs {need} devices for its layouts, found {len(devices)}")
    report = {"model": cfg.model.hf_path or cfg.model.preset, "params": model_cfg.param_count(),
              "devices": f"{len(devices)} x {devices[0].platform}"}
    _stage(f"{report['model']}: {model_cfg.param_count() / 1e6:.2f}M params on {report['devices']}")

    t = time.perf_counter()
    train_mesh = train_layout.make_mesh(devices[: train_layout.size])
    train_sh = shardings_for(logical_axes(model_cfg), train_mesh, ShardingRules.train(model_cfg, train_layout))
    if cfg.model.hf_path:
        _, weights = load_hf(cfg.model.hf_path, dtype=dtype, shardings=train_sh)
    else:
        weights = init(jax.random.key(cfg.seed), model_cfg, dtype, shardings=train_sh)
    report["init_s"] = time.perf_counter() - t
    _stage(f"weights in train layout {train_layout.name} ({report['init_s']:.1f}s)")

    run_dir = Path(cfg.run_dir)
    t = time.perf_counter()
    save_hf(run_dir / "hf", model_cfg, weights)
    _, reloaded = load_hf(run_dir / "hf", dtype=dtype, shardings=train_sh)
    report["hf_round_trip_exact"] = _trees_equal(weights, reloaded)
    _stage(f"HF export + sharded import -> {run_dir / 'hf'}: exact={report['hf_round_trip_exact']} "
           f"({time.perf_counter() - t:.1f}s)")

    rollout = Layout(tp=cfg.mesh.rollout_tp)
    groups = split_devices(devices[: cfg.mesh.rollout_devices], cfg.mesh.rollout_instances)
    inst_meshes = [rollout.make_mesh(g) for g in groups]
    inst_weights, moved = [], []
    for mesh in inst_meshes:
        w, r = reshard(weights, shardings_for(logical_axes(model_cfg), mesh, ShardingRules.rollout(model_cfg, rollout)))
        inst_weights.append(w)
        moved.append(r.bytes_moved)
    merged_layout = Layout(tp=cfg.mesh.rollout_devices)
    merged_mesh = merged_layout.make_mesh(devices[: cfg.mesh.rollout_devices])
    merged, r_merge = reshard(inst_weights[0], shardings_for(logical_axes(model_cfg), merged_mesh,
                                                             ShardingRules.rollout(model_cfg, merged_layout)))
    back, r_back = reshard(merged, train_sh)
    report["reshard"] = {"train_to_instances_bytes": moved, "instance_to_merged_bytes": r_merge.bytes_moved,
                         "merged_to_train_bytes": r_back.bytes_moved, "round_trip_exact": _trees_equal(weights, back)}
    _stage(f"reshard train -> {len(inst_meshes)} x {rollout.name} -> {merged_layout.name} -> train: "
           f"exact={report['reshard']['round_trip_exact']}, bytes moved {moved} / {r_merge.bytes_moved} / "
           f"{r_back.bytes_moved}")

    rng = np.random.default_rng(cfg.seed)
    prompts = rng.integers(0, model_cfg.vocab_size, (cfg.batch, cfg.prompt_len)).tolist()
    t = time.perf_counter()
    outs = {"train": greedy(weights, model_cfg, prompts, cfg.new_tokens, train_mesh)}
    for i, (w, mesh) in enumerate(zip(inst_weights, inst_meshes)):
        outs[f"instance{i}"] = greedy(w, model_cfg, prompts, cfg.new_tokens, mesh)
    outs["merged"] = greedy(merged, model_cfg, prompts, cfg.new_tokens, merged_mesh)
    same = all(np.array_equal(outs["train"], o) for o in outs.values())
    report["greedy"] = {"layouts": list(outs), "identical": bool(same), "seconds": time.perf_counter() - t,
                        "sample": outs["train"][0].tolist()}
    _stage(f"greedy {cfg.batch}x{cfg.new_tokens} tokens on {len(outs)} layouts: identical={same} "
           f"({report['greedy']['seconds']:.1f}s)")

    report["ok"] = bool(report["hf_round_trip_exact"] and report["reshard"]["round_trip_exact"] and same)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "demo.json").write_text(json.dumps(report, indent=2))
    _stage(f"{'OK' if report['ok'] else 'MISMATCH'}; report in {run_dir / 'demo.json'}")
    return report


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(DemoConfig, argv, default_yaml=CONFIGS_DIR / "demo.yaml", prog="python -m jaxrl.demo", examples=(
        "model.preset=qwen3-0.6b 'mesh.train={fsdp: 8, tp: 1}'", "mesh.rollout_tp=4 mesh.rollout_instances=2 batch=16"))
    # Fake CPU devices so the 8-device layouts run on a laptop; no effect on GPU/TPU backends.
    request_cpu_devices(max(cfg.mesh.train.num_devices, cfg.mesh.rollout_devices))
    return 0 if run(cfg)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
