"""MisConfig: defaults, YAML and Namespace construction, and the error messages users see."""

import argparse
import glob

import pytest
import torch

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


# ---------------------------------------------------------------- YAML loading (shared by from_yaml, the host,
# check-config)
def yaml_error(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        MisConfig.from_yaml(path)
    assert "\n" not in str(info.value)
    return str(info.value), path


@pytest.mark.parametrize("text, where", [
    ("use_rs: true\ntis_level: [token\n", "3:1"),         # unclosed flow sequence: found at the end of the file
    ("use_rs: true\n  tis_level: token\n", "2:12"),      # bad indentation
    ("tis_mode: 'clip\n", "2:1"),                        # unclosed quote
    ("tis_mode: clip\n\ttis_level: token\n", "2:1"),     # a tab
])
def test_yaml_syntax_error_is_one_line_with_file_line_column(tmp_path, text, where):
    message, path = yaml_error(tmp_path, text)
    assert message.startswith(f"{path}:{where}: ")


def test_duplicate_yaml_key_is_an_error(tmp_path):
    message, path = yaml_error(tmp_path, "tis_mode: clip\nuse_rs: true\ntis_mode: mask\n")
    assert message == f"{path}:3:1: duplicate key 'tis_mode' (first at line 1)"
    message, path = yaml_error(tmp_path, "rs_divergence:\n  seq_max_k3: 0.5\n  seq_max_k3: 0.4\n")
    assert message == f"{path}:3:3: duplicate key 'seq_max_k3' (first at line 2)"


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    from miles_mis.config import load_yaml_mapping

    path = tmp_path / "c.yaml"
    path.write_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n")
    assert load_yaml_mapping(path)["other"] == {"x": 1, "y": 3}


def test_missing_or_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(ValueError) as info:
        MisConfig.from_yaml(tmp_path / "nope.yaml")
    assert str(info.value) == f"{tmp_path / 'nope.yaml'}: cannot read the file (No such file or directory)"
    with pytest.raises(ValueError) as info:
        MisConfig.from_yaml(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: cannot read the file")
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"tis_mode: \xff\xfe\n")
    with pytest.raises(ValueError) as info:
        MisConfig.from_yaml(binary)
    assert str(info.value).startswith(f"{binary}: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("text, number, quoted, listed", [
    ("tis_mode: icepop\ntis_bounds: 0.5_2\n", "0.52", '"0.5_2"', "[0.5, 2]"),
    ("tis_mode: icepop\ntis_bounds: 1_3\n", "13", '"1_3"', "[1, 3]"),
    ("rs_divergence:\n  seq_mean_k1: 0.999_1\n", "0.9991", '"0.999_1"', "[0.999, 1]"),
    ("rs_divergence: {token_k1: 0.5_2}\n", "0.52", '"0.5_2"', "[0.5, 2]"),
])
def test_unquoted_underscore_range_read_as_a_number_says_to_quote_it(tmp_path, text, number, quoted, listed):
    message, path = yaml_error(tmp_path, text)
    assert message.startswith(f"{path}: ")
    for word in [f"the number {number}", "underscores are digit separators", f"quote it ({quoted})",
                 f"write {listed}"]:
        assert word in message, message


def test_a_number_for_a_range_from_python_still_explains_the_spelling():
    with pytest.raises(ValueError, match=r"tis_bounds=0.52 is invalid: .*\"L_U\".*\[L, U\]"):
        MisConfig(tis_bounds=0.52)


def test_value_errors_of_a_file_name_the_file(tmp_path):
    message, path = yaml_error(tmp_path, "tis_mode: truncated\n")
    assert message.startswith(f"{path}: tis_mode='truncated' is invalid")


