"""One rank of the distributed tests: ``python tests/dist_scripts/worker.py MODE [--timeout S]``.

Started by a real launcher (mpiexec, mpirun, torchrun) from tests/ranks/test_dist_ranks.py. Modes:
  allreduce  discover, join, all-reduce rank+1, check the sum and the object helpers, print
             (and with --out DIR write DIR/rank<N>.json) the result; exit 0
  config     ranks hold different configs: check_same_on_all_ranks must stop both
  raise      rank 1 raises in the middle of a run of all-reduces
  kill       rank 1 SIGKILLs itself in the middle of a run of all-reduces
  hang       rank 1 stops answering (sleeps); rank 0's all-reduce must time out
  leave-last rank 1 takes 1 s to leave the group: rank 0, the store's host, leaves after it
  end-apart  rank 1 ends its process 1 s after MPI_Finalize, rank 0 at once: the launcher must
             not take rank 0's end for an abnormal one (MPICH's hydra SIGKILLs every rank
             still running when one ends without PMI's finalize)
  refuse     every rank refuses alike (an error raised on all ranks, exit 2, as a refused
             resume); rank 1's failure note takes 2 s, then writes DIR/noted<N> as each
             rank's does (submission.train's note writes the rank's status record)
  refuse-0-late  the same, but rank 0's note takes 1 s and rank 1, waiting for it, is slow
             (descheduled) between its looks at the store that rank 0 hosts
"""
import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from runtime.launch import dist  # noqa: E402
from runtime.launch.env import discover  # noqa: E402


class Refused(RuntimeError):
    raised_on_all_ranks = True
    exit_code = 2


def allreduce_steps(ctx, n, fault_rank=None, fault=None):
    for step in range(n):
        if step == 3 and ctx.rank == fault_rank:
            fault()
        t = torch.full((4,), float(ctx.rank + 1))
        dist.all_reduce_sum(t)
        time.sleep(0.05)
    return t


def main(mode: str, timeout_s: float, out_dir: str = "") -> int:
    info = discover()

    def body():
        ctx = dist.init_distributed(info, device="cpu", timeout_s=timeout_s)
        ws = ctx.world_size
        if mode == "allreduce":
            t = allreduce_steps(ctx, 2)
            expect = ws * (ws + 1) / 2
            assert torch.all(t == expect), (t, expect)
            assert dist.broadcast_object({"from": ctx.rank}) == {"from": 0}
            assert dist.all_gather_object(ctx.rank) == list(range(ws))
            dist.check_same_on_all_ranks("config", {"lr": 1e-3, "seed": 1})
            dist.barrier()
            result = json.dumps({
                "rank": ctx.rank, "world_size": ws, "local_rank": ctx.local_rank,
                "local_world_size": ctx.local_world_size, "launcher": info.launcher,
                "rendezvous": info.rendezvous, "backend": ctx.backend, "sum": t[0].item(),
                "is_main": ctx.is_main})
            print("RESULT " + result, flush=True)
            if out_dir:  # launchers may interleave the ranks' stdout; files never do
                with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
                    f.write(result)
            dist.shutdown()
        elif mode == "config":
            cfg = {"optimizer": {"lr": 1e-3 * (1 + ctx.rank), "name": "lamb"}, "seed": 1}
            dist.check_same_on_all_ranks("config", cfg)
            print("config check passed (wrong)", flush=True)
        elif mode == "raise":
            def boom():
                raise RuntimeError("injected failure on rank 1")
            allreduce_steps(ctx, 400, fault_rank=1, fault=boom)
        elif mode == "kill":
            allreduce_steps(ctx, 400, fault_rank=1,
                            fault=lambda: os.kill(os.getpid(), signal.SIGKILL))
        elif mode == "hang":
            allreduce_steps(ctx, 400, fault_rank=1, fault=lambda: time.sleep(3600))
        elif mode == "leave-last":
            allreduce_steps(ctx, 2)
            if ctx.rank == 1:   # rank 1 is slow to leave: rank 0 must still go after it
                count_left = dist._count_left

                def slow(store, n):
                    if n == 1:
                        time.sleep(1.0)
                        print(f"LEFT {time.time():.6f}", flush=True)
                    return count_left(store, n)
                dist._count_left = slow
            dist.shutdown()
            print(f"DONE{ctx.rank} {time.time():.6f}", flush=True)
        elif mode == "end-apart":
            allreduce_steps(ctx, 2)
            dist.shutdown()
            if ctx.rank == 1:   # slow between MPI_Finalize (in leave_process) and its end
                class SlowEnd:
                    def __getattr__(self, name):
                        return getattr(os, name)

                    @staticmethod
                    def _exit(code):
                        time.sleep(1.0)
                        print(f"END1 {time.time():.6f}", flush=True)
                        os._exit(code)
                dist.os = SlowEnd()
            print(f"DONE{ctx.rank} {time.time():.6f}", flush=True)
        elif mode in ("refuse", "refuse-0-late"):
            late = 1 if mode == "refuse" else 0

            def note(e):
                if ctx.rank == late:
                    time.sleep(2.0 if late else 1.0)
                open(os.path.join(out_dir, f"noted{ctx.rank}"), "w").close()
            dist.on_failure(note)
            if late == 0 and ctx.rank == 1:   # its looks at the store 0.5 s apart
                class Slow:
                    def __getattr__(self, name):
                        return getattr(time, name)

                    @staticmethod
                    def sleep(s):
                        time.sleep(max(s, 0.5))
                dist.time = Slow()
            dist.barrier()
            raise Refused("refused alike on every rank")
        else:
            raise SystemExit(f"unknown mode {mode}")
        return 0

    return dist.run_guarded(body, info, leave=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--tag", default="", help="ignored; lets the test find its own ranks")
    ap.add_argument("--out", default="", help="directory for rank<N>.json results")
    a = ap.parse_args()
    sys.exit(main(a.mode, a.timeout, a.out))
