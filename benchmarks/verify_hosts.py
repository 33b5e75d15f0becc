"""The host adapters against the hosts' REAL loss code, on CPU: miles_mis.hosts.<host>_loss.policy_loss (through
``--loss-type custom_loss``) against the host's own ``policy_loss`` + ``--custom-tis-function-path`` path, and the test
double of tests/host_doubles.py against the real code, on the doubles' batches.

Needs a checkout of the host (not shipped here: pass its path) and megatron-core (the test extra). The host's imports
that a CPU loss never calls (ray, sglang, wandb, …) are stubbed; Megatron's own code runs (its fused vocab-parallel
cross-entropy on a gloo group). Each CP rank is a process on gloo.

    git clone https://github.com/radixark/miles /tmp/miles && git -C /tmp/miles checkout 31f1ca961a94
    python benchmarks/verify_hosts.py --host miles --source /tmp/miles --cp 2 --qkv-format bshd

Prints, over the modes (standard, metrics-only, bypass with metrics, decoupled, decoupled with entropy) and seeds:
whether the adapter's loss, gradient with respect to the logits and every value the host logs equal the host path's
bit for bit, the adapter's extra logged values, and the largest differences between the double and the real code.
``--inputs`` runs the configs that read more than the hook receives (current policy, directional trust regions)
against the host path given those inputs explicitly.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import itertools
import json
import os
import socket
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
LOSS_MODULES = {"miles": "miles.backends.training_utils.loss_hub.losses", "slime": "slime.backends.megatron_utils.loss"}
STUBBED = {"ray", "sglang", "wandb", "flash_attn", "apex", "sglang_router", "pylatexenc", "mbridge", "tensorboard",
           "datasets", "qwen_vl_utils", "swanlab", "liger_kernel", "torch_memory_saver", "nvtx", "pynvml"}
MODES = [("standard", {}), ("metrics-only", dict(get_mismatch_metrics=True)),
         ("bypass-metrics", dict(use_rollout_logprobs=True, get_mismatch_metrics=True)),
         ("decoupled", dict(use_tis=True)),
         ("decoupled-entropy", dict(use_tis=True, get_mismatch_metrics=True, entropy_coef=0.01))]
INPUT_MODES = [("current-policy", dict(use_tis=True, tis_policy="current")),
               ("directional", dict(use_tis=True, rs_divergence={"token_dtv": [-0.05, 0.05]})),
               ("current-and-vaco", dict(use_tis=True, tis_policy="current", rs_divergence={"seq_mean_datv": 0.02}))]
ADAPTER_ONLY = ("mis_rollout_incomplete_fraction",)  # from the batch's rollout_mask_sums


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A MagicMock module for each STUBBED top-level package."""

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in STUBBED else None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):
        pass


class HostArgs:
    """The host's Namespace: the flags set here, None for every other attribute (as an unset flag)."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def __getattr__(self, name):
        return None


EXPLICIT: dict = {}


def explicit_hook(**kwargs):
    """The host path's hook for ``--inputs``: miles_mis's entry point given the inputs explicitly."""
    from miles_mis import compute_mis_weights_with_cp

    return compute_mis_weights_with_cp(**kwargs, **EXPLICIT)


def _set_parallel_state(host, rank, size, mpu):
    if host != "miles":
        return  # slime reads Megatron-core's state
    from miles.backends.training_utils import parallel
    from miles.utils.ft_utils.process_group_utils import GroupInfo

    one = GroupInfo(rank=0, size=1, group=mpu.get_tensor_model_parallel_group())
    cp = GroupInfo(rank=rank, size=size, group=mpu.get_context_parallel_group())
    parallel.set_parallel_state(parallel.ParallelState(intra_dp=one, intra_dp_cp=cp, cp=cp, tp=one, pp=one, ep=one,
                                                       etp=one, indep_dp=one))


def _loss_function(host):
    if host == "miles":
        from miles.backends.training_utils.loss import loss_function

        return lambda args, batch, logits: loss_function(args, batch, 2, logits, apply_megatron_loss_scaling=True,
                                                         num_rollouts=8)
    from slime.backends.megatron_utils.loss import loss_function as slime_loss_function

    return lambda args, batch, logits: slime_loss_function(args, batch, 2, 8, logits)


def _args(host, fmt, path, flags, yaml):
    correcting = flags.get("use_tis") or flags.get("get_mismatch_metrics")
    values = dict(yaml, use_tis=False, use_rollout_logprobs=False, get_mismatch_metrics=False, entropy_coef=0.0,
                  eps_clip=0.2, eps_clip_high=0.28, tis_clip=2.0, tis_clip_low=0.0, rollout_temperature=1.0,
                  qkv_format=fmt, advantage_estimator="grpo", kl_loss_type="low_var_kl", calculate_per_token_loss=False,
                  rollout_top_p=1.0, log_probs_chunk_size=-1,
                  loss_type="custom_loss" if path == "adapter" else "policy_loss",
                  custom_loss_function_path=f"miles_mis.hosts.{host}_loss.policy_loss",
                  custom_tis_function_path="miles_mis.compute_mis_weights_with_cp" if correcting else None)
    values.update(flags)
    return HostArgs(**values)


def _explicit_inputs(host, flags, batch, logits, args):
    """The inputs the adapter hands over, computed here for the host path's explicit hook."""
    EXPLICIT.clear()
    EXPLICIT["rollout_mask_sums"] = batch["rollout_mask_sums"]
    if flags.get("tis_policy") == "current":
        module = importlib.import_module(LOSS_MODULES[host])
        kwargs = dict(args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
                      response_lengths=batch["response_lengths"])
        if host == "miles":
            kwargs["max_seq_lens"] = batch.get("max_seq_lens")
        out = module.get_log_probs_and_entropy(logits, **kwargs)
        EXPLICIT["cur_log_probs"] = [t.detach() for t in (out[1] if host == "slime" else out)["log_probs"]]
    if flags.get("rs_divergence"):
        EXPLICIT["advantages"] = batch["advantages"]


