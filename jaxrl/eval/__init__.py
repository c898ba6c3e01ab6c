"""Held-out evaluation through the rollout engine: `core.evaluate` (one evaluation: accuracy mean@n, pass@k,
lengths), `periodic.PeriodicEval` (the `eval` section of a training run), `heldout` (a file or a split of the
training data) and `python -m jaxrl.eval` (`__main__`: a checkpoint evaluated on a file, results to JSON)."""
