"""MetroRLHF's blockwise backward on the rollout's K/V (`trainer.kv_source=rollout`) with several processes:
each process stages its own instances' K/V and gathers its own rows of every micro-batch
(`jaxrl.train.rollout_kv`). `trainer.repartition=tokens` (samples moved between processes, their K/V not) is
refused here. N processes == 1 process is tested in tests/test_train_processes.py's `test_processes_equal_one`:
`pat_kv_two` (2 processes, the update's micro-batches, K/V migrated by PAT's switch) and `stream_kv_two`
(2 processes, the stream trainer's micro-batches, warmed up: nothing compiles after step 0)."""

import pytest

from jaxrl.config import train as train_cfg
from jaxrl.config.base import ConfigError
from jaxrl.config.loading import load_config

ROLLOUT_KV = ["trainer.backward=blockwise", "trainer.block_size=48", "trainer.kv_source=rollout"]


def test_two_processes_config_loads_and_repartition_is_refused():
    load_config(train_cfg.TrainConfig, [*ROLLOUT_KV, "distributed.num_processes=2"])
    with pytest.raises(ConfigError) as info:
        load_config(train_cfg.TrainConfig, [*ROLLOUT_KV, "distributed.num_processes=2", "trainer.repartition=tokens"])
    assert "trainer.repartition" in str(info.value) and "kv_source=rollout" in str(info.value)
    load_config(train_cfg.TrainConfig, [*ROLLOUT_KV, "trainer.repartition=tokens"])      # one process: nothing moves
