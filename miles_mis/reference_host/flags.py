"""The reference host's flag layer: miles' policy-loss flags as an argparse parser, the merge of a
``--custom-config-path`` YAML file and of ``--mis-set KEY=VALUE`` items onto the parsed args (each value converted
and checked exactly as its flag on the command line), the flag ranges and combinations :func:`validate_args`
refuses, and the loading of the correction function named by ``--custom-tis-function-path``.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

LOSS_DENOMINATORS = ("input-mask", "returned-mask")  # --loss-denominator


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with every flag's default, and descriptions printed as written."""


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the host's flags (miles spellings) to ``parser`` (a new one if None).

    The help strings carry their defaults, so a host's own parser shows them whatever its formatter.
    """
    parser = parser or argparse.ArgumentParser(description="miles_mis reference host flags",
                                               formatter_class=HelpFormatter)
    group = parser.add_argument_group("policy loss (miles flags)")
    group.add_argument("--use-tis", action="store_true", default=False,
                       help="decoupled 3-policy PPO: multiply the loss by the IS weight π_old/π_rollout")
    group.add_argument("--use-rollout-logprobs", action="store_true", default=False,
                       help="bypass PPO: use the rollout log-probs as π_old (no trainer recompute)")
    group.add_argument("--get-mismatch-metrics", action="store_true", default=False,
                       help="call the custom correction function for its metrics only")
    group.add_argument("--custom-tis-function-path", default=None,
                       help="correction function: pkg.module.func or path/to/file.py:func (default: %(default)s)")
    group.add_argument("--custom-config-path", default=None,
                       help="YAML file whose top-level keys are set on the parsed args, each checked like its "
                            "flag (default: %(default)s)")
    group.add_argument("--mis-set", action="append", default=None, metavar="KEY=VALUE",
                       help="set one miles_mis config key (any key of MisConfig.keys(), e.g. tis_mode, "
                            "rs_batch_gate) after --custom-config-path, overriding that file's key; VALUE is read "
                            "as YAML (tis_upper_bound=auto, 'rs_batch_gate={k3: 0.05}') and checked as the same "
                            "key in the file; repeat for more keys, each once (default: %(default)s = the "
                            "file's keys and the defaults)")
    group.add_argument("--tis-clip", type=float, default=2.0,
                       help="built-in vanilla TIS upper bound, > 0 (default: %(default)s)")
    group.add_argument("--tis-clip-low", type=float, default=0.0,
                       help="built-in vanilla TIS lower bound, >= 0 and < --tis-clip (default: %(default)s)")
    group.add_argument("--eps-clip", type=float, default=0.2, help="PPO clip range below 1, > 0 (default: %(default)s)")
    group.add_argument("--eps-clip-high", type=float, default=None,
                       help="PPO clip range above 1, > 0 (default: %(default)s = --eps-clip)")
    group.add_argument("--eps-clip-c", type=float, default=None,
                       help="dual-clip constant (> 1) for A < 0 (default: %(default)s = off)")
    group.add_argument("--calculate-per-token-loss", action="store_true", default=False,
                       help="sum over tokens instead of the mean of per-sequence means")
    group.add_argument("--loss-denominator", choices=LOSS_DENOMINATORS, default="input-mask",
                       help="each sequence's denominator of the loss mean: the sum of the input loss mask (miles "
                            "with rollout_mask_sums) or of the whole mask the correction returned (miles' "
                            "get_sum_of_sample_mean without them); the two agree without rejections "
                            "(default: %(default)s)")
    group.add_argument("--loss-type", choices=("ppo", "reinforce"), default="ppo",
                       help="policy-gradient loss (default: %(default)s)")
    group.add_argument("--use-opsm", action="store_true", default=False,
                       help="off-policy sequence masking (DeepSeek-V3.2)")
    group.add_argument("--opsm-delta", type=float, default=1e-4,
                       help="OPSM threshold δ on the sequence KL, >= 0 (default: %(default)s)")
    group.add_argument("--pass-current-log-probs", action="store_true", default=False,
                       help="also pass the current policy's log-probs to the correction function (cur_log_probs, as "
                            "slime PR 2084), for tis_policy: current")
    group.add_argument("--qkv-format", choices=("thd", "bshd"), default="thd",
                       help="packed (thd) or padded (bshd) sequences (default: %(default)s)")
    return parser


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse the flags, merge ``--custom-config-path`` (its keys override flags) and then ``--mis-set`` (its keys
    override the file's), then validate.

    miles and slime validate before merging the YAML, so a YAML can enable use_tis together with
    use_rollout_logprobs there; here every check sees the merged values.
    """
    parser = build_parser(parser)
    args = parser.parse_args(argv)
    merge_config_file(args, parser)
    validate_args(args)
    return args


