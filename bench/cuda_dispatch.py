"""CUDA's dispatch decisions on a CPU: what ``python -m bench.kernel_count`` runs a training step
under, so the ops the step dispatches on the CPU are the ones it would dispatch on a GPU.

Where the same PyTorch code takes another route on CUDA than on the CPU, and the route
changes which ops run, this module makes the CPU take CUDA's route for the duration of
``as_on_cuda()`` (every registration is undone on exit):

  autocast     CUDA's autocast op lists on the CPU's autocast key. The CPU's lists differ
               (torch 2.13: CUDA runs layer_norm, softmax, log_softmax, sum ... in fp32 and
               casts the inputs of addcmul, index_put ... to the widest type; the CPU runs
               them as they come, and casts cat, stack, index_copy, cross_entropy_loss that
               CUDA leaves alone). Every op with an autocast kernel on either key gets CUDA's
               policy here, read from the installed ATen header ``ATen/autocast_mode.h`` (the
               ``AT_FORALL_*`` lists that ``autocast_mode.cpp`` registers for AutocastCUDA),
               applied as ``autocast_mode.h``'s ``WrapFunction_`` policies do: cast every
               eligible tensor (floating, not float64) to bf16/fp16 (lower_precision_fp) or
               fp32 (fp32); an unset ``dtype`` argument set to fp32 when the first tensor is
               eligible (fp32_set_opt_dtype); the widest floating type (promote); and the
               few CUDA registers beside the lists (cuDNN convolutions in lower precision,
               ``norm`` redispatched with an fp32 dtype, ``binary_cross_entropy`` refused).
               An op the CPU lists and CUDA does not runs uncast. ``check_autocast_lists``
               holds the header's lists equal to the ops torch registered for AutocastCUDA.
  dropout      ``aten::dropout`` in training is one ``native_dropout`` on CUDA (mask and output
               in one kernel, ``native_dropout_backward`` in the backward) and
               ``bernoulli_``, ``div_``, ``mul`` on the CPU (ATen/native/Dropout.cpp,
               ``is_fused_kernel_acceptable``: CUDA, XPU, lazy and PrivateUse1 only).
  attention    the unpadded model's attention in bf16/fp16 is FlashAttention-2's varlen kernel
               (``aten::_flash_attention_forward`` / ``_backward``, kernels.attention
               ``flash_varlen``), which has no CPU kernel: a CPU kernel is registered for
               both with flash's shapes and dtypes (output, logsumexp fp32 [heads, T], rng
               state, and the three gradients). It computes ``out = v`` and its exact
               gradient, not attention: the count does not depend on values, and every state
               update of the step is on the device (no branch reads a value).
               ``attention_as_on_cuda(model)`` makes the model take CUDA's rule
               (kernels.attention ``cuda_dispatch``: flash in half precision).
  _scaled_mm   FP8 GEMMs (torchao's, model.fp8 with emulation off): CUDA's kernel refuses
               shapes the CPU's accepts - an inner dimension not a multiple of 16, above all
               (aten/src/ATen/native/cuda/Blas.cpp, ``_scaled_mm_out_cuda``'s checks). The
               CPU kernel of ``aten::_scaled_mm`` is replaced by one that makes CUDA's checks
               first (``check_scaled_mm``), then runs the CPU's own kernel (its ``out``
               overload): ``scaled_mm_as_on_cuda()``.

Owns: ``as_on_cuda``, the policies above, ``check_autocast_lists``, ``check_scaled_mm``.
Never: changes numbers outside the ``with`` (each registration is removed on exit), or is
used in training: only the kernel count imports it.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

_LISTS = {"AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp", "AT_FORALL_FP32": "fp32",
          "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype", "AT_FORALL_PROMOTE": "promote"}
# Registered for AutocastCUDA in autocast_mode.cpp outside the AT_FORALL lists: cuDNN
# convolutions (lower precision), the norm overloads redispatched to their dtype overload
# with fp32 (fp32_append_dtype) and binary_cross_entropy (refused under autocast).
_CUDA_EXTRA = {"cudnn_convolution": "lower_precision_fp",
               "cudnn_convolution_transpose": "lower_precision_fp",
               "norm.Scalar": "fp32_append_dtype", "norm.ScalarOpt_dim": "fp32_append_dtype",
               "binary_cross_entropy": "banned"}


def autocast_header() -> Path:
    return Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def cuda_autocast_lists(header: Path | None = None) -> dict[str, str]:
    """{op overload name ("sum", "sum.dim_IntList"): CUDA's cast policy}, from the
    ``AT_FORALL_*`` macro lists of the installed ``ATen/autocast_mode.h``."""
    path = header or autocast_header()
    try:
        text = path.read_text()
    except OSError as e:
        raise RuntimeError(f"{path}: unreadable ({e.strerror}); the kernel count reads CUDA's "
                           f"autocast lists from torch's headers - install a torch wheel that "
                           f"ships them") from None
    out: dict[str, str] = {}
    for macro, policy in _LISTS.items():
        m = re.search(rf"#define {macro}\(_\)((?:[^\n]*\\\n)*[^\n]*)", text)
        if m is None:
            raise RuntimeError(f"{path}: no {macro} list; torch's autocast header changed - "
                               f"update bench/cuda_dispatch.py")
        for name, overload in re.findall(r"_\(\s*(\w+)\s*(?:,\s*(\w+)\s*)?\)", m.group(1)):
            out[f"{name}.{overload}" if overload else name] = policy
    return out


def _registered(key: str) -> set[str]:
    """aten op overloads ("sum", "sum.dim_IntList") with a kernel of their own for ``key``."""
    names = set()
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
                full, key):
            names.add(full[len("aten::"):])
    return names


def check_autocast_lists(lists: dict[str, str]) -> None:
    """The header's lists name exactly the ops torch registered for AutocastCUDA (an op
    missing either way means the header and the library disagree: the policy would be
    guessed)."""
    want = set(lists) | set(_CUDA_EXTRA)
    have = {n[:-len(".default")] if n.endswith(".default") else n
            for n in _registered("AutocastCUDA")}
    if want != have:
        raise RuntimeError(f"CUDA's autocast lists in {autocast_header()} and the ops torch "
                           f"registered for AutocastCUDA differ: header only "
                           f"{sorted(want - have)}, registered only {sorted(have - want)}")


def _overload(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


_BANNED = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
           "autocast (CUDA's autocast refuses them): use binary_cross_entropy_with_logits")


def _autocast_kernel(op: torch._ops.OpOverload, policy: str) -> Callable:
    """A Python kernel for the CPU autocast key doing what CUDA's ``WrapFunction_<policy>``
    does, then running ``op`` below autocast."""
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    dtype_kw = dtype_at is not None and op._schema.arguments[dtype_at].kwarg_only

    def kernel(*args, **kwargs):
        low = torch.get_autocast_dtype("cpu")
        if policy == "banned":
            raise RuntimeError(_BANNED)
        if policy == "fp32_append_dtype":  # norm.Scalar / norm.ScalarOpt_dim
            # (arguments equal to their default arrive left out: the schema fills them)
            bound = {a.name: a.default_value for a in op._schema.arguments
                     if a.has_default_value()}
            bound.update(zip((a.name for a in op._schema.arguments), args), **kwargs)
            x = bound["self"]
            to = torch.float32 if _eligible(x) else x.dtype
            with torch._C._ExcludeDispatchKeyGuard(below):
                if "dim" in bound:
                    return torch.ops.aten.norm.ScalarOpt_dim_dtype(
                        x, bound["p"], bound["dim"], bound["keepdim"], dtype=to)
                return torch.ops.aten.norm.ScalarOpt_dtype(x, bound["p"], dtype=to)
        if policy in ("lower_precision_fp", "fp32", "promote"):
            if policy == "promote":
                types = {t.dtype for t in _tensors(args, kwargs) if _eligible(t)}
                to = torch.float32 if torch.float32 in types else low
            else:
                to = low if policy == "lower_precision_fp" else torch.float32

            def cast(t):
                return t.to(to) if _eligible(t) and t.dtype != to else t
            args = tuple(_map_tensors(a, cast) for a in args)
            kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
        elif policy == "fp32_set_opt_dtype" and args and _eligible(args[0]):
            if dtype_kw or dtype_at >= len(args):
                if kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.float32
            elif args[dtype_at] is None:
                args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)
    return kernel


@contextlib.contextmanager
def cuda_autocast_on_cpu() -> Iterator[dict[str, str]]:
    """CPU autocast with CUDA's op lists (see the module docstring); yields the policy of
    every op it registered ("none": runs uncast, as CUDA leaves it)."""
    lists = cuda_autocast_lists()
    check_autocast_lists(lists)
    lists.update(_CUDA_EXTRA)
    ops = {n[:-len(".default")] if n.endswith(".default") else n
           for n in _registered("AutocastCPU")} | set(lists)
    lib = torch.library.Library("aten", "IMPL")
    policies = {}
    try:
        with warnings.catch_warnings():  # each replaces the CPU's kernel: said once, here
            warnings.filterwarnings("ignore", ".*(overriding a previously registered kernel"
                                    "|may also be overridden)")
            for name in sorted(ops):
                policy = lists.get(name, "none")
                policies[name] = policy
                op = _overload(name)
                lib.impl(name, _autocast_kernel(op, policy) if policy != "none" else
                         _passthrough(op), "AutocastCPU")
        yield policies
    finally:
        lib._destroy()


def _passthrough(op) -> Callable:
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)
    return kernel


# ---------------------------------------------------------------------------------- dropout

def _fused_dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as ATen runs it on CUDA (Dropout.cpp): ``native_dropout`` when
    training with 0 < p < 1 on a non-empty tensor; the input itself when p is 0, not
    training, or empty; a multiply by zero at p = 1."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.ops.aten.native_dropout(x, p, train)[0]


# -------------------------------------------------------------------------------- attention

def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *, scale=None, window_size_left=None,
                   window_size_right=None, seqused_k=None, alibi_slopes=None,
                   block_table=None, num_splits=None):
    """FlashAttention-2 varlen forward's outputs, shaped and typed as flash returns them
    (PyTorch's ``_flash_attention_forward``); the output is ``v`` (see the module
    docstring)."""
    tokens, heads = q.shape[0], q.shape[1]
    lse = torch.zeros(heads, tokens, dtype=torch.float32, device=q.device)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)   # 0-dim, as flash's meta:
    empty = torch.empty(0, dtype=q.dtype, device=q.device)          # compiled code checks it
    return v.clone(), lse, rng, offset, empty


def _flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p,
                    is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                    window_size_right=None):
    """The gradients of ``out = v``: zero for q and k, ``grad_out`` for v."""
    return torch.zeros_like(q), torch.zeros_like(k), grad_out.clone()


@contextlib.contextmanager
def flash_on_cpu() -> Iterator[None]:
    """CPU kernels for the flash attention ops (module docstring), removed on exit."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("_flash_attention_forward", _flash_forward, "CPU")
        lib.impl("_flash_attention_backward", _flash_backward, "CPU")
        yield
    finally:
        lib._destroy()


