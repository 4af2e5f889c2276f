import dataclasses, sys, torch, warnings
from runtime import dist
from runtime.env import discover
from runtime.hostsync import HostSyncs, SIM_DEVICE
from runtime.trainer import Trainer
from tests.test_trainer import tiny_config
ctx = dist.init_distributed(discover({}), device="cpu")
ctx = dataclasses.replace(ctx, device=SIM_DEVICE); dist._CTX = ctx
cfg = tiny_config("/tmp/presto/small")
with HostSyncs(SIM_DEVICE) as s:
    t = Trainer(cfg, ctx); t.setup()
    print("compiled after setup:", t.optimizer.flat_binding.compiled)
    it = t.balance_meter.wrap(iter(t.train_loader))
    for _ in range(3): t.train_step(it)
    print("compiled after steps:", t.optimizer.flat_binding.compiled)
print(s.report())
