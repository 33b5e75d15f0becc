"""Speed of the vectorised core against per-sequence implementations, side by side in one process.

Inputs: lengths uniform in [T/4, T], log-ratio noise sigma = 0.05, the default config (configs/mis.yaml
with --use-tis: token truncate [0.5, 2], token RS, veto 1e-4, batch normalisation).

Compared on the same inputs, each in its host's native format (that conversion is not timed; the implementations and
their check are in benchmarks/core_baselines.py):
  list        miles_mis.compute_mis_weights_with_cp (per-sequence lists in and out, pg_loss × weights)
  packed      miles_mis.compute_mis_weights_packed on the flat [N] tensors and cu_seqlens
  padded      a padded dense implementation: [B, T] tensors, padding = 0 in the loss mask,
              per-sequence reductions along dim 1, every output (weights, mask, all metrics) a [B, T]
              tensor; checked equal to ours (at the real tokens) before timing
  per-seq     a per-sequence torch loop (vectorised inside a sequence, one Python iteration per
              sequence, the structure of miles' mis.py), checked equal to ours before timing
  list I/O    what the list interface costs a packed implementation at the least: read the B lengths
              (one numel per sequence) into cu_seqlens, torch.cat the three input lists, weight pg_loss
              (the list entry returns pg_loss x weights, zeroed where rejected) and split the output mask
              into B tensors (the list path should lose no more than this against the packed one)
  reference   the readable pure-Python reference of tests/reference.py (one point only: it is slow)

list, packed, padded and list I/O are timed in one interleaved pass (the order shuffled every round); per-seq in a
second pass, interleaved with list (its per-call churn of small tensors slows whatever runs after it). The cost of the
"where the mismatch lives" location sums (miles_mis.correction.mismatch_location.local_values, via
pipeline.local_batch_values) is the default packed call timed with and without them, interleaved in a third pass:
without = pipeline.local_batch_values replaced by a function returning a zero vector of the same size and dtype
(restored after). Also counts aten operations per call (TorchDispatchMode) of the list and the packed entry points at
B=8 and B=512: each must be equal.

With ``--lags``, instead: the cost of per-sequence lags (docs/staleness.md). At each shape, the default list call
without lags, the same call with ``version_lags`` (random lags 0..4: the lag-bucket metrics), and with lags and the
lag-aware keys too (``tis_upper_bound_by_lag`` and the ``rs_max_lag`` / ``rs_max_lag_k3`` gate), interleaved;
then the aten operations per call without lags and with them at B=8 and B=512.

With ``--trust-regions``, instead: the cost of the probability-space ``rs_divergence`` options (binary TV and KL,
DPPO's directional token rule and VACO's gate, with advantages) and of a ratio option for scale, each against the
default call, interleaved; then the aten operations per call (and the default call's with advantages passed but
not read: the same count).

With ``--device DEV``, instead: the list and packed entry points and the padded baseline on DEV (timed with CUDA
events on a GPU), and the kernel launches, host syncs and aten operations of one call (the torch profiler;
benchmarks/device_timing.py); ``--json FILE`` writes them (benchmarks/gpu_check.sh).

With ``--backends``, instead: eager against the compiled backend (``kernel_backend: compiled``): the first call's
compile time, the list and packed entry points at the four shapes, each costly option's share of a default call on
both backends, recompiles over the shapes, and the aten operations left outside the compiled kernels.

    python benchmarks/bench_core.py [--repeats 15] [--lags | --trust-regions | --backends |
                                     --device cuda [--json F] [--quick]]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from op_count import count_aten_ops  # noqa: E402

from miles_mis import MisConfig, compute_mis_weights_packed, compute_mis_weights_with_cp  # noqa: E402
from miles_mis.correction import pipeline  # noqa: E402  (its batch-sum stage is swapped out in location_share_ms)

from core_baselines import (CONFIG, check_same, list_interface, make_inputs, ours, ours_packed,  # noqa: E402
                            packed_inputs, padded, padded_inputs, per_sequence, reference_call)


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def interleaved_medians_ms(*fns, repeats, seed=0):
    """Median times of functions run in turn, so that drift on a shared machine hits them all. The order is
    shuffled every round (seeded): what runs right before a function (caches flushed, memory handed back to
    the OS by a slow one) varies. A rotation would not do that: it keeps every function's predecessor the
    same (f0 f1 f2, f1 f2 f0, ...: f1 always follows f0), which moved one time by up to 40 % here."""
    rng = random.Random(seed)
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    order = list(range(len(fns)))
    for _ in range(repeats):
        rng.shuffle(order)
        for i in order:
            start = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def location_share_ms(flat, repeats: int) -> tuple[float, float]:
    """Median times of the default packed call with and without the location sums, interleaved."""
    real = pipeline.local_batch_values
    seen = []
    pipeline.local_batch_values = lambda *args: seen.append(real(*args)) or seen[-1]
    try:
        ours_packed(flat)
    finally:
        pipeline.local_batch_values = real
    zeros = torch.zeros_like(seen[0])  # what the stage returns, as zeros: the rest of the call is unchanged

    def without():
        pipeline.local_batch_values = lambda batch, terms, config: zeros
        try:
            return ours_packed(flat)
        finally:
            pipeline.local_batch_values = real

    return tuple(interleaved_medians_ms(lambda: ours_packed(flat), without, repeats=repeats))


def count_ops(num_seqs: int) -> tuple[int, int]:
    """aten operations per call of the list and the packed entry points."""
    inputs = make_inputs(num_seqs, 64, seed=1)
    pg_loss = torch.ones(sum(inputs["response_lengths"]))
    flat = packed_inputs(inputs)
    return count_aten_ops(lambda: ours(inputs, pg_loss)), count_aten_ops(lambda: ours_packed(flat))


LAG_CONFIG = MisConfig(**dict(CONFIG.to_dict(), tis_upper_bound_by_lag=[2.0, 1.5, 1.25], rs_max_lag=2,
                               rs_max_lag_k3=0.05))


def lag_costs(repeats: int) -> None:
    """The default list call without lags, with lags, and with lags and the lag-aware keys, interleaved."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians in ms of the list entry point, "
          "interleaved (target: lag metrics at most 10% of a default call)")
    print(f"{'B':>5} {'T':>5} {'tokens':>7} {'no lags':>8} {'lags':>8} {'+bounds, gate':>14} {'lags %':>7} "
          f"{'+keys %':>8}")
    for num_seqs, max_len in [(64, 512), (256, 1024), (1024, 128), (4096, 64)]:
        inputs = make_inputs(num_seqs, max_len)
        pg_loss = torch.ones(sum(inputs["response_lengths"]))
        lags = torch.randint(0, 5, (num_seqs,), generator=torch.Generator().manual_seed(1)).tolist()
        plain, with_lags, with_keys = interleaved_medians_ms(
            lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, **inputs),
            lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, version_lags=lags, **inputs),
            lambda: compute_mis_weights_with_cp(LAG_CONFIG, pg_loss=pg_loss, version_lags=lags, **inputs),
            repeats=repeats)
        print(f"{num_seqs:>5} {max_len:>5} {len(pg_loss):>7} {plain:>8.2f} {with_lags:>8.2f} {with_keys:>14.2f} "
              f"{100 * (with_lags - plain) / plain:>6.1f}% {100 * (with_keys - plain) / plain:>7.1f}%")
    for num_seqs in (8, 512):
        inputs = make_inputs(num_seqs, 64, seed=1)
        pg_loss = torch.ones(sum(inputs["response_lengths"]))
        lags = [i % 5 for i in range(num_seqs)]
        without = count_aten_ops(lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, **inputs))
        with_lags = count_aten_ops(lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, version_lags=lags,
                                                                       **inputs))
        print(f"aten ops per call at B={num_seqs}: {without} without lags, {with_lags} with them")


