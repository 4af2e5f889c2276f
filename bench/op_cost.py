"""What each kernel of a counted step computes and moves: FLOPs and bytes read + written, read
from the dispatched ATen op's tensors (shapes, strides and dtypes) - the input of the
device-time model (``python -m bench.device_time``, runtime.calibrate.gpus prices it).

    op_costs(name, args, kwargs, out, kernels)   # one Cost per CUDA kernel the op launches
    generated_costs(roles, args)                  # an Inductor kernel, by its arguments' roles

The rules:
  * bytes: every tensor an op reads once and every tensor it writes once, each by the memory
    it spans (a broadcast dimension - stride 0 - counts once; a view counts its own elements).
    An in-place op (``add_``) reads and writes its first argument; an op that overwrites it
    (``copy_``, ``fill_``, ``zero_``, the random fills, ``_foreach_copy_``) only writes it. A
    tensor passed twice is read once;
  * GEMMs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm`` ...): 2·m·n·k FLOPs a batch,
    their input dtype (fp8 for ``_scaled_mm``), the output's 128×128 tiles;
  * FlashAttention varlen (``_flash_attention_forward``): 4·d·Σ L² FLOPs a head over the
    sequences of ``cu_seqlens`` (QKᵀ and PV, non-causal); its backward 2.5× that (5 products)
    in the main kernel, beside ``flash_bwd_dot_do_o`` (reads dO and O, writes D and clears the
    fp32 dQ accumulator) and ``flash_bwd_convert_dq`` (dQ fp32 -> dQ). The padded path's SDPA
    (the CPU's ``_scaled_dot_product_flash_attention_for_cpu`` standing for CUDA's fused
    kernel) by the same formulas on [batch, heads, L, d];
  * gathers and scatters by the rows they touch, not the table: ``embedding``,
    ``index_select``, ``index``, ``gather`` read as many elements as they write;
    ``index_add_``/``index_put_``/``scatter_add_`` read the source and the index and update as
    many elements of the target; ``nll_loss_forward`` reads one logit a target;
  * the ops bench.kernel_counter counts as several kernels, split as CUDA does:
    ``native_layer_norm_backward`` (dx; then dγ, dβ, re-reading dy and x),
    ``embedding_dense_backward`` (zeros for the whole table; the touched rows),
    ``nll_loss_backward`` (zeros for the whole gradient; the targets' elements); the
    multi-tensor ops per launch (their elements as multi_tensor_apply fills the launches);
  * an Inductor kernel by its arguments: ``in_ptr`` read, ``out_ptr`` written, ``in_out_ptr``
    both (the roles of the generated C++ kernel's parameters); its FLOPs are not counted
    (pointwise and reductions are priced by their bytes).

Limits (docs/benchmarks/device_time.md): a kernel's bytes assume each tensor crosses memory
once (caches ignored both ways); the CPU's Inductor groups loops as its CPU scheduler does,
Triton's grouping can differ; library-internal kernels (cuBLAS split-K) are not seen.

Owns: ``Cost``, the rules above. Never: counts launches (bench.kernel_counter decides how many
kernels an op is), prices them (runtime.calibrate.gpus), or changes what an op computes.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

TILE = 128  # runtime.calibrate.gpus.TILE (bench may import runtime; this keeps the rules alone)

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "_scaled_mm",
         "_int_mm", "addmv", "mv", "dot"}
OVERWRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_",
              "exponential_", "_foreach_copy_", "_foreach_zero_", "set_"}
"""In-place ops that write their first argument without reading it."""
SDPA_FORWARD = {"_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention"}
SDPA_BACKWARD = {f"{n}_backward" for n in SDPA_FORWARD}


@dataclass(frozen=True)
class Cost:
    """One kernel's work: ``kind`` 'gemm', 'attention' or 'memory'; bytes read + written;
    FLOPs (GEMMs and attention); the input ``dtype`` of the products ('bf16', 'fp16', 'fp8',
    'fp32'); ``tiles``: a GEMM's 128×128 output tiles; ``cta_flops``: attention's longest
    CTA (128 queries of one head against its whole sequence)."""

    kind: str
    bytes: float
    flops: float = 0.0
    dtype: str = ""
    tiles: int = 0
    cta_flops: float = 0.0

    def scaled(self, f: float) -> "Cost":
        return Cost(self.kind, self.bytes * f, self.flops * f, self.dtype, self.tiles,
                    self.cta_flops)

    def to_list(self) -> list:
        return [self.kind, self.bytes, self.flops, self.dtype, self.tiles, self.cta_flops]

    @classmethod
    def from_list(cls, v: list) -> "Cost":
        return cls(v[0], float(v[1]), float(v[2]), v[3], int(v[4]), float(v[5]))


def dtype_name(dtype) -> str:
    s = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}.get(
        s, "fp8" if s.startswith("float8") else s)


def _tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def nbytes(t) -> int:
    """Bytes ``t`` spans: its elements, a stride-0 (broadcast) dimension counted once."""
    if not _tensor(t) or t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _flat(x) -> list:
    if _tensor(x):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    return []


def _unique(ts: Iterable) -> list:
    seen, out = set(), []
    for t in ts:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype) if t.numel() else id(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _sum(ts: Iterable) -> int:
    return sum(nbytes(t) for t in ts)


def _elements(t) -> int:
    return t.numel() if _tensor(t) else 0


def mutated(func, args: tuple, kwargs: dict) -> list:
    """The tensors ``func`` writes in place by its schema (``Tensor(a!)`` arguments: ``out=``,
    an in-place op's self, every list a fused optimizer updates)."""
    out = []
    schema = getattr(func, "_schema", None)
    if schema is None:
        return out
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if a.name == "grads" and kwargs.get("grad_scale") is None:
                continue  # a fused Adam stores the gradients back only to unscale them
            out += _flat(value)
    return out


def generic_bytes(name: str, args: tuple, kwargs: dict, out: Any,
                  written_in_place: list | None = None) -> tuple[int, int]:
    """(read, written) bytes of an elementwise, reduction, copy or fill op (module rules);
    ``written_in_place``: the arguments its schema writes (``mutated``)."""
    outs = kwargs.get("out")
    written = _flat(outs if outs is not None else out) + list(written_in_place or [])
    inputs = [t for k, v in kwargs.items() if k != "out" for t in _flat(v)]
    inputs = _flat(args) + inputs
    if name.endswith("_") and not written:  # in place (a _foreach_ op returns nothing)
        written = _flat(args[0]) if args else []
    written = _unique(written)
    if name in OVERWRITES and args:
        first = {id(t) for t in _flat(args[0])}
        inputs = [t for t in inputs if id(t) not in first]
    return _sum(_unique(inputs)), _sum(written)


def gemm_cost(name: str, args: tuple, kwargs: dict, out: Any) -> Cost:
    """2·m·n·k FLOPs a batch; bytes of the operands, the bias and the output."""
    if name in ("mm", "_int_mm", "_scaled_mm"):
        a, b = args[0], args[1]
    elif name in ("bmm",):
        a, b = args[0], args[1]
    else:  # addmm(bias, a, b), baddbmm(self, a, b), _addmm_activation, addmv, addbmm
        a, b = args[1], args[2]
    if name in ("mv", "addmv", "dot"):
        m, k = (a.shape if a.dim() == 2 else (1, a.shape[0]))
        n, batch = 1, 1
    else:
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        batch = math.prod(a.shape[:-2]) if a.dim() > 2 else 1
    read, written = generic_bytes(name, args, kwargs, out)
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE) * batch
    return Cost("gemm", read + written, 2.0 * m * n * k * batch, dtype_name(a.dtype), tiles)