def merge_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """Set the top-level keys of ``--custom-config-path`` on ``args``, as miles does, but each value first goes
    through what the command line does to its flag (:func:`convert_config_values`); then the ``--mis-set``
    keys (:func:`apply_mis_set`), which override the file's.

    ``parser``: the parser that made ``args`` (a host that adds its own flags passes it, so that they are
    checked too); default the host's flags. Unknown keys: see :func:`convert_config_values`.
    """
    parser = parser or build_parser()
    if getattr(args, "custom_config_path", None):
        from ..config import load_yaml_mapping

        path = str(args.custom_config_path)
        values = load_yaml_mapping(path)
        function_path = values.get("custom_tis_function_path", getattr(args, "custom_tis_function_path", None))
        third_party = lambda: bool(function_path) and not _is_ours(load_function(str(function_path)))  # noqa: E731
        for key, value in convert_config_values(values, parser, source=path, pass_unknown=third_party,
                                                plugin_keys=bool(function_path)).items():
            setattr(args, key, value)
    apply_mis_set(args, parser)


# flags that only the command line may give (a config file holding them is an error)
COMMAND_LINE_ONLY = frozenset({"mis_set"})
MIS_SET_EXAMPLES = "e.g. --mis-set tis_mode=clip, --mis-set 'rs_batch_gate={k3: 0.05}'"


def parse_mis_set(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of one ``--mis-set``: the key (stripped) and VALUE read as YAML by the reader of config files
    (so ``1e-4`` is a string as in a file, ``{k3: 0.05}`` a mapping, an empty VALUE null)."""
    import yaml

    from ..config import strict_loader

    key, sep, text = str(item).partition("=")
    key = key.strip()
    if not sep:
        raise ValueError(f"--mis-set {item!r} is invalid: expected KEY=VALUE with an '=' ({MIS_SET_EXAMPLES})")
    if not key:
        raise ValueError(f"--mis-set {item!r} is invalid: the key before '=' is empty: expected KEY=VALUE "
                         f"({MIS_SET_EXAMPLES})")
    try:
        return key, yaml.load(text, Loader=strict_loader())
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or getattr(error, "context", None) or str(error)
        mark = getattr(error, "problem_mark", None)
        at = f" at character {mark.column + 1}" if mark is not None and mark.line == 0 else ""
        raise ValueError(f"--mis-set {key}: {text!r} is not a YAML value ({' '.join(problem.split())}{at}): quote "
                         f"the whole KEY=VALUE for the shell ({MIS_SET_EXAMPLES})") from None


def mis_set_keys(args: argparse.Namespace) -> list[str]:
    """The keys the ``--mis-set`` flags of ``args`` set, in order."""
    return [str(item).partition("=")[0].strip() for item in getattr(args, "mis_set", None) or ()]


def apply_mis_set(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> None:
    """Set the ``--mis-set KEY=VALUE`` keys on ``args`` (after the config file: they override its keys).

    A key must be a miles_mis config key (``MisConfig.keys()``), given once; its value goes through
    :func:`convert_config_values` exactly as the same key read from the config file would (a key that is also a
    flag, ``use_tis``, is converted as that flag; a miles_mis key without a correction function is an error), and
    ``MisConfig`` checks it in :func:`validate_args`. Errors name ``--mis-set KEY``.
    """
    items = getattr(args, "mis_set", None)
    if not items:
        return
    from ..config import MisConfig, did_you_mean

    parser = parser or build_parser()
    flags = {action.dest for action in parser._actions if action.option_strings}
    values: dict[str, Any] = {}
    for item in items:
        key, value = parse_mis_set(item)
        if key not in MisConfig.keys():
            if key in flags:
                raise ValueError(f"--mis-set {key}: {key!r} is not a miles_mis config key but the flag "
                                 f"{flag_name(key, parser)}: give that flag instead")
            raise ValueError(f"--mis-set {key}: unknown key {key!r}{did_you_mean(key, MisConfig.keys())}; allowed "
                             f"keys: the miles_mis config keys ({', '.join(MisConfig.keys())})")
        if key in values:
            raise ValueError(f"--mis-set {key} is given twice: give each key once")
        values[key] = value
    function_path = getattr(args, "custom_tis_function_path", None)
    for key, value in convert_config_values(values, parser, source="--mis-set", plugin_keys=bool(function_path),
                                            label=lambda key: f"--mis-set {key}").items():
        setattr(args, key, value)


# Ranges of the numeric flags, checked at parse time for the command line and a YAML value alike:
# dest -> (test on a finite number, the allowed values in words, whether None (unset) is allowed).
FLAG_RANGES: dict[str, tuple[Callable[[float], bool], str, bool]] = {
    "eps_clip": (lambda x: x > 0, "finite numbers > 0 (the PPO clip range below 1)", False),
    "eps_clip_high": (lambda x: x > 0, "finite numbers > 0 (the PPO clip range above 1) or null", True),
    "eps_clip_c": (lambda x: x > 1, "finite numbers > 1 (the dual-clip constant) or null", True),
    "tis_clip": (lambda x: x > 0, "finite numbers > 0 (the built-in TIS upper bound)", False),
    "tis_clip_low": (lambda x: x >= 0, "finite numbers >= 0 (the built-in TIS lower bound; 0 = none)", False),
    "opsm_delta": (lambda x: x >= 0, "finite numbers >= 0 (the OPSM threshold on the sequence KL)", False),
}


def check_flag_range(dest: str, value: Any, where: str) -> None:
    """ValueError ``WHERE: VALUE is invalid: allowed values are ...`` unless ``value`` is in ``dest``'s range."""
    if dest not in FLAG_RANGES:
        return
    test, allowed, nullable = FLAG_RANGES[dest]
    if value is None and nullable:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and test(value)):
        raise ValueError(f"{where}: {value!r} is invalid: allowed values are {allowed}")