def _cudnn_sdpa(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
    """cuDNN's fused attention's outputs on [batch, heads, L, d], shaped and typed as
    ``_scaled_dot_product_cudnn_attention`` returns them; the output is ``v``."""
    b, h, L = q.shape[0], q.shape[1], q.shape[2]
    lse = torch.zeros(b, h, L, dtype=torch.float32, device=q.device)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    none = torch.empty(0, dtype=torch.int64, device=q.device)
    return (v.clone(), lse, none, none.clone(), L, k.shape[2], seed, seed.clone(),
            torch.empty(0, dtype=q.dtype, device=q.device))


def _cudnn_sdpa_backward(grad_out, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k,
                         max_q, max_k, dropout_p, is_causal, *, scale=None):
    """The gradients of ``out = v``."""
    return torch.zeros_like(q), torch.zeros_like(k), grad_out.clone()


@contextlib.contextmanager
def sdpa_as_on_cuda() -> Iterator[None]:
    """The padded path's ``F.scaled_dot_product_attention`` in bf16/fp16 as CUDA runs it on
    Hopper with an additive mask: cuDNN's fused attention, one forward and one backward kernel
    (the H100 record's checks stage: ``cudnn_generated_fort_native_sdpa_sm90_flash_fprop`` and
    ``..._bprop`` for padded and packed batches) - on the CPU the math path's ~12 ops a layer
    each way run instead. A CPU kernel stands in for the cuDNN ops (output ``v``, as flash's),
    and SDPA calls them; restored on exit."""
    import torch.nn.functional as F
    lib = torch.library.Library("aten", "IMPL")
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if q.dtype not in (torch.bfloat16, torch.float16) or q.dim() != 4 or kw:
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, **kw)
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, attn_mask, True, dropout_p, is_causal, False, scale=scale)[0]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*(overriding a previously registered kernel"
                                    "|may also be overridden)")
            lib.impl("_scaled_dot_product_cudnn_attention", _cudnn_sdpa, "CPU")
            lib.impl("_scaled_dot_product_cudnn_attention_backward", _cudnn_sdpa_backward,
                     "CPU")
        F.scaled_dot_product_attention = sdpa
        yield
    finally:
        F.scaled_dot_product_attention = original
        lib._destroy()


