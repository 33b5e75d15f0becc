"""The package's inner walls, read from the source (no import): no module reaches another module's private names,
every subpackage exports public names only, and the reference host depends only on the public API it tests."""

import ast
import importlib
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "miles_mis"
SUBPACKAGES = ("analyze", "centering", "cli", "config", "correction", "hosts", "inputs", "lab", "parallel",
               "reference_host", "tensors")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_module_aliases(tree: ast.Module) -> set[str]:
    """Names bound to a miles_mis module by an import (``from . import ops``, ``from ..tensors import ops as o``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("miles_mis")):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if alias.name.startswith("miles_mis"))
    return names


def private_crossings() -> list[str]:
    """Every place a module imports or reads a private name of another miles_mis module."""
    found = []
    for path, tree in _modules():
        where = path.relative_to(PACKAGE.parent)
        aliases = _package_module_aliases(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("miles_mis")):
                found += [f"{where}:{node.lineno} imports {alias.name}" for alias in node.names if _private(alias.name)]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                  and _private(node.attr)):
                found.append(f"{where}:{node.lineno} reads {node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_another_modules_private_names():
    assert private_crossings() == []


def test_the_check_sees_a_private_import(tmp_path, monkeypatch):
    """The check above can fail: a module that imports a private name is reported."""
    fake = tmp_path / "miles_mis"
    (fake / "sub").mkdir(parents=True)
    (fake / "sub" / "a.py").write_text("from ..tensors import _secret\nfrom .. import ops\nx = ops._hidden\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert private_crossings() == ["miles_mis/sub/a.py:1 imports _secret", "miles_mis/sub/a.py:3 reads ops._hidden"]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_subpackages_export_public_names_only(name):
    module = importlib.import_module(f"miles_mis.{name}")
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"miles_mis.{name} declares what it exports (__all__)"
    assert not [item for item in exported if _private(item)]
    assert [item for item in exported if not hasattr(module, item)] == []


# what the reference host may import besides the top-level API: the config (the YAML and keys the contract names) and
# the collectives it emulates Megatron's CP group with (parallel.distributed), each module with the names it may take
# (None: any); never the CP layout (it reads Megatron's zigzag layout itself, reference_host/cp_shards.py), the
# correction, the inputs' readers or the plugin
HOST_MAY_IMPORT = {"config": None, "parallel.distributed": None, "parallel": {"distributed"}}


def host_import_crossings() -> list[str]:
    """Every import in the reference host of a miles_mis name outside the public API and HOST_MAY_IMPORT."""
    import miles_mis

    public = set(miles_mis.__all__)
    found = []
    for path, tree in _modules():
        if "reference_host" not in path.parts:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{path.name}:{node.lineno} import {alias.name}" for alias in node.names
                          if alias.name.split(".")[0] == "miles_mis"]
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("miles_mis")):
                names = {alias.name for alias in node.names}
                own = node.level == 1  # a sibling module of the reference host
                top = (node.level == 2 and not node.module) or node.module == "miles_mis"
                allowed = node.level == 2 and node.module in HOST_MAY_IMPORT and (
                    HOST_MAY_IMPORT[node.module] is None or names <= HOST_MAY_IMPORT[node.module])
                if own or allowed:
                    continue
                if not top or not names <= public:
                    found.append(f"{path.name}:{node.lineno} from {'.' * node.level}{node.module or ''} import "
                                 + ", ".join(alias.name for alias in node.names))
    return found


def test_the_reference_host_depends_only_on_the_public_api():
    """The reference host is an independent oracle of the contract: it imports from miles_mis only what the top-level
    package exports (the entry points and MisConfig), the config and the collectives, besides its own modules; not
    the plugin's CP layout, which it would then share with the code it tests."""
    assert host_import_crossings() == []


def test_the_host_check_sees_the_plugins_layout(tmp_path, monkeypatch):
    """The check above can fail: a reference host that imports the plugin's CP layout, in any spelling, is reported;
    the collectives are not."""
    fake = tmp_path / "miles_mis" / "reference_host"
    fake.mkdir(parents=True)
    (fake / "a.py").write_text("from ..parallel import distributed\nfrom ..parallel.cp_layout import zigzag_layout\n"
                               "from ..parallel import cp_layout\nfrom ..parallel import distributed, cp_layout\n"
                               "import miles_mis.parallel.cp_layout\nfrom miles_mis.parallel import cp_layout\n"
                               "from ..parallel import zigzag_layout\nfrom .cp_shards import rank_shards\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake.parent)
    assert host_import_crossings() == [
        "a.py:2 from ..parallel.cp_layout import zigzag_layout", "a.py:3 from ..parallel import cp_layout",
        "a.py:4 from ..parallel import distributed, cp_layout", "a.py:5 import miles_mis.parallel.cp_layout",
        "a.py:6 from miles_mis.parallel import cp_layout", "a.py:7 from ..parallel import zigzag_layout"]


def test_the_reference_host_forwards_the_contracts_keyword_names():
    """The host's own lists of the contract's optional kwargs are the names the plugin reads."""
    from miles_mis.inputs import sampling_mask, versions
    from miles_mis.reference_host import loss

    assert loss.LAG_KWARGS == versions.LAG_KWARGS and loss.SAMPLING_MASK_KWARGS == sampling_mask.KWARGS