def flag_name(dest: str, parser: argparse.ArgumentParser | None = None) -> str:
    """The command-line spelling of ``dest`` (``eps_clip`` -> ``--eps-clip``)."""
    for action in (parser._actions if parser is not None else ()):
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return "--" + dest.replace("_", "-")


def convert_config_values(values: Mapping[Any, Any], parser: argparse.ArgumentParser | None = None, *,
                          source: str, pass_unknown: Callable[[], bool] | bool = False,
                          plugin_keys: bool = True, label: Callable[[str], str] | None = None) -> dict[str, Any]:
    """The keys of a config file, each value converted and checked exactly as its flag on the command line.

    A key that is a flag of ``parser`` (its dest: ``eps_clip`` for ``--eps-clip``) takes the flag's type
    (applied to the text the command line would carry: ``1e-4`` read by YAML as a string is float("1e-4")),
    choices and range (:data:`FLAG_RANGES`); a switch (store_true) takes only a YAML boolean; null only
    where the flag's default is None. A miles_mis config key (``MisConfig.keys()``) passes unchanged:
    ``MisConfig`` checks it when the function is miles_mis's. Any other key is an error with a did-you-mean,
    unless ``pass_unknown`` (a bool, or a callable asked on the first unknown key) is true — a correction
    function that is not miles_mis's may read keys of its own, as miles sets every key on args — and even then
    a key within a typo of a known key is an error. ``plugin_keys`` False (no correction function is named, so
    the built-in TIS runs): a miles_mis config key is an error, since nothing would read it. Errors:
    ``SOURCE: key 'k' (--flag): ...``; ``label(key)`` replaces ``SOURCE: key 'k'`` when given. A command-line-only
    flag (:data:`COMMAND_LINE_ONLY`: ``mis_set``) is an error.
    """
    from ..config import MisConfig

    parser = parser or build_parser()
    label = label or (lambda key: f"{source}: key {key!r}")
    actions = {action.dest: action for action in parser._actions
               if action.option_strings and action.default is not argparse.SUPPRESS
               and action.dest not in COMMAND_LINE_ONLY}
    known = tuple(actions) + tuple(k for k in MisConfig.keys() if k not in actions)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ValueError(f"{source}: key {key!r} is invalid: keys are names (strings)")
        if key in COMMAND_LINE_ONLY:
            raise ValueError(f"{label(key)} ({flag_name(key, parser)}) is a command-line flag only: set the keys it "
                             "would set directly in this file (KEY: VALUE)")
        if key in actions:
            out[key] = _flag_value(actions[key], value, parser, f"{label(key)} ({flag_name(key, parser)})")
            continue
        # score centering's keys are read by the custom-loss adapters (and the lab's loss), not by the TIS hook
        if not plugin_keys and key in MisConfig.keys() and not key.startswith("score_centering"):
            raise ValueError(f"{label(key)} is a miles_mis config key, but no --custom-tis-function-path is "
                             "given, so the built-in TIS would silently ignore it: add --custom-tis-function-path "
                             "miles_mis.compute_mis_weights_with_cp (flag or YAML key)")
        if key not in known:
            if callable(pass_unknown):
                pass_unknown = bool(pass_unknown())
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.8 if pass_unknown else 0.6)
            if not pass_unknown or close:
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                why = ("; it is passed to a custom correction function as is only when it is not a typo of a known "
                       "key: rename it" if pass_unknown else
                       f"; allowed keys: the flags ({', '.join(actions)}) and the miles_mis config keys "
                       f"({', '.join(k for k in MisConfig.keys() if k not in actions)})")
                raise ValueError(f"{source}: unknown key {key!r}{hint}{why}")
        out[key] = value
    return out


