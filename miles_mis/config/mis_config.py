"""`MisConfig`: the one validated configuration object of miles_mis.

It is built once at the boundary, from a YAML file (`MisConfig.from_yaml`), a mapping
(`MisConfig.from_dict`) or what a host passes as ``args`` (`MisConfig.from_args`: its argparse Namespace,
or a mapping read as `from_dict` reads it), and everything below the entry points' reader (`inputs.host_call`) reads
only this frozen dataclass. Every constructor ends in the same ``MisConfig(**keys)``, so they give the same answers.

Key names and meanings follow miles' ``mis.yaml``. `KEY_SPECS` is the table of the keys: it declares
MisConfig's fields and drives their checks, the did-you-mean suggestions and the key table of docs/config.md
(`render_key_table`). Every error is a ``ValueError`` that names the key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import upper_bound
from .keys import (ADAPTIVE_KEYS, ALIASED_BOUNDS, AUTO, HOST_FLAG_KEYS, HOST_OWNED_ATTRIBUTES, KEY_NAMES, KEY_SPECS,
                   KEYS_BY_NAME, PARSE_ORDER, RATIO_MAX, as_positive, check_order, did_you_mean, shown_value)
from .yaml_io import load_yaml_mapping


class _Unset:
    """The default of a tis bound that was not given, told apart from the same value given explicitly:
    ``tis_bounds`` with an explicit ``tis_upper_bound: 2.0`` (the default's value) is still two settings of one
    bound. ``MisConfig.__post_init__`` replaces it by ``value``; the repr is the value's (help, signatures)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _key_fields(cls: type) -> type:
    """Declare one field per `KEY_SPECS` entry on ``cls``, in table order, for ``@dataclass`` to read."""
    cls.__annotations__ = {spec.name: spec.annotation for spec in KEY_SPECS}
    for spec in KEY_SPECS:
        setattr(cls, spec.name, _Unset(spec.default) if spec.name in ALIASED_BOUNDS else spec.default)
    return cls


@dataclass(frozen=True)
@_key_fields
class MisConfig:
    """Effective correction settings (defaults already resolved): one field per `KEY_SPECS` entry, in that order.

    Stored forms: tis_lower_bound defaults to 1 / tis_upper_bound (None with ``tis_upper_bound: auto``), the rs
    bounds to the tis bounds; tis_bounds is an input alias only (None once it has set the tis bounds);
    rs_divergence is a tuple of (option, lower, upper) in DIVERGENCE_OPTIONS order (lower None for k2/k3),
    rs_batch_gate a tuple of (statistic, threshold) in gate.STATISTICS order, tis_auto_bounds a tuple (L, U).
    """

    @property
    def adaptive_bound(self) -> bool:
        """The TIS upper bound is chosen per call (``tis_upper_bound: auto``)."""
        return self.upper_bound.adaptive

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in KEY_NAMES}
        _resolve_unset_bounds(values)
        for name in PARSE_ORDER:
            values[name] = KEYS_BY_NAME[name].parse(values[name])
        if values["tis_bounds"] is not None:  # an input alias only: the bounds carry the values
            values["tis_lower_bound"], values["tis_upper_bound"] = values["tis_bounds"]
            values["tis_bounds"] = None
        if values["tis_upper_bound"] == AUTO:
            _resolve_adaptive_bounds(values)
        else:
            _resolve_fixed_bounds(values)
        _check_lag_keys(values)
        if values["score_centering_mis_low"] > values["score_centering_mis_high"]:
            raise ValueError(f"score_centering_mis_low={values['score_centering_mis_low']!r} is larger than "
                             f"score_centering_mis_high={values['score_centering_mis_high']!r}: allowed values are "
                             "0 < low <= high")
        for name, value in values.items():
            object.__setattr__(self, name, value)  # frozen
        # the TIS upper bound's shape, resolved once (not a key: derived from tis_upper_bound and its companions)
        object.__setattr__(self, "upper_bound", upper_bound.resolve(
            values["tis_upper_bound"], values["tis_upper_bound_by_lag"], values["tis_auto_bounds"],
            values["tis_auto_target_ess"], values["tis_auto_scope"]))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return KEY_NAMES

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> "MisConfig":
        """Build from a mapping; an unknown key is an error with a did-you-mean suggestion, a host flag key
        (:data:`HOST_FLAG_KEYS`) is left to the host. Errors start with ``SOURCE: ``."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{source}: expected a mapping of config keys, got {type(values).__name__}")
        values = {key: value for key, value in values.items() if key not in HOST_FLAG_KEYS}
        for key in values:
            if key not in cls.keys():
                known = cls.keys() + tuple(sorted(HOST_FLAG_KEYS))
                raise ValueError(f"{source}: unknown key {key!r}{did_you_mean(str(key), known)}; "
                                 f"allowed keys: {', '.join(cls.keys())} (and the host flags "
                                 f"{', '.join(sorted(HOST_FLAG_KEYS))})")
        return cls._build(values, source)

    @classmethod
    def _build(cls, values: Mapping[str, Any], source: str | None) -> "MisConfig":
        """``cls(**values)`` (known keys only), its error prefixed with ``SOURCE: `` when a source is named: the
        one place every constructor checks the values, so that a mapping, a file and a Namespace agree."""
        try:
            return cls(**dict(values))
        except ValueError as error:
            if source is None:
                raise
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "MisConfig":
        """Build from a YAML file (the file miles passes with ``--custom-config-path``), read by
        :func:`load_yaml_mapping`: every error is one ``ValueError`` line naming the file."""
        return cls.from_dict(load_yaml_mapping(path), source=str(path))

    @classmethod
    def from_args(cls, args: Any) -> "MisConfig":
        """Build from what a host passes as ``args``: its argparse Namespace (YAML keys already set on it as
        attributes), a ``MisConfig`` (returned as is), or a mapping of config keys (read as :meth:`from_dict`
        reads it: an unknown key is an error, since a dict carries no host flags of its own).

        On a Namespace the attributes that are config keys are the mapping (a missing one takes its default)
        and every other attribute is the host's, except one starting with ``tis_`` or ``rs_`` that is neither a
        key nor a host-owned flag such as ``tis_clip``: an error, as it is almost always a typo in the YAML file
        that would otherwise be silently ignored. Anything else (None, a list, a string, a number) is an error:
        it would otherwise read as an empty Namespace, all defaults, and run metrics-only silently.
        """
        if isinstance(args, MisConfig):
            return args
        if isinstance(args, Mapping):
            return cls.from_dict(args)
        if not hasattr(args, "__dict__"):
            shown = reprlib.repr(args)
            kind = "" if args is None else f" ({type(args).__name__})"
            raise ValueError(f"args: {shown}{kind} is invalid: allowed values are a host Namespace "
                             "(argparse.Namespace, SimpleNamespace), a MisConfig, or a mapping of config keys")
        attributes = vars(args)
        for name in attributes:
            if (isinstance(name, str) and name.startswith(("tis_", "rs_")) and name not in cls.keys()
                    and name not in HOST_OWNED_ATTRIBUTES):
                raise ValueError(f"args: unknown attribute {name!r}{did_you_mean(name, cls.keys())}; "
                                 f"allowed tis_*/rs_* keys: "
                                 f"{', '.join(k for k in cls.keys() if k.startswith(('tis_', 'rs_')))}")
        # unprefixed errors: the host names where the values came from (its config file, --mis-set)
        return cls._build({key: attributes[key] for key in cls.keys() if key in attributes}, None)

    @classmethod
    def preset(cls, name: str, use_tis: bool | None = None) -> "MisConfig":
        """A named preset: configs/<name>.yaml (shipped in the package as miles_mis.configs).

        Like the files, presets leave ``use_tis`` to the host's --use-tis flag (False here) unless they set
        it; pass ``use_tis=True`` to use one directly (a preset that sets use_tis keeps its own value).
        """
        files = preset_files()
        if name not in files:
            raise ValueError(f"unknown preset {name!r}{did_you_mean(name, tuple(files))}; allowed presets: "
                             f"{', '.join(sorted(files))}")
        values = load_yaml_mapping(files[name])
        if use_tis is not None and "use_tis" not in values:
            values["use_tis"] = use_tis
        return cls.from_dict(values, source=str(files[name]))

    def to_dict(self) -> dict[str, Any]:
        """Keys and values as a YAML file would hold them (rs_divergence as an option -> threshold mapping)."""
        out = dataclasses.asdict(self)
        out["rs_divergence"] = {option: (upper if lower is None else [lower, upper])
                                for option, lower, upper in self.rs_divergence} or None
        out["rs_batch_gate"] = dict(self.rs_batch_gate) or None
        out["tis_auto_bounds"] = list(self.tis_auto_bounds)
        out["tis_upper_bound_by_lag"] = (None if self.tis_upper_bound_by_lag is None
                                         else list(self.tis_upper_bound_by_lag))
        return out


# ---------------------------------------------------------------------- the bounds, resolved together
def _resolve_unset_bounds(values: dict[str, Any]) -> None:
    """Refuse ``tis_bounds`` with either tis bound given, whatever the bound's value (an explicit
    ``tis_upper_bound: 2.0`` or ``tis_lower_bound: null`` too: the alias would silently replace it), then
    resolve the bounds not given to their defaults."""
    given = [name for name in ALIASED_BOUNDS if not isinstance(values[name], _Unset)]
    if values["tis_bounds"] is not None and given:
        shown = " and ".join(f"{name}={shown_value(values[name])}" for name in given)
        raise ValueError(f"tis_bounds={shown_value(values['tis_bounds'])} is given with {shown}: tis_bounds sets "
                         "tis_lower_bound and tis_upper_bound, so give either tis_bounds or the two bounds, "
                         "not both")
    for name in ALIASED_BOUNDS:
        if isinstance(values[name], _Unset):
            values[name] = values[name].value


def _resolve_adaptive_bounds(values: dict[str, Any]) -> None:
    """The bounds with ``tis_upper_bound: auto``: no default lower bound, and explicit rs bounds with use_rs."""
    if values["tis_mode"] != "truncate":
        raise ValueError(f"tis_upper_bound: auto is a truncation bound: allowed only with tis_mode truncate "
                         f"(tis_mode is {values['tis_mode']!r})")
    lower = as_positive("tis_lower_bound", values["tis_lower_bound"], default=None)
    rs_upper = as_positive("rs_upper_bound", values["rs_upper_bound"], default=None)
    rs_lower = as_positive("rs_lower_bound", values["rs_lower_bound"], default=lower)
    if values["use_rs"]:
        if rs_upper is None or rs_lower is None:
            raise ValueError("with tis_upper_bound: auto and use_rs, set rs_lower_bound and rs_upper_bound (or "
                             "tis_lower_bound): unset rs bounds take the tis bounds, and the upper one changes "
                             "every call")
        check_order("rs_lower_bound", rs_lower, "rs_upper_bound", rs_upper)
    values.update(tis_lower_bound=lower, rs_upper_bound=rs_upper, rs_lower_bound=rs_lower)


def _resolve_fixed_bounds(values: dict[str, Any]) -> None:
    """The bounds with a numeric tis_upper_bound: tis_lower_bound defaults to 1 / tis_upper_bound, the rs bounds to
    the tis bounds; the tis_auto_* keys must keep their defaults (they would do nothing)."""
    upper = values["tis_upper_bound"]
    if isinstance(upper, str) and upper.strip().lower() == AUTO:
        raise ValueError(f"tis_upper_bound={upper!r} is invalid: write auto (lower case) or a number")
    changed = [name for name in ADAPTIVE_KEYS if values[name] != KEYS_BY_NAME[name].default]
    if changed:
        raise ValueError(f"{', '.join(changed)} only act with tis_upper_bound: auto (tis_upper_bound is "
                         f"{upper!r}): set tis_upper_bound: auto or remove them")
    try:
        upper = as_positive("tis_upper_bound", upper, required=True)
    except ValueError as error:
        raise ValueError(f"{error} or auto (an adaptive bound, tis_mode truncate)") from None
    lower = as_positive("tis_lower_bound", values["tis_lower_bound"], default=1.0 / upper)
    if values["tis_mode"] != "truncate":  # truncate has no lower bound: min(rho, U) with U <= 1 is fine
        check_order("tis_lower_bound", lower, "tis_upper_bound", upper)
    elif upper > RATIO_MAX:
        raise ValueError(f"tis_upper_bound={upper!r} is invalid: ratios are clamped to [e^-20, e^20], so allowed "
                         f"values are at most {RATIO_MAX:.3g} (a larger bound could never act)")
    rs_upper = as_positive("rs_upper_bound", values["rs_upper_bound"], default=upper)
    rs_lower = as_positive("rs_lower_bound", values["rs_lower_bound"], default=lower)
    if values["use_rs"]:
        both_given = values["rs_lower_bound"] is not None and values["rs_upper_bound"] is not None
        check_order("rs_lower_bound", rs_lower, "rs_upper_bound", rs_upper,
                     note="" if both_given else " (an unset rs bound takes the tis bound, and tis_lower_bound "
                                                "defaults to 1/tis_upper_bound)")
    values.update(tis_upper_bound=upper, tis_lower_bound=lower, rs_upper_bound=rs_upper, rs_lower_bound=rs_lower)


def _check_lag_keys(values: dict[str, Any]) -> None:
    """The staleness keys against the bounds: per-lag bounds tighten a numeric ``tis_upper_bound`` (none above it,
    and above ``tis_lower_bound`` where the mode has a lower bound); ``rs_max_lag_k3`` qualifies ``rs_max_lag``."""
    by_lag = values["tis_upper_bound_by_lag"]
    if by_lag is not None:
        upper = values["tis_upper_bound"]
        if upper == AUTO:
            raise ValueError("tis_upper_bound_by_lag needs a numeric tis_upper_bound (it is auto): the per-lag bounds "
                             "are fixed, the adaptive bound is chosen per call; use one of them")
        above = next((lag for lag, bound in enumerate(by_lag) if bound > upper), None)
        if above is not None:
            raise ValueError(f"tis_upper_bound_by_lag[{above}]={by_lag[above]!r} is larger than tis_upper_bound="
                             f"{upper!r}: the per-lag bounds tighten tis_upper_bound; raise tis_upper_bound or lower "
                             "the per-lag bound")
        lower = values["tis_lower_bound"]
        if values["tis_mode"] != "truncate" and not by_lag[-1] > lower:
            raise ValueError(f"tis_upper_bound_by_lag[{len(by_lag) - 1}]={by_lag[-1]!r} must be larger than "
                             f"tis_lower_bound={lower!r} (tis_mode {values['tis_mode']} bounds below too): allowed "
                             "values are 0 < lower < upper")
    if values["rs_max_lag_k3"] is not None and values["rs_max_lag"] is None:
        raise ValueError(f"rs_max_lag_k3={values['rs_max_lag_k3']!r} is set without rs_max_lag: the gate rejects the "
                         "lags beyond rs_max_lag whose k3 exceeds it; set rs_max_lag (e.g. 1)")


def host_setting(args: Any, name: str) -> Any:
    """A host setting as given: an attribute of a Namespace, or a key of a mapping used as the config."""
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def preset_files() -> dict[str, Path]:
    """name -> YAML file of every shipped preset: the source tree's configs/, else the installed copy."""
    package = Path(__file__).resolve().parents[1]  # miles_mis/
    for directory in (package / "configs", package.parent / "configs"):  # installed wheel, source tree
        files = {path.stem: path for path in sorted(directory.glob("*.yaml"))}
        if files:
            return files
    return {}


