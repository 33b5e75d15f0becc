"""KEY_SPECS, the table of config keys: MisConfig's fields, its checks, its did-you-mean suggestions and the key
table of docs/config.md all come from it."""

import dataclasses
import os

import pytest

from miles_mis.config import KEY_NAMES, KEY_SPECS, PARSE_ORDER, MisConfig, render_key_table


def docs_key_table(repo_root):
    lines = (repo_root / "docs" / "config.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| key | type / allowed | default | meaning |")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


def test_the_docs_key_table_is_the_rendered_table(repo_root):
    assert docs_key_table(repo_root) == render_key_table(), (
        "docs/config.md's key table differs from KEY_SPECS: paste miles_mis.config.render_key_table() into it")


def test_the_fields_are_the_table():
    assert tuple(field.name for field in dataclasses.fields(MisConfig)) == KEY_NAMES == MisConfig.keys()
    defaults = MisConfig()
    for spec in KEY_SPECS:
        if spec.kind not in ("bound", "mapping", "range") and spec.name != "kernel_backend":  # stored resolved
            assert getattr(defaults, spec.name) == spec.default, spec.name
    # kernel_backend's default (null) resolves to MILES_MIS_BACKEND, else eager
    assert defaults.kernel_backend == (os.environ.get("MILES_MIS_BACKEND") or "eager")


def test_every_key_but_the_bounds_is_parsed_once():
    assert sorted(PARSE_ORDER) == sorted(spec.name for spec in KEY_SPECS if spec.kind != "bound")


@pytest.mark.parametrize("spec", [spec for spec in KEY_SPECS if spec.kind == "choice"], ids=lambda spec: spec.name)
def test_a_misspelt_choice_suggests_from_the_table(spec):
    for choice in spec.choices:
        with pytest.raises(ValueError) as info:
            MisConfig(**{spec.name: choice + "x"})
        assert f"(did you mean {choice!r}?): allowed values are {', '.join(spec.choices)}" in str(info.value)


@pytest.mark.parametrize("spec", [spec for spec in KEY_SPECS if spec.kind == "mapping"], ids=lambda spec: spec.name)
def test_a_misspelt_mapping_name_suggests_from_the_table(spec):
    for name in spec.choices:
        with pytest.raises(ValueError) as info:
            MisConfig(**{spec.name: {name + "x": 0.5}})
        assert f"(did you mean {name!r}?)" in str(info.value) and ", ".join(spec.choices) in str(info.value)


@pytest.mark.parametrize("name", KEY_NAMES)
def test_a_misspelt_key_suggests_from_the_table(name):
    with pytest.raises(ValueError) as info:
        MisConfig.from_dict({name + "x": 1})
    assert f"(did you mean {name!r}?)" in str(info.value) and ", ".join(KEY_NAMES) in str(info.value)