_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def _flag_value(action: argparse.Action, value: Any, parser: argparse.ArgumentParser, where: str) -> Any:
    """``value`` (from YAML) converted and checked as the command line does it for ``action``'s flag."""
    flag = max(action.option_strings, key=len)
    if isinstance(action, _SWITCHES):
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: {_shown(value)} is invalid: {flag} is a switch, allowed values are the YAML "
                         "booleans true or false (unquoted)")
    if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._AppendConstAction):
        if value == action.const or value == action.default:
            return value
        raise ValueError(f"{where}: {_shown(value)} is invalid: allowed values are {action.const!r} (the flag given) "
                         f"or {action.default!r}")
    if isinstance(action, argparse._CountAction):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return int(value)
        raise ValueError(f"{where}: {_shown(value)} is invalid: {flag} counts, allowed values are integers >= 0")
    if not isinstance(action, (argparse._StoreAction, argparse._AppendAction)):
        return value  # a host's own Action class: its meaning is unknown here
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+", argparse.REMAINDER) \
        or isinstance(action.nargs, int)
    if many:
        if value is None and action.default is None:
            return None
        items = value if isinstance(value, list) else [value]
        return [_flag_item(action, item, parser, where, flag) for item in items]
    if value is None:
        if action.default is None:
            return None  # unset, as the flag's default
        raise ValueError(f"{where}: null is invalid: {flag} has no unset value (default {action.default!r})")
    return _flag_item(action, value, parser, where, flag)


def _flag_item(action: argparse.Action, value: Any, parser: argparse.ArgumentParser, where: str, flag: str) -> Any:
    type_func = parser._registry_get("type", action.type, action.type)
    type_name = getattr(type_func, "__name__", repr(type_func)) if type_func is not None else "string"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        kind = "a boolean" if isinstance(value, bool) else f"a {type(value).__name__}"
        raise ValueError(f"{where}: {_shown(value)} is invalid: {flag} takes one {type_name} value, not {kind}")
    # the text the command line would carry: as written (YAML may read "1e-4" as a string), else the number
    text = value if isinstance(value, str) else getattr(value, "yaml_text", None) or repr(value)
    converted: Any = text
    if type_func is not None:
        try:
            converted = type_func(text)
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"{where}: {error}") from None
        except (TypeError, ValueError):
            raise ValueError(f"{where}: invalid {type_name} value: {text!r}") from None
    if action.choices is not None and converted not in action.choices:
        from ..config import did_you_mean

        hint = did_you_mean(str(converted), tuple(str(c) for c in action.choices))
        raise ValueError(f"{where}: invalid choice: {converted!r}{hint} (choose from "
                         f"{', '.join(repr(c) for c in action.choices)})")
    check_flag_range(action.dest, converted, where)
    return converted


