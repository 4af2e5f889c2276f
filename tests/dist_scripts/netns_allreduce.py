"""One rank of the test-bed check (tests/e2e/test_netns.py): join over the runtime's env path
(torchrun-style variables, MASTER_ADDR = rank 0's namespace address), all-reduce a tensor of
MB megabytes REPEAT times, print one JSON line: seconds per allreduce, the address the peer was
reached at, and the sum (checked).

    python tests/dist_scripts/netns_allreduce.py MB REPEAT
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402

from runtime.launch.dist import init_distributed, run_guarded, shutdown  # noqa: E402
from runtime.launch.env import discover  # noqa: E402


def main() -> None:
    mb, repeat = float(sys.argv[1]), int(sys.argv[2])
    info = discover()
    ctx = init_distributed(info, device="cpu", timeout_s=60)
    t = torch.full((int(mb * 2 ** 20 / 4),), float(ctx.rank + 1))
    torch_dist.all_reduce(t)  # connections up before timing
    times = []
    for _ in range(repeat):
        t.fill_(ctx.rank + 1)
        start = time.perf_counter()
        torch_dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    assert torch.all(t == 3.0), t[:4]
    print(json.dumps({"rank": ctx.rank, "launcher": info.launcher, "master": info.master_addr,
                      "seconds": times, "mb": mb}), flush=True)
    shutdown()


if __name__ == "__main__":
    run_guarded(main, leave=True)