def _with_options(options: dict) -> MisConfig:
    return MisConfig(**dict(CONFIG.to_dict(), rs_divergence=options))


TRUST_REGION_CONFIGS = {  # name -> (config, passes advantages)
    "ratio k1": (_with_options({"token_k1": [0.5, 2.0]}), False),
    "atv": (_with_options({"token_atv": 0.05}), False),
    "bkl": (_with_options({"token_bkl": 0.01}), False),
    "dppo dtv": (_with_options({"token_dtv": [-0.2, 0.2]}), True),
    "vaco datv": (_with_options({"seq_mean_datv": 0.05}), True),
}


def trust_region_costs(repeats: int) -> None:
    """The default list call against the same call with each probability-space option (and a ratio option for
    scale), interleaved; then the aten operations per call, and the default call's with advantages passed."""
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; medians in ms of the list entry point, "
          "interleaved (target: an option at most 10% of a default call)")
    names = list(TRUST_REGION_CONFIGS)
    print(f"{'B':>5} {'T':>5} {'tokens':>7} {'default':>8} " + " ".join(f"{name + ' %':>11}" for name in names))
    for num_seqs, max_len in [(64, 512), (256, 1024), (1024, 128), (4096, 64)]:
        inputs = make_inputs(num_seqs, max_len)
        pg_loss = torch.ones(sum(inputs["response_lengths"]))
        advantages = [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(inputs["response_lengths"])]
        calls = [lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, **inputs)]
        for config, needs in TRUST_REGION_CONFIGS.values():
            extra = {"advantages": advantages} if needs else {}
            calls.append(lambda config=config, extra=extra: compute_mis_weights_with_cp(config, pg_loss=pg_loss,
                                                                                         **inputs, **extra))
        plain, *timed = interleaved_medians_ms(*calls, repeats=repeats)
        print(f"{num_seqs:>5} {max_len:>5} {len(pg_loss):>7} {plain:>8.2f} "
              + " ".join(f"{100 * (t - plain) / plain:>10.1f}%" for t in timed))
    inputs = make_inputs(512, 64, seed=1)
    pg_loss = torch.ones(sum(inputs["response_lengths"]))
    advantages = [torch.ones(n) for n in inputs["response_lengths"]]
    default = count_aten_ops(lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, **inputs))
    unread = count_aten_ops(lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, advantages=advantages,
                                                                **inputs))
    counts = {name: count_aten_ops(lambda config=config, needs=needs: compute_mis_weights_with_cp(
        config, pg_loss=pg_loss, **inputs, **({"advantages": advantages} if needs else {})))
        for name, (config, needs) in TRUST_REGION_CONFIGS.items()}
    print(f"aten ops per call at B=512: default {default}, default with advantages passed (not read) {unread}; "
          + ", ".join(f"{name} {count}" for name, count in counts.items()))