def _shown(value: Any) -> str:
    return "null" if value is None else repr(value)


def _is_ours(function: Callable) -> bool:
    return getattr(function, "__module__", "").startswith("miles_mis")


def validate_args(args: argparse.Namespace) -> None:
    """Flag ranges (:data:`FLAG_RANGES`) and combinations; each error names the flags involved, and the config
    file when one was merged (its keys count as the flags).

    One valid combination prints a one-line warning on stderr: ``--use-tis`` with ``--custom-config-path`` and no
    ``--custom-tis-function-path`` (the built-in vanilla TIS, which reads none of the file's miles_mis keys; a file
    holding one is an error at the merge)."""
    config_path = getattr(args, "custom_config_path", None)
    overridden = mis_set_keys(args)
    together = [f"the keys of {config_path}"] if config_path else []
    together += ["--mis-set use_tis"] if "use_tis" in overridden else []
    where = f" (flags and {' and '.join(together)} together)" if together else ""
    for dest in FLAG_RANGES:
        if hasattr(args, dest):
            check_flag_range(dest, getattr(args, dest), flag_name(dest))
    if getattr(args, "use_tis", False) and getattr(args, "use_rollout_logprobs", False):
        raise ValueError("--use-tis and --use-rollout-logprobs are mutually exclusive: decoupled PPO needs the "
                         "trainer's recomputed log-probs as π_old, bypass PPO replaces them by the rollout's" + where)
    if getattr(args, "get_mismatch_metrics", False) and not getattr(args, "custom_tis_function_path", None):
        raise ValueError("--get-mismatch-metrics needs --custom-tis-function-path (e.g. "
                         "miles_mis.compute_mis_weights_with_cp): the built-in TIS has no mismatch metrics" + where)
    if getattr(args, "loss_type", "ppo") == "reinforce" and not (args.use_tis or args.use_rollout_logprobs):
        raise ValueError("--loss-type reinforce needs --use-tis or --use-rollout-logprobs: REINFORCE + IS weights "
                         "each token by an importance ratio against the rollout log-probs" + where)
    if args.tis_clip_low >= args.tis_clip:
        raise ValueError(f"--tis-clip-low={args.tis_clip_low} must be smaller than --tis-clip={args.tis_clip}{where}")
    if getattr(args, "custom_tis_function_path", None):
        function = load_function(args.custom_tis_function_path)  # fail at start-up, not at the first step
        if _is_ours(function):
            from ..config import MisConfig

            try:
                config = MisConfig.from_args(args)  # the plugin's own config errors, early
            except ValueError as error:
                raise ValueError(_config_error_message(str(error), config_path, overridden)) from None
            _check_current_policy(args, config, where)
        cp_size = getattr(args, "context_parallel_size", 1)
        if is_packed_entry(function) and isinstance(cp_size, int) and cp_size > 1:
            raise ValueError(packed_cp_message(args.custom_tis_function_path, cp_size, "--context-parallel-size"))
    elif getattr(args, "use_tis", False) and config_path:
        # valid but most likely not what was meant: a miles_mis key in the file was refused at the merge
        # (convert_config_values), but a file of host flags only, or an empty one, would pass silently while the
        # built-in TIS runs
        print(f"warning: --use-tis with --custom-config-path {config_path} but no --custom-tis-function-path: the "
              f"built-in vanilla TIS runs (token weights truncated to [--tis-clip-low, --tis-clip] = "
              f"[{args.tis_clip_low:g}, {args.tis_clip:g}]) and reads no miles_mis config from the file (only its host "
              "flags apply); add --custom-tis-function-path miles_mis.compute_mis_weights_with_cp to use miles_mis",
              file=sys.stderr, flush=True)


