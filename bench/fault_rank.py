"""One rank of ``submission.train`` with a numerical fault injected, for ``bench.faults``:

    mpiexec -n 2 python -m bench.fault_rank --fault nan --from-step 23 -- --config C --set k=v

  nan    from step S on, the first encoder layer's output is NaN on rank 0 (the loss is NaN
         everywhere after the all-reduce; the gradients too): a NaN storm, in fp32
  fp16   the fp16 loss scaler is switched on (CPU has no fp16; this is the dynamic loss scale
         of train.precision=fp16 with an initial scale of 2^8) and from step S on one weight's
         gradient is inf on rank 0 while the loss stays finite: an overflow storm the scaler
         cannot end, since the scale halves to its floor of 1 and the gradient stays inf

Rank 0 writes ``<train.output_dir>/fault_start`` (wall-clock time) when step S starts, so the
benchmark can time the detection. Everything else is submission.train as run_and_time.sh
starts it. Never used by the runtime: a benchmark's hook from outside (the trainer has no
fault switch).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.fault_rank",
        description="One rank of submission.train with a numerical fault injected from a "
                    "step on (nan: NaN activations; fp16: an overflow storm the loss scaler "
                    "cannot end), for bench.faults. The arguments after -- are "
                    "submission.train's.")
    ap.add_argument("--fault", choices=["nan", "fp16"], required=True)
    ap.add_argument("--from-step", type=int, required=True, help="first faulty step (1-based)")
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args

    from runtime.optim.grad_scale import DynamicLossScale
    from runtime.train.trainer import Trainer
    import submission.train as entry

    real_setup = Trainer.setup

    def setup(self):
        real_setup(self)
        start = a.from_step - 1  # state.step counts completed steps
        out = Path(self.cfg.train.output_dir)
        marked = []

        def faulty() -> bool:
            if self.state.step < start:
                return False
            if not marked and self.dist.rank == 0:
                (out / "fault_start").write_text(f"{time.time()}\n")
                marked.append(True)
            return self.dist.rank == 0

        if a.fault == "nan":
            layer = self.model.bert.encoder.layer[0]
            layer.register_forward_hook(
                lambda m, i, o: o * float("nan") if m.training and faulty() else o)
        else:
            self.loss_scale = DynamicLossScale(2.0 ** 8, device=self.dist.device)
            self.checkpoints.states["loss_scale"] = self.loss_scale
            self.control.guard.scale_before = 2.0 ** 8
            weight = self.model.bert.encoder.layer[0].output.dense.weight
            weight.register_hook(lambda g: torch.full_like(g, float("inf")) if faulty() else g)

    Trainer.setup = setup
    return entry.main(args)


if __name__ == "__main__":
    sys.exit(main())