def _worker(rank, size, options, port, out):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.meta_path.insert(0, _Stubs())
    sys.path[:0] = [options["source"], str(REPO / "tests"), str(REPO), os.path.dirname(__file__)]
    sys.modules["verify_hosts_hook"] = types.SimpleNamespace(hook=explicit_hook)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(context_parallel_size=size)
    from host_doubles import Double, make_batch

    from miles_mis import MisConfig

    host, fmt = options["host"], options["qkv_format"]
    _set_parallel_state(host, rank, size, mpu)
    call = _loss_function(host)
    yaml = {k: v for k, v in MisConfig.preset("mis").to_dict().items() if k not in ("use_tis", "get_mismatch_metrics")}
    rows = []
    for (mode, flags), seed in itertools.product(INPUT_MODES if options["inputs"] else MODES, range(options["seeds"])):
        results = {}
        for path in ("host", "adapter") if options["inputs"] else ("host", "adapter", "double"):
            batch, leaf, logits, _ = make_batch(seed, rank, size, fmt)
            if host == "slime":
                batch.pop("max_seq_lens")
            args = _args(host, fmt, path, flags, yaml)
            if path == "host" and options["inputs"]:
                args.custom_tis_function_path = "verify_hosts_hook.hook"
                _explicit_inputs(host, flags, batch, logits, args)
            if path == "double":
                args.loss_type = "policy_loss"
                double = Double(host, rank, size, mpu.get_context_parallel_group())
                loss, log = double.loss_function(args, batch, logits, num_microbatches=2, global_batch_size=8,
                                                 dp_cp_size=size)
                log = {k: float(v) for k, v in log.items()}
            else:
                loss, _, packed = call(args, batch, logits)
                log = dict(zip(packed["keys"], [float(v) for v in packed["values"][1:]]))
            loss.backward()
            results[path] = (loss.detach(), leaf.grad.clone(), log)
        (h_loss, h_grad, h_log), (a_loss, a_grad, a_log) = results["host"], results["adapter"]
        row = dict(mode=mode, seed=seed, rank=rank, loss=bool(torch.equal(h_loss, a_loss)),
                   grad=bool(torch.equal(h_grad, a_grad)),
                   log=[k for k in a_log if k not in ADAPTER_ONLY or k in h_log] == list(h_log)
                   and all(h_log[k] == a_log[k] for k in h_log),
                   adapter_only={k: a_log[k] for k in a_log if k not in h_log})
        if "double" in results:
            d_loss, d_grad, d_log = results["double"]
            shared = [k for k in h_log if k in d_log]
            row.update(double_loss=float((h_loss - d_loss).abs()), double_grad=float((h_grad - d_grad).abs().max()),
                       double_log=max([abs(h_log[k] - d_log[k]) for k in shared] or [0.0]),
                       only_real=sorted(set(h_log) - set(d_log)))
        rows.append(row)
    Path(f"{out}.{rank}").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--host", choices=sorted(LOSS_MODULES), required=True)
    parser.add_argument("--source", required=True, help="a checkout of the host's repository (its root)")
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (processes on gloo)")
    parser.add_argument("--qkv-format", choices=("thd", "bshd"), default="thd", help="bshd: miles only")
    parser.add_argument("--seeds", type=int, default=3, help="batches (seeds) per mode")
    parser.add_argument("--inputs", action="store_true", help="the configs that read inputs beyond the hook's")
    options = vars(parser.parse_args())
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the hosts torch.compile one PPO function: eager is the same
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "rows")
    mp.start_processes(_worker, args=(options["cp"], options, port, out), nprocs=options["cp"], start_method="spawn")
    rows = sum((json.loads(Path(f"{out}.{r}").read_text()) for r in range(options["cp"])), [])
    equal = all(r["loss"] and r["grad"] and r["log"] for r in rows)
    print(f"{options['host']} at {options['source']}, cp {options['cp']}, {options['qkv_format']}: {len(rows)} cases "
          f"(modes x seeds x ranks)")
    print(f"  adapter == host path (loss, gradient, every value the host logs, bit for bit): {equal}")
    print(f"  adapter-only values: {sorted({(k, v) for r in rows for k, v in r['adapter_only'].items()})}")
    if "double_loss" in rows[0]:
        print("  double vs real: max |loss| %.3g, max |gradient| %.3g, max |logged value| %.3g; logged by the real "
              "code only: %s" % (max(r["double_loss"] for r in rows), max(r["double_grad"] for r in rows),
                                 max(r["double_log"] for r in rows), sorted({k for r in rows for k in r["only_real"]})))
    for row in [r for r in rows if not (r["loss"] and r["grad"] and r["log"])][:5]:
        print("  UNEQUAL", row)
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
