"""RolloutService: several instances over a device pool (rollout DP = number of instances).

    svc = RolloutService(cfg, weights, tp=2, instances=4)
    ids = svc.add(prompt_tokens, SamplingParams(max_new_tokens=64, temperature=1.0, n=8, seed=1))
    for c in svc.stream():          # each Completion the moment it finishes
        ...
    svc.update_weights(new_weights) # layer-wise reshard from any layout

Every `step()` dispatches all instances' work (`Instance.launch`, asynchronous) before reading any
result (`Instance.collect`), so instances on disjoint devices run concurrently; with `overlap` (default)
each instance also reads step n only after dispatching step n+1 (see `instance`).
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence as Seq

import jax

from jaxrl.runtime import enable_compilation_cache
from models import ModelConfig, Weights, logical_axes
from sharding import Layout, ShardingRules, reshard, shardings_for, split_devices

from .instance import Completion, Instance, Sequence
from .sampling import SamplingParams

ROUTERS = ("least_loaded", "round_robin")
ATTENTION_IMPLS = ("xla", "pallas")   # xla: CPU default; pallas: GPU kernels (interpret mode on the CPU)


class RolloutService:
    def __init__(self, cfg: ModelConfig, weights: Weights, *, tp: int = 1, instances: int = 1, devices=None,
                 num_pages: int | None = None, page_size: int = 16, max_batch: int = 64, max_seq_len: int = 1024,
                 prefill_chunk: int = 256, prefill_tokens: int = 8192, kv_dtype=None, prefix_sharing: bool = True,
                 router: str = "least_loaded", attention_impl: str = "xla", overlap: bool = True):
        if router not in ROUTERS:
            raise ValueError(f"router={router!r}; valid choices: {', '.join(ROUTERS)}")
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={attention_impl!r}; valid choices: {', '.join(ATTENTION_IMPLS)}")
        devices = list(devices if devices is not None else jax.devices())
        if tp * instances > len(devices):
            raise ValueError(f"tp={tp} x instances={instances} needs {tp * instances} devices, have {len(devices)}")
        enable_compilation_cache()
        self.cfg, self.router, self.layout = cfg, router, Layout(tp=tp)
        if num_pages is None:
            num_pages = max_batch * -(-max_seq_len // page_size) + 1
        self.instances: list[Instance] = []
        for i, group in enumerate(split_devices(devices[: tp * instances], instances)):
            mesh = self.layout.make_mesh(group)
            w, _ = reshard(weights, self._shardings(mesh))
            self.instances.append(Instance(i, cfg, mesh, w, num_pages=num_pages, page_size=page_size,
                                           max_batch=max_batch, prefill_chunk=prefill_chunk,
                                           prefill_tokens=prefill_tokens, kv_dtype=kv_dtype,
                                           prefix_sharing=prefix_sharing, attention_impl=attention_impl,
                                           overlap=overlap))
        self._ids = itertools.count()
        self._groups = itertools.count()
        self._rr = itertools.cycle(range(instances))
        self._where: dict[int, Instance] = {}

    def _shardings(self, mesh):
        return shardings_for(logical_axes(self.cfg), mesh, ShardingRules.rollout(self.cfg, self.layout))

    # ------------------------------------------------------------------ API
    def add(self, prompt: Seq[int], params: SamplingParams = SamplingParams()) -> list[int]:
        """Queue one prompt (`params.n` samples, routed together so they share prompt pages)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        if max(prompt) >= self.cfg.vocab_size or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        group = next(self._groups) if params.n > 1 else None
        seqs = []
        for j in range(params.n):
            rid = next(self._ids)
            seqs.append(Sequence(rid, prompt, params, seed=(params.seed * 1_000_003 + j) % 2**32, group=group))
        inst = self._route()
        inst.add(seqs)
        for s in seqs:
            self._where[s.rid] = inst
        return [s.rid for s in seqs]

    def _route(self) -> Instance:
        if self.router == "round_robin":
            return self.instances[next(self._rr)]
        return min(self.instances, key=lambda i: (i.load, i.index))

    def abort(self, rid: int) -> Completion | None:
        """Remove a request at once and free its pages; returns its partial completion (None if unknown)."""
        inst = self._where.pop(rid, None)
        s = inst.abort(rid) if inst else None
        if s is None:
            return None
        return Completion(s.rid, s.prompt, s.out, s.logprobs, "abort", inst.index, s.preemptions)

    def has_work(self) -> bool:
        return any(i.has_work() for i in self.instances)

    def step(self) -> list[Completion]:
        for inst in self.instances:                              # dispatch everything first
            inst.launch()
        done = [c for inst in self.instances for c in inst.collect()]
        for c in done:
            self._where.pop(c.request_id, None)
        return done

    def stream(self) -> Iterator[Completion]:
        """Run until idle, yielding each completion as soon as it finishes."""
        while self.has_work():
            yield from self.step()

    def run(self) -> list[Completion]:
        """Run until idle; completions ordered by request id."""
        return sorted(self.stream(), key=lambda c: c.request_id)

    def update_weights(self, weights: Weights) -> list:
        """Reshard `weights` (any layout) into every instance, layer by layer; returns the reports."""
        reports = []
        for inst in self.instances:
            inst.weights, r = reshard(weights, self._shardings(inst.mesh))
            reports.append(r)
        return reports

    def stats(self) -> list[dict]:
        return [i.stats() for i in self.instances]


def generate(cfg: ModelConfig, weights: Weights, prompts: Seq[Seq[int]], params: SamplingParams = SamplingParams(),
             *, tp: int = 1, instances: int = 1, **service_kw) -> list[Completion]:
    """Generate for every prompt; returns completions in prompt order (`params.n` per prompt, adjacent)."""
    svc = RolloutService(cfg, weights, tp=tp, instances=instances, **service_kw)
    order = [rid for p in prompts for rid in svc.add(p, params)]
    by_id = {c.request_id: c for c in svc.stream()}
    return [by_id[r] for r in order]
