"""The config's keys: `KEY_SPECS`, the table of every key (its kind, default, what it accepts, one line of meaning),
and the parsers that check and normalise each kind of value. The table declares MisConfig's fields and drives their
checks, the did-you-mean suggestions and the key table of docs/config.md (`render_key_table`). Key names and meanings
follow miles' ``mis.yaml``. Every error is a ``ValueError`` that names the key, the bad value and what is allowed."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..tensors import backend as _backend
from .yaml_io import yaml_value

LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "clip", "mask", "icepop")
NORMALIZE_SCOPES = ("micro_batch", "dp")
SCORE_CENTERING_WEIGHTINGS = ("none", "tis", "mis")  # f of score centering (miles' --score-centering-is)
TIS_POLICIES = ("old", "current")  # the policy the weights compare with π_rollout: π_old or π_θ
AUTO = "auto"  # tis_upper_bound: auto (miles_mis.correction.adaptive)
# what rs_batch_gate may test (miles_mis.correction.gate computes them)
GATE_STATISTICS = ("k3", "kl", "max_abs_log_ratio")
# Divergence rejection options: "<aggregation>_<estimator>". k1 takes a [lower, upper] range on the ratio,
# k2 and k3 an upper bound on the statistic.
DIVERGENCE_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
                      # in probability space (DPPO, KPop): tv = p_train − p_rollout takes a range [−α, β];
                      # atv = |p_train − p_rollout| and bkl = KL(Bern(p_rollout) ‖ Bern(p_train)) an upper bound
                      "token_tv", "seq_mean_tv", "token_atv", "seq_mean_atv", "seq_max_atv",
                      "token_bkl", "seq_sum_bkl", "seq_mean_bkl", "seq_max_bkl",
                      # directional (DPPO's token rule, VACO's sequence rule; they read the host's advantages): a
                      # token is rejected only when its update, sign(A_t), moves p_train further from p_rollout
                      "token_dtv", "token_dbkl", "seq_mean_datv", "seq_mean_dbkl")
# Ratios are exp(clamp(log ratio, ±20)): a bound outside [e^-20, e^20] could never act, so it is refused.
RATIO_MIN, RATIO_MAX = math.exp(-20.0), math.exp(20.0)

# Attributes a miles/slime host owns that start with the prefixes we police on a Namespace;
# they belong to the host's built-in vanilla TIS, not to us.
HOST_OWNED_ATTRIBUTES = frozenset({"tis_clip", "tis_clip_low"})
# Host flags a --custom-config-path YAML may also set (the host applies them; MisConfig ignores them).
HOST_FLAG_KEYS = frozenset({"use_rollout_logprobs", "get_mismatch_metrics", "custom_tis_function_path", "tis_clip",
                            "tis_clip_low", "eps_clip", "eps_clip_high", "eps_clip_c", "calculate_per_token_loss",
                            "loss_denominator", "loss_type", "use_opsm", "opsm_delta", "qkv_format",
                            "pass_current_log_probs"})


# ---------------------------------------------------------------------- key specifications
@dataclass(frozen=True)
class KeySpec:
    """One config key: its name, kind, default, what it accepts and one line saying what it does (``doc``).

    The kind says what the key accepts and how `parse` reads it (null only where the default is null):

    - ``bool``: true or false; ``choice``: one of ``choices``;
    - ``fraction``: a number in (0, ``maximum``), or (0, ``maximum``] with ``includes_maximum``; a larger number is
      the error ``too_large``, a format string of ``key``, ``value`` (as given) and ``number`` (as read);
    - ``range``: a ratio range "L_U" or [L, U], 0 < L < U;
    - ``mapping``: a mapping from one of ``choices`` to a threshold (read by its dedicated ``parser``);
    - ``bound``: a ratio bound, a number > 0 (or one of ``choices``); the bounds default to one another, so they
      are resolved together after the other keys (`_resolve_fixed_bounds`, `_resolve_adaptive_bounds`).

    ``parser`` replaces the kind's parser; ``allowed`` and ``shown_default`` replace what the docs' key table
    derives from the kind and the default.
    """

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    maximum: float | None = None
    includes_maximum: bool = False
    too_large: str = ""
    parser: Callable[[KeySpec, Any], Any] | None = None
    allowed: str = ""
    shown_default: str = ""

    def parse(self, value: Any) -> Any:
        """``value`` checked and normalised, or a ``ValueError`` naming the key, the value and what is allowed."""
        return (self.parser or _KIND_PARSERS[self.kind])(self, value)

    @property
    def annotation(self) -> str:
        """The field's type, as MisConfig declares it."""
        if self.kind == "bool":
            return "bool"
        if self.kind == "choice":
            return "str"
        if self.kind in ("fraction", "bound") and not self.choices:
            return "float | None" if self.default is None else "float"
        return "Any"  # a number or a word, a range, a mapping

    def table_row(self) -> str:
        """This key's row of the docs' key table: key | type / allowed | default | meaning."""
        return f"| `{self.name}` | {self.allowed or self._derived_allowed()} | " \
               f"{self.shown_default or yaml_value(self.default)} | {self.doc} |"

    def _derived_allowed(self) -> str:
        null = "null or " if self.default is None else ""
        if self.kind == "bool":
            return "bool"
        if self.kind == "choice":
            return ", ".join(self.choices)
        if self.kind == "fraction":
            return f"{null}number in (0, {self.maximum:g}{']' if self.includes_maximum else ')'}"
        if self.kind == "bound":
            return f"{null}number > 0" + "".join(f", or {word}" for word in self.choices)
        if self.kind == "range":
            return f'{null}"L_U" or [L, U]'
        return f"{null}mapping of {', '.join(self.choices)} → threshold"


