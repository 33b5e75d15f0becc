"""The configuration: `MisConfig`, the one validated settings object, built at the boundary from a YAML file, a
mapping or a host's args; the table of its keys (`KEY_SPECS`), the YAML reader and writer, and the TIS upper bound as
a type (`upper_bound`)."""

from .settings import (ADAPTIVE_KEYS, ALIASED_BOUNDS, AUTO, DIVERGENCE_OPTIONS, GATE_STATISTICS, HOST_FLAG_KEYS,
                       HOST_OWNED_ATTRIBUTES, KEY_NAMES, KEY_SPECS, KEYS_BY_NAME, LEVELS, NORMALIZE_SCOPES,
                       PARSE_ORDER, RATIO_MAX, RATIO_MIN, TIS_MODES, TIS_POLICIES, KeySpec, MisConfig, YamlFloat,
                       YamlInt, did_you_mean, host_setting, load_yaml_file, load_yaml_mapping, preset_files,
                       render_key_table, strict_loader, yaml_value)
from .upper_bound import AdaptiveBound, FixedBound, PerLagBound, UpperBound

__all__ = ["ADAPTIVE_KEYS", "ALIASED_BOUNDS", "AUTO", "DIVERGENCE_OPTIONS", "GATE_STATISTICS", "HOST_FLAG_KEYS",
           "HOST_OWNED_ATTRIBUTES", "KEY_NAMES", "KEY_SPECS", "KEYS_BY_NAME", "LEVELS", "NORMALIZE_SCOPES",
           "PARSE_ORDER", "RATIO_MAX", "RATIO_MIN", "TIS_MODES", "TIS_POLICIES", "AdaptiveBound", "FixedBound",
           "KeySpec", "MisConfig", "PerLagBound", "UpperBound", "YamlFloat", "YamlInt", "did_you_mean", "host_setting",
           "load_yaml_file", "load_yaml_mapping", "preset_files", "render_key_table", "strict_loader", "yaml_value"]
