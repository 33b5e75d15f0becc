"""Public names the README once documented keep working for a release, with a DeprecationWarning that names the new
path and points at the importing line."""

import importlib
import sys
import warnings

import pytest

import miles_mis.reference_host as reference_host
import miles_mis.reference_host.flags as reference_flags
import miles_mis.reference_host.loss as reference_loss

MOVED = [("miles_mis.host", reference_host), ("miles_mis.host.flags", reference_flags),
         ("miles_mis.host.loss", reference_loss)]


def fresh_import(name: str):
    """Import ``name`` as a first import would (its old modules dropped), recording every warning."""
    for module in [m for m in sys.modules if m == "miles_mis.host" or m.startswith("miles_mis.host.")]:
        del sys.modules[module]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, caught


@pytest.mark.parametrize("old, new", MOVED)
def test_the_old_path_warns_naming_the_new_one(old, new):
    _, caught = fresh_import(old)
    ours = [w for w in caught
            if issubclass(w.category, DeprecationWarning) and old + " is deprecated" in str(w.message)]
    assert len(ours) == 1
    assert f"import {new.__name__} instead" in str(ours[0].message) and "0.3.0" in str(ours[0].message)
    assert ours[0].filename != importlib.import_module("miles_mis.deprecation").__file__  # points at the importer


@pytest.mark.parametrize("old, new", MOVED)
def test_the_old_path_gives_the_same_objects(old, new):
    module, _ = fresh_import(old)
    names = getattr(new, "__all__", None) or [n for n in vars(new) if not n.startswith("_")]
    assert names
    for name in names:
        assert getattr(module, name) is getattr(new, name), name


def test_the_documented_calls_work_through_the_old_path():
    host, _ = fresh_import("miles_mis.host")
    args = host.parse_args(["--use-tis", "--custom-tis-function-path", "miles_mis.compute_mis_weights_with_cp"])
    assert args.use_tis is True
    assert host.load_function(args.custom_tis_function_path).__name__ == "compute_mis_weights_with_cp"
    assert host.policy_loss is reference_host.policy_loss


def test_the_new_path_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        importlib.reload(reference_host)


def test_the_version_is_one_number_everywhere():
    import re
    from pathlib import Path

    import miles_mis

    root = Path(__file__).resolve().parents[1]
    setup_version = re.search(r'version="([^"]+)"', (root / "setup.py").read_text()).group(1)
    changelog_version = re.search(r"^## (\S+)", (root / "CHANGELOG.md").read_text(), re.M).group(1)
    assert setup_version == miles_mis.__version__ == changelog_version
