"""Read one training epoch on this rank and write its samples' input_ids to OUT/rank<r>.json.

Launch: mpiexec -n 2 python tests/dist_scripts/read_epoch.py DATA_DIR OUT [BATCH] [SEED]
Rank and world size come from runtime.launch.env, the one module that reads the launcher's
environment; no process group is needed, the loader itself never communicates.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `loaders`

from loaders.dataset import TrainLoader  # noqa: E402
from runtime.launch.env import discover  # noqa: E402


def main() -> None:
    data_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    info = discover()
    rank, world = info.rank, info.world_size
    loader = TrainLoader(data_dir, rank, world, batch, seed)
    rows = []
    for _ in range(loader.steps_per_epoch):
        b = next(loader)
        for i, n in enumerate(b.attention_mask.sum(1).tolist()):
            rows.append(b.input_ids[i, :n].tolist())
    loader.close()
    record = {"rank": rank, "world_size": world, "steps": len(rows) // batch, "input_ids": rows}
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
