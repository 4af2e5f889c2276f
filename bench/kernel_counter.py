"""The kernel counter of ``python -m bench.kernel_count``: which dispatched op would launch
device work on a GPU, how many CUDA kernels it is, its category, and the Inductor-generated
kernels counted at every call.

    with counting(host=batch_tensors) as c:   # a TorchDispatchMode below autograd
        ...                                    # c.phase names where the ops run
    summarize(c.records)                       # totals by category, phase and op

The rules (bench/kernel_count.py's docstring and docs/benchmarks/kernel_count.md say why):
views, metadata and ``NO_KERNEL`` ops launch nothing, nor does a copy onto its own memory, an
op on empty tensors or the host's work on the batch; each other op is one launch, except the
``KERNELS_PER_OP`` names (read from PyTorch's CUDA sources) and the multi-tensor ops
(``MULTI_TENSOR_DEPTH``: counted as ATen's multi_tensor_apply splits them into launches).

With ``counting(costs=True)`` each record also gets one bench.op_cost.Cost per kernel (its
FLOPs and bytes, for the device-time model: bench.device_time), and a ``tagger`` set on the
counter labels each record (``tags``: bench.device_cases marks the encoder's ops and the
gradient buffer's).

Owns: the rules, the categories and phases, the counter, the wrapping of Inductor's generated
kernels (with their parameters' read/write roles), the summary of a count.
Never: builds or runs a step (bench.kernel_count does), needs a GPU, or changes what an op
computes.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

# ---------------------------------------------------------------------------- the op rules

NO_KERNEL = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
    "lift_fresh", "alias", "set_", "resize_", "resize_as_", "record_stream", "_unsafe_view",
    "_reshape_alias", "is_same_size", "_has_compatible_shallow_copy_type", "is_nonzero",
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit",
    "_assert_async", "_assert_scalar", "_functional_assert_async", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "view_as_real", "view_as_complex"})
"""Ops that launch nothing on a GPU beside the views (``OpOverload.is_view``): allocation,
metadata, profiler markers, asserts the step does not make."""

KERNELS_PER_OP = {
    # PyTorch flash_api.cpp mha_varlen_bwd -> run_mha_bwd: flash_bwd_dot_do_o_kernel (D and
    # the dq accumulator's clear), flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel,
    # flash_bwd_convert_dq_kernel. The forward is one flash_fwd_kernel.
    "_flash_attention_backward": 3,
    # layer_norm_kernel.cu: the input gradient kernel, then GammaBetaBackward (one kernel
    # below 64K rows; a partial-sum kernel and a sum above).
    "native_layer_norm_backward": 2,
    # Embedding.cu, embedding_dense_backward_cuda with <= 3072 indices: zeros for the
    # gradient, then embedding_backward_feature_kernel (above 3072: a sort-based path of ~8).
    "embedding_dense_backward": 2,
    # Loss.cu: grad_input.zero_(), then the scatter of -1 (times the weight) at the targets.
    "nll_loss_backward": 2,
}
"""CUDA kernels of an op that launches more than one (each other op: one)."""

MULTI_TENSOR_DEPTH = {"_foreach_add_": 2, "_foreach_copy_": 2}
"""Multi-tensor ops counted by ATen's ``multi_tensor_apply``
(aten/src/ATen/native/cuda/MultiTensorApply.cuh), with their depth (the tensor lists a
launch reads and writes): one kernel for many tensors, a new one when a launch's tensors or
its chunks of 65,536 elements are full (``multi_tensor_launches``). Other ``_foreach_`` ops:
one launch each (``_foreach_norm`` adds a clean-up kernel; none is in the step)."""

MTA_CHUNK = 65536
MTA_MAX_TENSORS = (770, 448, 336, 252, 210)
MTA_MAX_CHUNKS = 2240
"""multi_tensor_apply's limits a launch with 32 KB kernel arguments (CUDA >= 12.1 with a
driver that allows them, compute capability >= 7: the H100 and H200 machines), by depth 1-5;
with 4 KB arguments 110/64/48/36/30 tensors and 320 chunks."""


def multi_tensor_launch_elements(depth: int, numels: Iterable[int]) -> list[int]:
    """The elements of each kernel ``multi_tensor_apply`` launches for tensors of ``numels``
    elements at ``depth``: its loop - a launch when the tensors (the last one whole) or the
    chunks are full, and one for what is left; empty tensors are skipped."""
    max_tensors, max_chunks = MTA_MAX_TENSORS[depth - 1], MTA_MAX_CHUNKS
    launches: list[int] = []
    tensors = chunks_in = elements = 0
    for n in numels:
        if n == 0:
            continue
        tensors += 1
        chunks = -(-n // MTA_CHUNK)
        for c in range(chunks):
            chunks_in += 1
            elements += min(MTA_CHUNK, n - c * MTA_CHUNK)
            if (tensors == max_tensors and c == chunks - 1) or chunks_in == max_chunks:
                launches.append(elements)
                chunks_in = elements = 0
                tensors = 0 if c == chunks - 1 else 1
    return launches + ([elements] if chunks_in > 0 else [])


def multi_tensor_launches(depth: int, numels: Iterable[int]) -> int:
    """Kernels ``multi_tensor_apply`` launches for tensors of ``numels`` elements at
    ``depth`` (``multi_tensor_launch_elements``)."""
    return len(multi_tensor_launch_elements(depth, numels))


def launch_elements(name: str, args: tuple) -> list[int] | None:
    """A multi-tensor op's elements per launch (None: not one)."""
    if name in MULTI_TENSOR_DEPTH:
        return multi_tensor_launch_elements(MULTI_TENSOR_DEPTH[name],
                                            (t.numel() for t in args[0]))
    return None


