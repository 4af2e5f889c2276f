"""Train a tiny model for a few steps with data.balance=BALANCE on this rank and write what
the balance meter saw: OUT/rank<r>.json has this rank's per-step counts and the reduced
``extra`` metrics. Launch under mpiexec -n N or alone. The tiny model of tests/support/tiny.py.

    python tests/dist_scripts/balance_steps.py DATA_DIR OUT BALANCE ATTENTION
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from runtime.launch.dist import init_distributed, run_guarded, shutdown  # noqa: E402
from runtime.launch.env import discover  # noqa: E402
from runtime.train.trainer import Trainer  # noqa: E402
from tests.support.tiny import tiny_config  # noqa: E402


def main() -> None:
    data_dir, out, balance, attention = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = tiny_config(data_dir, f"data.balance={balance}", f"model.attention={attention}")
    ctx = init_distributed(discover(), device="cpu", timeout_s=60)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    it = trainer.balance_meter.wrap(iter(trainer.train_loader))
    for _ in range(3):
        trainer.train_step(it)
    mine = [counts for counts, _ in trainer.balance_meter._closed]  # this rank's own counts
    logged = trainer.step_log.flush()  # a logging point: every rank reduces here (and fills
    steps = []                         # each step's compute_s into its counts)
    for m, counts in zip(logged, mine):
        steps.append({"local": counts, "extra": m.extra, "computed_tokens": m.computed_tokens,
                      "real_tokens": m.real_tokens})
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({"world": ctx.world_size,
                                                          "steps": steps}))
    trainer.close()
    shutdown()


if __name__ == "__main__":
    run_guarded(main, leave=True)
