"""A host's own policy loss, run with miles_mis's correction and the whole batch handed to it.

Both hosts load a whole policy loss by path (``--loss-type custom_loss --custom-loss-function-path``), called once
per micro-batch as ``func(args, batch, logits, sum_of_sample_mean) -> (loss, log)``. ``policy_loss`` is that
function for a given ``Host``: it imports the host's own ``policy_loss_function`` (so PPO, dual clip, OPSM, GSPO, KL and
entropy terms and whatever the host adds later stay the host's) and calls it with ``--custom-tis-function-path`` set to
miles_mis's entry point, and sends that entry point, through ``miles_mis.inputs.batch_channel.BATCH_INPUTS``, what
the hook's arguments lack but the batch holds: the advantages, the current policy's log-probs, rollout ids, lags,
sampling masks; each read only when the config needs it or the batch carries it. With nothing extra to read, the
result is the host's own ``policy_loss`` + ``--custom-tis-function-path`` result, bit for bit (docs/hosts.md).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from ..inputs import advantages, rollouts, sampling_mask
from ..inputs.batch_channel import BATCH_INPUTS, Deferred
from ..correction import staleness
from ..config import MisConfig, host_setting
from .score_centering import score_centering_loss

ENTRY_POINT = "miles_mis.compute_mis_weights_with_cp"  # the hook the host's loss calls
OUR_ENTRY_POINTS = (ENTRY_POINT, "miles_mis.compute_mis_weights_fsdp", "miles_mis.plugin.compute_mis_weights_with_cp",
                    "miles_mis.plugin.compute_mis_weights_fsdp")


@dataclass(frozen=True)
class Host:
    """What the adapter needs to know of one host (its source read at ``verified_commit``)."""

    name: str  # "miles"
    repository: str  # "radixark/miles"
    verified_commit: str
    loss_module: str  # the module of the host's policy_loss_function
    sampling_mask_key: str  # the batch key of the sampling masks' CSR offsets (per sample, whole response)

    @property
    def where(self) -> str:
        return f"{self.repository}@{self.verified_commit[:9]}"


def host_loss_module(host: Host) -> Any:
    """The host's loss module; outside the host (or on a version without it) one line naming what is missing and the
    commit the adapter was verified against."""
    try:
        module = importlib.import_module(host.loss_module)
    except ImportError as error:
        raise ImportError(f"miles_mis.hosts: cannot import {host.loss_module} ({error}): this adapter runs inside "
                          f"{host.name}'s trainer (verified against {host.where})") from None
    if not callable(getattr(module, "policy_loss_function", None)):
        raise ImportError(f"miles_mis.hosts: {host.loss_module} has no policy_loss_function: this {host.name} version "
                          f"differs from the one the adapter was verified against ({host.where})")
    return module


def policy_loss(host: Host, args: Any, batch: Mapping[str, Any], logits: torch.Tensor,
                sum_of_sample_mean: Callable) -> tuple[torch.Tensor, dict]:
    """``host``'s policy loss of one micro-batch with miles_mis's correction (``--use-tis``) or its metrics
    (``--get-mismatch-metrics``), the correction given what the batch holds; with ``score_centering: true`` the
    score-centered loss instead (``hosts.score_centering``), which needs the logits the hook never sees. Returns
    the host's (loss, log)."""
    if host_setting(args, "score_centering") not in (None, False):  # a YAML value: MisConfig checks it
        config = MisConfig.from_args(args)
        if config.score_centering:
            return score_centering_loss(config, args, batch, logits, sum_of_sample_mean, host_parallel_state(host))
    module = host_loss_module(host)
    if not (host_setting(args, "use_tis") or host_setting(args, "get_mismatch_metrics")):
        return module.policy_loss_function(args, batch, logits, sum_of_sample_mean)
    config = MisConfig.from_args(args)
    inputs = batch_inputs_for(host, config, args, batch)
    with contextlib.ExitStack() as scope:
        if config.tis_policy == "current":
            inputs["cur_log_probs"] = scope.enter_context(_host_log_probs(host, module))
        scope.enter_context(BATCH_INPUTS.sending(inputs))
        return module.policy_loss_function(_with_entry_point(host, args), batch, logits, sum_of_sample_mean)


def host_parallel_state(host: Host) -> Any:
    """The host's parallel state (``.cp``, ``.tp`` groups) as its loss module reads it (miles' loss module imports
    ``get_parallel_state``); None where the module has none (slime: Megatron-core's groups are read instead)."""
    get_parallel_state = getattr(host_loss_module(host), "get_parallel_state", None)
    return get_parallel_state() if callable(get_parallel_state) else None