def _check_current_policy(args: argparse.Namespace, config: Any, where: str) -> None:
    """``tis_policy: current`` needs the current log-probs passed (an error at start-up, not at the first step); with
    the clipped PPO loss and ``--use-tis`` it is valid but double-counts π_θ/π_old after the first optimizer step of
    a rollout (docs/algorithms.md): a one-line warning."""
    if config.tis_policy != "current":
        return
    if not getattr(args, "pass_current_log_probs", False):
        raise ValueError("tis_policy: current needs --pass-current-log-probs: the host must pass the current "
                         "policy's log-probs (cur_log_probs) for the weights π_θ/π_rollout" + where)
    if config.use_tis and getattr(args, "loss_type", "ppo") == "ppo":
        print("warning: tis_policy: current with the clipped PPO loss: the PPO ratio already holds π_θ/π_old, so "
              "the weights π_θ/π_rollout count it twice once π_θ moves from π_old (every optimizer step of a rollout "
              "after the first); with --loss-type reinforce they are the whole correction (docs/algorithms.md)",
              file=sys.stderr, flush=True)


def _config_error_message(message: str, config_path: str | None, overridden: Sequence[str]) -> str:
    """A MisConfig error prefixed with where its values come from: the ``--mis-set`` keys it names
    (``--mis-set tis_mode='trunc' is invalid ...`` when it is about that key alone), else the config file and the
    ``--mis-set`` keys (which also went into the config)."""
    named = [key for key in overridden if re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message)]
    if len(named) == 1 and re.match(rf"{re.escape(named[0])}[=:.]", message):
        return f"--mis-set {message}"  # MisConfig's "key=value is invalid ...", as the user wrote it
    if named:
        source = ", ".join(f"--mis-set {key}" for key in named)
        source += f" (with the keys of {config_path})" if config_path else ""
    else:
        given = ", ".join(f"--mis-set {key}" for key in overridden)
        source = (config_path + (f" (with {given})" if given else "")) if config_path else given
    return f"{source}: {message}" if source else message


def is_packed_entry(function: Callable) -> bool:
    """Whether ``function`` is ``miles_mis.compute_mis_weights_packed`` (by any path that resolves to it)."""
    from .. import compute_mis_weights_packed

    return function is compute_mis_weights_packed


def packed_cp_message(path: Any, size: int, what: str = "the context parallel size") -> str:
    return (f"--custom-tis-function-path {path!s}: compute_mis_weights_packed takes whole sequences, but {what} is "
            f"{size}: under context parallelism use miles_mis.compute_mis_weights_with_cp (same results, CP shards)")


# file plugins, executed once per process: resolved file path -> module
_FILE_MODULES: dict[Path, Any] = {}


def _error_line(error: BaseException) -> str:
    """``Type: message`` on one line, with the file and line of a syntax error."""
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({error.filename}, line {error.lineno})"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def load_function(path: str) -> Callable:
    """``pkg.module.func`` (import + getattr, as miles) or ``path/to/file.py:func``.

    A file is executed once per process (cached by its resolved path), as an import would be: the host
    calls this at start-up and on every policy-loss call.
    """
    if ":" in path:
        file_path, _, name = path.rpartition(":")
        resolved = Path(file_path).resolve()
        module = _FILE_MODULES.get(resolved)
        if module is None:
            spec = importlib.util.spec_from_file_location(resolved.stem, resolved)
            if spec is None or spec.loader is None or not resolved.is_file():
                raise ValueError(f"--custom-tis-function-path {path!r}: no Python file at {file_path!r}")
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as error:  # a syntax error or an exception at import: one line naming the flag
                raise ValueError(f"--custom-tis-function-path {path!r}: executing {file_path} failed: "
                                 f"{_error_line(error)}") from error
            _FILE_MODULES[resolved] = module
    else:
        module_name, _, name = path.rpartition(".")
        if not module_name or not name:
            raise ValueError(f"--custom-tis-function-path {path!r} is invalid: expected pkg.module.func or "
                             "path/to/file.py:func")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"--custom-tis-function-path {path!r}: cannot import {module_name!r} ({error})") from None
        except Exception as error:  # the module raised while importing
            raise ValueError(f"--custom-tis-function-path {path!r}: importing {module_name!r} failed: "
                             f"{_error_line(error)}") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--custom-tis-function-path {path!r}: {name!r} is not a function of that module")
    return function
