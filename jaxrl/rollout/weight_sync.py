"""Weight syncs into a `RolloutService`'s instances: between rollouts (`update_weights`) and in the middle of
one (`swap_weights`, partial rollouts across weight versions), with the collective half split off (`stage`)
so that, with several processes, it runs at the same point in every process's program.

    staged = stage(svc, new_weights)                  # multi-process: every process, same point
    swap_weights(svc, new_weights, version=3, kv="keep", staged=staged)   # live sequences continue on them
    update_weights(svc, new_weights, version=3)       # between rollouts

`RolloutService.stage/update_weights/swap_weights` call these.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxrl.config.train import SWAP_KV      # a mid-generation weight update: the K/V kept, or recomputed
from models import Weights, fit_vocab, lora, vocab_rows
from sharding import Layout, padded_vocab_for, reshard, to_local_groups

from . import migration


@dataclasses.dataclass
class Staged:
    """Weights made ready for this process's instances (`RolloutService.stage`)."""

    weights: Weights
    adapters: bool            # only the LoRA adapters move
    src: Weights              # what moves (the adapters, or the whole tree)
    copies: list | None       # this process's copy per instance (multi-process), else None
    meshes: list              # the instances' meshes it was staged for


def local_copies(svc, weights, meshes) -> list | None:
    """Multi-process: global weights (shards on every process) become this process's instance copies
    by one collective on-device reshard (`sharding.to_local_groups`), never through the host; every
    process calls this at the same point. None when the weights are already addressable here."""
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in jax.tree.leaves(weights)):
        return None
    tps = {m.shape["tp"] for m in meshes}
    if len(tps) != 1:
        raise ValueError(f"global (multi-process) weights need instances of one tp size; got {sorted(tps)}")
    tp = tps.pop()
    padded = padded_vocab_for(svc.cfg, Layout(tp=tp))
    shardings = svc.weight_shardings(meshes[0])
    if weights.embed is None:                  # LoRA's adapters alone (`update_weights`)
        shardings = lora.split(shardings)[0]
    elif vocab_rows(weights) != padded:        # the rollout's vocabulary padding, on the global arrays
        weights = fit_vocab(weights, padded)
    specs = jax.tree.map(lambda sh: sh.spec, shardings)
    return to_local_groups(weights, specs, [list(m.devices.flat) for m in meshes], tp)


def swap_weights(svc, weights: Weights, version: int, *, kv: str = "keep", adapters_only: bool = False,
                 staged: Staged | None = None) -> dict:
    """A weight update in the middle of generation (partial rollouts across weight versions): every
    in-flight step is drained, then each live sequence continues with `weights` from its next token on,
    and those tokens record `version` (`Completion.versions`). kv="keep": the K/V of the positions so far
    stay, computed by the older weights (AReaL's interruptible generation: no recomputation, the new
    weights attend over old K/V); kv="recompute": they are dropped and every sequence re-prefills prompt +
    tokens with the new weights, so its continuation is exactly what the new weights generate from that
    prefix. `staged`: from `stage(weights)`, already run (multi-process: the collective half, on the train
    pool's thread in step with the other processes), so the swap itself moves weights within this process
    only. Returns {"sequences": live sequences, "recomputed": positions to prefill again}."""
    if kv not in SWAP_KV:
        raise ValueError(f"kv={kv!r}; valid choices: {', '.join(SWAP_KV)}")
    svc.pause()
    live = 0
    for inst in svc.instances:
        for s in inst.sched.live:
            spans = svc._versions.setdefault(s.rid, [(0, svc.version)])
            if spans[-1][0] == len(s.out):
                spans[-1] = (len(s.out), int(version))
            else:
                spans.append((len(s.out), int(version)))
            live += 1
    update_weights(svc, weights, adapters_only=adapters_only, version=version, staged=staged)
    recomputed = sum(inst.sched.drop_kv() for inst in svc.instances) if kv == "recompute" else 0
    return {"sequences": live, "recomputed": recomputed}


def stage(svc, weights: Weights, *, adapters_only: bool = False) -> Staged:
    """The part of a sync that may involve other processes: global weights (multi-process) become this
    process's copies for its instances by one collective reshard that every process runs at the same point
    in its program (`local_copies`); nothing for weights this process already addresses. `update_weights`
    and `swap_weights` given the result move them within the process only; the instances' layout must not
    change in between (a single process re-stages if it did)."""
    adapters = adapters_only and lora.has_adapters(weights) and all(
        not x.is_deleted() for i in svc.instances for x in jax.tree.leaves(lora.split(i.weights)[1]))
    src = lora.split(weights)[0] if adapters else weights
    meshes = [i.mesh for i in svc.instances]
    return Staged(weights, adapters, src, local_copies(svc, src, meshes), meshes)


def update_weights(svc, weights: Weights, *, adapters_only: bool = False, version: int | None = None,
                   staged: Staged | None = None) -> list:
    """Reshard `weights` (any layout) into every instance, layer by layer; returns the reports. `version`:
    the weights' version, recorded by every token sampled from now on (between rollouts; in the middle of
    one, `swap_weights` also says how the live sequences continue).
    `adapters_only` (LoRA, `models.lora`): the caller vouches that the frozen base of `weights` is the one
    the instances hold (an RL update never changes it; a warm start or a resume does), so only the adapters
    move; an instance whose base arrays were the trainer's own, donated by its update, gets the whole tree
    again."""
    reports, given = [], migration.buffers(weights)
    if staged is None or staged.weights is not weights or staged.meshes != [i.mesh for i in svc.instances]:
        if staged is not None and staged.copies is not None and staged.weights is weights:
            raise RuntimeError("the instances' layout changed between stage() and the sync of global "
                               "(multi-process) weights; stage them again, at the same point on every process")
        staged = stage(svc, weights, adapters_only=adapters_only)
    adapters, src, copies = staged.adapters, staged.src, staged.copies
    for k, inst in enumerate(svc.instances):
        w = src if copies is None else copies[k]
        if adapters:
            new, r = reshard(w, lora.split(svc.weight_shardings(inst.mesh))[0],
                             whole_leaf_bytes=svc.SYNC_WHOLE_LEAF_BYTES)
            inst.weights = lora.join(new, lora.split(inst.weights)[1])
        else:
            inst.weights, r = svc.place(w, inst.mesh, whole_leaf_bytes=svc.SYNC_WHOLE_LEAF_BYTES)
        inst.external = migration.buffers(inst.weights) & given
        reports.append(r)
    svc.synced_bytes += sum(r.bytes_moved for r in reports)
    if version is not None:
        svc.version = int(version)
    return reports