@pytest.mark.parametrize("text, words", [
    ("use_rs: true\ntis_level: [token\n", [":3:1: "]),
    ("tis_mode: clip\ntis_mode: mask\n", [":2:1: duplicate key 'tis_mode' (first at line 1)"]),
    ("tis_bounds: 0.5_2\n", ['quote it ("0.5_2")']),
    ("eps_clip: -1\n", ["key 'eps_clip' (--eps-clip)", "finite numbers > 0"]),   # host flags: as the host checks them
    ("loss_type: foo\n", ["key 'loss_type'", "invalid choice: 'foo'"]),
    ("use_opsm: 'no'\n", ["key 'use_opsm'", "true or false"]),
    ("eps_clp: 0.1\n", ["unknown key 'eps_clp'", "did you mean 'eps_clip'"]),
    ("use_tis: true\nuse_rollout_logprobs: true\n", ["--use-tis and --use-rollout-logprobs are mutually exclusive"]),
    ("tis_clip_low: 3\n", ["--tis-clip-low=3.0 must be smaller than --tis-clip=2.0"]),  # combinations, as the host
])
def test_check_config_prints_one_error_line(tmp_path, text, words):
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "check-config", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 1 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: {path}")
    for word in words:
        assert word in out.stderr, out.stderr
    missing = subprocess.run([sys.executable, "-m", "miles_mis.cli", "check-config", str(tmp_path / "nope.yaml")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr == f"error: {tmp_path / 'nope.yaml'}: cannot read the file " \
                                                          "(No such file or directory)\n"


# ---------------------------------------------------------------- every key through every constructor
# For every MisConfig key, a valid non-default setting and an invalid one: (key, Python values, the same in YAML).
# The YAML spells what a user writes (1e-4 is a string to YAML 1.1, and numeric strings are numbers to MisConfig).
VALID_SETTINGS = [
    ("use_tis", {"use_tis": True}, "use_tis: true"),
    ("use_rs", {"use_rs": True}, "use_rs: true"),
    ("tis_level", {"tis_level": "sequence"}, "tis_level: sequence"),
    ("rs_level", {"use_rs": True, "rs_level": "geometric"}, "use_rs: true\nrs_level: geometric"),
    ("tis_mode", {"tis_mode": "icepop"}, "tis_mode: icepop"),
    ("tis_lower_bound", {"tis_mode": "clip", "tis_lower_bound": 0.8}, "tis_mode: clip\ntis_lower_bound: 0.8"),
    ("tis_upper_bound", {"tis_upper_bound": 4}, "tis_upper_bound: 4"),
    ("tis_upper_bound", {"tis_upper_bound": "auto"}, "tis_upper_bound: auto"),
    ("rs_lower_bound", {"use_rs": True, "rs_lower_bound": "1e-1"}, "use_rs: true\nrs_lower_bound: 1e-1"),
    ("rs_upper_bound", {"use_rs": True, "rs_upper_bound": 3.0}, "use_rs: true\nrs_upper_bound: 3.0"),
    ("rs_veto_threshold", {"rs_veto_threshold": "1e-4"}, "rs_veto_threshold: 1e-4"),
    ("tis_batch_normalize", {"tis_batch_normalize": True}, "tis_batch_normalize: true"),
    ("tis_batch_normalize_scope", {"tis_batch_normalize_scope": "dp"}, "tis_batch_normalize_scope: dp"),
    ("tis_bounds", {"tis_mode": "icepop", "tis_bounds": "0.5_3"}, 'tis_mode: icepop\ntis_bounds: "0.5_3"'),
    ("tis_bounds", {"tis_mode": "mask", "tis_bounds": [0.25, 4.0]}, "tis_mode: mask\ntis_bounds: [0.25, 4.0]"),
    ("rs_divergence", {"rs_divergence": {"seq_mean_k1": [0.999, 1.001], "seq_max_k3": 0.5}},
     "rs_divergence: {seq_mean_k1: [0.999, 1.001], seq_max_k3: 0.5}"),
    ("rs_batch_gate", {"rs_batch_gate": {"k3": 0.05}}, "rs_batch_gate: {k3: 0.05}"),
    ("rs_batch_gate_scope", {"rs_batch_gate": {"kl": "1e-2"}, "rs_batch_gate_scope": "dp"},
     "rs_batch_gate: {kl: 1e-2}\nrs_batch_gate_scope: dp"),
    ("metrics_low_prob_threshold", {"metrics_low_prob_threshold": 0.05}, "metrics_low_prob_threshold: 0.05"),
    ("tis_auto_target_ess", {"tis_upper_bound": "auto", "tis_auto_target_ess": 0.8},
     "tis_upper_bound: auto\ntis_auto_target_ess: 0.8"),
    ("tis_auto_bounds", {"tis_upper_bound": "auto", "tis_auto_bounds": "1.5_10"},
     'tis_upper_bound: auto\ntis_auto_bounds: "1.5_10"'),
    ("tis_auto_scope", {"tis_upper_bound": "auto", "tis_auto_scope": "dp"},
     "tis_upper_bound: auto\ntis_auto_scope: dp"),
    ("tis_policy", {"tis_policy": "current"}, "tis_policy: current"),
    ("tis_upper_bound_by_lag", {"tis_upper_bound_by_lag": [2.0, 1.5, "1.2"]},
     'tis_upper_bound_by_lag: [2.0, 1.5, "1.2"]'),
    ("rs_max_lag", {"rs_max_lag": 2}, "rs_max_lag: 2"),
    ("rs_max_lag_k3", {"rs_max_lag": 0, "rs_max_lag_k3": "1e-3"}, "rs_max_lag: 0\nrs_max_lag_k3: 1e-3"),
    ("kernel_backend", {"kernel_backend": "compiled"}, "kernel_backend: compiled"),
    ("score_centering", {"score_centering": True}, "score_centering: true"),
    ("score_centering_is", {"score_centering_is": "mis"}, "score_centering_is: mis"),
    ("score_centering_tis_clip", {"score_centering_tis_clip": "1e-1"}, "score_centering_tis_clip: 1e-1"),
    ("score_centering_mis_low", {"score_centering_mis_low": 5}, "score_centering_mis_low: 5"),  # = high: one value
    ("score_centering_mis_high", {"score_centering_mis_high": 100}, "score_centering_mis_high: 100"),
]
INVALID_SETTINGS = [
    ("use_tis", {"use_tis": "yes"}, "use_tis: 'yes'"),
    ("use_rs", {"use_rs": 1}, "use_rs: 1"),
    ("tis_level", {"tis_level": "tokens"}, "tis_level: tokens"),
    ("rs_level", {"rs_level": "seq"}, "rs_level: seq"),
    ("tis_mode", {"tis_mode": "trunc"}, "tis_mode: trunc"),
    ("tis_lower_bound", {"tis_mode": "mask", "tis_lower_bound": 3}, "tis_mode: mask\ntis_lower_bound: 3"),
    ("tis_lower_bound", {"tis_lower_bound": -1}, "tis_lower_bound: -1"),
    ("tis_upper_bound", {"tis_upper_bound": None}, "tis_upper_bound: null"),
    ("tis_upper_bound", {"tis_upper_bound": "Auto"}, "tis_upper_bound: Auto"),
    ("rs_lower_bound", {"use_rs": True, "rs_lower_bound": 2, "rs_upper_bound": 1},
     "use_rs: true\nrs_lower_bound: 2\nrs_upper_bound: 1"),
    ("rs_upper_bound", {"rs_upper_bound": 0}, "rs_upper_bound: 0"),
    ("rs_veto_threshold", {"rs_veto_threshold": 2}, "rs_veto_threshold: 2"),
    ("tis_batch_normalize", {"tis_batch_normalize": "true"}, "tis_batch_normalize: 'true'"),
    ("tis_batch_normalize_scope", {"tis_batch_normalize_scope": "global"}, "tis_batch_normalize_scope: global"),
    ("tis_bounds", {"tis_bounds": "2_0.5"}, 'tis_bounds: "2_0.5"'),
    # tis_bounds with an explicit tis bound, whatever its value (2.0 is the default's, null the lower's)
    ("tis_bounds", {"tis_bounds": "0.5_3", "tis_upper_bound": 2.0}, 'tis_bounds: "0.5_3"\ntis_upper_bound: 2.0'),
    ("tis_bounds", {"tis_bounds": "0.5_3", "tis_lower_bound": None}, 'tis_bounds: "0.5_3"\ntis_lower_bound: null'),
    ("tis_bounds", {"tis_bounds": "0.5_3", "tis_upper_bound": 3.0}, 'tis_bounds: "0.5_3"\ntis_upper_bound: 3.0'),
    ("rs_divergence", {"rs_divergence": {"seq_mean_k4": 0.5}}, "rs_divergence: {seq_mean_k4: 0.5}"),
    ("rs_batch_gate", {"rs_batch_gate": {"k3": -1}}, "rs_batch_gate: {k3: -1}"),
    ("rs_batch_gate_scope", {"rs_batch_gate_scope": "all"}, "rs_batch_gate_scope: all"),
    ("metrics_low_prob_threshold", {"metrics_low_prob_threshold": 1.5}, "metrics_low_prob_threshold: 1.5"),
    ("tis_auto_target_ess", {"tis_upper_bound": "auto", "tis_auto_target_ess": 1.5},
     "tis_upper_bound: auto\ntis_auto_target_ess: 1.5"),
    ("tis_auto_bounds", {"tis_upper_bound": "auto", "tis_auto_bounds": [0.5, 10]},
     "tis_upper_bound: auto\ntis_auto_bounds: [0.5, 10]"),
    ("tis_auto_scope", {"tis_auto_scope": "dp"}, "tis_auto_scope: dp"),  # acts only with tis_upper_bound: auto
    ("tis_policy", {"tis_policy": "theta"}, "tis_policy: theta"),
    ("tis_upper_bound_by_lag", {"tis_upper_bound_by_lag": [1.5, 2.0]}, "tis_upper_bound_by_lag: [1.5, 2.0]"),
    ("tis_upper_bound_by_lag", {"tis_upper_bound_by_lag": [3.0]}, "tis_upper_bound_by_lag: [3.0]"),  # > U = 2
    ("tis_upper_bound_by_lag", {"tis_upper_bound_by_lag": []}, "tis_upper_bound_by_lag: []"),
    ("tis_upper_bound_by_lag", {"tis_upper_bound": "auto", "tis_upper_bound_by_lag": [2.0]},
     "tis_upper_bound: auto\ntis_upper_bound_by_lag: [2.0]"),
    ("rs_max_lag", {"rs_max_lag": 1.5}, "rs_max_lag: 1.5"),
    ("rs_max_lag", {"rs_max_lag": -1}, "rs_max_lag: -1"),
    ("rs_max_lag_k3", {"rs_max_lag_k3": 0.01}, "rs_max_lag_k3: 0.01"),  # without rs_max_lag
    ("rs_max_lag_k3", {"rs_max_lag": 1, "rs_max_lag_k3": 0}, "rs_max_lag: 1\nrs_max_lag_k3: 0"),
    ("kernel_backend", {"kernel_backend": "inductor"}, "kernel_backend: inductor"),
    ("score_centering", {"score_centering": "on"}, "score_centering: 'on'"),
    ("score_centering_is", {"score_centering_is": "icepop"}, "score_centering_is: icepop"),
    ("score_centering_tis_clip", {"score_centering_tis_clip": 0}, "score_centering_tis_clip: 0"),
    ("score_centering_mis_low", {"score_centering_mis_low": 6}, "score_centering_mis_low: 6"),  # above high (5)
    ("score_centering_mis_high", {"score_centering_mis_high": float("inf")}, "score_centering_mis_high: .inf"),
]


def settings_ids(settings):
    return [f"{key}-{i}" for i, (key, _, _) in enumerate(settings)]


def test_the_settings_cover_every_key():
    assert {key for key, _, _ in VALID_SETTINGS} == set(MisConfig.keys())
    assert {key for key, _, _ in INVALID_SETTINGS} == set(MisConfig.keys())


def write_yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    return path


def check_config_output(path, capsys):
    """``miles-mis check-config FILE --use-tis`` in-process: (exit status, stdout, stderr)."""
    from miles_mis import cli

    capsys.readouterr()
    status = cli.main(["check-config", str(path), "--use-tis"])
    out = capsys.readouterr()
    return status, out.out, out.err


def built_every_way(values, text, tmp_path, capsys):
    """The config of ``values`` (and of ``text``, the same in YAML) from every constructor, or each one's error
    message without its source prefix: name -> MisConfig or str. check-config answers as with --use-tis."""
    import dataclasses
    from types import SimpleNamespace

    import yaml

    path = write_yaml(tmp_path, text)
    assert yaml.safe_load(text) == values  # the YAML spells the same settings
    constructors = {
        "MisConfig(**)": (lambda: MisConfig(**values), ""),
        "from_dict": (lambda: MisConfig.from_dict(values), "config: "),
        "from_yaml": (lambda: MisConfig.from_yaml(path), f"{path}: "),
        "from_args(SimpleNamespace)": (lambda: MisConfig.from_args(SimpleNamespace(**values)), ""),
        "from_args(dict)": (lambda: MisConfig.from_args(dict(values)), "config: "),
    }
    results = {}
    for name, (build, prefix) in constructors.items():
        try:
            config = build()
        except ValueError as error:
            message = str(error)
            assert message.startswith(prefix) and "\n" not in message, (name, message)
            results[name] = message[len(prefix):]
        else:
            results[name] = config if "use_tis" in values else dataclasses.replace(config, use_tis=True)
    status, out, err = check_config_output(path, capsys)
    if status == 0:  # the effective config it prints, read back (1e-05 is a string to YAML 1.1: from_dict reads it)
        results["check-config"] = MisConfig.from_dict(yaml.safe_load(out))
    else:
        assert status == 1 and out == "" and err.startswith(f"error: {path}: ") and err.count("\n") == 1, err
        results["check-config"] = err[len(f"error: {path}: "):-1]
    return results


@pytest.mark.parametrize("key, values, text", VALID_SETTINGS, ids=settings_ids(VALID_SETTINGS))
def test_every_key_valid_value_gives_one_config_through_every_constructor(tmp_path, capsys, key, values, text):
    results = built_every_way(values, text, tmp_path, capsys)
    first = results["MisConfig(**)"]
    assert isinstance(first, MisConfig), results
    assert all(result == first for result in results.values()), results
    default = MisConfig(use_tis=True)
    changed = first.tis_upper_bound != default.tis_upper_bound if key == "tis_bounds" else \
        getattr(first, key) != getattr(MisConfig(), key)  # use_tis: True, against use_tis False
    assert changed, (key, first)


@pytest.mark.parametrize("key, values, text", INVALID_SETTINGS, ids=settings_ids(INVALID_SETTINGS))
def test_every_key_invalid_value_gives_one_error_through_every_constructor(tmp_path, capsys, key, values, text):
    results = built_every_way(values, text, tmp_path, capsys)
    message = results["MisConfig(**)"]
    assert isinstance(message, str) and key in message, results
    assert all(result == message for result in results.values()), results


@pytest.mark.parametrize("values", [{"tis_upper_bound": 2.0}, {"tis_lower_bound": None}, {"tis_upper_bound": 3.0},
                                    {"tis_lower_bound": 0.5, "tis_upper_bound": 3.0}])
def test_tis_bounds_with_an_explicit_bound_is_one_error_from_a_namespace(values):
    # from_args used to accept tis_bounds with a bound equal to its default, and train with the alias's bound
    args = argparse.Namespace(use_tis=True, tis_mode="icepop", tis_bounds="0.5_3", eps_clip=0.2, **values)
    given = " and ".join(f"{key}={'null' if value is None else repr(value)}" for key, value in values.items())
    expected = (f"tis_bounds='0.5_3' is given with {given}: tis_bounds sets tis_lower_bound and tis_upper_bound, "
                "so give either tis_bounds or the two bounds, not both")
    for build in (lambda: MisConfig.from_args(args), lambda: MisConfig(**{**values, "tis_bounds": "0.5_3"})):
        with pytest.raises(ValueError) as info:
            build()
        assert str(info.value) == expected


def test_tis_bounds_alone_and_the_bounds_alone_still_work():
    alias = MisConfig.from_args(argparse.Namespace(tis_mode="icepop", tis_bounds="0.5_3", tis_clip=2.0))
    assert (alias.tis_lower_bound, alias.tis_upper_bound, alias.tis_bounds) == (0.5, 3.0, None)
    explicit = MisConfig.from_args(argparse.Namespace(tis_mode="icepop", tis_lower_bound=0.5, tis_upper_bound=3.0))
    assert explicit == alias
    # a null tis_bounds is no alias: the bounds may be given with it (to_dict() writes tis_bounds: null)
    assert MisConfig.from_dict({**alias.to_dict(), "tis_bounds": None}) == alias
    assert MisConfig.from_args(argparse.Namespace(**alias.to_dict())) == alias


def test_from_args_reads_a_dict_like_from_dict():
    # a dict has no attributes: it used to give the defaults, metrics-only mode, silently
    cfg = MisConfig.from_args({"use_tis": True, "tis_mode": "mask", "eps_clip": 0.2, "qkv_format": "thd"})
    assert cfg == MisConfig(use_tis=True, tis_mode="mask") == MisConfig.from_dict({"use_tis": True, "tis_mode": "mask"})
    with pytest.raises(ValueError) as info:
        MisConfig.from_args({"use_tis": True, "tis_mdoe": "mask"})
    assert str(info.value).startswith("config: unknown key 'tis_mdoe' (did you mean 'tis_mode'?)")
    with pytest.raises(ValueError) as info:
        MisConfig.from_args({"use_tis": True, "seed": 3})  # a dict is a config: no host attributes to ignore
    assert str(info.value).startswith("config: unknown key 'seed'")


def test_a_dict_as_the_plugins_args_corrects():
    from conftest import call_plugin, random_batch

    train, rollout, masks = random_batch(0)
    as_dict = call_plugin({"use_tis": True, "tis_mode": "mask"}, train, rollout, masks)
    as_config = call_plugin(MisConfig(use_tis=True, tis_mode="mask"), train, rollout, masks)
    metrics_only = call_plugin(MisConfig(), train, rollout, masks)
    assert torch.equal(as_dict[0], as_config[0]) and not torch.equal(as_dict[0], metrics_only[0])
    assert all(torch.equal(a, b) for a, b in zip(as_dict[1], as_config[1]))


ALLOWED_ARGS = ("is invalid: allowed values are a host Namespace (argparse.Namespace, SimpleNamespace), a MisConfig, "
                "or a mapping of config keys")


@pytest.mark.parametrize("args, shown", [(None, "None"), ([1, 2], "[1, 2] (list)"),
                                         ("tis_mode=mask", "'tis_mode=mask' (str)"), (3, "3 (int)"),
                                         (("use_tis", True), "('use_tis', True) (tuple)")])
def test_from_args_refuses_what_is_no_namespace_config_or_mapping(args, shown):
    with pytest.raises(ValueError) as info:
        MisConfig.from_args(args)
    assert str(info.value) == f"args: {shown} {ALLOWED_ARGS}"


def test_the_plugin_refuses_none_as_its_args():
    from conftest import call_plugin, random_batch

    train, rollout, masks = random_batch(1)
    with pytest.raises(ValueError, match=r"^args: None is invalid: allowed values are a host Namespace"):
        call_plugin(None, train, rollout, masks)


def test_check_config_prints_values_yaml_reads_back(tmp_path, capsys):
    """Every line check-config prints is YAML that reads back as the effective value (1.0e-06, not 1e-06: YAML 1.1
    reads the latter as a string)."""
    import yaml

    text = "rs_veto_threshold: 1.0e-6\ntis_upper_bound: 2\nrs_divergence: {seq_max_k3: 1.0e-5, token_tv: [-0.2, 0.2]}"
    status, out, _ = check_config_output(write_yaml(tmp_path, text), capsys)
    assert status == 0
    printed = yaml.safe_load("\n".join(line.split("   #")[0] for line in out.splitlines() if not line.startswith("#")))
    config = MisConfig.from_yaml(write_yaml(tmp_path, text))
    assert printed["rs_veto_threshold"] == 1e-6 and isinstance(printed["rs_veto_threshold"], float)
    assert printed["rs_divergence"] == {"seq_max_k3": 1e-5, "token_tv": [-0.2, 0.2]}
    for key, value in config.to_dict().items():
        if key not in ("tis_bounds", "use_tis"):  # an input alias; use_tis is the --use-tis flag here
            want = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
            if isinstance(value, dict):
                want = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            assert printed[key] == want, key
