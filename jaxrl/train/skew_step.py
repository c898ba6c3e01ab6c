"""One RL step's StreamRL skew-aware placement (paper §5.2–5.3), around the rollout:

    sk = SkewStep(cfg.rollout.skew, cfg, svc_instances=..., tokenizer=tok)
    route = sk.place(svc, prompts)            # before the rollout: predicted lengths -> instance, priority, caps
    ... rl.rollout_and_score(..., route=route)
    sk.observe(prompts, completions)          # after: (prompt, mean response length) pairs, every process's
    metrics = sk.finish(step)                 # refresh the ranker every k steps; skew/... metrics

**Place.** The ranker predicts each local prompt's response length; `skew.plan_placement` takes the top
α as long-tail prompts, chooses N_l dedicated instances and each class's batch cap by the cost model
(PTL from the PAT profile, or the linear model; L = P50/P90 of the last `history` response lengths),
deals the prompts and sets the caps on the service. The engine runs LPT admission (`order="lpt"`), each
request's priority being its predicted length. Until the ranker's first refresh the engine's own router
places the prompts (caps lifted, priorities 0: FCFS among them) and `skew/active` is 0.

**Observe.** Each trained prompt's mean response length over its kept samples, gathered from every process
(so every process holds the same ranker and the checkpoint of process 0 is everyone's), is a pair of the
ranker's history; every sample's length enters the recent-length window for P50/P90.

**Checkpointed.** `state_dict()` (the ranker: weights, Adam state, history, metrics; the recent lengths;
the step counter) goes into the checkpoint's meta, so kill -9 and resume continues with the same ranker.

With PAT (`engine.adaptive_tp`), the placement's classes go to the switch driver (`svc.adaptive.classes`), so
a TP switch mid-generation keeps them: each class dealt over its own share of the new instances
(`skew.Classes`), merged only on a single instance.

With RollPacker's stream trainer, the long-tail instances are among those it never frees (N_l is capped at
their count), and a shrink moves each freed instance's requests to kept instances of the same class.

Simplified: predictions use the ranker of the last refresh (the paper preprocesses the dataset once after
training and fine-tunes online, which amounts to the same); multi-process runs place each process's prompts
over its own instances (per-process Algorithm 2 over per-process prompts).
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

import numpy as np

from jaxrl.config.skew import SkewSection
from jaxrl.rollout import skew
from jaxrl.rollout.adaptive_tp import Predictor, Profile
from jaxrl.rollout.ranker import LengthRanker

from .distributed import gather_ragged


class SkewStep:
    def __init__(self, section: SkewSection, *, max_prompt_len: int, group_size: int, max_new_tokens: int,
                 seed: int, tp: int, recent: int = 1024):
        r = section.ranker
        self.section, self.group_size, self.max_new_tokens = section, group_size, max_new_tokens
        self.ranker = LengthRanker(max_prompt_len, buckets=r.buckets, d_model=r.d_model, layers=r.layers,
                                   heads=r.heads, lr=r.lr, train_steps=r.train_steps, batch=r.batch,
                                   history=r.history, holdout=r.holdout, seed=seed)
        self.recent: deque[int] = deque(maxlen=recent)
        self.ptl = self._ptl(section, tp, max_prompt_len)
        self.steps = 0
        self.last_plan: skew.Placement | None = None
        self.last_refresh: dict = {}

    @staticmethod
    def _ptl(section: SkewSection, tp: int, max_prompt_len: int):
        if section.profile is None:
            return skew.linear_ptl(section.ptl_base_s, section.ptl_per_seq_s)
        pred = Predictor(Profile.load(section.profile))
        if tp not in pred.layouts:
            raise ValueError(f"rollout.skew.profile {section.profile} has no TP{tp} layout (the engine's); "
                             f"it has {pred.layouts}")
        return skew.ptl_from_profile(pred, tp, context=max_prompt_len)

    # ------------------------------------------------------------------------------ warm start
    def load_pairs(self, path: str | Path, tokenizer=None) -> int:
        """Warm start from a JSONL file of {"tokens": [ids], "length": n} or {"prompt": text, "length": n}
        (text needs `tokenizer`); refreshes once. Returns the pairs read."""
        prompts, lengths = [], []
        for k, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                tokens = row["tokens"] if "tokens" in row else tokenizer.encode(row["prompt"])
                prompts.append([int(t) for t in tokens])
                lengths.append(int(row["length"]))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}:{k}: expected {{\"tokens\": [ids], \"length\": n}} or "
                                 f"{{\"prompt\": text, \"length\": n}} ({type(e).__name__}: {e})") from None
        self.ranker.observe(prompts, lengths)
        self.recent.extend(lengths)
        self.last_refresh = self.ranker.refresh()
        return len(prompts)

    # ------------------------------------------------------------------------------ the step
    def place(self, svc, prompts: list[list[int]], *, max_long: int | None = None
              ) -> tuple[list[int | None], list[float]]:
        """(instance, priority) per prompt, with the instances' batch caps set on `svc`. `max_long`: dedicated
        long-tail instances at most (the stream trainer's: the instances it never frees)."""
        n = len(svc.instances)
        pat = svc.adaptive
        if not self.ranker.trained or not prompts:
            svc.set_batch_caps([None] * n)
            self.last_plan = None
            if pat is not None:
                pat.classes = None
            return [None] * len(prompts), [0.0] * len(prompts)
        predicted = self.ranker.predict(prompts)
        cap = min(i.max_batch for i in svc.instances)
        self.last_plan = plan = skew.plan_placement(
            predicted, instances=n, group_size=self.group_size, cap=cap, ptl=self.ptl, lengths=list(self.recent),
            alpha=self.section.alpha, default_length=self.max_new_tokens, max_long=max_long)
        svc.set_batch_caps(plan.caps)
        if pat is not None:          # PAT's switches keep the long/regular classes (`skew.Classes`)
            pat.classes = skew.Classes.from_placement(plan)
        priority = plan.priority if self.section.lpt else [0.0] * len(prompts)
        return list(plan.instance), list(priority)

    def instance_classes(self, svc) -> dict[int, str] | None:
        """Instance -> "long" / "regular" of the running layout (None: no placement this step): the
        placement's, or, after PAT switched mid-generation, the classes it kept."""
        if self.last_plan is None:
            return None
        pat = svc.adaptive
        n_long = pat.classes.n_long if pat is not None and pat.classes is not None else self.last_plan.split.n_long
        return {k: "long" if k < n_long else "regular" for k in range(len(svc.instances))}

    def observe(self, prompts: list[list[int]], lengths: list[list[int]], *, log: Path | None = None) -> None:
        """After the rollout: each trained prompt's kept samples' response lengths (every process calls it).
        `log`: append the step's pairs (every process's) to this JSONL file, the warm-start format."""
        flat = np.concatenate([np.asarray(p, np.int32) for p in prompts]) if prompts else np.zeros(0, np.int32)
        sizes = gather_ragged(np.asarray([len(p) for p in prompts], np.int32))
        tokens = gather_ragged(flat)
        means = gather_ragged(np.asarray([np.mean(x) if len(x) else 0.0 for x in lengths], np.float32))
        every = gather_ragged(np.asarray([n for x in lengths for n in x], np.int32))
        cuts = np.cumsum(np.concatenate([[0], sizes]))
        pairs = [tokens[a:b].tolist() for a, b in zip(cuts, cuts[1:])]
        targets = [int(round(float(m))) for m in means]
        self.ranker.observe(pairs, targets)
        if log is not None:
            with open(log, "a") as f:
                f.writelines(json.dumps({"tokens": t, "length": n}) + "\n" for t, n in zip(pairs, targets))
        self.recent.extend(int(n) for n in every)

    def finish(self, step: int) -> dict:
        """Refresh every `refresh_every` steps; this step's skew/... metrics."""
        self.steps += 1
        out = {}
        if self.steps % self.section.ranker.refresh_every == 0:
            t0 = time.perf_counter()
            self.last_refresh = self.ranker.refresh()
            out["skew/refresh_s"] = time.perf_counter() - t0
            for k in ("kendall_tau", "recall_top20", "loss"):
                out[f"skew/{k}"] = float(self.last_refresh.get(k, float("nan")))
        out["skew/pairs"] = float(self.last_refresh.get("pairs", 0))
        plan = self.last_plan
        out["skew/active"] = float(plan is not None)
        if plan is not None:
            out["skew/long_instances"] = float(plan.split.n_long)
            out["skew/long_prompts"] = float(len(plan.long))
            out["skew/batch_cap_long"] = float(plan.split.bs_long)
            out["skew/batch_cap_regular"] = float(plan.split.bs_reg)
            out["skew/predicted_s"] = float(plan.split.seconds)
            out["skew/predicted_mixed_s"] = float(plan.costs[0].seconds)
        return out

    # ------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {"ranker": self.ranker.state_dict(), "recent": list(self.recent), "steps": self.steps,
                "last_refresh": {k: v for k, v in self.last_refresh.items()
                                 if isinstance(v, (int, float)) and np.isfinite(v)}}

    def load_state_dict(self, d: dict) -> None:
        self.ranker.load_state_dict(d["ranker"])
        self.recent.clear()
        self.recent.extend(int(n) for n in d["recent"])
        self.steps = int(d["steps"])
        self.last_refresh = dict(d.get("last_refresh", {}))
