"""`python tests/delayed_stage.py ARGS...`: `python -m jaxrl.train ARGS...` with the weights' staging for a
mid-rollout swap (`RolloutService.stage`, on the train pool's thread after each update) delayed by 1 s in
process 1 (for runs under scripts/launch_local.sh, where a test cannot monkeypatch). Tests only: what is under
test is that the swap waits for the staged weights on every process, so a slow process changes no token."""

import sys
import time

import jax

from jaxrl.rollout.service import RolloutService
from jaxrl.train.__main__ import main

_stage = RolloutService.stage


def _delayed(self, weights, **kw):
    if jax.process_index() == 1:
        time.sleep(1.0)
    return _stage(self, weights, **kw)


RolloutService.stage = _delayed

if __name__ == "__main__":
    sys.exit(main())