def kernels_of(name: str, args: tuple) -> int:
    """The CUDA kernels one call of op ``name`` launches (``KERNELS_PER_OP``,
    ``MULTI_TENSOR_DEPTH``; else 1)."""
    launches = launch_elements(name, args)
    if launches is not None:
        return len(launches)
    return KERNELS_PER_OP.get(name, 1)

CATEGORIES = ("gemm", "attention", "cast", "elementwise", "reduction", "norm", "index",
              "copy/fill", "compiled", "optimizer")
_BY_NAME = {
    "gemm": {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot",
             "_addmm_activation", "_scaled_mm", "_int_mm"},
    "attention": {"_flash_attention_forward", "_flash_attention_backward",
                  "_efficient_attention_forward", "_efficient_attention_backward",
                  "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_backward",
                  "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_efficient_attention_backward",
                  "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_cudnn_attention_backward"},
    "norm": {"native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
             "_fused_rms_norm_backward", "native_group_norm", "native_group_norm_backward",
             "native_batch_norm", "native_batch_norm_backward"},
    "reduction": {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "norm",
                  "linalg_vector_norm", "_foreach_norm", "prod", "any", "all", "_softmax",
                  "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
                  "nll_loss_forward", "nll_loss_backward", "logsumexp", "std", "var",
                  "var_mean", "std_mean", "cumsum", "count_nonzero"},
    "index": {"index_select", "index", "index_put_", "index_put", "_index_put_impl_",
              "index_add_", "index_add", "embedding", "embedding_dense_backward", "gather",
              "scatter", "scatter_", "scatter_add", "scatter_add_", "index_copy",
              "index_copy_", "take", "masked_select", "index_fill_", "index_fill"},
    "copy/fill": {"fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like",
                  "full_like", "new_zeros", "new_ones", "new_full", "scalar_tensor", "clone",
                  "cat", "stack", "_local_scalar_dense", "copy_", "_to_copy"},
}
_CATEGORY = {name: cat for cat, names in _BY_NAME.items() for name in names}

PHASES = ("input", "forward", "backward", "sync", "optimizer", "step", "output")
"""Where an op runs: the batch's copy before a replay (input), the trainer's spans (forward,
backward, sync, optimizer: its clip and loss scale included), the rest of the step body
(step: the learning rate from the device table, the loss sums) and the step values packed
and copied out after the replay (output)."""


def category(name: str, args: tuple, out: Any) -> str:
    """The op's category: by name (``_BY_NAME``); a copy that changes the dtype is a cast."""
    cat = _CATEGORY.get(name, "elementwise")
    if name == "_to_copy" and _dtype(out) != _dtype(args[0] if args else None):
        return "cast"
    if name == "copy_" and len(args) > 1 and _dtype(args[0]) != _dtype(args[1]):
        return "cast"
    return cat


def _dtype(t) -> Any:
    import torch
    return t.dtype if isinstance(t, torch.Tensor) else None


def _same_data(dst, src) -> bool:
    """ATen's early exit in copy_ (aten/src/ATen/native/Copy.cpp): the same memory, strides,
    sizes and dtype - nothing is launched."""
    import torch
    return (isinstance(src, torch.Tensor)
            and dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
            and dst.storage_offset() == src.storage_offset() and dst.stride() == src.stride()
            and dst.shape == src.shape and dst.dtype == src.dtype)


def _tensors(tree) -> list:
    import torch
    from torch.utils._pytree import tree_leaves
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _launches(func, name: str, args: tuple, kwargs: dict, out: Any) -> bool:
    if func.is_view or name in NO_KERNEL:
        return False
    if name == "copy_" and len(args) > 1 and _same_data(args[0], args[1]):
        return False
    outs = _tensors(out)
    return not outs or any(t.numel() > 0 for t in outs)


# ------------------------------------------------------------------------------- the counter