def _seq_lengths(cu) -> list[int]:
    c = cu.tolist()
    return [b - a for a, b in zip(c, c[1:]) if b > a]


def _attention_flops(lengths: list[int], heads: int, d: int) -> tuple[float, float]:
    """(FLOPs of the forward: QKᵀ and PV over every sequence, its longest CTA's)."""
    total = 4.0 * d * heads * sum(L * L for L in lengths)
    cta = 4.0 * d * min(TILE, max(lengths, default=0)) * max(lengths, default=0)
    return total, cta


def flash_costs(name: str, args: tuple, out: Any) -> list[Cost]:
    """FlashAttention varlen forward (1 kernel) or backward (3 kernels: module rules)."""
    if name == "_flash_attention_forward":
        q, k, v, cu = args[0], args[1], args[2], args[3]
        o, lse = out[0], out[1]
        fl, cta = _attention_flops(_seq_lengths(cu), q.shape[1], q.shape[2])
        by = _sum([q, k, v, cu]) + _sum([o, lse])
        return [Cost("attention", by, fl, dtype_name(q.dtype), 0, cta)]
    dout, q, k, v, o, lse, cu = args[:7]
    T, heads, d = q.shape
    fl, cta = _attention_flops(_seq_lengths(cu), heads, d)
    accum = T * heads * d * 4          # the fp32 dQ accumulator
    dsum = T * heads * 4               # D = rowsum(dO * O), fp32
    dot = Cost("memory", _sum([dout, o]) + dsum + accum)
    main = Cost("attention", _sum([dout, q, k, v, lse, cu]) + dsum + 2 * accum
                + _sum(_flat(out)[1:3]), 2.5 * fl, dtype_name(q.dtype), 0, 2.5 * cta)
    convert = Cost("memory", accum + nbytes(_flat(out)[0]))
    return [dot, main, convert]


