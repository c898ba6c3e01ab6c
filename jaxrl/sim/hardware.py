"""GPU presets for the analytic cost model: vendor figures, and the efficiencies fitted to published points.

Vendor figures (datasheets; none of the four papers states them except where said):

| GPU | bf16 dense | memory | HBM bandwidth | intra-node link (per direction) | network |
|---|---|---|---|---|---|
| H100 SXM5 | 989 TFLOP/s | 80 GB | 3.35 TB/s | NVLink4 450 GB/s (PAT §5.1: "900 GB/s" bidirectional) | 400 Gb/s IB |
| H800 SXM5 | 989 TFLOP/s | 80 GB | 3.35 TB/s | NVLink 200 GB/s (400 GB/s bidirectional) | 400 Gb/s IB (RollPacker §6) |
| A40 | 149.7 TFLOP/s | 48 GB | 696 GB/s | PCIe 4.0 x16 (PAT §5.1) | 100 Gb/s IB (PAT §5.1) |

Fitted: PAT's Fig. 4 gives four decode latencies of Llama-3.1-8B
(bf16) on 8 GPUs (the GPU is not named there; §2.3 and §4.2 use 8×A40): one sequence, 15.37 ms at TP2 and
9.64 ms at TP8; a global batch of 128, 24.41 ms at TP2x4 and 30.87 ms at TP8. With the decode model of
`cost.AnalyticCost` (weights and KV read at `hbm_efficiency` x bandwidth, two ring all-reduces per layer of
`2(tp-1)` hops of `hop_latency_s` plus their bytes at `allreduce_bw`), the four points fix four unknowns
exactly (Newton's method: `fit.fit_pat_fig4`; tests/test_sim_fit.py checks these values are its result): the HBM efficiency (0.746, which absorbs the
per-step fixed costs), the hop latency (6.6 us), the PCIe all-reduce bus bandwidth (8.23 GB/s) and the
batch-128 points' context length, which the paper does not state (1,750 tokens). The Hopper presets keep the fitted
HBM efficiency; on NVSwitch a small all-reduce is one step (the one-shot / NVLS all-reduces of NCCL and of
the inference engines' custom kernels), so it costs a flat 8 us (a rule of thumb for 8 GPUs, a parameter)
instead of ring hops, and its bytes move at 80% of the per-direction line rate (NCCL's usual large-message
efficiency). Their end-to-end figures are not fitted to PAT's 8xH100 runs except through `train_mfu`
(below): docs/simulator.md holds the held-out points no fit uses (`heldout.py`).

`train_mfu` and `SimConfig.cluster.driver_s_per_token` are fitted jointly by `fit.fit_step_constants` (0.241
and 1.20e-5 s/token today); the values in use below were fitted one after the other, as follows, against an
older FLOP count, and stay until the cluster results are re-simulated (`fit.STALE` records the gap).
`train_mfu` (model FLOPs of the policy update, reference and old log-prob forwards over the step's tokens,
divided by peak x devices x time) is fitted to PAT's 8xH100 Llama-3.1-8B 24K step: 172.5 s in all, 134.3 s of
generation, so 38.2 s outside generation for ~443K generated tokens; less the reward, the sync and the single
controller's share (`SimConfig.cluster.driver_s_per_token`, fitted to DistFlow), ~29.7 s of forwards and
update, i.e. 6.2e-5 s per token of prompt + response, which the FLOP count of the simulator's recipe
(`configs/sim/pat_llama8b_h100.yaml`) reaches at 20.7% of peak. `prefill_mfu` is a rule-of-thumb 0.5
(prefill is < 10% of generation in these workloads: PAT §2.3, "decoding accounts for over 90% of the
generation latency").
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float          # bf16 dense, FLOP/s
    memory_bytes: float        # HBM
    hbm_bw: float              # bytes/s
    link_bw: float             # intra-node, per direction (NVLink / PCIe), bytes/s
    net_bw: float              # inter-node per GPU (InfiniBand), bytes/s
    node_size: int = 8
    hbm_efficiency: float = 0.746      # fraction of hbm_bw a decode step's weight + KV reads reach (fitted)
    hop_latency_s: float = 6.6e-6      # per ring hop of an all-reduce (fitted on A40 PCIe)
    allreduce_latency_s: float | None = None   # NVSwitch: one flat latency per all-reduce instead of ring hops
    allreduce_bw: float = 8.23e9       # all-reduce bus bandwidth (fitted on A40 PCIe)
    decode_flops_efficiency: float = 0.5   # of peak, for the compute-bound side of a decode step
    prefill_mfu: float = 0.5
    train_mfu: float = 0.207           # fitted: PAT 8xH100 Llama-3.1-8B 24K non-generation time
    kv_memory_fraction: float = 0.85   # of HBM for rollout weights + KV (vLLM/SGLang gpu_memory_utilization)
    sync_overhead_s: float = 2.0       # fixed cost of a train -> rollout weight sync (reshard set-up, rebuild)
    control_s: float = 0.70            # a PAT switch's fixed cost (graph recapture 0.73 s of PAT's 5.52 s: §5.4)

    @property
    def per_dir_link(self) -> float:
        return self.link_bw


_HOPPER = dict(peak_flops=989e12, memory_bytes=80e9, hbm_bw=3.35e12, net_bw=50e9, allreduce_latency_s=8e-6)

PRESETS: dict[str, GPU] = {
    "h100": GPU("h100", link_bw=450e9, allreduce_bw=0.8 * 450e9, **_HOPPER),
    "h800": GPU("h800", link_bw=200e9, allreduce_bw=0.8 * 200e9, **_HOPPER),
    "a40": GPU("a40", peak_flops=149.7e12, memory_bytes=48e9, hbm_bw=696e9, link_bw=25e9, net_bw=12.5e9),
}


def gpu(name: str) -> GPU:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown GPU preset {name!r}; valid choices: {', '.join(sorted(PRESETS))}") from None


# PAT Fig. 4 (§3.1): (tp, sequences per TP group, context tokens, measured seconds per decode step).
# The batch-128 context is not stated; 1,750 is the fitted value (module docstring).
PAT_FIG4 = ((2, 1, 1, 15.37e-3), (8, 1, 1, 9.64e-3), (2, 32, 1750, 24.41e-3), (8, 128, 1750, 30.87e-3))
