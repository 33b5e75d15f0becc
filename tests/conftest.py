import os
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
REPO = Path(__file__).resolve().parents[1]
# The device the tensors of the device-aware tests live on (``pytest --device cuda``; benchmarks/gpu_check.sh): the
# batch helpers below build their tensors on the CPU (seeded generators) and move them there. CPU by default.
DEVICE = torch.device("cpu")


# MILES_MIS_BACKEND=compiled runs every config built in the tests on the compiled backend (miles_mis.tensors.backend):
# then every config compiles (dynamo's limit of 8 per kernel would run the rest eager), and the run ends with the count
# of kernels that fell back to eager (0 expected)
if os.environ.get("MILES_MIS_BACKEND") == "compiled":
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 1_000_000
    torch._dynamo.config.accumulated_recompile_limit = 1_000_000


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("MILES_MIS_BACKEND") == "compiled":
        from miles_mis.tensors import backend

        terminalreporter.write_line(f"compiled backend: {len(backend.FALLBACKS)} fallbacks to eager in this process"
                                    + "".join(f"\n  {line}" for line in backend.FALLBACKS))


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="the device of the device-aware tests' tensors (default cpu)")


def pytest_configure(config):
    global DEVICE
    DEVICE = torch.device(config.getoption("--device"))
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA device")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def on_device(tensors):
    """``tensors`` (a tensor or a list of them) on DEVICE."""
    if isinstance(tensors, torch.Tensor):
        return tensors.to(DEVICE)
    return [t.to(DEVICE) for t in tensors]


def random_batch(seed: int, num_seqs: int = 12, max_len: int = 40, noise: float = 0.3,
                 zero_length: bool = True, holes: bool = True, nonfinite: bool = False):
    """Random per-sequence log-probs (float32) with ragged lengths, masks with zeros inside,
    a zero-length, a 1-token and an all-masked sequence, optionally non-finite log-probs."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    train, rollout, masks = [], [], []
    for i in range(num_seqs):
        n = rng.randint(0 if zero_length else 1, max_len)
        if i == 1:
            n = 1
        t = -torch.rand(n, generator=gen) * 3.0
        r = t + noise * torch.randn(n, generator=gen)
        m = torch.ones(n)
        if holes and n > 2:
            m[torch.rand(n, generator=gen) < 0.2] = 0.0
        if i == 2:
            m.zero_()
        if nonfinite and i == 3 and n > 0:
            t[0] = float("nan")  # a valid token (SGLang's null log-prob): the sequence must be rejected
        if nonfinite and i == 4 and n > 2:
            r[-1], m[-1] = float("inf"), 0.0  # a masked token: must be ignored
        train.append(t)
        rollout.append(r)
        masks.append(m)
    return on_device(train), on_device(rollout), on_device(masks)


def random_advantages(masks, seed: int) -> list:
    """Per-token advantages for ``masks``' sequences: GRPO-like per-sequence values (some 0: a group whose rewards all
    agree) with a per-token spread on some sequences, so both signs and 0 occur; NaN on masked tokens (never read)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    out = []
    for i, m in enumerate(masks):
        value = (torch.randn(1, generator=gen) if i % 4 else torch.zeros(1)).expand(len(m)).clone()
        if i % 3 == 1:
            value = value + torch.randn(len(m), generator=gen)
        value[m.cpu() == 0] = float("nan")
        out.append(value)
    return on_device(out)


def call_plugin(cfg, train, rollout, masks, pg_loss=None):
    """compute_mis_weights_with_cp at cp = 1 as a host calls it (prompts of 5 tokens, pg_loss of ones)."""
    from miles_mis import compute_mis_weights_with_cp

    n = sum(t.numel() for t in train)
    pg_loss = torch.ones(n, device=DEVICE, requires_grad=True) if pg_loss is None else pg_loss
    return compute_mis_weights_with_cp(cfg, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
                                       loss_masks=masks, total_lengths=[t.numel() + 5 for t in train],
                                       response_lengths=[t.numel() for t in train])


@pytest.fixture
def repo_root():
    return REPO


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ on the path for its own sibling imports)."""
    import importlib.util

    benchmarks = REPO / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    spec = importlib.util.spec_from_file_location(name, benchmarks / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_lab_cells(regime: str, steps: int) -> dict:
    """A lab_verdicts regime's cells (algorithm -> seed -> row) from the committed results, paired one machine per
    seed as `lab_verdicts.py tables --docs` pairs them: a regime of its own length from its own file
    (benchmarks/results/lab_one_step_off.jsonl), the 40-step regimes from lab_verdicts.jsonl."""
    plan = load_benchmark("lab_verdicts_plan")
    from lab_runs import first_rollout, one_machine_per_seed, read_results

    name = "lab_one_step_off.jsonl" if regime in plan.REGIME_STEPS else "lab_verdicts.jsonl"
    rows = [r for r in read_results(REPO / "benchmarks" / "results" / name) if r["steps"] == steps]
    paired = one_machine_per_seed(rows, plan.SEED, plan.CELL, first_rollout)
    return {a: plan.cell_of(paired, regime, a) for a in plan.REGIMES[regime][1]}