def sdpa_costs(name: str, args: tuple, out: Any) -> list[Cost]:
    """The padded path's attention on [batch, heads, L, d]: one kernel each way."""
    if name in SDPA_FORWARD:
        q, k, v = args[0], args[1], args[2]
        b, heads, L, d = q.shape
        fl, cta = _attention_flops([L] * b, heads, d)
        return [Cost("attention", _sum([q, k, v]) + _sum(_flat(out)), fl, dtype_name(q.dtype),
                     0, cta)]
    grad, q = args[0], args[1]
    b, heads, L, d = q.shape
    fl, cta = _attention_flops([L] * b, heads, d)
    return [Cost("attention", _sum(_unique(_flat(args))) + _sum(_flat(out)), 2.5 * fl,
                 dtype_name(q.dtype), 0, 2.5 * cta)]


def gather_scatter_costs(name: str, args: tuple, kwargs: dict, out: Any) -> list[Cost] | None:
    """Ops that touch only the rows of a table their indices name (module rules)."""
    if name == "embedding":        # (weight, indices)
        o = out
        return [Cost("memory", 2 * nbytes(o) + nbytes(args[1]))]
    if name in ("index_select", "gather", "index"):
        idx = [t for t in _flat(args[1:]) if _tensor(t)]
        return [Cost("memory", 2 * nbytes(out) + _sum(idx))]
    if name in ("index_add_", "index_add", "scatter_add_", "scatter_add", "index_copy_",
                "scatter_", "scatter"):  # (self, dim, index, source)
        src = args[3] if len(args) > 3 and _tensor(args[3]) else None
        idx = args[2] if _tensor(args[2]) else None
        moved = nbytes(src) if src is not None else 0
        elem = args[0].element_size()
        touched = min(_elements(src) if src is not None else 0, args[0].numel()) * elem
        extra = nbytes(args[0]) if not name.endswith("_") else 0  # out of place: a copy first
        return [Cost("memory", moved + nbytes(idx) + 2 * touched + 2 * extra)]
    if name in ("index_put_", "index_put", "_index_put_impl_"):  # (self, indices, values)
        vals = args[2]
        idx = [t for t in _flat(args[1]) if _tensor(t)]
        n = max(_elements(t) for t in idx) if idx else 0
        touched = (vals.numel() if vals.numel() > 1 else n) * args[0].element_size()
        return [Cost("memory", nbytes(vals) + _sum(idx) + 2 * touched)]
    if name == "nll_loss_forward":  # (input [M, V], target [M], ...)
        target = args[1]
        return [Cost("memory", target.numel() * args[0].element_size() + nbytes(target)
                     + _sum(_flat(out)))]
    return None