# ---------------------------------------------------------------------- parsers of the kinds and of special keys
def shown_value(value: Any) -> str:
    """A value as an error shows it: repr, but as the user wrote it in YAML where that differs (null for None,
    0.5_3 for the number YAML 1.1 reads from it)."""
    return "null" if value is None else getattr(value, "yaml_text", None) or repr(value)


def did_you_mean(name: str, candidates: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _as_bool(spec: KeySpec, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{spec.name}={value!r} is invalid: allowed values are true or false")


def _as_choice(spec: KeySpec, value: Any) -> str:
    if isinstance(value, str) and value in spec.choices:
        return value
    hint = did_you_mean(str(value), spec.choices) if isinstance(value, str) else ""
    raise ValueError(f"{spec.name}={value!r} is invalid{hint}: allowed values are {', '.join(spec.choices)}")


def as_positive(key: str, value: Any, *, default: float | None = None, required: bool = False) -> float | None:
    """A finite positive float; YAML 1.1 reads ``1e-4`` as the string "1e-4", so numeric strings are accepted."""
    if value is None:
        if required:
            raise ValueError(f"{key} is required (got null): allowed values are positive numbers")
        return default
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"{key}={value!r} is invalid: allowed values are finite positive numbers")
    return number


def _as_fraction(spec: KeySpec, value: Any) -> float | None:
    number = as_positive(spec.name, value, required=spec.default is not None)
    if number is not None and (number > spec.maximum if spec.includes_maximum else number >= spec.maximum):
        raise ValueError(spec.too_large.format(key=spec.name, value=value, number=number))
    return number


def _as_range(key: str, value: Any) -> tuple[float, float]:
    """A ratio range written "L_U" (verl) or [L, U]; 0 < L < U."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        text = getattr(value, "yaml_text", None)
        if text is not None:  # YAML 1.1 read an unquoted L_U as one number: underscores are digit separators
            parts = text.split("_")
            listed = f"[{parts[0]}, {parts[1]}]" if len(parts) == 2 else "[L, U]"
            raise ValueError(f"{key}: {text} is invalid: YAML reads an unquoted {text} as the number {value!r} "
                             f"(underscores are digit separators); quote it (\"{text}\") or write {listed}")
        raise ValueError(f"{key}={value!r} is invalid: a range is two numbers, \"L_U\" (quoted in YAML: unquoted, "
                         "0.5_2 is the number 0.52) or [L, U] with 0 < L < U")
    parts = value.split("_") if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        raise ValueError(f"{key}={value!r} is invalid: allowed values are a ratio range \"L_U\" (e.g. \"0.5_2.0\") "
                         "or [L, U] with 0 < L < U")
    lower = as_positive(f"{key} lower", parts[0], required=True)
    upper = as_positive(f"{key} upper", parts[1], required=True)
    check_order(f"{key} lower", lower, f"{key} upper", upper)
    return lower, upper


def _as_tv_range(key: str, value: Any) -> tuple[float, float]:
    """A range [−α, β] of p_train − p_rollout (prime-rl's DPPO mask): −1 ≤ −α < 0 < β ≤ 1, as [L, U] or "L_U"."""
    parts = value.split("_") if isinstance(value, str) else value
    numbers_ = []
    if isinstance(parts, (list, tuple)) and len(parts) == 2:
        for part in parts:
            try:
                number = float(part.strip() if isinstance(part, str) else part)
            except (TypeError, ValueError):
                break
            if isinstance(part, bool) or not math.isfinite(number):
                break
            numbers_.append(number)
    if len(numbers_) != 2 or not -1.0 <= numbers_[0] < 0.0 < numbers_[1] <= 1.0:
        raise ValueError(f"{key}={shown_value(value)} is invalid: a tv option takes the range [−α, β] of p_train − "
                         "p_rollout, e.g. [-0.2, 0.2], with −1 ≤ −α < 0 < β ≤ 1")
    return numbers_[0], numbers_[1]


def _as_optional_range(spec: KeySpec, value: Any) -> tuple[float, float] | None:
    return None if value is None and spec.default is None else _as_range(spec.name, value)


def _as_search_range(spec: KeySpec, value: Any) -> tuple[float, float]:
    """The adaptive bound's search range: a ratio range whose lower end is at least 1."""
    bounds = _as_range(spec.name, value)
    if bounds[0] < 1.0:
        raise ValueError(f"{spec.name}={list(bounds)!r} is invalid: a truncation bound below 1 truncates on-policy "
                         f"tokens (ratio 1); allowed values are [L, U] with 1 <= L < U <= {RATIO_MAX:.3g}")
    return bounds


def _as_divergence(spec: KeySpec, value: Any) -> tuple[tuple[str, float | None, float], ...]:
    """rs_divergence as ((option, lower or None, upper), ...) in ``spec.choices`` order: k1 options take a ratio
    range, k2/k3 options an upper bound (lower None)."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(v, tuple) and len(v) == 3 for v in value):
        value = {option: (upper if lower is None else [lower, upper]) for option, lower, upper in value}

    def check(option: str, threshold: Any) -> tuple[str, float | None, float]:
        key = f"{spec.name}.{option}"
        if option.endswith("_k1"):
            return (option, *_as_range(key, threshold))
        if option.endswith(("_tv", "_dtv")):
            return (option, *_as_tv_range(key, threshold))
        if isinstance(threshold, (list, tuple)) or (isinstance(threshold, str) and "_" in threshold):
            raise ValueError(f"{key}={threshold!r} is invalid: k2/k3/atv/bkl options take one upper bound on the "
                             "statistic (a positive number), k1 options a ratio range, tv options a range [−α, β]")
        upper = as_positive(key, threshold, required=True)
        if option.endswith(("_atv", "_datv")) and upper >= 1.0:
            raise ValueError(f"{key}={threshold!r} is invalid: |p_train − p_rollout| is at most 1, so a bound ≥ 1 "
                             "rejects nothing; allowed values are in (0, 1)")
        return option, None, upper

    return _named_mapping(spec, value, "option", check,
                          "a mapping from option to threshold, e.g. {seq_mean_k1: [0.999, 1.001], seq_max_k3: 0.5}")


def _as_gate(spec: KeySpec, value: Any) -> tuple[tuple[str, float], ...]:
    """rs_batch_gate as ((statistic, threshold), ...) in ``spec.choices`` (gate.STATISTICS) order."""
    if value is None or value == () or value == {}:  # off ({} as YAML writes an empty mapping)
        return ()
    if isinstance(value, tuple) and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        value = dict(value)

    def check(name: str, threshold: Any) -> tuple[str, float]:
        return name, as_positive(f"{spec.name}.{name}", threshold, required=True)

    return _named_mapping(spec, value, "statistic", check, f"a mapping from statistic ({', '.join(spec.choices)}) "
                                                           "to a threshold, e.g. {k3: 0.05}")


def _named_mapping(spec: KeySpec, value: Any, what: str, check, shape: str) -> tuple:
    """A mapping name -> setting, validated: every name one of ``spec.choices`` (did-you-mean otherwise), each entry
    ``check(name, setting)``; returned as a tuple of the checked entries in ``spec.choices`` order."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{spec.name}={value!r} is invalid: allowed values are null or {shape}")
    out = {}
    for name, setting in value.items():
        if name not in spec.choices:
            raise ValueError(f"{spec.name}: unknown {what} {name!r}{did_you_mean(str(name), spec.choices)}; "
                             f"allowed {what}s: {', '.join(spec.choices)}")
        out[name] = check(name, setting)
    return tuple(out[name] for name in spec.choices if name in out)


def check_order(lower_key: str, lower: float, upper_key: str, upper: float, note: str = "") -> None:
    for key, value in ((lower_key, lower), (upper_key, upper)):
        if not RATIO_MIN <= value <= RATIO_MAX:
            raise ValueError(f"{key}={value!r} is invalid: ratios are clamped to [e^-20, e^20], so allowed values "
                             f"are in [{RATIO_MIN:.3g}, {RATIO_MAX:.3g}] (a bound outside could never act)")
    if not lower < upper:
        raise ValueError(f"{lower_key}={lower!r} must be smaller than {upper_key}={upper!r}{note}: "
                         "allowed values are 0 < lower < upper")


def _as_lag_bounds(spec: KeySpec, value: Any) -> tuple[float, ...] | None:
    """tis_upper_bound_by_lag: [U_0, U_1, ...], each a ratio bound > 0 within [e^-20, e^20], non-increasing (a
    bound that tightens as the sample gets staler)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{spec.name}={shown_value(value)} is invalid: allowed values are null or a non-empty list of "
                         "upper bounds [U_0, U_1, ...], one per lag (the last for every larger lag), non-increasing")
    bounds = tuple(as_positive(f"{spec.name}[{lag}]", bound, required=True) for lag, bound in enumerate(value))
    for lag, bound in enumerate(bounds):
        if not RATIO_MIN <= bound <= RATIO_MAX:
            raise ValueError(f"{spec.name}[{lag}]={bound!r} is invalid: ratios are clamped to [e^-20, e^20], so "
                             f"allowed values are in [{RATIO_MIN:.3g}, {RATIO_MAX:.3g}]")
    rising = next((lag for lag in range(1, len(bounds)) if bounds[lag] > bounds[lag - 1]), None)
    if rising is not None:
        raise ValueError(f"{spec.name}: [{rising}]={bounds[rising]!r} is larger than [{rising - 1}]="
                         f"{bounds[rising - 1]!r}: the bound must not loosen as a sample gets staler (allowed: a "
                         "non-increasing list)")
    return bounds


def _as_max_lag(spec: KeySpec, value: Any) -> int | None:
    """rs_max_lag: null or an integer >= 0 (a YAML int, or a numeric string as YAML 1.1 may leave it)."""
    if value is None:
        return None
    number = value
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise ValueError(f"{spec.name}={shown_value(value)} is invalid: allowed values are null (off) or an integer "
                         ">= 0, the largest lag (weight versions behind the trainer) a sequence may have")
    return int(number)


def _as_backend(spec: KeySpec, value: Any) -> str:
    """A kernel backend; null takes ``MILES_MIS_BACKEND`` (checked like the key, its error naming the variable),
    else eager."""
    if value is not None:
        return _as_choice(spec, value)
    value = _backend.environment_default()
    if value is None:
        return "eager"
    if value not in spec.choices:
        raise ValueError(f"{_backend.ENVIRONMENT}={value!r} is invalid: allowed values are {', '.join(spec.choices)}")
    return value


def _as_optional_positive(spec: KeySpec, value: Any) -> float | None:
    return as_positive(spec.name, value, default=None)


_KIND_PARSERS = {"bool": _as_bool, "choice": _as_choice, "fraction": _as_fraction, "range": _as_optional_range}

# ---------------------------------------------------------------------- the key table
KEY_SPECS = (
    KeySpec("use_tis", "bool", False, "apply the correction; false = metrics-only",
            shown_default="the host's `--use-tis` flag"),
    KeySpec("use_rs", "bool", False, "rejection sampling at `rs_level`: reject what leaves [`rs_lower_bound`, "
                                     "`rs_upper_bound`]"),
    KeySpec("tis_level", "choice", "token", "level of the IS weight ([math](math.md#levels-level_log_ratio))",
            choices=LEVELS),
    KeySpec("rs_level", "choice", "token", "level of the RS test", choices=LEVELS),
    KeySpec("tis_mode", "choice", "truncate", "how the weight is bounded ([math](math.md#is-modes-bound_weights))",
            choices=TIS_MODES),
    KeySpec("tis_lower_bound", "bound", None, "L (unused by truncate; with `tis_upper_bound: auto` it stays unset)",
            shown_default="1 / `tis_upper_bound`"),
    KeySpec("tis_upper_bound", "bound", 2.0, "U; `auto` (tis_mode truncate): chosen per call, the largest bound in "
            "`tis_auto_bounds` whose truncated weights keep the ESS ≥ `tis_auto_target_ess` "
            "([math](math.md#the-adaptive-bound-miles_miscorrectionadaptivepy)); with `use_rs`, set the rs bounds "
            "explicitly",
            choices=(AUTO,)),
    KeySpec("rs_lower_bound", "bound", None, "the RS test's lower bound", shown_default="`tis_lower_bound`"),
    KeySpec("rs_upper_bound", "bound", None, "the RS test's upper bound", shown_default="`tis_upper_bound`"),
    KeySpec("rs_veto_threshold", "fraction", None, "reject a sequence holding a token with ρ < threshold; null = off",
            maximum=1.0, too_large="{key}={number!r} is invalid: it is a probability ratio below which a token is "
            "catastrophic; allowed values are null (off) or a number in (0, 1), typically 1e-4 to 1e-6"),
    KeySpec("tis_batch_normalize", "bool", False, "divide the weights by their mean over what is trained"),
    KeySpec("tis_batch_normalize_scope", "choice", "micro_batch", "the mean of this micro-batch (as miles), or over "
            "the current micro-batch of every data-parallel rank (one more all-reduce per call; "
            "[cp.md](cp.md#batch-normalisation-scope))", choices=NORMALIZE_SCOPES),
    KeySpec("tis_bounds", "range", None, "sets `tis_lower_bound` and `tis_upper_bound` at once (verl's IcePop "
            "spelling); not together with either of them"),
    KeySpec("rs_divergence", "mapping", None, "rejection by divergence statistics "
            "([math](math.md#rejection-by-divergence-statistics-miles_miscorrectiondivergencepy)): k1 options take a "
            "ratio range \"L_U\" or [L, U], k2/k3/atv/bkl options an upper bound, tv options a range [−α, β] of "
            "p_train − p_rollout; all ANDed. The directional ones (dtv, dbkl, datv) need the host's `advantages` "
            "([math](math.md#directional-trust-regions-dppo-vaco))", choices=DIVERGENCE_OPTIONS,
            parser=_as_divergence),
    KeySpec("rs_batch_gate", "mapping", None,
            "the batch gate ([math](math.md#the-batch-gate-miles_miscorrectiongatepy)): "
            "statistics of the whole micro-batch (every CP rank's tokens); when any exceeds its threshold, every "
            "weight and mask of the micro-batch is 0, `mis_batch_gated` is 1 and a warning is logged (logger "
            "`miles_mis`). E.g. `{k3: 0.05}`", choices=GATE_STATISTICS, parser=_as_gate),
    KeySpec("rs_batch_gate_scope", "choice", "micro_batch", "the gate's statistics over this micro-batch, or over "
            "the current micro-batch of every data-parallel rank (one more DP exchange per call)",
            choices=NORMALIZE_SCOPES),
    KeySpec("metrics_low_prob_threshold", "fraction", 0.1, "θ of `mis_k3_low_rollout_prob`: tokens the engine "
            "sampled with probability below θ", maximum=1.0,
            too_large="{key}={value!r} is invalid: allowed values are probabilities in (0, 1)"),
    KeySpec("tis_auto_target_ess", "fraction", 0.9, "the ESS the adaptive bound keeps (only with "
            "`tis_upper_bound: auto`)", maximum=1.0, includes_maximum=True,
            too_large="{key}={value!r} is invalid: an ESS fraction; allowed values are in (0, 1]"),
    KeySpec("tis_auto_bounds", "range", (1.2, 20.0), "the adaptive bound's search range (64 geometric candidates; "
            "only with `tis_upper_bound: auto`)", parser=_as_search_range,
            allowed="\"L_U\" or [L, U], 1 ≤ L < U ≤ e²⁰"),
    KeySpec("tis_auto_scope", "choice", "micro_batch", "the adaptive bound over this micro-batch (every CP rank's "
            "tokens) or over the current micro-batch of every data-parallel rank (one more fixed-size DP exchange "
            "per call; only with `tis_upper_bound: auto`)", choices=NORMALIZE_SCOPES),
    KeySpec("tis_policy", "choice", "old", "the policy the weights compare with π_rollout: `old` = the host's "
            "`train_log_probs` (π_old), `current` = the current policy π_θ the host passes as `cur_log_probs` or "
            "`current_log_probs` (detached); every stage and metric then reads π_θ/π_rollout "
            "([algorithms](algorithms.md#the-current-policy-in-the-weights-tis_policy-current))",
            choices=TIS_POLICIES),
    KeySpec("tis_upper_bound_by_lag", "list", None, "per-lag upper bounds [U_0, U_1, …], each ≤ `tis_upper_bound`: "
            "a sequence `lag` weight versions behind is bounded at U_min(lag, last) instead (the lower bound, where "
            "the mode has one, stays `tis_lower_bound`); with `use_tis`, needs the host's lags "
            "([staleness](staleness.md#lag-aware-bounds-and-the-staleness-gate))",
            parser=_as_lag_bounds, allowed="null or a non-increasing list of numbers > 0"),
    KeySpec("rs_max_lag", "count", None, "reject the sequences more than this many weight versions behind the "
            "trainer (a fixed drop, as miles' `--max-weight-staleness`); with `rs_max_lag_k3`, only the lags whose "
            "measured mismatch is high; with `use_tis`, needs the host's lags; null = off", parser=_as_max_lag,
            allowed="null or an integer ≥ 0"),
    KeySpec("rs_max_lag_k3", "fraction", None, "the staleness gate: with `rs_max_lag`, the sequences of a lag "
            "beyond it are rejected only when that lag's k3 over the micro-batch exceeds this; null = always "
            "(the fixed drop)", maximum=math.inf, parser=_as_optional_positive, allowed="null or a number > 0"),
    KeySpec("kernel_backend", "choice", None, "how the core's per-token kernels run: `compiled` = through "
            "torch.compile (inductor), eager without a working compiler (one warning line); null = the environment "
            "variable `MILES_MIS_BACKEND`, else eager ([performance](performance.md#the-compiled-backend))",
            choices=_backend.BACKENDS, parser=_as_backend, allowed="null, eager, compiled",
            shown_default="`MILES_MIS_BACKEND`, else eager"),
    KeySpec("score_centering", "bool", False, "score centering ([score centering](score_centering.md)): the "
            "loss subtracts the expected score under the engine, from its recorded top-K candidates; runs only "
            "in the `custom_loss` adapters (`miles_mis.hosts.miles_loss.policy_loss`, `...slime_loss.policy_loss`), "
            "which need the logits; the hook refuses it"),
    KeySpec("score_centering_is", "choice", "none", "f, the importance weighting score centering composes with: "
            "`none` f ≡ 1, `tis` min(r, `score_centering_tis_clip`), `mis` r inside [`score_centering_mis_low`, "
            "`score_centering_mis_high`], 0 outside (miles' `--score-centering-is`)",
            choices=SCORE_CENTERING_WEIGHTINGS),
    KeySpec("score_centering_tis_clip", "fraction", 2.0, "c of `score_centering_is: tis`", maximum=math.inf,
            allowed="number > 0"),
    KeySpec("score_centering_mis_low", "fraction", 0.5, "lo of `score_centering_is: mis`", maximum=math.inf,
            allowed="number > 0, ≤ `score_centering_mis_high`"),
    KeySpec("score_centering_mis_high", "fraction", 5.0, "hi of `score_centering_is: mis`", maximum=math.inf,
            allowed="number > 0"),
)
KEY_NAMES = tuple(spec.name for spec in KEY_SPECS)
KEYS_BY_NAME = {spec.name: spec for spec in KEY_SPECS}
# The order the keys are parsed in, so that of several bad values the same one is reported: every key but the
# bounds, which are resolved together afterwards.
PARSE_ORDER = ("use_tis", "use_rs", "tis_batch_normalize", "tis_level", "rs_level", "tis_mode",
               "tis_batch_normalize_scope", "tis_bounds", "rs_divergence", "rs_batch_gate", "rs_batch_gate_scope",
               "metrics_low_prob_threshold", "rs_veto_threshold", "tis_auto_target_ess", "tis_auto_bounds",
               "tis_auto_scope", "tis_policy", "tis_upper_bound_by_lag", "rs_max_lag", "rs_max_lag_k3",
               "kernel_backend", "score_centering", "score_centering_is", "score_centering_tis_clip",
               "score_centering_mis_low", "score_centering_mis_high")
# The bounds tis_bounds sets: giving one of them with tis_bounds is an error, even at its default's value.
ALIASED_BOUNDS = ("tis_lower_bound", "tis_upper_bound")
ADAPTIVE_KEYS = tuple(name for name in KEY_NAMES if name.startswith("tis_auto_"))


def render_key_table() -> str:
    """The markdown key table of docs/config.md, one row per `KEY_SPECS` entry."""
    return "\n".join(["| key | type / allowed | default | meaning |", "|---|---|---|---|",
                      *(spec.table_row() for spec in KEY_SPECS)])


