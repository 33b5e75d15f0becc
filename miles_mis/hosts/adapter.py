"""A host's own policy loss, run with miles_mis's correction and the whole batch handed to it.

Both hosts load a whole policy loss by path (``--loss-type custom_loss --custom-loss-function-path``), called once
per micro-batch as ``func(args, batch, logits, sum_of_sample_mean) -> (loss, log)``. ``policy_loss`` is that
function for a given ``Host``: it imports the host's own ``policy_loss_function`` (so PPO, dual clip, OPSM, GSPO, KL and
entropy terms and whatever the host adds later stay the host's) and calls it with ``--custom-tis-function-path`` set to
miles_mis's entry point, while ``miles_mis.batch_inputs`` hands that entry point what the hook's arguments lack but the
batch holds: the advantages, the current policy's log-probs, rollout ids, lags, sampling masks; each read only when the
config needs it or the batch carries it. With nothing extra to read, the result is the host's own
``policy_loss`` + ``--custom-tis-function-path`` result, bit for bit (docs/hosts.md).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .. import advantages, batch_inputs, divergence, rollouts, sampling_mask
from ..config import MisConfig
from ..inputs import host_setting

ENTRY_POINT = "miles_mis.compute_mis_weights_with_cp"  # the hook the host's loss calls
OUR_ENTRY_POINTS = (ENTRY_POINT, "miles_mis.compute_mis_weights_fsdp", "miles_mis.plugin.compute_mis_weights_with_cp",
                    "miles_mis.plugin.compute_mis_weights_fsdp")
LAG_KEYS = ("tis_upper_bound_by_lag", "rs_max_lag")


@dataclass(frozen=True)
class Host:
    """What the adapter needs to know of one host (its source read at ``verified_commit``)."""

    name: str  # "miles"
    repository: str  # "radixark/miles"
    verified_commit: str
    loss_module: str  # the module of the host's policy_loss_function
    # (host loss module, args, batch, logits) -> the current policy's log-probs per sample (CP-local), by the host's
    # own helper, with the same arguments its policy loss uses
    current_log_probs: Callable[[Any, Any, Mapping[str, Any], torch.Tensor], list]
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
    (``--get-mismatch-metrics``), the correction given what the batch holds. Returns the host's (loss, log)."""
    module = host_loss_module(host)
    if not (host_setting(args, "use_tis") or host_setting(args, "get_mismatch_metrics")):
        return module.policy_loss_function(args, batch, logits, sum_of_sample_mean)
    config = MisConfig.from_args(args)
    inputs = batch_inputs_for(host, module, config, args, batch, logits)
    with batch_inputs.provided(inputs):
        return module.policy_loss_function(_with_entry_point(host, args), batch, logits, sum_of_sample_mean)


def _with_entry_point(host: Host, args: Any) -> Any:
    """``args`` with ``custom_tis_function_path`` naming miles_mis's entry point (a copy when it is unset); another
    function there is an error: this adapter exists to run miles_mis's correction."""
    path = host_setting(args, "custom_tis_function_path")
    if path in OUR_ENTRY_POINTS:
        return args
    if path:
        raise ValueError(f"--custom-tis-function-path {path}: miles_mis.hosts.{host.name}_loss runs miles_mis's "
                         f"correction inside {host.name}'s policy loss; leave the flag unset or set it to {ENTRY_POINT}")
    args = copy.copy(args)
    args.custom_tis_function_path = ENTRY_POINT
    return args


def batch_inputs_for(host: Host, module: Any, config: MisConfig, args: Any, batch: Mapping[str, Any],
                     logits: torch.Tensor) -> dict[str, Any]:
    """What the correction reads beyond the hook's arguments, from the batch: each input only when the config reads
    it (advantages, the current policy) or the batch carries it (rollout ids, lags, sampling masks)."""
    inputs: dict[str, Any] = {}
    if advantages.needed(config):
        inputs["advantages"] = _required(batch, "advantages", host, _directional_options(config))
    if config.tis_policy == "current":
        if not callable(getattr(module, "get_log_probs_and_entropy", None)):
            raise ImportError(f"miles_mis.hosts: {host.loss_module} has no get_log_probs_and_entropy, which tis_policy: "
                              f"current needs for the current policy's log-probs: this {host.name} version differs from "
                              f"the one the adapter was verified against ({host.where})")
        with torch.no_grad():  # the values only: the correction's weights are detached
            inputs["cur_log_probs"] = [t.detach() for t in host.current_log_probs(module, args, batch, logits)]
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
    """Each sample's lag from the batch's ``weight_versions`` (one list of versions per sample, as miles records
    them), relative to ``args.current_weight_version`` when set (the trainer's version, an int a hook may set), else
    to the newest version among the batch's samples (then every lag is a lower bound: docs/hosts.md#lags)."""
    versions = batch.get("weight_versions")
    needed = [key for key in LAG_KEYS if getattr(config, key) is not None] if config.use_tis else []
    if versions is None:
        if needed:
            raise ValueError(f"{' and '.join(needed)} needs each sample's lag, but this {host.name} batch holds no "
                             f"weight_versions ({host.name} at {host.where} does not put them in the training batch; "
                             "docs/hosts.md#lags)")
        return {}
    current = host_setting(args, "current_weight_version")
    if current is None:
        current = _newest_version(versions)
    return {"weight_versions": versions, "current_weight_version": current}


def _newest_version(versions: Any) -> int | None:
    """The newest numeric version among the samples' (None when there is none: the correction names the problem)."""
    newest = None
    for entry in versions if isinstance(versions, (list, tuple)) else ():
        for value in entry if isinstance(entry, (list, tuple)) else [entry]:
            text = str(value).strip()
            if text.isdigit():
                newest = int(text) if newest is None else max(newest, int(text))
    return newest


def _required(batch: Mapping[str, Any], key: str, host: Host, why: str) -> Any:
    value = batch.get(key)
    if value is None:
        raise ValueError(f"{why} reads the batch's {key}, but this {host.name} batch holds none")
    return value


def _directional_options(config: MisConfig) -> str:
    options = [option for option, _, _ in config.rs_divergence
               if divergence.split_option(option)[1] in divergence.DIRECTIONAL]
    return "rs_divergence option " + ", ".join(options)