def multi_kernel_costs(name: str, args: tuple, kwargs: dict, out: Any) -> list[Cost] | None:
    """The ops bench.kernel_counter counts as several kernels, split as CUDA launches them."""
    if name == "native_layer_norm_backward":
        dy, x, _shape, mean, rstd, w = args[:6]
        dx, dw, db = (list(out) + [None, None, None])[:3]
        stats = _sum([mean, rstd])
        first = Cost("memory", _sum([dy, x, w]) + stats + nbytes(dx))
        second = Cost("memory", _sum([dy, x]) + stats + nbytes(dw) + nbytes(db))
        return [first, second]
    if name == "embedding_dense_backward":  # (grad [T, H], indices, num_weights, ...)
        grad, idx = args[0], args[1]
        return [Cost("memory", nbytes(out)), Cost("memory", nbytes(grad) + nbytes(idx)
                                                  + 2 * nbytes(grad))]
    if name == "nll_loss_backward":  # (grad_out, input, target, ...)
        target = args[2]
        return [Cost("memory", nbytes(out)),
                Cost("memory", nbytes(target) + target.numel() * out.element_size())]
    return None


def op_costs(name: str, args: tuple, kwargs: dict, out: Any, kernels: int,
             launch_elements: list[int] | None = None, func=None) -> list[Cost]:
    """One Cost per kernel of the op ``name`` (``kernels`` of them: bench.kernel_counter's
    count); ``launch_elements``: a multi-tensor op's elements in each launch; ``func``: the
    op overload (its schema names what it writes in place)."""
    if name in GEMMS:
        costs = [gemm_cost(name, args, kwargs, out)]
    elif name in ("_flash_attention_forward", "_flash_attention_backward"):
        costs = flash_costs(name, args, out)
    elif name in SDPA_FORWARD or name in SDPA_BACKWARD:
        costs = sdpa_costs(name, args, out)
    else:
        costs = (multi_kernel_costs(name, args, kwargs, out)
                 or gather_scatter_costs(name, args, kwargs, out))
        if costs is None:
            read, written = generic_bytes(name, args, kwargs, out,
                                          mutated(func, args, kwargs))
            if launch_elements and len(launch_elements) > 1:
                total = sum(launch_elements)
                costs = [Cost("memory", (read + written) * e / total) for e in launch_elements]
            else:
                costs = [Cost("memory", read + written)]
    if len(costs) < kernels:   # kernels the rules do not split: launched, nothing moved
        costs += [Cost("memory", 0.0)] * (kernels - len(costs))
    return costs[:kernels] if len(costs) > kernels else costs


# ----------------------------------------------------------------- Inductor's generated kernels

_KERNEL_PARAMS = re.compile(r'extern "C"\s+void\s+kernel\(([^)]*)\)', re.S)


def kernel_roles(source: str, name: str) -> list[str] | None:
    """The roles of generated kernel ``name``'s parameters in its wrapper module's ``source``
    ('r' read, 'w' written, 'rw' both, '' a scalar), or None where the source has no C++
    signature for it (a Triton kernel, a template)."""
    start = source.find(f"{name} = async_compile.")
    if start < 0:
        return None
    end = source.find(" = async_compile.", start + len(name) + 16)
    m = _KERNEL_PARAMS.search(source, start, end if end > 0 else len(source))
    if m is None:
        return None
    roles = []
    for param in m.group(1).split(","):
        pname = param.strip().split()[-1] if param.strip() else ""
        roles.append("rw" if pname.startswith("in_out_ptr") else "r" if
                     pname.startswith("in_ptr") else "w" if pname.startswith("out_ptr") else "")
    return roles


def generated_costs(roles: list[str] | None, args: tuple) -> list[Cost]:
    """One memory kernel: the bytes of its tensor arguments by role (each once where the
    roles are unknown)."""
    tensors = [(i, a) for i, a in enumerate(args) if _tensor(a)]
    total = 0
    for i, t in tensors:
        role = roles[i] if roles is not None and i < len(roles) else "r"
        total += nbytes(t) * (2 if role == "rw" else 1 if role else 0)
    return [Cost("memory", total)]