@contextlib.contextmanager
def _host_log_probs(host: Host, module: Any) -> Iterator[Deferred]:
    """The current policy's log-probs as the host's own loss computes them, detached, for ``tis_policy: current``:
    within the block the loss module's ``get_log_probs_and_entropy`` is wrapped to keep a detached copy of what it
    returns (miles returns a dict, slime a pair), so no second log-softmax over the logits is computed. Restored on
    exit (the host's loss runs on one thread per process)."""
    original = getattr(module, "get_log_probs_and_entropy", None)
    if not callable(original):
        raise ImportError(f"miles_mis.hosts: {host.loss_module} has no get_log_probs_and_entropy, which tis_policy: "
                          f"current needs for the current policy's log-probs: this {host.name} version differs from "
                          f"the one the adapter was verified against ({host.where})")
    kept: list = []

    def keeping(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        values = out[1] if isinstance(out, tuple) else out
        kept[:] = [[t.detach() for t in values["log_probs"]]]
        return out

    def read() -> list:
        if not kept:
            raise ValueError(f"tis_policy: current: {host.name}'s policy loss called the correction before computing "
                             f"its log-probs: this {host.name} version differs from the one the adapter was verified "
                             f"against ({host.where})")
        return kept[0]

    module.get_log_probs_and_entropy = keeping
    try:
        yield Deferred(read)
    finally:
        module.get_log_probs_and_entropy = original


def entry_point(host: Host) -> Callable[[Any, Mapping[str, Any], torch.Tensor, Callable], tuple[torch.Tensor, dict]]:
    """The function a host loads with ``--custom-loss-function-path``: ``policy_loss`` for ``host``."""
    def host_policy_loss(args: Any, batch: Mapping[str, Any], logits: torch.Tensor, sum_of_sample_mean: Callable):
        return policy_loss(host, args, batch, logits, sum_of_sample_mean)

    host_policy_loss.__name__ = host_policy_loss.__qualname__ = "policy_loss"
    host_policy_loss.__doc__ = (f"{host.name}'s ``custom_loss`` entry: {host.name}'s own policy loss, corrected by "
                                "miles_mis with what the batch holds (docs/hosts.md).")
    return host_policy_loss


def _with_entry_point(host: Host, args: Any) -> Any:
    """``args`` with ``custom_tis_function_path`` naming miles_mis's entry point (a copy when it is unset); another
    function there is an error: this adapter exists to run miles_mis's correction."""
    path = host_setting(args, "custom_tis_function_path")
    if path in OUR_ENTRY_POINTS:
        return args
    if path:
        raise ValueError(f"--custom-tis-function-path {path}: miles_mis.hosts.{host.name}_loss runs miles_mis's "
                         f"correction inside {host.name}'s policy loss; leave the flag unset or set it to "
                         f"{ENTRY_POINT}")
    args = copy.copy(args)
    args.custom_tis_function_path = ENTRY_POINT
    return args


def batch_inputs_for(host: Host, config: MisConfig, args: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """What the correction reads beyond the hook's arguments, from the batch: each input only when the config reads
    it (advantages, lags) or the batch carries it (rollout ids and counts, sampling masks). The current policy's
    log-probs come from the host's own computation (``policy_loss``)."""
    inputs: dict[str, Any] = {}
    if advantages.needed(config) and batch.get("advantages") is not None:  # without: the entry point names the options
        inputs["advantages"] = batch["advantages"]
    for key in (rollouts.KWARG, rollouts.MASK_SUMS_KWARG):  # ids group; the counts alone flag fragments
        if batch.get(key) is not None:
            inputs[key] = batch[key]
    inputs.update(batch_lags(host, config, args, batch))
    offsets = batch.get(host.sampling_mask_key)
    if offsets is not None:
        inputs[host.sampling_mask_key if host.sampling_mask_key in sampling_mask.OFFSET_KWARGS
               else sampling_mask.OFFSET_KWARGS[0]] = offsets
    return inputs


def batch_lags(host: Host, config: MisConfig, args: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """Each sample's lag: the trainer's version ``args.current_weight_version`` (an int a hook sets on the host's
    Namespace) minus the oldest of the sample's ``weight_versions`` (one per generation call, as miles records them).
    Read when the config acts on lags (then both are required, each missing one named) or when both are there (the
    lag metrics); never relative to another sample's version (docs/hosts.md#lags)."""
    needed = staleness.lag_keys_in_use(config)
    versions, current = batch.get("weight_versions"), host_setting(args, "current_weight_version")
    keys = " and ".join(needed)
    if needed and versions is None:
        raise ValueError(f"{keys} needs each sample's lag, but this {host.name} batch holds no weight_versions "
                         f"({host.name} at {host.where} does not put them in the training batch; docs/hosts.md#lags)")
    if needed and current is None:
        raise ValueError(f"{keys} needs each sample's lag, the trainer's weight version minus the sample's, but "
                         "args.current_weight_version is not set: set it to the trainer's version before each step "
                         "(docs/hosts.md#lags)")
    if versions is None or current is None:
        return {}
    return {"weight_versions": versions, "current_weight_version": current}
