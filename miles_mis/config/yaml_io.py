"""The config's YAML: the one writer of config values (`yaml_value`, read back as the same value by YAML 1.1) and the
strict reader of config files (`load_yaml_mapping`: duplicate keys are errors, every error one line naming the file,
line and column)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping


def yaml_value(value: Any) -> str:
    """A config value as YAML 1.1 text that reads back as ``value``: the one writer of every config file, printout
    and docs default. Floats keep a '.' and a signed exponent (1.0e-06, not 1e-06, which YAML 1.1 reads as a
    string); lists and tuples are flow lists [L, U], mappings flow mappings {option: threshold}."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key}: {yaml_value(v)}" for key, v in value.items()) + "}"
    if isinstance(value, float):
        return _yaml_float(value)
    return str(value)


def _yaml_float(value: float) -> str:
    text = repr(float(value))  # shortest round-trip spelling: '2.0', '0.0001', '1e-06', '4.85e+08'
    if "e" in text:
        mantissa, exponent = text.split("e")
        if "." not in mantissa:
            mantissa += ".0"
        text = f"{mantissa}e{'' if exponent[0] in '+-' else '+'}{exponent}"
    return text


# ---------------------------------------------------------------------- YAML files
def load_yaml_file(path: str | Path) -> Any:
    """The one YAML reader of miles_mis (``MisConfig.from_yaml``, presets, the host's
    ``--custom-config-path``, ``miles-mis check-config``): ``yaml.safe_load`` semantics (YAML 1.1, so
    ``1e-4`` is a string), plus

    - every error is a one-line ``ValueError``: ``FILE:LINE:COLUMN: message`` for a syntax error,
      ``FILE: cannot read the file (...)`` for a missing or unreadable one;
    - a key given twice in one mapping is an error (PyYAML silently keeps the last one);
    - a number written with underscores (YAML 1.1 digit separators: ``0.5_2`` is the number 0.52) keeps
      its source text, so that a range written unquoted can be reported as the user wrote it.
    """
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{path}: cannot read the file ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: cannot read the file (not UTF-8 text: {error.reason} at byte "
                         f"{error.start})") from None
    try:
        return yaml.load(text, Loader=strict_loader())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        message = error.problem or error.context or "invalid YAML"
        if error.problem and error.context:
            started = (f" started at line {error.context_mark.line + 1}"
                       if error.context_mark is not None and error.context_mark.line != mark.line else "")
            message += f" ({error.context}{started})"
        raise ValueError(f"{where}: {' '.join(message.split())}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: {' '.join(str(error).split())}") from None


def load_yaml_mapping(path: str | Path) -> dict:
    """:func:`load_yaml_file` for a config file: a mapping of keys (an empty file is ``{}``)."""
    values = load_yaml_file(path)
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return dict(values)


class YamlFloat(float):
    """A float YAML read from text that is not its own spelling (``0.5_2`` -> 0.52); ``yaml_text`` is that text."""

    yaml_text: str


class YamlInt(int):
    """An int YAML read from text that is not its own spelling (``1_3`` -> 13, ``010`` -> 8, ``0x10`` -> 16);
    ``yaml_text`` is that text."""

    yaml_text: str


_LOADER = None


def strict_loader():
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                        continue  # merge keys (<<) may be overridden; complex keys are left to PyYAML
                    key = self.construct_object(key_node, deep=True)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r} (first at line {seen[key].line + 1})",
                            key_node.start_mark)
                    seen[key] = key_node.start_mark
            return super().construct_mapping(node, deep=deep)

    def number(kind, construct):
        def constructor(loader, node):
            value = construct(loader, node)
            # keep the text whenever it is not the number's own spelling (YAML 1.1 reads 0.5_2 as 0.52, 010 as 8,
            # 0x10 as 16, 1:30 as 90): the host converts that text as the command line would
            if type(value) in (int, float) and math.isfinite(value) and str(node.value) != repr(value):
                value = kind(value)
                value.yaml_text = node.value
            return value
        return constructor

    StrictLoader.add_constructor("tag:yaml.org,2002:float",
                                 number(YamlFloat, yaml.constructor.SafeConstructor.construct_yaml_float))
    StrictLoader.add_constructor("tag:yaml.org,2002:int",
                                 number(YamlInt, yaml.constructor.SafeConstructor.construct_yaml_int))
    _LOADER = StrictLoader
    return _LOADER

