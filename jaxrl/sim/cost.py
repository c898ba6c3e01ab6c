"""Cost models of the simulator: how long each piece of device work takes, in seconds.

Two models answer the same questions (`SimExecutor` and the step simulator ask them):

* `ProfileCost(profile)`: a latency profile from `python -m jaxrl.rollout.profile` (CPU or GPU), read through
  PAT's own `adaptive_tp.Predictor` — decode step ℓ(B, T; tp) (on the padded shape when the profile has the
  engine's shapes), prefill T_prefill(B, L; tp), the KV migration bandwidth, the weight reshard seconds and
  the control overhead, all as measured. Training-side stages take per-token seconds (`stage_rates`,
  measured from a run's metrics).
* `AnalyticCost(model, gpu)`: a GPU node from first principles (`hardware.GPU`): a decode step of a TP group
  is max(memory, compute) + communication, where memory = (weight shard + the batch's KV shard) / (HBM
  bandwidth x efficiency), compute = (2·N_active·B + 4·layers·q_width·ΣL) / tp / (peak x efficiency), and
  communication = 2 all-reduces per layer, each a latency (2(tp−1) ring hops of α on PCIe, one flat α on
  NVSwitch) plus 2(tp−1)/tp x B·hidden·s bytes at the all-reduce bus bandwidth; prefill and training from FLOPs at a stated MFU; the weight sync
  and KV moves from bytes over links. `hardware.py` says which parameters are vendor figures and which were
  fitted to which published point.

Both give the KV pool of an instance (`pages`): the analytic one from the HBM budget minus the weight
shard (as `jaxrl.rollout.memory` does on a device), the profile one as the engine does on the CPU.
Weight bytes a relayout moves (`reshard_bytes`) are counted by `sharding.reuse` itself on abstract
shapes (the nested device order of `sharding.tp_groups`), within one node, when JAX has enough devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxrl.rollout.adaptive_tp import Predictor, Profile
from jaxrl.rollout.memory import layout_pages
from models import ModelConfig, abstract, logical_axes
from sharding import Layout, ShardingRules, padded_vocab_for, shardings_for, tp_groups, tree_reuse_bytes

from .hardware import GPU


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """K and V of one token over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def kv_shards(cfg: ModelConfig, tp: int) -> int:
    """Ranks a page's bytes are split over: tp when it divides the KV heads; otherwise the rollout rules
    replicate the heads (`sharding.ShardingRules.rollout`) and every rank holds the whole page."""
    return tp if cfg.num_kv_heads % tp == 0 else 1


def weight_shard_bytes(cfg: ModelConfig, tp: int, dtype_bytes: int) -> float:
    """Weight bytes on one rank of a TP group: everything split tp ways but the K/V projections, which every
    rank holds whole once the KV heads replicate (tp does not divide them), as the rollout rules lay them out."""
    kv = cfg.num_layers * 2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim
    split = cfg.param_count() - (kv if cfg.num_kv_heads % tp else 0)
    return (split / tp + (kv if cfg.num_kv_heads % tp else 0)) * dtype_bytes


def train_flops(cfg: ModelConfig, tokens: float, attended: float) -> float:
    """Forward FLOPs over `tokens` tokens that attend `attended` (token, key) pairs in all: 2·N per token plus
    QK^T and AV, 4·layers·(heads·head_dim) per pair."""
    return 2.0 * cfg.param_count() * tokens + 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attended


