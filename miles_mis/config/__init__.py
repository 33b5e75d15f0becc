"""The configuration: `MisConfig`, the one validated settings object built at the boundary from a YAML file, a
mapping or a host's args (`mis_config`); the table of its keys and their parsers (`keys`); the YAML writer and strict
reader (`yaml_io`); and the TIS upper bound as a type (`upper_bound`)."""

from .keys import (ADAPTIVE_KEYS, ALIASED_BOUNDS, AUTO, DIVERGENCE_OPTIONS, GATE_STATISTICS, HOST_FLAG_KEYS,
                   HOST_OWNED_ATTRIBUTES, KEY_NAMES, KEY_SPECS, KEYS_BY_NAME, LEVELS, NORMALIZE_SCOPES, PARSE_ORDER,
                   RATIO_MAX, RATIO_MIN, TIS_MODES, TIS_POLICIES, KeySpec, did_you_mean, render_key_table)
from .mis_config import MisConfig, host_setting, preset_files
from .upper_bound import AdaptiveBound, FixedBound, PerLagBound, UpperBound
from .yaml_io import YamlFloat, YamlInt, load_yaml_file, load_yaml_mapping, strict_loader, yaml_value

__all__ = ["ADAPTIVE_KEYS", "ALIASED_BOUNDS", "AUTO", "DIVERGENCE_OPTIONS", "GATE_STATISTICS", "HOST_FLAG_KEYS",
           "HOST_OWNED_ATTRIBUTES", "KEY_NAMES", "KEY_SPECS", "KEYS_BY_NAME", "LEVELS", "NORMALIZE_SCOPES",
           "PARSE_ORDER", "RATIO_MAX", "RATIO_MIN", "TIS_MODES", "TIS_POLICIES", "AdaptiveBound", "FixedBound",
           "KeySpec", "MisConfig", "PerLagBound", "UpperBound", "YamlFloat", "YamlInt", "did_you_mean", "host_setting",
           "load_yaml_file", "load_yaml_mapping", "preset_files", "render_key_table", "strict_loader", "yaml_value"]
