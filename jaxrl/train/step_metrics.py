"""Per-step metrics of an RL step (what `metrics.jsonl` and TensorBoard get), gathered over processes:
only scalars cross processes; per-sample arrays are gathered (ragged: tail batching trains unequal counts
per process) into the scalar statistics here."""

from __future__ import annotations

import numpy as np

from .distributed import gather_ragged, global_max, global_sum


def step_metrics(rewards, lens, rstats: dict, m: dict, times: dict, *, lr: float, svc) -> dict:
    """Rewards, response lengths, the update's statistics `m`, reward failures, preemptions, engine steps,
    the stage `times` and the mechanisms' counters in `m` (`blockwise/...`, `stream/...`)."""
    # float64 after the gather too: across processes values travel as float32 (exact for float32 rewards),
    # and a float32 mean would differ from one process's float64 one in the last digits
    all_r = np.asarray(gather_ragged(np.asarray(rewards, np.float64)), np.float64)
    all_l = np.asarray(gather_ragged(np.asarray(lens, np.float64)), np.float64)
    counts = global_sum([rstats["timeouts"], rstats["crashes"], sum(s["preemptions"] for s in svc.stats())])
    if not all_r.size:                 # nothing trained (dynamic sampling dropped every group): zeros
        all_r = all_l = np.zeros(1)
    out = {"reward_mean": all_r.mean(), "reward_std": all_r.std(),
           "pass_rate": float(np.mean(all_r >= 1.0)), "response_len_mean": all_l.mean(),
           "response_len_p50": float(np.percentile(all_l, 50)), "response_len_p90": float(np.percentile(all_l, 90)),
           "response_len_max": all_l.max(), "kl": m["kl"], "entropy": m["entropy"], "clip_frac": m["clip_frac"],
           "grad_norm": m["grad_norm"], "loss": m["loss"], "skipped": m["skipped"], "lr": lr,
           "reward_timeouts": counts[0], "reward_crashes": counts[1], "preemptions_total": counts[2],
           "tokens_per_s": all_l.sum() / max(times["rollout_s"], 1e-9),
           "engine_steps": global_max(rstats["engine_steps"]), **times,
           **{k: v for k, v in m.items() if k.startswith(("blockwise/", "stream/", "async/"))}}
    return {k: (float(v) if not isinstance(v, int) else v) for k, v in out.items()}


def staleness_metrics(step: int, completions, k: int, default: int) -> dict:
    """async/... (trainer.max_staleness = k): the trained tokens' staleness, `step` minus the weights version
    that sampled each (`Completion.token_versions`; `default` where none was recorded), over all processes: its
    mean and the fraction of tokens at each lag 0..k (the histogram), and above k (`async/lag_over_k_frac`:
    carried partial responses kept with their correction, `trainer.stale_samples=correct`)."""
    counts, lag_sum = np.zeros(k + 2), 0.0
    for c in completions:
        lags = step - np.asarray(c.token_versions(default), np.int64)
        counts += np.bincount(np.clip(lags, 0, k + 1), minlength=k + 2)
        lag_sum += float(np.maximum(lags, 0).sum())
    *counts, lag_sum = np.asarray(global_sum([float(x) for x in counts] + [lag_sum]), np.float64)
    total = max(sum(counts), 1.0)
    out = {f"async/lag{j}_frac": float(counts[j] / total) for j in range(k + 1)}
    out["async/lag_over_k_frac"] = float(counts[k + 1] / total)
    out["async/staleness_mean"] = float(lag_sum / total)
    return out


def tail_metrics(plan, rstats: dict, lens, *, trained: int) -> dict:
    """tail/...: the round (1 = long), prompts launched (over every wave)
    and trained, the responses aborted and their tokens, decoded tokens thrown away, the round's longest
    kept response; with dynamic sampling the groups dropped (all rewards equal), the waves drawn and the
    prompts the batch still lacked."""
    launched, trained, aborted, aborted_tok, wasted, dropped = global_sum(
        [rstats.get("launched", len(plan.rows)), trained, rstats["aborted"], rstats["aborted_tokens"],
         rstats["wasted_tokens"], rstats.get("dropped", 0)])
    return {"tail/long_round": int(plan.kind == "long"),
            "tail/queued": len(rstats.get("queued", [])), "tail/prompts_launched": int(launched),
            "tail/prompts_trained": int(trained), "tail/aborted_responses": int(aborted),
            "tail/aborted_tokens": int(aborted_tok), "tail/wasted_tokens": int(wasted),
            "tail/max_response_len": global_max(max(lens, default=0)), "tail/dropped_groups": int(dropped),
            "tail/waves": int(rstats.get("waves", 1)), "tail/batch_short": int(rstats.get("batch_short", 0))}


def carry_metrics(rstats: dict) -> dict:
    """Carried partial responses (rollout.tail_batching.carry_partial), over all processes: resumed responses
    and their tokens (decoded in an earlier round, not again), and those the staleness rule dropped or kept
    with their correction (`jaxrl.rollout.partial_carry.apply_staleness`)."""
    keys = ("carried_samples", "carried_tokens", "stale_dropped", "stale_corrected")
    got = global_sum([rstats.get(k, 0) for k in keys])
    return {"tail/carried_samples": int(got[0]), "tail/carried_tokens": int(got[1]),
            "async/dropped_samples": int(got[2]), "async/corrected_samples": int(got[3])}


def placement_metrics(svc, train_devices: int, gstream, staleness: int, wait: float) -> dict:
    """placement/... (StreamRL disaggregated): the pools' sizes, the staleness of the trained samples, the
    wait for the train pool, and the groups and micro-batches streamed before the rollout ended."""
    out = {"placement/gen_devices": sum(svc.layout), "placement/train_devices": train_devices,
           "placement/gen_instances": len(svc.instances), "placement/staleness": staleness,
           "placement/train_wait_s": wait}
    if gstream is not None:
        out.update({"placement/groups_streamed": gstream.groups_early, "placement/groups": gstream.groups,
                    "placement/micro_batches_streamed": gstream.micro_batches_early})
    return out
