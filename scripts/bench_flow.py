"""DistFlow's data path at 1, 2 and 4 processes: what reaches process 0, and the padding the
token-balanced repartition removes.

    python scripts/bench_flow.py --out scripts/results/bench_flow.json

For each process count N (local processes under jax.distributed, 8/N fake CPU devices each) every process
holds its own share of a step's samples: `--per-process` samples (weak scaling, as in the trainer, where
each process rolls out its own prompts), most of them short, and the step's long tail (10% of all
samples, half to all of pack_len) drawn by one process (`lengths_for`). It then runs

* the trainer's databuffer (`jaxrl.flow.SampleBuffer.repartition`, what `trainer.repartition=tokens`
  runs before packing): sample data moves process-to-process on the devices; `proc0_sample_bytes` is the
  sample data that lands on process 0 (its own training share only; nothing passes through it for
  others);
* its single-controller twin: every process's samples gathered on process 0 (as a central driver that
  packs and dispatches the batch would need them); `single_controller_proc0_bytes` is what process 0
  received from the others (measured on the arrays received);

and the padding fraction of the packed batch with each process packing its own samples
(`padding_local`: the longest process sets everyone's row count) and after the token-balanced
repartition (`padding_balanced`). The step's scalar metrics (every process computes them by all-reduce;
process 0 only writes them) are not counted here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_harness import write_result  # noqa: E402

OUTPUTS = ("bench_flow.json",)  # its files in scripts/results/ (tests/test_docs.py)


def lengths_for(process: int, processes: int, n: int, pack_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths of one process's `n` samples. Responses are short (lognormal, median ~37
    tokens) except the step's long tail: 10% of all samples, between pack_len/2 and pack_len - 48 tokens,
    all drawn by the last process (the one whose prompts were hard)."""
    import numpy as np

    rng = np.random.default_rng([seed, process])
    prompts = rng.integers(16, 48, n)
    resp = np.minimum(np.exp(rng.normal(3.6, 0.6, n)).astype(int) + 1, pack_len - 48)
    if process == processes - 1:
        k = min(n, round(0.10 * n * processes))
        resp[:k] = rng.integers(pack_len // 2, pack_len - 48, k)
    return [(int(p), int(r)) for p, r in zip(prompts, resp)]


def worker(args) -> None:
    import numpy as np

    from jaxrl.config.train import DistributedSection
    from jaxrl.train.distributed import initialize

    n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    initialize(DistributedSection(), local_cpu_devices=8 // n)
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from jaxrl.flow import SampleBuffer
    from jaxrl.flow.databuffer import encode
    from jaxrl.train.batch import Sample
    from jaxrl.train.distributed import global_sum

    me = jax.process_index()
    rng = np.random.default_rng([args.seed, 100 + me])
    samples = [Sample(list(rng.integers(0, 100, p)), list(rng.integers(0, 100, r)),
                      rng.standard_normal(r).astype(np.float32), list(rng.standard_normal(r).astype(float)), 0)
               for p, r in lengths_for(me, n, args.per_process, args.pack_len, args.seed)]
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    buf = SampleBuffer(mesh, args.pack_len)
    moved, m = buf.repartition(samples)
    assert sum(global_sum([len(moved)])) == n * args.per_process       # every sample exactly once
    # the single-controller twin: every process's encoded samples gathered on process 0
    fields = encode(samples, args.pack_len, me)
    mine = sum(int(v[me][:len(samples)].nbytes) for v in fields.values())
    if n > 1:
        counts = multihost_utils.process_allgather(np.asarray([len(samples)], np.int32))
        width = int(np.max(counts))
        got = 0
        for name, v in fields.items():
            rows = np.zeros((width, *v[me].shape[1:]), v[me].dtype)
            rows[:len(samples)] = v[me][:len(samples)]
            every = np.asarray(multihost_utils.process_allgather(rows))
            got += sum(int(every[p][:int(counts[p][0])].nbytes) for p in range(n) if p != 0)
        central = got
    else:
        central = 0
    if me == 0:
        out = {"processes": n, "proc0_sample_bytes": int(m.get("flow/proc0_sample_bytes", 0)),
               "bytes_moved": int(m.get("flow/bytes_moved", 0)), "single_controller_proc0_bytes": int(central),
               "proc0_own_sample_bytes": mine, "padding_local": float(m["flow/padding_local"]),
               "padding_balanced": float(m["flow/padding_balanced"]),
               "samples": int(args.per_process * n)}
        Path(args.row_out).write_text(json.dumps(out))
    multihost_utils.sync_global_devices("bench_flow done")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="scripts/results/bench_flow.json")
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--per-process", type=int, default=32)
    ap.add_argument("--pack-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = []
    for n in [int(x) for x in args.processes.split(",")]:
        row_out = Path(args.out).with_suffix(f".p{n}.tmp")
        cmd = [sys.executable, __file__, "--worker", "--row-out", str(row_out), "--per-process", str(args.per_process),
               "--pack-len", str(args.pack_len), "--seed", str(args.seed)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("XLA_FLAGS", None)
        if n > 1:
            cmd = [str(ROOT / "scripts" / "launch_local.sh"), str(n), *cmd]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode:
            raise SystemExit(f"{n} process(es) failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        rows.append(json.loads(row_out.read_text()))
        row_out.unlink()
        print(json.dumps(rows[-1]), flush=True)
    write_result(args.out, {"bench": "flow", "per_process": args.per_process, "pack_len": args.pack_len, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
