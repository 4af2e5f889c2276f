"""Build the trainer on this rank, evaluate the untrained model once, write the all-reduced
eval counts (rank 0) to OUT. Launch under mpiexec -n N or alone; the counts must not depend on N.
The tiny model of tests/support/tiny.py; tests/unit/test_trainer.py does the same in its own process
for a world of one.

    python tests/dist_scripts/eval_counts.py DATA_DIR OUT
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
    data_dir, out = sys.argv[1], Path(sys.argv[2])
    cfg = tiny_config(data_dir, "data.eval_batch_size=7")
    info = discover()
    ctx = init_distributed(info, device="cpu", timeout_s=30)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    with torch.no_grad():  # an untrained model predicts nothing right; make it say "the"
        trainer.model.cls.predictions.bias[1996] += 20.0
    result = trainer.evaluate()
    if ctx.rank == 0:
        out.write_text(json.dumps({"world": ctx.world_size, "correct": result.correct,
                                   "count": result.count, "accuracy": result.accuracy,
                                   "eval_samples": trainer.state.eval_samples}))
    trainer.close()
    shutdown()


if __name__ == "__main__":
    run_guarded(main, leave=True)
