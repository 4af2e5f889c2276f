"""The sharded optimizer (optim.shard), pure parts: shards of whole rows and the pieces of a
bucket, the row padding of a sharded buffer, the config's refusals, the memory estimate.
The runs: tests/integration/test_shard_integration.py (one rank), tests/ranks/test_shard.py."""
from __future__ import annotations


import pytest

from kernels.optim_flat import FlatLayout
from runtime.config import ConfigError
from runtime.grad_sync.shard import REDUCTION, Shard
from runtime.launch.dist import BlockGroups
from runtime.train import memory
from tests.support.tiny import tiny_config

def groups(size: int, index: int = 0, blocks: int = 1) -> BlockGroups:
    return BlockGroups(size, index, blocks, 0)


def test_shards_are_equal_whole_rows_and_pieces_cover_a_bucket_once():
    total = 10 * 1024 + 0  # 10 rows
    shards = [Shard(total, groups(4, j), align=1024) for j in range(4)]
    assert {s.elements for s in shards} == {3 * 1024} and shards[0].padded_total == 12 * 1024
    assert [s.window for s in shards] == [(j * 3072, (j + 1) * 3072) for j in range(4)]
    for lo, hi in ((0, 10240), (100, 5000), (3072, 6144), (9000, 10240), (5, 6)):
        pieces = shards[0].pieces(lo, hi)
        assert sum(b - a for _, a, b in pieces) == hi - lo
        assert all(j * 3072 <= a < b <= (j + 1) * 3072 for j, a, b in pieces)
        owned = [s.owned(lo, hi) for s in shards]
        assert sum(b - a for o in owned if o for a, b in [o]) == hi - lo
    assert Shard(total, groups(1)).window == (0, 10240)
    assert REDUCTION == {"nccl": "reduce", "gloo": "allreduce"}


def test_a_sharded_buffer_pads_rows_of_the_last_tensor():
    layout = FlatLayout.build([(3, 1000), (5,)])   # 3 rows + 1 row
    seg = layout.row_segment("cpu", rows=6)
    assert seg.tolist() == [0, 0, 0, 1, 1, 1]


def test_the_config_refuses_what_cannot_shard(small_dataset):
    with pytest.raises(ConfigError, match="optim.shard='world' needs train.grad_sync"):
        tiny_config(small_dataset, "optim.shard=world", "train.grad_sync=ddp",
                    "train.clip_mode=global_after")
    with pytest.raises(ConfigError, match="optim.shard='node' needs optim.backend"):
        tiny_config(small_dataset, "optim.shard=node")   # the tiny config's foreach
    with pytest.raises(ConfigError, match="optim.shard"):
        tiny_config(small_dataset, "optim.shard=half")
    tiny_config(small_dataset, "optim.shard=world", "optim.backend=fused")


def test_the_memory_estimate_keeps_one_shard_of_the_optimizer_state(small_dataset):
    base = ["system.ranks_per_node=8", "system.nodes=2", "train.global_batch_size=256",
            "optim.backend=auto"]
    est = {s: memory.estimate(tiny_config(small_dataset, *base, f"optim.shard={s}"))
           for s in ("none", "node", "world")}
    p = est["none"].params
    assert est["none"].static == p * (12 + 8)
    assert est["node"].static == int(p * (12 + 8 / 8))
    assert est["world"].static == int(p * (12 + 8 / 16))


