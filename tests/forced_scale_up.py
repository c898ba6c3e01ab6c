"""`python tests/forced_scale_up.py ARGS...`: `python -m jaxrl.train ARGS...` with StreamRL's scale-up rule
forced due (for runs in processes of their own, e.g. under scripts/launch_local.sh, where a test cannot
monkeypatch). Tests only: the rule itself is tests/test_pipeline.py's; what is under test is what a
scale-up does."""

import sys

from jaxrl.train import balance
from jaxrl.train.__main__ import main

balance.scale_up_due = lambda t_gen, t_train, k: (True, t_gen - t_train, t_gen / (k + 1))

if __name__ == "__main__":
    sys.exit(main())
