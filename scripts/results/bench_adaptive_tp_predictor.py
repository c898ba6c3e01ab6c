import os, sys, json, time, dataclasses
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
sys.path.insert(0, "scripts")
import numpy as np, jax
import bench_adaptive_tp as B
from jaxrl.config.generate import EngineSection
from jaxrl.rollout.adaptive_tp import Predictor, Profile
from jaxrl.rollout.profile import run_profile
from models import init
cfg = B.model_config(False)
w = init(jax.random.key(0), cfg)
engine = EngineSection(tp=2, instances=4, max_batch=16, max_seq_len=512, page_size=16, overlap=False)
t0 = time.time()
prof = run_profile(cfg, w, engine, candidates=[1, 2, 4], batches=6, contexts=[16, 96, 192, 384], decode_steps=4, progress=False)
prof.save("/tmp/bat/prof_fresh.json")
print("profile", time.time() - t0, flush=True)
total = 64
res = {}
for tp in (1, 2, 4):
    svc = dataclasses.replace(engine, tp=tp, instances=8 // tp, max_batch=total * tp // 8).build(cfg, w)
    svc.instances[0].warm()
    prompts, lens = B.requests(min(total * tp // 8, 32), tp, cfg.vocab_size, 40, 300)
    rows = B.repeated(svc, prompts, lens, 60, 3)
    res[tp] = rows
    del svc
    B.free_executables()
    print("traj", tp, time.time() - t0, flush=True)
json.dump({str(k): v for k, v in res.items()}, open("/tmp/bat/traj_fresh.json", "w"))
padded = Predictor(prof)
plain_prof = Profile.from_json(prof.to_json())
for lp in plain_prof.layouts.values():
    lp.shapes = None
plain = Predictor(plain_prof)
for tp, rows in res.items():
    print(tp, "padded", round(B.mape(padded, rows, tp), 4), "sum", round(B.mape(plain, rows, tp), 4))