def _counter_class():
    """``KernelCounter``, made on first use: the module imports torch lazily (the record's
    header and ``--help`` need none)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class KernelCounter(TorchDispatchMode):
        """Records (phase, category, op, kernels) of every op that would launch device work
        (module docstring). ``host``: tensors on the host (their storages, and what is
        computed from them alone, are host work); ``phase``: where the ops run now."""

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True  # compiled artifacts run under the mode; their tracing does not

        def __init__(self, host: Iterable = (), costs: bool = False):
            super().__init__()
            self.records: list[tuple[str, str, str, int]] = []
            # with ``costs``: per record, one bench.op_cost.Cost per kernel (its FLOPs, bytes)
            self.costs: list[list] | None = [] if costs else None
            # tagger(name, args, kwargs, out) -> str: a label of each record, in ``tags``
            self.tagger = None
            self.tags: list[str] = []
            self.phase = "step"
            self._host: dict[int, Any] = {}  # storage address -> a tensor keeping it alive
            for t in host:
                self._mark_host(t)

        def _mark_host(self, t) -> None:
            storage = t.untyped_storage()
            if storage.nbytes():
                self._host[storage.data_ptr()] = t

        def _on_host(self, t) -> bool:
            storage = t.untyped_storage()
            return bool(storage.nbytes()) and storage.data_ptr() in self._host

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = _tensors((args, kwargs))
            if self._host and inputs and all(self._on_host(t) for t in inputs):
                for t in _tensors(out):
                    self._mark_host(t)
                return out
            name = func.overloadpacket.__name__
            if _launches(func, name, args, kwargs, out):
                kernels = kernels_of(name, args)
                costs = None
                if self.costs is not None:
                    from bench.op_cost import op_costs
                    costs = op_costs(name, args, kwargs, out, kernels,
                                     launch_elements(name, args), func)
                tag = self.tagger(name, args, kwargs, out) if self.tagger else None
                self.add(name, category(name, args, out), kernels, costs, tag)
            return out

        def add(self, name: str, cat: str, kernels: int = 1, costs: list | None = None,
                tag: str | None = None) -> None:
            if self.phase == "optimizer":
                cat = "optimizer"
            self.records.append((self.phase, cat, name, kernels))
            if self.tagger is not None:
                self.tags.append(tag if tag is not None else self.tagger(name, (), {}, None))
            if self.costs is not None:
                if costs is None:
                    from bench.op_cost import Cost
                    costs = [Cost("memory", 0.0)] * kernels
                self.costs.append(costs)

        def generated_kernel(self, name: str, args: tuple = (), roles=None) -> None:
            """One call of an Inductor-generated kernel (``args``: what the wrapper passed it,
            ``roles``: its parameters' read/write roles, bench.op_cost.kernel_roles)."""
            costs = None
            if self.costs is not None:
                from bench.op_cost import generated_costs
                costs = generated_costs(roles, args)
            tag = self.tagger(name, args, {}, None) if self.tagger else None
            self.add(name, "compiled", 1, costs, tag)

    return KernelCounter


_ACTIVE: list = []
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)


def count_inductor_kernels() -> int:
    """Every generated kernel of every Inductor wrapper module loaded so far, counted at each
    call into the innermost active counter: the wrapper's ``call`` looks its kernels up in the
    module's globals, so a counting function put there is what it calls. Returns how many
    kernels were newly wrapped (a module is wrapped once)."""
    from torch._inductor.codecache import PyCodeCache
    wrapped = 0
    for mod in list(PyCodeCache.modules):
        if getattr(mod, "_kernel_count_wrapped", False):
            continue
        try:
            source = Path(mod.__file__).read_text()
        except (OSError, TypeError):
            source = ""
        from bench.op_cost import kernel_roles
        for name in _KERNEL_DEF.findall(source):
            fn = getattr(mod, name, None)
            if callable(fn):
                setattr(mod, name, _counted(fn, name, kernel_roles(source, name)))
                wrapped += 1
        mod._kernel_count_wrapped = True
    return wrapped


def _counted(fn, name: str, roles=None):
    def kernel(*args, **kwargs):
        if _ACTIVE:
            _ACTIVE[-1].generated_kernel(name, args, roles)
        return fn(*args, **kwargs)
    return kernel


class Phases:
    """The trainer's timeline stand-in during the count: its spans set the counter's phase."""

    def __init__(self, counter):
        self.counter = counter

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        before, self.counter.phase = self.counter.phase, name
        try:
            yield
        finally:
            self.counter.phase = before


@contextlib.contextmanager
def counting(host: Iterable = (), costs: bool = False):
    """A KernelCounter active inside the ``with`` (generated kernels included); ``costs``:
    each kernel's FLOPs and bytes too (``counter.costs``, bench.op_cost)."""
    counter = _counter_class()(host, costs)
    _ACTIVE.append(counter)
    try:
        with counter:
            yield counter
    finally:
        _ACTIVE.remove(counter)


def summarize(records: list[tuple[str, str, str, int]]) -> dict:
    """Totals (ops: dispatched ops that launch; kernels: ``kernels_of`` them) by category,
    phase and op."""
    def table(key: int) -> dict:
        ops, kernels = Counter(), Counter()
        for r in records:
            ops[r[key]] += 1
            kernels[r[key]] += r[3]
        return {k: {"ops": ops[k], "kernels": kernels[k]} for k in
                sorted(ops, key=lambda k: -kernels[k])}
    return {"ops": len(records), "kernels": sum(r[3] for r in records),
            "by_category": table(1), "by_phase": table(0), "by_op": table(2)}