# ------------------------------------------------------------------------------ _scaled_mm

def check_scaled_mm(mat1, mat2, scale_result=None, bias=None, out_dtype=None) -> None:
    """CUDA's checks of ``torch._scaled_mm``'s operands (``_scaled_mm_out_cuda`` in
    aten/src/ATen/native/cuda/Blas.cpp, torch 2.4 to 2.13; its messages), raised as CUDA
    raises them: RuntimeError, ValueError for the e5m2 pair."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    out = out_dtype or mat1.dtype

    def check(ok: bool, message: str, kind=RuntimeError) -> None:
        if not ok:
            raise kind(message)
    check(mat1.dim() == 2, "mat1 must be a matrix")
    check(mat2.dim() == 2, "mat2 must be a matrix")
    (m, k), (k2, n) = mat1.shape, mat2.shape
    check(k == k2, f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    check(scale_result is None or (scale_result.numel() == 1 and
                                   scale_result.dtype == torch.float32),
          "scale_result must be a float scalar")
    check(bias is None or bias.numel() == n, f"Bias must be size {n} but got "
                                             f"{None if bias is None else bias.numel()}")
    check(k % 16 == 0, f"Expected trailing dimension of mat1 to be divisible by 16 but got "
                       f"mat1 shape: ({m}x{k}).")
    check(k2 % 16 == 0 and n % 16 == 0, f"mat2 shape ({k2}x{n}) must be divisible by 16")
    check(mat1.dtype in fp8, f"Expected mat1 to be Float8 matrix got {mat1.dtype}")
    check(mat2.dtype in fp8, f"Expected mat2 to be Float8 matrix got {mat2.dtype}")
    check(not (mat1.dtype == mat2.dtype == torch.float8_e5m2),
          "Multiplication of two Float8_e5m2 matrices is not supported", ValueError)
    if bias is not None:
        check(out != torch.float32, "Bias is not supported when out_dtype is set to Float32")
        check(bias.dtype in (torch.bfloat16, torch.float16),
              f"Bias must be either Half or BFloat16, but got {bias.dtype}")


def _scaled_mm_checked(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None,
                       out_dtype=None, use_fast_accum=False):
    check_scaled_mm(mat1, mat2, scale_result, bias, out_dtype)
    out = torch.empty(mat1.shape[0], mat2.shape[1], dtype=out_dtype or mat1.dtype,
                      device=mat1.device)
    return torch.ops.aten._scaled_mm.out(mat1, mat2, scale_a, scale_b, bias, scale_result,
                                         out_dtype, use_fast_accum, out=out)


@contextlib.contextmanager
def scaled_mm_as_on_cuda() -> Iterator[None]:
    """The CPU's ``aten::_scaled_mm`` with CUDA's checks first (module docstring), restored
    on exit."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*(overriding a previously registered kernel"
                                    "|may also be overridden)")
            lib.impl("_scaled_mm", _scaled_mm_checked, "CPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def attention_as_on_cuda(model) -> Iterator[None]:
    """``model`` (a BertForPreTraining with unpadded attention) choosing its varlen kernel by
    CUDA's rule (kernels.attention ``cuda_dispatch``: flash varlen in bf16/fp16)."""
    from kernels import attention
    bert = model.bert
    kernel, by_name = bert.kernel, attention._BY_NAME["cuda_varlen"]
    bert.kernel = "cuda_varlen"
    attention._BY_NAME["cuda_varlen"] = attention.cuda_dispatch  # (without its is_cuda check)
    try:
        yield
    finally:
        bert.kernel = kernel
        attention._BY_NAME["cuda_varlen"] = by_name


@contextlib.contextmanager
def as_on_cuda(autocast: bool = True) -> Iterator[dict[str, str]]:
    """Autocast, dropout, the flash ops and ``_scaled_mm``'s checks as on CUDA (module
    docstring); yields the autocast policies registered ({} with ``autocast=False``: the CPU's
    own lists, for comparison). The model's attention rule: ``attention_as_on_cuda``."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("dropout", _fused_dropout, "AutogradCPU")
        with (cuda_autocast_on_cpu() if autocast else contextlib.nullcontext({})) as policies, \
                flash_on_cpu(), scaled_mm_as_on_cuda():
            yield policies
    finally:
        lib._destroy()