@functools.lru_cache(maxsize=256)
def _reuse_bytes(cfg: ModelConfig, dtype: str, src: int, dst: int, devices: int) -> int | None:
    """Bytes `sharding.reuse` moves for a relayout tp src -> dst over `devices` devices (None when JAX has
    fewer devices)."""
    if jax.device_count() < devices:
        return None
    pool = jax.devices()[:devices]
    pad = padded_vocab_for(cfg, Layout(tp=max(src, dst)))

    def shardings(group):
        layout = Layout(tp=len(group))
        return shardings_for(logical_axes(cfg, vocab_size=pad), layout.make_mesh(group), ShardingRules.rollout(cfg, layout))

    tree = abstract(cfg, np.dtype(dtype), vocab_size=pad)
    old = [shardings(g) for g in tp_groups(pool, [src] * (devices // src))]
    return sum(tree_reuse_bytes(tree, old, shardings(g)) for g in tp_groups(pool, [dst] * (devices // dst)))


@functools.lru_cache(maxsize=256)
def _engine_pages(cfg: ModelConfig, tp: int, page_size: int, budget: int, dtype: str) -> int | None:
    """`rollout.memory.layout_pages` on this process's first `tp` devices (None when it has fewer, or when the
    weights leave no room): the engine's exact count."""
    if jax.device_count() < tp:
        return None
    try:
        return layout_pages(cfg, jax.devices()[:tp], page_size=page_size, budget=budget, dtype=dtype)
    except ValueError:
        return None


class _Common:
    cfg: ModelConfig
    dtype_bytes: int
    kv_bytes_per_device: int | None = None

    def budget_pages(self, cfg: ModelConfig, tp: int, page_size: int, budget: float) -> int:
        """Pages of a TP-`tp` instance when each device has `budget` bytes for weights + KV: the engine's own
        count where this process can lay the weights out, else (budget − weight shard) / page bytes per rank."""
        dtype = {2: "bfloat16", 4: "float32"}[self.dtype_bytes]
        got = _engine_pages(cfg, tp, page_size, int(budget), dtype)
        if got is not None:
            return got
        per_page = page_size * kv_bytes_per_token(cfg, self.dtype_bytes) / kv_shards(cfg, tp)
        pages = int((budget - weight_shard_bytes(cfg, tp, self.dtype_bytes)) // per_page)
        if pages < 2:
            raise ValueError(f"{cfg.param_count() / 1e9:.2f}B parameters at tp={tp} leave no KV room in "
                             f"{budget / 1e9:.1f} GB per device: use a larger tp")
        return pages

    def page_bytes(self, cfg: ModelConfig, page_size: int) -> int:
        """K + V bytes of one page over every layer (all kv heads)."""
        return page_size * kv_bytes_per_token(cfg, self.dtype_bytes)

    def kv_shards(self, cfg: ModelConfig, tp: int) -> int:
        return kv_shards(cfg, tp)

    def reshard_bytes(self, cfg: ModelConfig, src: int, dst: int) -> int:
        """Bytes a relayout's weight reshard moves within one node (0 when not countable here)."""
        node = max(src, dst)
        got = _reuse_bytes(cfg, {1: "int8", 2: "bfloat16", 4: "float32"}[self.dtype_bytes], src, dst, node)
        return int(got or 0)


@dataclasses.dataclass
class StageRates:
    """Per-token seconds of the training-side stages on the run's train devices (`ProfileCost`): measured
    from a run's metrics (`train_s` / tokens trained, ...) or given."""

    train_s_per_token: float = 0.0
    forward_s_per_token: float = 0.0    # one log-prob forward (reference, old policy)
    sync_s: float = 0.0                 # the per-step weight sync


class ProfileCost(_Common):
    """Costs from a PAT latency profile (see the module docstring). `num_pages`: the engine's pool (None: the
    CPU engine's default, max_batch sequences of max_seq_len); `host_step_s`: per engine step on the host."""

    def __init__(self, profile: Profile, cfg: ModelConfig, *, dtype_bytes: int = 4, stages: StageRates = StageRates(),
                 num_pages: int | None = None, kv_bytes_per_device: int | None = None):
        self.profile, self.cfg, self.dtype_bytes, self.stages = profile, cfg, dtype_bytes, stages
        self.kv_bytes_per_device = kv_bytes_per_device
        self.predictor = Predictor(profile)
        self.num_pages = num_pages
        self.control_s = profile.control_seconds
        self.name = f"profile:{profile.key.get('device', '?')}"

    def contention(self, tp: int, batch: float = 1.0) -> float:
        """κ of the profiled layout at this batch per instance (`LayoutProfile.contention`, linear between
        its measured batches, clamped): how much its instances' steps add up."""
        lp = self.profile.layouts.get(tp)
        if lp is None or not lp.contention:
            return 0.0
        pts = sorted(lp.contention)
        return float(np.interp(batch, [b for b, _ in pts], [k for _, k in pts]))

    def decode_s(self, tp: int, contexts: np.ndarray, *, rows: int, width: int) -> float:
        c = np.asarray(contexts, np.float64)
        return float(self.predictor.step_latency(tp, len(c), c.sum(), c.max()))

    def prefill_s(self, tp: int, starts: np.ndarray, n_valid: np.ndarray) -> float:
        n = np.asarray(n_valid, np.float64)
        return float(self.predictor.prefill_latency(tp, len(n), float(n.mean())))

    def kv_move_s(self, bytes_per_rank: float) -> float:
        return float(bytes_per_rank) / self.profile.migrate_bytes_per_s

    def reshard_s(self, cfg: ModelConfig, src: int, dst: int) -> float:
        return self.predictor.reshard_seconds(src, dst)

    def pages(self, cfg: ModelConfig, tp: int, *, page_size: int, max_batch: int, max_seq_len: int) -> int:
        """As the engine on the CPU: `num_pages`, else the `kv_bytes_per_device` budget, else max_batch
        sequences of max_seq_len."""
        if self.num_pages:
            return self.num_pages
        if self.kv_bytes_per_device:
            return self.budget_pages(cfg, tp, page_size, self.kv_bytes_per_device)
        return max_batch * -(-max_seq_len // page_size) + 1

    # training side
    def train_s(self, tokens: float, attended: float, devices: int) -> float:
        return self.stages.train_s_per_token * tokens

    def forward_s(self, tokens: float, attended: float, devices: int) -> float:
        return self.stages.forward_s_per_token * tokens

    def sync_s(self, devices: int, *, across_pools: bool = False) -> float:
        return self.stages.sync_s


class AnalyticCost(_Common):
    """An analytic GPU node (see the module docstring and `hardware.py`)."""

    def __init__(self, cfg: ModelConfig, hw: GPU, *, dtype_bytes: int = 2, num_pages: int | None = None,
                 kv_bytes_per_device: int | None = None):
        self.cfg, self.hw, self.dtype_bytes, self.num_pages = cfg, hw, dtype_bytes, num_pages
        self.kv_bytes_per_device = kv_bytes_per_device
        self.weight_bytes = cfg.param_count() * dtype_bytes
        # a decode step reads every weight but the embedding table (B rows of it); a tied head reads the table
        self.read_bytes = (cfg.param_count() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)) * dtype_bytes
        self.active = cfg.param_count() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1)
        self.kv_token = kv_bytes_per_token(cfg, dtype_bytes)
        self.q_width = cfg.num_heads * cfg.head_dim
        self.control_s = hw.control_s
        self.name = f"analytic:{hw.name}"

    def contention(self, tp: int, batch: float = 1.0) -> float:
        return 0.0                 # every instance on GPUs of its own

    def allreduce_s(self, tp: int, nbytes: float) -> float:
        """One ring all-reduce of `nbytes` over `tp` GPUs of a node."""
        if tp <= 1:
            return 0.0
        hw = self.hw
        latency = hw.allreduce_latency_s if hw.allreduce_latency_s is not None else 2 * (tp - 1) * hw.hop_latency_s
        return latency + 2 * (tp - 1) / tp * nbytes / hw.allreduce_bw

    def decode_s(self, tp: int, contexts: np.ndarray, *, rows: int = 0, width: int = 0) -> float:
        hw, cfg = self.hw, self.cfg
        b, ctx = len(contexts), float(np.sum(contexts))
        weights = self.read_bytes / tp + weight_shard_bytes(cfg, tp, self.dtype_bytes) - self.weight_bytes / tp
        memory = (weights + ctx * self.kv_token / kv_shards(cfg, tp)) / (hw.hbm_bw * hw.hbm_efficiency)
        flops = (2.0 * self.active * b + 4.0 * cfg.num_layers * self.q_width * ctx) / tp
        compute = flops / (hw.peak_flops * hw.decode_flops_efficiency)
        comm = 2 * cfg.num_layers * self.allreduce_s(tp, b * cfg.hidden_size * self.dtype_bytes)
        return max(memory, compute) + comm

    def prefill_s(self, tp: int, starts: np.ndarray, n_valid: np.ndarray) -> float:
        s, n = np.asarray(starts, np.float64), np.asarray(n_valid, np.float64)
        attended = float(np.sum(n * s + n * (n + 1) / 2))
        flops = train_flops(self.cfg, float(n.sum()), attended) / tp
        comm = 2 * self.cfg.num_layers * self.allreduce_s(tp, float(n.sum()) * self.cfg.hidden_size * self.dtype_bytes)
        return flops / (self.hw.peak_flops * self.hw.prefill_mfu) + comm

    def kv_move_s(self, bytes_per_rank: float) -> float:
        return float(bytes_per_rank) / self.hw.link_bw

    def reshard_s(self, cfg: ModelConfig, src: int, dst: int) -> float:
        """The bytes `sharding.reuse` moves in one node, spread over its GPUs, over the intra-node link."""
        node = max(src, dst)
        return self.reshard_bytes(cfg, src, dst) / node / self.hw.link_bw

    def pages(self, cfg: ModelConfig, tp: int, *, page_size: int, max_batch: int, max_seq_len: int) -> int:
        """(HBM x kv_memory_fraction − weight shard) / one page's bytes on a GPU, as `rollout.memory` counts."""
        if self.num_pages:
            return self.num_pages
        return self.budget_pages(cfg, tp, page_size,
                                 self.kv_bytes_per_device or self.hw.memory_bytes * self.hw.kv_memory_fraction)

    # training side: FLOPs at train_mfu over the devices
    def train_s(self, tokens: float, attended: float, devices: int) -> float:
        """Policy update: forward + backward (3x the forward FLOPs)."""
        return 3 * train_flops(self.cfg, tokens, attended) / (devices * self.hw.peak_flops * self.hw.train_mfu)

    def forward_s(self, tokens: float, attended: float, devices: int) -> float:
        """One log-prob forward (reference or old policy) over the step's tokens."""
        return train_flops(self.cfg, tokens, attended) / (devices * self.hw.peak_flops * self.hw.train_mfu)

    def sync_s(self, devices: int, *, across_pools: bool = False) -> float:
        """Train -> rollout weight sync: each GPU receives the weights over NVLink (colocated: a reshard inside
        the node), or the network (disaggregated pools), plus a fixed overhead."""
        bw = self.hw.net_bw if across_pools else self.hw.link_bw
        return self.weight_bytes / bw + self.hw.sync_overhead_s


def attended_pairs(prompt: np.ndarray, response: np.ndarray) -> float:
    """Σ over sequences of the causal (query, key) pairs of prompt + response."""
    n = np.asarray(prompt, np.float64) + np.asarray(response, np.float64)
    return float(np.sum(n * (n + 1) / 2))