SHAPES = [(64, 512), (256, 1024), (1024, 128), (4096, 64)]


def _compiled(config: MisConfig) -> MisConfig:
    return MisConfig(**dict(config.to_dict(), kernel_backend="compiled"))


BACKEND_OPTIONS = {  # name -> (config, extra inputs): the costly options, each on top of the default config
    "lags": (CONFIG, "lags"),
    **{name: (config, "advantages" if needs else None) for name, (config, needs) in TRUST_REGION_CONFIGS.items()},
}


def backend_costs(repeats: int) -> None:
    """Eager against compiled (``kernel_backend``): the first call's compile time per config, the list and packed
    entry points at the four shapes (interleaved), each costly option's share of a default call on both backends,
    recompiles over the shapes, and the aten operations left outside the compiled kernels."""
    from torch._dynamo.utils import counters

    from miles_mis.tensors import backend

    compiled_config = _compiled(CONFIG)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, default config "
          f"(configs/mis.yaml + --use-tis); inductor cache: "
          f"{__import__('os').environ.get('TORCHINDUCTOR_CACHE_DIR', '/tmp/torchinductor_<user> (default)')}")
    inputs = make_inputs(64, 512)
    flat = packed_inputs(inputs)
    start = time.perf_counter()
    ours_packed(flat)
    eager_first = time.perf_counter() - start
    start = time.perf_counter()
    compute_mis_weights_packed(compiled_config, **flat)
    print(f"first call: eager {eager_first * 1e3:.0f} ms, compiled {time.perf_counter() - start:.1f} s (the probe and "
          f"3 kernels compiled, or loaded from the inductor cache); fallbacks: {backend.FALLBACKS or 'none'}")
    graphs = counters["stats"]["unique_graphs"]
    print("medians in ms, interleaved: eager and compiled, list and packed entry points")
    print(f"{'B':>5} {'T':>5} {'tokens':>7} {'list eager':>10} {'list comp':>10} {'list x':>7} {'packed eager':>12} "
          f"{'packed comp':>11} {'packed x':>8}")
    for num_seqs, max_len in SHAPES:
        inputs = make_inputs(num_seqs, max_len)
        pg_loss = torch.ones(sum(inputs["response_lengths"]))
        flat = packed_inputs(inputs)
        list_e, list_c, packed_e, packed_c = interleaved_medians_ms(
            lambda: ours(inputs, pg_loss),
            lambda: compute_mis_weights_with_cp(compiled_config, pg_loss=pg_loss, **inputs),
            lambda: ours_packed(flat), lambda: compute_mis_weights_packed(compiled_config, **flat), repeats=repeats)
        print(f"{num_seqs:>5} {max_len:>5} {len(pg_loss):>7} {list_e:>10.2f} {list_c:>10.2f} {list_e / list_c:>6.2f}x "
              f"{packed_e:>12.2f} {packed_c:>11.2f} {packed_e / packed_c:>7.2f}x")
    print(f"recompiles over the four shapes after the first call: {counters['stats']['unique_graphs'] - graphs}")
    print("each option's share of a default list call (medians, interleaved; target: at most 10 % when on):")
    print(f"{'B':>5} {'T':>5} {'option':>10} {'eager':>8} {'+ option':>9} {'share':>7} {'compiled':>9} {'+ option':>9} "
          f"{'share':>7} {'compile s':>9}")
    for num_seqs, max_len in (SHAPES[0], SHAPES[1]):
        inputs = make_inputs(num_seqs, max_len)
        pg_loss = torch.ones(sum(inputs["response_lengths"]))
        extras = {"lags": {"version_lags": torch.randint(0, 5, (num_seqs,),
                                                         generator=torch.Generator().manual_seed(1)).tolist()},
                  "advantages": {"advantages": [torch.full((n,), 1.0 if i % 2 else -1.0)
                                                for i, n in enumerate(inputs["response_lengths"])]},
                  None: {}}
        for name, (config, extra) in BACKEND_OPTIONS.items():
            kwargs = extras[extra]
            start = time.perf_counter()
            compute_mis_weights_with_cp(_compiled(config), pg_loss=pg_loss, **inputs, **kwargs)
            compile_s = time.perf_counter() - start
            plain_e, option_e, plain_c, option_c = interleaved_medians_ms(
                lambda: compute_mis_weights_with_cp(CONFIG, pg_loss=pg_loss, **inputs),
                lambda: compute_mis_weights_with_cp(config, pg_loss=pg_loss, **inputs, **kwargs),
                lambda: compute_mis_weights_with_cp(compiled_config, pg_loss=pg_loss, **inputs),
                lambda: compute_mis_weights_with_cp(_compiled(config), pg_loss=pg_loss, **inputs, **kwargs),
                repeats=repeats)
            print(f"{num_seqs:>5} {max_len:>5} {name:>10} {plain_e:>8.2f} {option_e:>9.2f} "
                  f"{100 * (option_e - plain_e) / plain_e:>6.0f}% {plain_c:>9.2f} {option_c:>9.2f} "
                  f"{100 * (option_c - plain_c) / plain_c:>6.0f}% {compile_s:>9.1f}")
    from device_timing import launches_and_syncs

    inputs = make_inputs(512, 64, seed=1)
    pg_loss = torch.ones(sum(inputs["response_lengths"]))
    flat = packed_inputs(inputs)
    cpu = torch.device("cpu")
    events = {name: launches_and_syncs(call, cpu)["aten_events"] for name, call in (
        ("list eager", lambda: ours(inputs, pg_loss)),
        ("list compiled", lambda: compute_mis_weights_with_cp(compiled_config, pg_loss=pg_loss, **inputs)),
        ("packed eager", lambda: ours_packed(flat)),
        ("packed compiled", lambda: compute_mis_weights_packed(compiled_config, **flat)))}
    print("aten events per call at B=512 (torch profiler, nested ones included; a compiled kernel's fused loop is "
          "none): " + ", ".join(f"{name} {count}" for name, count in events.items()))
    print(f"fallbacks: {backend.FALLBACKS or 'none'}")


