"""MisConfig: defaults, YAML and Namespace construction, and the error messages users see."""

import argparse
import glob

import pytest

from miles_mis import MisConfig


def test_defaults_are_resolved():
    cfg = MisConfig(tis_upper_bound=4.0)
    assert cfg.tis_lower_bound == 0.25
    assert (cfg.rs_lower_bound, cfg.rs_upper_bound) == (0.25, 4.0)
    assert cfg.rs_veto_threshold is None and cfg.use_tis is False


def test_config_is_frozen():
    with pytest.raises(Exception):
        MisConfig().tis_mode = "clip"


def test_shipped_mis_yaml_is_the_miles_default(repo_root):
    cfg = MisConfig.from_yaml(repo_root / "configs" / "mis.yaml")
    assert (cfg.tis_level, cfg.tis_mode, cfg.tis_lower_bound, cfg.tis_upper_bound) == ("token", "truncate", 0.5, 2.0)
    assert cfg.use_rs and cfg.rs_level == "token" and cfg.rs_veto_threshold == 1e-4 and cfg.tis_batch_normalize


def test_every_shipped_config_loads(repo_root):
    files = sorted(glob.glob(str(repo_root / "configs" / "*.yaml")))
    assert len(files) >= 6
    for path in files:
        MisConfig.from_yaml(path)


def test_yaml_11_string_numbers_are_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rs_veto_threshold: 1e-4\ntis_upper_bound: 2\ntis_lower_bound: '5e-1'\n")
    cfg = MisConfig.from_yaml(path)
    assert cfg.rs_veto_threshold == 1e-4 and cfg.tis_upper_bound == 2.0 and cfg.tis_lower_bound == 0.5


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("# nothing\n")
    assert MisConfig.from_yaml(path) == MisConfig()


@pytest.mark.parametrize("text, words", [
    ("tis_levle: token\n", ["tis_levle", "did you mean 'tis_level'"]),
    ("tis_mode: truncated\n", ["tis_mode", "'truncated'", "truncate, clip, mask, icepop"]),
    ("tis_level: tokens\n", ["tis_level", "'tokens'", "token, sequence, geometric"]),
    ("tis_upper_bound: -1\n", ["tis_upper_bound", "-1", "positive"]),
    ("tis_upper_bound: null\n", ["tis_upper_bound", "required"]),
    ("tis_upper_bound: abc\n", ["tis_upper_bound", "'abc'", "positive numbers"]),
    ("tis_upper_bound: .nan\n", ["tis_upper_bound", "finite"]),
    ("tis_mode: clip\ntis_lower_bound: 3\n", ["tis_lower_bound=3.0", "tis_upper_bound=2.0", "lower < upper"]),
    ("use_rs: true\nrs_lower_bound: 2\nrs_upper_bound: 1\n", ["rs_lower_bound=2.0", "rs_upper_bound=1.0"]),
    ("use_rs: true\ntis_upper_bound: 1\n", ["rs_lower_bound=1.0", "1/tis_upper_bound"]),
    ("rs_veto_threshold: 2\n", ["rs_veto_threshold", "(0, 1)"]),
    ("use_rs: 'yes'\n", ["use_rs", "'yes'", "true or false"]),
    ("tis_batch_normalize: 1\n", ["tis_batch_normalize", "true or false"]),
    ("- a\n- b\n", ["expected a mapping"]),
])
def test_yaml_errors_name_key_value_and_allowed(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        MisConfig.from_yaml(path)
    for word in words:
        assert word in str(info.value)


def test_truncate_accepts_an_upper_bound_of_one():
    assert MisConfig(tis_mode="truncate", tis_upper_bound=1.0).tis_upper_bound == 1.0


def test_from_args_reads_attributes_and_ignores_other_host_flags():
    args = argparse.Namespace(use_tis=True, tis_mode="clip", tis_lower_bound="0.8", tis_clip=2.0, tis_clip_low=0.0,
                              rs_veto_threshold="1e-5", eps_clip=0.2, qkv_format="thd")
    cfg = MisConfig.from_args(args)
    assert cfg.use_tis and cfg.tis_mode == "clip" and cfg.tis_lower_bound == 0.8 and cfg.rs_veto_threshold == 1e-5


def test_from_args_unknown_tis_attribute_suggests():
    with pytest.raises(ValueError, match=r"rs_veto_treshold.*did you mean 'rs_veto_threshold'"):
        MisConfig.from_args(argparse.Namespace(use_tis=True, rs_veto_treshold=1e-4))


def test_from_args_passes_a_config_through():
    cfg = MisConfig(use_tis=True)
    assert MisConfig.from_args(cfg) is cfg


def test_normalize_scope():
    assert MisConfig().tis_batch_normalize_scope == "micro_batch"
    with pytest.raises(ValueError, match="tis_batch_normalize_scope='global'.*micro_batch, dp"):
        MisConfig(tis_batch_normalize_scope="global")


def test_host_flags_in_a_yaml_are_left_to_the_host(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("get_mismatch_metrics: true\neps_clip: 0.3\ntis_mode: clip\n")
    assert MisConfig.from_yaml(path).tis_mode == "clip"
    path.write_text("get_mismatch_metric: true\n")
    with pytest.raises(ValueError, match="unknown key 'get_mismatch_metric'"):
        MisConfig.from_yaml(path)


@pytest.mark.parametrize("text", ["tis_upper_bound: 1e10\n", "tis_mode: clip\ntis_lower_bound: 1e-12\n",
                                  "rs_divergence: {token_k1: [0.5, 1e9]}\n"])
def test_bounds_outside_the_clamp_are_refused(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="could never act"):
        MisConfig.from_yaml(path)
