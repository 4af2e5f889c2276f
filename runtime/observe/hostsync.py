"""Host syncs and wrong-device tensors, counted: on a GPU by torch's sync debug mode, on a CPU
by a simulated device, so the CUDA path's commonest bugs are caught where no GPU is.

Owns: ``HostSyncs``, a context manager that records every event of these kinds inside it,
each with the repository line that caused it:

  read          a device value read by the host (``item``, ``tolist``, ``bool``/``int``/
                ``float``, ``numpy``, ``torch.equal``): the host waits for the GPU;
  shape         an op whose output size depends on device data (``nonzero``, a boolean-mask
                index, ``unique_consecutive``, ``repeat_interleave`` without ``output_size``,
                ``masked_select``, ``bincount``): the host waits to learn the size;
  h2d           a blocking host-to-device copy (``torch.tensor(data, device=dev)``,
                ``.to(dev)`` without ``non_blocking``, a host index into a device tensor);
  d2h           a device-to-host copy (``.cpu()``, ``.to("cpu")``);
  wrong_device  a host tensor in a collective, or mixed with device tensors in one op. On
                NCCL that is a crash ("No backend type associated with device type cpu");
                gloo takes CPU tensors, which is why CPU runs never showed it.
  host_copy     (``capture=True`` only) any copy from host memory to the device, pinned and
                ``non_blocking`` included: inside a CUDA graph it would replay from the host
                address of the capture, never the new value.

With ``capture=True`` (the region a CUDA graph would capture, runtime.train.graphs) every op
on a device tensor is also kept in ``trace`` as (op, output shapes): the same region run on
other data must give the same trace - no shape, and no Python decision, depends on the data.

On CUDA (``device.type == "cuda"``) the counting is torch's: ``torch.cuda.set_sync_debug_mode
("warn")`` reports every synchronising call (each becomes a ``sync`` event); wrong-device
collectives raise there by themselves.

On CPU the device is *simulated*: give the runtime ``SIM_DEVICE`` (``cpu:0``, a CPU device
that compares unequal to plain ``cpu``) as its device. A ``TorchFunctionMode`` then tags each
tensor as device (made with ``device=SIM_DEVICE``, moved there with ``.to``, or computed from
a device tensor) or host (made without a device, ``from_numpy``, ``.cpu()``), reports a device
tensor's ``.device`` as ``SIM_DEVICE`` so ``device=t.device`` keeps the tag, and records the
events above as CUDA would incur them. Collectives are watched by wrapping the functions of
``torch.distributed`` for the duration. Limits: what runs in C++ (DDP's reducer, autograd's
own kernels) or inside compiled code is not seen; tensors made outside the context (loader
threads) are untagged and never reported; a pinned-memory ``non_blocking`` copy is assumed,
so unpinned copies are not counted here (the GPU stage of bench.gpu sees them).

Never: changes what the code computes (every call runs as it would), or is on in training:
tests and ``python -m bench.gpu`` use it.

Example::

    with HostSyncs(ctx.device) as syncs:
        trainer.train_step(it)
    assert not syncs.events, syncs.report()
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as torch_dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

SIM_DEVICE = torch.device("cpu", 0)
"""The simulated accelerator: a CPU device that compares unequal to ``torch.device("cpu")``."""

KINDS = ("read", "shape", "h2d", "d2h", "wrong_device", "sync", "host_copy")
ROOT = Path(__file__).resolve().parents[2]
_HERE = str(Path(__file__).resolve())

_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy",
          "equal", "allclose", "__repr__", "__format__"}
_SHAPES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
           "_unique2", "bincount"}
_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "linspace",
              "rand", "randn", "randint", "randperm", "eye", "scalar_tensor", "empty_strided",
              "from_numpy", "zeros_like", "ones_like", "full_like", "empty_like", "rand_like",
              "randn_like", "randint_like"}
_NEW = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put", "index_select",
             "index_copy_", "index_copy", "index_add_", "gather", "scatter_", "take"}
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "reduce_scatter", "reduce", "all_to_all_single",
                "all_to_all", "send", "recv", "isend", "irecv", "gather", "scatter")

_DEVICE, _HOST = "device", "host"
_DATA_SET = torch.Tensor.data.__set__


@dataclass(frozen=True)
class SyncEvent:
    kind: str    # one of KINDS
    op: str      # the torch call (or collective) that caused it
    where: str   # "path:line (function)" of the first caller in the repository

    def __str__(self) -> str:
        return f"{self.kind:12s} {self.op:24s} {self.where}"


def simulated(ctx):
    """``ctx`` (a runtime.launch.dist.DistContext) on ``SIM_DEVICE``, standing in for a GPU:
    what the CPU tests hand the runtime (the engine never imports this module)."""
    import dataclasses
    return dataclasses.replace(ctx, device=SIM_DEVICE, simulates_cuda=True)


class HostSyncs:
    """Records host syncs and wrong-device tensors inside ``with`` (see the module docstring).

    ``device``: the rank's device (a CUDA device, or ``SIM_DEVICE`` on CPU; plain ``cpu``
    records nothing: there is no device to wait for). ``allow``: substrings of ``where`` that
    are expected (e.g. a documented sync), kept in ``allowed`` instead of ``events``."""

    def __init__(self, device: Any, allow: Iterable[str] = (), capture: bool = False):
        self.device = torch.device(device)
        self.allow = tuple(allow)
        self.capture = capture
        self.events: list[SyncEvent] = []
        self.allowed: list[SyncEvent] = []
        self.trace: list[tuple[str, tuple]] = []
        self._stack: Optional[contextlib.ExitStack] = None

    @property
    def simulated(self) -> bool:
        return self.device == SIM_DEVICE

    def add(self, kind: str, op: str, where: Optional[str] = None) -> None:
        event = SyncEvent(kind, op, where or caller())
        (self.allowed if any(a in event.where for a in self.allow) else self.events).append(event)

    def counts(self) -> dict[str, int]:
        return dict(Counter(e.kind for e in self.events))

    def report(self) -> str:
        """One line per distinct event, with how often it happened."""
        if not self.events:
            return "no host syncs"
        seen = Counter(self.events)
        return "\n".join(f"{n:4d}x {e}" for e, n in seen.most_common())

    def __enter__(self) -> "HostSyncs":
        stack = contextlib.ExitStack()
        if self.device.type == "cuda":
            stack.enter_context(_CudaSyncDebug(self))
        elif self.simulated:
            stack.enter_context(_WatchedCollectives(self))
            stack.enter_context(SimulatedDevice(self))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None


def caller(skip_torch: bool = True) -> str:
    """The innermost frame in this repository outside this module, as "path:line (fn)"."""
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _HERE and path.startswith(str(ROOT)) and "/.venv/" not in path \
                and frame.f_code.co_name != "__torch_function__":  # another mode's handler
            return f"{Path(path).relative_to(ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
        if fallback is None and path != _HERE:
            fallback = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return fallback or "?"


# ---------------------------------------------------------------------------------- CUDA

# What torch's sync debug mode warns at each synchronising call (c10/cuda/CUDAFunctions.cpp);
# its other warning, once per process on the first set_sync_debug_mode ("Synchronization debug
# mode is a prototype feature and does not detect all synchronizing operations"), is no sync.
SYNC_WARNING = "called a synchronizing CUDA operation"


def is_sync_warning(text: str) -> bool:
    """Whether a warning's text is torch's report of one synchronising call."""
    return SYNC_WARNING in text


class _CudaSyncDebug:
    """torch.cuda.set_sync_debug_mode("warn"), each warning recorded as a ``sync`` event."""

    def __init__(self, syncs: HostSyncs):
        self.syncs = syncs

    def __enter__(self):
        self._before = torch.cuda.get_sync_debug_mode()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning
        syncs = self.syncs

        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if is_sync_warning(text):
                syncs.add("sync", text.split(".")[0][:60], caller())
            else:
                self._show(message, category, filename, lineno, file, line)
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self._before)
        warnings.showwarning = self._show
        self._warnings.__exit__(*exc)


# ---------------------------------------------------------------------- the simulated device

def _tag(t: Any) -> Optional[str]:
    return getattr(t, "_presto_sim", None) if isinstance(t, torch.Tensor) else None


def _set(t: Any, tag: Optional[str]) -> None:
    if tag is not None and isinstance(t, torch.Tensor):
        try:
            t._presto_sim = tag
        except (AttributeError, RuntimeError):  # some tensor subclasses refuse attributes
            pass


def _is_sim(device: Any) -> bool:
    if device is None or isinstance(device, (int, torch.dtype)):
        return False
    try:
        return torch.device(device) == SIM_DEVICE
    except (RuntimeError, TypeError):
        return False


def _target_device(args, kwargs) -> tuple[bool, Any]:
    """For ``Tensor.to``: (whether a device was named, that device) - from device=, a device
    or string argument, or a tensor argument (its device)."""
    if "device" in kwargs:
        return True, kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return True, a
        if isinstance(a, torch.Tensor):
            return True, SIM_DEVICE if _tag(a) == _DEVICE else torch.device("cpu")
    return False, None


class SimulatedDevice(TorchFunctionMode):
    """The CPU stand-in for a CUDA device; see the module docstring."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__set__":  # ``param.data = t`` (Module.to): the parameter is where t is
            if func == _DATA_SET and len(args) == 2:
                _set(args[0], _tag(args[1]))
            return func(*args, **kwargs)
        if name == "__get__":  # a property: only .device matters
            out = func(*args, **kwargs)
            if isinstance(out, torch.device) and args and _tag(args[0]) == _DEVICE:
                return SIM_DEVICE
            return out
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        tags = {_tag(t) for t in tensors}
        on_device = _DEVICE in tags
        self._before(name, args, kwargs, tensors, on_device)
        out = func(*args, **kwargs)
        if self.syncs.capture and (on_device or _is_sim(kwargs.get("device"))):
            self.syncs.trace.append((name, tuple(
                (tuple(o.shape), str(o.dtype)) for o in tree_flatten(out)[0]
                if isinstance(o, torch.Tensor))))
        if name in ("cpu", "to") and out is args[0] and _tag(out) == _DEVICE:
            named, dev = _target_device(args, kwargs)
            if name == "cpu" or (named and not _is_sim(dev)):
                out = out.view_as(out)  # on CUDA a new host tensor; keep the device one's tag
        self._tag_output(name, args, kwargs, out, tags)
        return out

    def _before(self, name, args, kwargs, tensors, on_device) -> None:
        add = self.syncs.add
        if on_device and _tag(args[0] if args else None) == _DEVICE:
            if name in _READS:
                add("read", name)
                return
            if name in ("cpu",) or (name == "to" and _target_device(args, kwargs)[0]
                                    and not _is_sim(_target_device(args, kwargs)[1])):
                add("d2h", name)
                return
        if on_device:
            if name in _SHAPES or (name == "where" and len(args) == 1 and not kwargs):
                add("shape", name)
            elif name == "repeat_interleave" and "output_size" not in kwargs and any(
                    _tag(a) == _DEVICE for a in args[1:2]) or (
                    name == "repeat_interleave" and len(args) == 1 and "output_size" not in kwargs):
                add("shape", name)
            elif name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
                index = args[1] if len(args) > 1 else None
                flat = tree_flatten(index)[0]
                if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                       and _tag(i) == _DEVICE for i in flat):
                    add("shape", f"{name}[bool mask]")
                if any(isinstance(i, torch.Tensor) and _tag(i) == _HOST and i.dim() > 0
                       for i in flat):
                    add("h2d", f"{name}[host index]")
            elif name not in ("copy_", "to") and any(
                    _tag(t) == _HOST and t.dim() > 0 for t in tensors):
                add("wrong_device", f"{name} (host tensor beside device tensors)")
        if name in ("tensor", "as_tensor") and _is_sim(kwargs.get("device")):
            data = args[0] if args else kwargs.get("data")
            if not (isinstance(data, torch.Tensor) and _tag(data) == _DEVICE):
                add("h2d", f"torch.{name}(..., device=)")
        elif name == "to" and args and _tag(args[0]) != _DEVICE:
            named, dev = _target_device(args, kwargs)
            if named and _is_sim(dev) and _tag(args[0]) == _HOST \
                    and not kwargs.get("non_blocking", False):
                add("h2d", "to(device) without non_blocking")
            elif named and _is_sim(dev) and _tag(args[0]) == _HOST and self.syncs.capture:
                add("host_copy", "to(device)")
        elif name == "copy_" and len(args) > 1 and _tag(args[0]) == _DEVICE \
                and _tag(args[1]) == _HOST and args[1].dim() > 0 \
                and not kwargs.get("non_blocking", False) \
                and not (len(args) > 2 and args[2]):
            add("h2d", "copy_ from host")
        elif name == "copy_" and len(args) > 1 and _tag(args[0]) == _DEVICE \
                and _tag(args[1]) == _HOST and self.syncs.capture:
            add("host_copy", "copy_ from host")

    def _tag_output(self, name, args, kwargs, out, tags) -> None:
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not outs:
            return
        if name in _FACTORIES or name in _NEW:
            if "device" in kwargs:
                tag = _DEVICE if _is_sim(kwargs["device"]) else _HOST
            elif name.endswith("_like") or name in _NEW:
                tag = _tag(args[0]) if args else None
            elif name == "as_tensor" and args and isinstance(args[0], torch.Tensor):
                tag = _tag(args[0])
            else:
                tag = _HOST
        elif name in ("to", "cuda", "cpu", "pin_memory"):
            if name == "cpu":
                tag = _HOST
            elif name == "cuda":
                tag = _DEVICE
            else:
                named, dev = _target_device(args, kwargs)
                tag = (_DEVICE if _is_sim(dev) else _HOST) if named else _tag(args[0])
        elif name in ("copy_",) and args:
            tag = _tag(args[0])
        elif _DEVICE in tags:
            tag = _DEVICE
        elif _HOST in tags:
            tag = _HOST
        else:
            tag = None
        if tag is None:
            return
        for o in outs:
            inplace = bool(args) and o is args[0]
            if inplace and _tag(o) is not None and name not in ("to", "cuda", "cpu", "copy_"):
                continue  # an in-place op keeps its tensor where it is
            _set(o, tag)


class _WatchedCollectives:
    """Wraps torch.distributed's tensor collectives: a host tensor in one is recorded as
    ``wrong_device`` (NCCL would refuse it)."""

    def __init__(self, syncs: HostSyncs):
        self.syncs = syncs
        self._real: dict[str, Any] = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            real = getattr(torch_dist, name, None)
            if real is None:
                continue
            self._real[name] = real
            setattr(torch_dist, name, self._watch(name, real))
        return self

    def _watch(self, name, real):
        syncs = self.syncs

        def watched(*args, **kwargs):
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and _tag(t) == _HOST:
                    syncs.add("wrong_device", f"torch.distributed.{name} of a host tensor")
                    break
            return real(*args, **kwargs)
        watched.__wrapped__ = real
        return watched

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(torch_dist, name, real)
        self._real.clear()