def device_costs(device: torch.device, repeats: int, json_path: Path | None, shapes=SHAPES) -> dict:
    """On ``device``: the list and packed entry points and the padded baseline (its tensors built on the device),
    timed interleaved (CUDA events on a GPU, device_timing.py), checked equal first; then the kernel launches and
    host syncs of one call of each entry point, from the profiler. Printed, and written to ``json_path``."""
    from device_timing import interleaved_device_ms, launches_and_syncs

    from miles_mis.tensors import backend

    rows = []
    compiled_config = _compiled(CONFIG)
    print(f"torch {torch.__version__} on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else
             f", {torch.get_num_threads()} threads") + "; medians in ms, interleaved")
    print(f"{'B':>5} {'T':>5} {'tokens':>7} {'list':>7} {'packed':>7} {'padded':>7} {'pad/pack':>8} "
          f"{'launches list/packed':>20} {'syncs list/packed':>17} {'reads list/packed':>17}")
    for num_seqs, max_len in shapes:
        cpu_inputs = make_inputs(num_seqs, max_len)
        inputs = {k: [t.to(device) for t in v] if k.endswith(("log_probs", "masks")) else v
                  for k, v in cpu_inputs.items()}
        pg_loss = torch.ones(sum(inputs["response_lengths"]), device=device)
        # the padded baseline makes its own tensors without a device: it runs with the device as the default one;
        # the entry points are timed without it, as a host calls them (their own tensors follow the inputs')
        with torch.device(device):
            flat = packed_inputs(inputs)
            dense, real = padded_inputs(inputs)
            check_same(inputs, pg_loss, flat, dense, real)

        def padded_on_device():
            with torch.device(device):
                return padded(dense)

        list_compiled = lambda: compute_mis_weights_with_cp(compiled_config, pg_loss=pg_loss, **inputs)  # noqa: E731
        packed_compiled = lambda: compute_mis_weights_packed(compiled_config, **flat)  # noqa: E731
        started = time.perf_counter()
        same = torch.equal(packed_compiled()[1], ours_packed(flat)[1])  # the first compiled call compiles
        compile_s = time.perf_counter() - started
        assert same, "the compiled backend keeps other tokens than eager"
        t_list, t_packed, t_padded, t_list_c, t_packed_c = interleaved_device_ms(
            lambda: ours(inputs, pg_loss), lambda: ours_packed(flat), padded_on_device, list_compiled, packed_compiled,
            repeats=repeats, device=device)
        counts = {"list": launches_and_syncs(lambda: ours(inputs, pg_loss), device),
                  "packed": launches_and_syncs(lambda: ours_packed(flat), device),
                  "list_compiled": launches_and_syncs(list_compiled, device),
                  "packed_compiled": launches_and_syncs(packed_compiled, device)}
        rows.append({"num_seqs": num_seqs, "max_len": max_len, "tokens": len(pg_loss), "list_ms": t_list,
                     "packed_ms": t_packed, "padded_ms": t_padded, "list_compiled_ms": t_list_c,
                     "packed_compiled_ms": t_packed_c, "first_compiled_call_s": compile_s, "counts": counts})
        pick = lambda key: f"{counts['list'][key]}/{counts['packed'][key]}"  # noqa: E731
        print(f"{num_seqs:>5} {max_len:>5} {len(pg_loss):>7} {t_list:>7.2f} {t_packed:>7.2f} {t_padded:>7.2f} "
              f"{t_padded / t_packed:>7.2f}x {pick('kernel_launches'):>20} {pick('host_syncs'):>17} "
              f"{pick('scalar_reads'):>17}")
        compiled_counts = (f"{counts['list_compiled']['kernel_launches']}/"
                           f"{counts['packed_compiled']['kernel_launches']}")
        print(f"{'':>19} compiled (kernel_backend): list {t_list_c:.2f} ({t_list / t_list_c:.2f}x), packed "
              f"{t_packed_c:.2f} ({t_packed / t_packed_c:.2f}x), launches list/packed {compiled_counts}, "
              f"first call {compile_s:.1f} s")
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "torch": torch.__version__, "repeats": repeats, "rows": rows,
              "compiled_fallbacks": list(backend.FALLBACKS)}
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--lags", action="store_true", help="the cost of per-sequence lags instead")
    parser.add_argument("--trust-regions", action="store_true",
                        help="the cost of the probability-space rs_divergence options instead")
    parser.add_argument("--device", default=None,
                        help="instead: list, packed and padded on this device (cuda: CUDA events), with kernel "
                             "launches and host syncs per call (default: the CPU comparison above)")
    parser.add_argument("--backends", action="store_true",
                        help="instead: eager against compiled (kernel_backend), default config and each costly option")
    parser.add_argument("--json", type=Path, default=None, help="with --device: also write the results here")
    parser.add_argument("--quick", action="store_true", help="with --device: the two smallest shapes only")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.device is not None:
        device_costs(torch.device(args.device), args.repeats, args.json,
                     sorted(SHAPES, key=lambda s: s[0] * s[1])[:2] if args.quick else SHAPES)
        return
    if args.backends:
        backend_costs(args.repeats)
        return
    if args.lags:
        lag_costs(args.repeats)
        return
    if args.trust_regions:
        trust_region_costs(args.repeats)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          "default config (configs/mis.yaml + --use-tis)")
    print("medians in ms, list/packed/padded/list I/O run interleaved, then per-seq interleaved with list "
          "(seq/list is from that pass);")
    print("pad%: padding share of the B x T padded tensors; pad/pack >= 1: the packed entry is as fast as padded")
    print(f"{'B':>5} {'T':>5} {'tokens':>7} {'pad%':>4} {'list':>7} {'packed':>7} {'padded':>7} {'per-seq':>8} "
          f"{'list I/O':>9} {'list-packed':>11} {'pad/pack':>8} {'list/pack':>9} {'seq/list':>8}")
    location_lines = []
    for num_seqs, max_len in [(64, 512), (256, 1024), (1024, 128), (4096, 64)]:
        inputs = make_inputs(num_seqs, max_len)
        lengths = inputs["response_lengths"]
        pg_loss = torch.ones(sum(lengths))
        flat = packed_inputs(inputs)
        dense, real = padded_inputs(inputs)
        check_same(inputs, pg_loss, flat, dense, real)
        weights, mask, _ = ours_packed(flat)
        keep = mask > 0
        # the per-sequence loop (10^4-10^5 small tensors per call) leaves the allocator and the caches in a
        # state that slows whatever runs next: it is timed in a second pass, interleaved with the list entry
        t_list, t_packed, t_padded, t_io = interleaved_medians_ms(
            lambda: ours(inputs, pg_loss), lambda: ours_packed(flat), lambda: padded(dense),
            lambda: list_interface(inputs, pg_loss, weights, keep), repeats=args.repeats)
        t_list_2, t_seq = interleaved_medians_ms(lambda: ours(inputs, pg_loss), lambda: per_sequence(inputs, pg_loss),
                                                 repeats=args.repeats)
        padding = 100 * (1 - len(pg_loss) / real.numel())
        print(f"{num_seqs:>5} {max_len:>5} {len(pg_loss):>7} {padding:>4.0f} {t_list:>7.2f} {t_packed:>7.2f} "
              f"{t_padded:>7.2f} "
              f"{t_seq:>8.1f} {t_io:>9.2f} {t_list - t_packed:>11.2f} {t_padded / t_packed:>7.2f}x "
              f"{t_list / t_packed:>8.2f}x {t_seq / t_list_2:>7.1f}x")
        t_with, t_without = location_share_ms(flat, args.repeats)
        share = 100 * (t_with - t_without) / t_with
        location_lines.append(f"B={num_seqs:<5} T={max_len:<5} location metrics: {share:.0f}% of a default call "
                              f"(packed {t_with:.2f} ms, {t_without:.2f} ms without them)")
    print("where the mismatch lives (location.local_values), default packed call with and without it, interleaved "
          "(target: at most 15%):")
    print("\n".join(location_lines))

    inputs = make_inputs(64, 512)
    pg_loss = torch.ones(sum(inputs["response_lengths"]))
    t_ours = median_ms(lambda: ours(inputs, pg_loss), args.repeats)
    t_ref = median_ms(lambda: reference_call(inputs, pg_loss), 1)
    print(f"pure-Python reference (tests/reference.py) at B=64, T=512: {t_ref:.0f} ms vs ours {t_ours:.2f} ms "
          f"({t_ref / t_ours:.0f}x)")

    (small, small_packed), (large, large_packed) = count_ops(8), count_ops(512)
    same = lambda a, b: "equal" if a == b else "DIFFERENT"  # noqa: E731
    print(f"aten ops per call: list B=8 -> {small}, B=512 -> {large} ({same(small, large)}); "
          f"packed B=8 -> {small_packed}, B=512 -> {large_packed} ({same(small_packed, large_packed)})")


if __name__ == "__main__":
    main()
