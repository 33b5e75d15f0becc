"""Host flags: a --custom-config-path YAML value goes through the same conversion, choices and range checks
as its flag; file plugins are executed once; --help shows the defaults; `miles-mis ... | head` is quiet."""

import subprocess
import sys

import pytest
import torch

from miles_mis import reference_host

PLUGIN = "miles_mis.compute_mis_weights_with_cp"


def parse_with_yaml(tmp_path, text, *flags, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return reference_host.parse_args([*flags, "--custom-config-path", str(path)]), path


def yaml_error(tmp_path, text, *flags):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        reference_host.parse_args([*flags, "--custom-config-path", str(path)])
    message = str(info.value)
    assert "\n" not in message
    return message, path


# ---------------------------------------------------------------- YAML values are converted like their flags
@pytest.mark.parametrize("text, attribute, expected", [
    ("eps_clip: '0.3'\n", "eps_clip", 0.3),       # a quoted number: float("0.3"), as on the command line
    ("eps_clip: 1e-1\n", "eps_clip", 0.1),        # PyYAML reads 1e-1 as the string "1e-1"
    ("tis_clip: 3\n", "tis_clip", 3.0),           # an int for a float flag becomes a float
    ("eps_clip_c: null\n", "eps_clip_c", None),   # null: the flag's unset default
    ("qkv_format: bshd\n", "qkv_format", "bshd"),
    ("use_opsm: true\nopsm_delta: 5e-3\n", "opsm_delta", 0.005),
])
def test_yaml_value_is_converted_like_its_flag(tmp_path, text, attribute, expected):
    args, _ = parse_with_yaml(tmp_path, text)
    value = getattr(args, attribute)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text, words", [
    ("loss_type: foo\n", ["key 'loss_type' (--loss-type)", "invalid choice: 'foo'", "'ppo', 'reinforce'"]),
    ("loss_type: reinforc\n", ["invalid choice: 'reinforc'", "did you mean 'reinforce'"]),
    ("use_tis: 'false'\n", ["key 'use_tis' (--use-tis)", "'false'", "YAML booleans true or false"]),
    ("use_opsm: 'no'\n", ["key 'use_opsm' (--use-opsm)", "'no'", "true or false"]),
    ("calculate_per_token_loss: 1\n", ["key 'calculate_per_token_loss'", "1 is invalid", "true or false"]),
    ("eps_clip: abc\n", ["key 'eps_clip' (--eps-clip)", "invalid float value: 'abc'"]),
    ("eps_clip: true\n", ["key 'eps_clip'", "True is invalid", "takes one float value, not a boolean"]),
    ("eps_clip: [0.1, 0.2]\n", ["key 'eps_clip'", "takes one float value, not a list"]),
    ("eps_clip: null\n", ["key 'eps_clip'", "null is invalid", "default 0.2"]),
    ("eps_clip: -0.1\n", ["key 'eps_clip' (--eps-clip)", "-0.1 is invalid", "finite numbers > 0"]),
    ("eps_clip: .nan\n", ["key 'eps_clip'", "nan is invalid", "finite numbers > 0"]),
    ("eps_clip_high: 0\n", ["key 'eps_clip_high'", "finite numbers > 0"]),
    ("eps_clip_c: 1\n", ["key 'eps_clip_c' (--eps-clip-c)", "finite numbers > 1"]),
    ("tis_clip: .inf\n", ["key 'tis_clip'", "inf is invalid", "finite numbers > 0"]),
    ("tis_clip_low: -0.5\n", ["key 'tis_clip_low'", "finite numbers >= 0"]),
    ("opsm_delta: '-1e-3'\n", ["key 'opsm_delta'", "-0.001 is invalid", "finite numbers >= 0"]),
    ("use_sr: true\n", ["unknown key 'use_sr'", "did you mean 'use_rs'"]),
    ("eps_clp: 0.1\n", ["unknown key 'eps_clp'", "did you mean 'eps_clip'"]),
    ("1: 2\n", ["key 1", "keys are names"]),
])
def test_yaml_value_errors_name_the_file_and_key(tmp_path, text, words):
    message, path = yaml_error(tmp_path, text)
    assert message.startswith(f"{path}: ")
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("argv, words", [
    (["--eps-clip", "-0.1"], ["--eps-clip: -0.1 is invalid", "finite numbers > 0"]),
    (["--eps-clip", "nan"], ["--eps-clip: nan is invalid"]),
    (["--eps-clip-high", "0"], ["--eps-clip-high: 0.0 is invalid", "> 0"]),
    (["--eps-clip-c", "inf"], ["--eps-clip-c: inf is invalid", "finite numbers > 1"]),
    (["--eps-clip-c", "1"], ["--eps-clip-c: 1.0 is invalid", "> 1"]),
    (["--tis-clip", "0"], ["--tis-clip: 0.0 is invalid", "> 0"]),
    (["--tis-clip-low", "-0.5"], ["--tis-clip-low: -0.5 is invalid", ">= 0"]),
    (["--opsm-delta", "-1"], ["--opsm-delta: -1.0 is invalid", ">= 0"]),  # checked with or without --use-opsm
    (["--use-opsm", "--opsm-delta", "nan"], ["--opsm-delta: nan is invalid"]),
])
def test_flag_ranges_are_checked_at_parse_time(argv, words):
    with pytest.raises(ValueError) as info:
        reference_host.parse_args(argv)
    for word in words:
        assert word in str(info.value)


def test_defaults_and_range_edges_are_valid():
    args = reference_host.parse_args([])
    assert (args.eps_clip, args.eps_clip_high, args.eps_clip_c, args.tis_clip, args.tis_clip_low,
            args.opsm_delta) == (0.2, None, None, 2.0, 0.0, 1e-4)
    args = reference_host.parse_args(["--tis-clip-low", "0", "--opsm-delta", "0", "--eps-clip-c", "1.01",
                                      "--eps-clip", "1e-4"])
    assert (args.tis_clip_low, args.opsm_delta, args.eps_clip_c, args.eps_clip) == (0.0, 0.0, 1.01, 1e-4)


def test_one_message_style_for_the_flag_and_the_yaml(tmp_path):
    with pytest.raises(ValueError) as flag:
        reference_host.parse_args(["--eps-clip", "-0.5"])
    message, path = yaml_error(tmp_path, "eps_clip: -0.5\n")
    problem = "-0.5 is invalid: allowed values are finite numbers > 0"
    assert str(flag.value).startswith(f"--eps-clip: {problem}")
    assert message.startswith(f"{path}: key 'eps_clip' (--eps-clip): {problem}")


def test_loss_type_typo_in_yaml_no_longer_runs_reinforce(tmp_path):
    # before: loss_type 'foo' was set as is and the policy loss took its REINFORCE branch
    message, _ = yaml_error(tmp_path, "loss_type: foo\nuse_rollout_logprobs: true\n")
    assert "invalid choice: 'foo'" in message


# ---------------------------------------------------------------- unknown keys
def write_plugin(tmp_path, log=None):
    plugin = tmp_path / "my_plugin.py"
    log_line = f"open({str(log)!r}, 'a').write('imported\\n')\n" if log else ""
    plugin.write_text(log_line + "def correct(*, pg_loss, loss_masks, **kwargs):\n"
                      "    return pg_loss, list(loss_masks), {}\n")
    return f"{plugin}:correct"


def test_unknown_keys_pass_through_to_a_third_party_function_but_typos_are_caught(tmp_path):
    path = write_plugin(tmp_path)
    args, _ = parse_with_yaml(tmp_path, "my_plugin_scale: 3\nmy_plugin_mode: fancy\n", "--use-tis",
                              "--custom-tis-function-path", path)
    assert (args.my_plugin_scale, args.my_plugin_mode) == (3, "fancy")
    message, _ = yaml_error(tmp_path, "use_sr: true\n", "--use-tis", "--custom-tis-function-path", path)
    assert "unknown key 'use_sr'" in message and "did you mean 'use_rs'" in message
    # the function path may come from the YAML itself
    args, _ = parse_with_yaml(tmp_path, f"custom_tis_function_path: {path}\nmy_plugin_scale: 3\n", "--use-tis")
    assert args.my_plugin_scale == 3


@pytest.mark.parametrize("flags", [[], ["--use-tis"], ["--use-tis", "--custom-tis-function-path", PLUGIN]])
def test_unknown_keys_are_errors_for_miles_mis_and_the_builtin_tis(tmp_path, flags):
    message, _ = yaml_error(tmp_path, "my_plugin_scale: 3\n", *flags)
    assert "unknown key 'my_plugin_scale'" in message and "allowed keys" in message


def test_miles_mis_keys_and_host_flags_are_known(tmp_path):
    args, _ = parse_with_yaml(tmp_path, "tis_mode: clip\ntis_lower_bound: 0.5\nget_mismatch_metrics: true\n",
                              "--custom-tis-function-path", PLUGIN)
    assert args.tis_mode == "clip" and args.get_mismatch_metrics is True


def test_config_errors_of_the_plugin_name_the_file(tmp_path):
    message, path = yaml_error(tmp_path, "tis_mode: trunc\n", "--use-tis", "--custom-tis-function-path", PLUGIN)
    assert message.startswith(f"{path}: ") and "did you mean 'truncate'" in message


def test_host_flag_keys_of_the_config_match_the_parser():
    from miles_mis.config import HOST_FLAG_KEYS

    dests = {action.dest for action in reference_host.build_parser()._actions} - {"help"}
    # --mis-set is the command line's way to set config keys: a config file cannot hold it
    assert reference_host.COMMAND_LINE_ONLY == {"mis_set"}
    assert HOST_FLAG_KEYS == dests - {"use_tis", "custom_config_path", "mis_set"}


# ---------------------------------------------------------------- a host's own flags (the lab)
def test_lab_flags_from_yaml_are_converted_and_checked(tmp_path):
    from miles_mis.lab.train import parse_args

    path = tmp_path / "lab.yaml"
    path.write_text("steps: '7'\nlr: 3e-3\nrollout_dtype: fp16\nquiet: true\n")
    args = parse_args(["--custom-config-path", str(path)])
    assert (args.steps, args.lr, args.rollout_dtype, args.quiet) == (7, 3e-3, "fp16", True)
    assert type(args.steps) is int
    for text, words in [("rollout_dtype: bf32\n", ["key 'rollout_dtype'", "invalid choice: 'bf32'", "bf16"]),
                        ("steps: 2.5\n", ["key 'steps' (--steps)", "invalid int value: '2.5'"]),
                        ("quiet: 'yes'\n", ["key 'quiet'", "true or false"]),
                        ("stpes: 3\n", ["unknown key 'stpes'", "did you mean 'steps'"]),
                        ("eps_clip: -1\n", ["key 'eps_clip'", "finite numbers > 0"])]:
        path.write_text(text)
        with pytest.raises(ValueError) as info:
            parse_args(["--custom-config-path", str(path)])
        for word in words:
            assert word in str(info.value)


def test_lab_cli_prints_one_error_line(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text("eps_clip: -1\n")
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "train", "--custom-config-path", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"error: {path}: key 'eps_clip' (--eps-clip): -1.0 is invalid: allowed values are "
                                  "finite numbers > 0 (the PPO clip range below 1)")


# ---------------------------------------------------------------- YAML syntax in --custom-config-path
def test_custom_config_syntax_error_and_duplicate_key_are_one_line(tmp_path):
    message, path = yaml_error(tmp_path, "use_opsm: true\neps_clip: [0.2\n")
    assert message.startswith(f"{path}:3:1: ")
    message, path = yaml_error(tmp_path, "eps_clip: 0.2\nuse_opsm: true\neps_clip: 0.3\n")
    assert message == f"{path}:3:1: duplicate key 'eps_clip' (first at line 1)"
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ValueError) as info:
        reference_host.parse_args(["--custom-config-path", str(missing)])
    assert str(info.value).startswith(f"{missing}: cannot read the file")


# ---------------------------------------------------------------- file plugins are executed once
def test_file_plugin_is_executed_once_per_process(tmp_path):
    log = tmp_path / "imports.log"
    path = write_plugin(tmp_path, log)
    args = reference_host.parse_args(["--use-tis", "--custom-tis-function-path", path])
    current = [torch.zeros(3, requires_grad=True)]
    batch = dict(advantages=[torch.ones(3)], log_probs=[torch.zeros(3)], rollout_log_probs=[torch.zeros(3)],
                 loss_masks=[torch.ones(3)], response_lengths=[3], total_lengths=[5])
    for _ in range(3):
        reference_host.policy_loss(args, batch, current)
    assert log.read_text() == "imported\n"
    # the same file under another spelling of its path is the same module
    same = reference_host.load_function(str(tmp_path / "." / "my_plugin.py") + ":correct")
    assert same is reference_host.load_function(path) and log.read_text() == "imported\n"


# ---------------------------------------------------------------- --help
def test_help_shows_defaults():
    text = " ".join(reference_host.build_parser().format_help().split())
    for part in ["--eps-clip EPS_CLIP PPO clip range below 1, > 0 (default: 0.2)", "(default: 0.0)",
                 "(default: 0.0001)", "--loss-type {ppo,reinforce}", "(default: ppo)", "(default: thd)",
                 "(default: 2.0)"]:
        assert part in text, part
    from miles_mis.lab.train import build_parser

    lab = " ".join(build_parser().format_help().split())
    assert ("(default: 0.2)" in lab and "--steps STEPS RL steps (rollout batches), >= 0 (default: 60)" in lab
            and "(default: bf16)" in lab)
    assert lab.count("(default: 0.2)") == 1
    for help_text in (text, lab):
        assert "--mis-set KEY=VALUE set one miles_mis config key" in help_text
        assert "repeat for more keys, each once (default: None = the file's keys and the defaults)" in help_text
        assert help_text.count("(default: None = the file's keys") == 1


# ---------------------------------------------------------------- `miles-mis ... | head`
@pytest.mark.parametrize("command", [["check-config", "configs/mis.yaml"], ["plugin-demo"]])
def test_closed_stdout_gives_no_broken_pipe_traceback(repo_root, command):
    process = subprocess.Popen([sys.executable, "-m", "miles_mis.cli", *command], cwd=repo_root,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader ends before the command writes (like `| head -0`)
    stderr = process.stderr.read().decode()
    process.wait(timeout=120)
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert stderr == ""


def test_head_reads_the_first_line(repo_root):
    out = subprocess.run(f"{sys.executable} -m miles_mis.cli check-config configs/mis.yaml | head -n 1",
                         shell=True, cwd=repo_root, capture_output=True, text=True)
    assert out.stdout.startswith("# effective config of configs/mis.yaml") and "Traceback" not in out.stderr


@pytest.mark.parametrize("source, message", [
    ("def f(:\n", r"executing .*bad_plugin\.py failed: SyntaxError: .*line 1"),
    ("raise RuntimeError('no GPU here')\n", r"executing .*bad_plugin\.py failed: RuntimeError: no GPU here"),
])
def test_a_broken_file_plugin_is_one_error_naming_the_flag(tmp_path, source, message):
    plugin = tmp_path / "bad_plugin.py"
    plugin.write_text(source)
    with pytest.raises(ValueError, match=r"^--custom-tis-function-path '.*bad_plugin\.py:f': " + message):
        reference_host.parse_args(["--use-tis", "--custom-tis-function-path", f"{plugin}:f"])


def test_a_function_path_without_a_module_is_named():
    with pytest.raises(ValueError, match=r"^--custom-tis-function-path 'func' is invalid: expected pkg.module.func"):
        reference_host.parse_args(["--use-tis", "--custom-tis-function-path", "func"])


@pytest.mark.parametrize("text, expected", [("010", 10.0), ("1.0e-1", 0.1), ("0.3", 0.3), ("2", 2.0)])
def test_yaml_numbers_are_read_from_their_text_like_the_command_line(tmp_path, text, expected):
    config = tmp_path / "flags.yaml"
    config.write_text(f"eps_clip: {text}\n")  # YAML 1.1 alone would read 010 as the octal 8
    assert reference_host.parse_args(["--custom-config-path", str(config)]).eps_clip == expected
    assert reference_host.parse_args(["--eps-clip", text]).eps_clip == expected


@pytest.mark.parametrize("text", ["0x10", "1:30"])
def test_yaml_numbers_the_command_line_refuses_are_refused(tmp_path, text):
    config = tmp_path / "flags.yaml"
    config.write_text(f"eps_clip: {text}\n")
    with pytest.raises(ValueError, match=r"flags\.yaml: key 'eps_clip' \(--eps-clip\)"):
        reference_host.parse_args(["--custom-config-path", str(config)])
    with pytest.raises(SystemExit):
        reference_host.parse_args(["--eps-clip", text])


def test_miles_mis_keys_without_a_correction_function_are_an_error(tmp_path):
    config = tmp_path / "mis.yaml"
    config.write_text("tis_mode: mask\n")  # with the built-in TIS nothing would read it
    with pytest.raises(ValueError, match=r"mis\.yaml: key 'tis_mode' is a miles_mis config key, but no "
                                         r"--custom-tis-function-path is given"):
        reference_host.parse_args(["--use-tis", "--custom-config-path", str(config)])
    args = reference_host.parse_args(["--use-tis", "--custom-config-path", str(config), "--custom-tis-function-path",
                            "miles_mis.compute_mis_weights_with_cp"])
    assert args.tis_mode == "mask"


# ---------------------------------------------------------------- --use-tis + a config file, no correction function
def builtin_tis_warning(path, clip_low=0.0, clip=2.0):
    return (f"warning: --use-tis with --custom-config-path {path} but no --custom-tis-function-path: the built-in "
            f"vanilla TIS runs (token weights truncated to [--tis-clip-low, --tis-clip] = [{clip_low:g}, {clip:g}]) "
            "and reads no miles_mis config from the file (only its host flags apply); add --custom-tis-function-path "
            "miles_mis.compute_mis_weights_with_cp to use miles_mis\n")


@pytest.mark.parametrize("text, flags, clip", [
    ("eps_clip: 0.3\n", ("--use-tis",), 2.0),          # host flags only: valid, but the built-in TIS runs
    ("{}\n", ("--use-tis", "--tis-clip", "3"), 3.0),    # nothing at all
    ("use_tis: true\ntis_clip: 1.5\n", (), 1.5),       # --use-tis from the file counts
])
def test_use_tis_with_a_config_file_and_no_function_warns_in_one_line(tmp_path, capsys, text, flags, clip):
    args, path = parse_with_yaml(tmp_path, text, *flags)
    assert args.use_tis and args.custom_tis_function_path is None and args.tis_clip == clip
    assert capsys.readouterr() == ("", builtin_tis_warning(path, clip=clip))


@pytest.mark.parametrize("text, flags", [
    ("eps_clip: 0.3\n", ("--use-tis", "--custom-tis-function-path", PLUGIN)),  # miles_mis reads the file
    (f"custom_tis_function_path: {PLUGIN}\n", ("--use-tis",)),                 # ... named in the file
    ("eps_clip: 0.3\n", ()),                                                   # no TIS at all
])
def test_no_warning_when_a_function_reads_the_file_or_tis_is_off(tmp_path, capsys, text, flags):
    parse_with_yaml(tmp_path, text, *flags)
    assert capsys.readouterr() == ("", "")
    reference_host.parse_args(["--use-tis"])  # no config file: the built-in TIS is what was asked for
    assert capsys.readouterr() == ("", "")


def test_lab_train_prints_the_warning_as_one_line(tmp_path):
    path = tmp_path / "flags.yaml"
    path.write_text("eps_clip: 0.3\n")
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "train", "--use-tis",
                          "--custom-config-path", str(path), "--steps", "0", "--sft-steps", "0",
                          "--out-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr == builtin_tis_warning(path) + f"wrote {tmp_path / 'run' / 'metrics.jsonl'} (0 steps)\n"


# ---------------------------------------------------------------- --mis-set KEY=VALUE
WITH_PLUGIN = ("--use-tis", "--custom-tis-function-path", PLUGIN)


def mis_set(*items, flags=WITH_PLUGIN):
    return reference_host.parse_args([*flags, *(part for item in items for part in ("--mis-set", item))])


def mis_set_error(*items, flags=WITH_PLUGIN):
    with pytest.raises(ValueError) as info:
        mis_set(*items, flags=flags)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("item, attribute, given, effective", [
    ("rs_batch_gate={k3: 0.05}", "rs_batch_gate", {"k3": 0.05}, (("k3", 0.05),)),
    ("rs_batch_gate={max_abs_log_ratio: 3, k3: 0.05}", "rs_batch_gate", {"max_abs_log_ratio": 3, "k3": 0.05},
     (("k3", 0.05), ("max_abs_log_ratio", 3.0))),
    ("rs_batch_gate=", "rs_batch_gate", None, ()),  # an empty value is YAML's null: off
    ("rs_batch_gate_scope=dp", "rs_batch_gate_scope", "dp", "dp"),
    ("metrics_low_prob_threshold=0.05", "metrics_low_prob_threshold", 0.05, 0.05),
    ("rs_veto_threshold=1e-4", "rs_veto_threshold", "1e-4", 1e-4),  # YAML 1.1 reads 1e-4 as a string, as in a file
    ("tis_mode=clip", "tis_mode", "clip", "clip"),
    ("rs_divergence={seq_mean_k1: [0.999, 1.001]}", "rs_divergence", {"seq_mean_k1": [0.999, 1.001]},
     (("seq_mean_k1", 0.999, 1.001),)),
    ("use_tis=false", "use_tis", False, False),  # as the file's use_tis: overrides the --use-tis flag
    (" tis_level = sequence", "tis_level", "sequence", "sequence"),  # the key is stripped, YAML strips the value
])
def test_mis_set_value_is_read_as_yaml_and_checked_by_misconfig(item, attribute, given, effective):
    from miles_mis import MisConfig

    args = mis_set(item)
    assert getattr(args, attribute) == given and type(getattr(args, attribute)) is type(given)
    assert getattr(MisConfig.from_args(args), attribute) == effective


def test_mis_set_turns_on_the_adaptive_bound():
    from miles_mis import MisConfig

    args = mis_set("tis_upper_bound=auto", "tis_auto_target_ess=0.8", "tis_auto_bounds=[1.5, 10]")
    config = MisConfig.from_args(args)
    assert (config.tis_upper_bound, config.tis_auto_target_ess, tuple(config.tis_auto_bounds)) == ("auto", 0.8,
                                                                                                    (1.5, 10.0))
    message = mis_set_error("tis_upper_bound=auto", "tis_auto_target_ess=1.5")
    assert message.startswith("--mis-set tis_auto_target_ess=1.5 is invalid") and "(0, 1]" in message


def test_mis_set_overrides_the_config_file_key(tmp_path):
    from miles_mis import MisConfig

    path = tmp_path / "mis.yaml"
    path.write_text("tis_mode: clip\ntis_lower_bound: 0.5\nrs_batch_gate: {k3: 0.05}\n")
    for argv in (["--custom-config-path", str(path), "--mis-set", "tis_mode=mask"],
                 ["--mis-set", "tis_mode=mask", "--custom-config-path", str(path)]):  # the order of the flags
        config = MisConfig.from_args(reference_host.parse_args([*WITH_PLUGIN, *argv]))
        assert (config.tis_mode, config.tis_lower_bound, config.rs_batch_gate) == ("mask", 0.5, (("k3", 0.05),))
    args = reference_host.parse_args([*WITH_PLUGIN, "--custom-config-path", str(path),
                                      "--mis-set", "rs_batch_gate=null"])
    assert MisConfig.from_args(args).rs_batch_gate == ()  # the file's gate turned off from the command line
    # a valid file key overridden by an invalid value: the error names --mis-set, not the file
    path.write_text("tis_mode: clip\n")
    message = mis_set_error("tis_mode=trunc", flags=(*WITH_PLUGIN, "--custom-config-path", str(path)))
    assert message == ("--mis-set tis_mode='trunc' is invalid (did you mean 'truncate'?): allowed values are "
                       "truncate, clip, mask, icepop")
    # a cross-key error between a file key and a --mis-set key names both
    path.write_text("tis_mode: clip\ntis_lower_bound: 0.5\n")
    message = mis_set_error("tis_upper_bound=0.4", flags=(*WITH_PLUGIN, "--custom-config-path", str(path)))
    assert message == (f"--mis-set tis_upper_bound (with the keys of {path}): tis_lower_bound=0.5 must be smaller than "
                       "tis_upper_bound=0.4: allowed values are 0 < lower < upper")


KEYS = "use_tis, use_rs, tis_level"  # the start of the allowed-keys list (MisConfig.keys() order)


@pytest.mark.parametrize("items, expected", [
    (["tis_mode"], "--mis-set 'tis_mode' is invalid: expected KEY=VALUE with an '=' (e.g. --mis-set tis_mode=clip, "
                   "--mis-set 'rs_batch_gate={k3: 0.05}')"),
    (["=clip"], "--mis-set '=clip' is invalid: the key before '=' is empty: expected KEY=VALUE (e.g. --mis-set "
                "tis_mode=clip, --mis-set 'rs_batch_gate={k3: 0.05}')"),
    (["tis_mod=clip"], f"--mis-set tis_mod: unknown key 'tis_mod' (did you mean 'tis_mode'?); allowed keys: the "
                       f"miles_mis config keys ({KEYS}"),
    (["rs_batch_gat={k3: 0.05}"], "--mis-set rs_batch_gat: unknown key 'rs_batch_gat' (did you mean 'rs_batch_gate'?)"),
    (["eps_clip=0.3"], "--mis-set eps_clip: 'eps_clip' is not a miles_mis config key but the flag --eps-clip: "
                       "give that flag instead"),
    (["tis_mode=trunc"], "--mis-set tis_mode='trunc' is invalid (did you mean 'truncate'?): allowed values are "
                         "truncate, clip, mask, icepop"),
    (["rs_batch_gate={k4: 0.05}"], "--mis-set rs_batch_gate: unknown statistic 'k4'; allowed statistics: k3, kl, "
                                   "max_abs_log_ratio"),
    (["rs_batch_gate={k3: -1}"], "--mis-set rs_batch_gate.k3=-1 is invalid: allowed values are finite positive "
                                 "numbers"),
    (["rs_batch_gate=0.05"], "--mis-set rs_batch_gate=0.05 is invalid: allowed values are null or a mapping from "
                             "statistic (k3, kl, max_abs_log_ratio) to a threshold, e.g. {k3: 0.05}"),
    (["rs_batch_gate={k3: 0.05"], "--mis-set rs_batch_gate: '{k3: 0.05' is not a YAML value (expected ',' or '}', but "
                                  "got '<stream end>' at character 10): quote the whole KEY=VALUE for the shell"),
    (["rs_batch_gate={k3: 1, k3: 2}"], "--mis-set rs_batch_gate: '{k3: 1, k3: 2}' is not a YAML value (duplicate key "
                                       "'k3' (first at line 1) at character 9)"),
    (["rs_batch_gate_scope=global"], "--mis-set rs_batch_gate_scope='global' is invalid: allowed values are "
                                     "micro_batch, dp"),
    (["metrics_low_prob_threshold=1.5"], "--mis-set metrics_low_prob_threshold=1.5 is invalid: allowed values are "
                                         "probabilities in (0, 1)"),
    (["use_tis=maybe"], "--mis-set use_tis (--use-tis): 'maybe' is invalid: --use-tis is a switch, allowed values are "
                        "the YAML booleans true or false (unquoted)"),
    (["tis_mode=clip", "tis_mode=mask"], "--mis-set tis_mode is given twice: give each key once"),
])
def test_mis_set_errors_are_one_line_naming_the_key(items, expected):
    message = mis_set_error(*items)
    assert message.startswith(expected), message


@pytest.mark.parametrize("key, text, core", [
    ("tis_mode", "trunc", "tis_mode='trunc' is invalid (did you mean 'truncate'?): allowed values are truncate, clip, "
                          "mask, icepop"),
    ("rs_batch_gate", "{k4: 0.05}", "rs_batch_gate: unknown statistic 'k4'"),
    ("rs_batch_gate", "{k3: 0}", "rs_batch_gate.k3=0 is invalid: allowed values are finite positive numbers"),
    ("rs_batch_gate_scope", "dpp", "rs_batch_gate_scope='dpp' is invalid (did you mean 'dp'?)"),
    ("metrics_low_prob_threshold", "0", "metrics_low_prob_threshold=0 is invalid: allowed values are finite positive"),
    ("tis_bounds", "0.5_2", "tis_bounds: 0.5_2 is invalid: YAML reads an unquoted 0.5_2 as the number 0.52"),
    ("use_tis", "'yes'", "'yes' is invalid: --use-tis is a switch, allowed values are the YAML booleans true or false"),
])
def test_mis_set_and_the_config_file_give_the_same_error(tmp_path, key, text, core):
    file_message, path = yaml_error(tmp_path, f"{key}: {text}\n", *WITH_PLUGIN)
    flag_message = mis_set_error(f"{key}={text}")
    assert core in file_message and core in flag_message
    assert file_message.startswith(f"{path}: ") and flag_message.startswith(f"--mis-set {key}")
    # the same words after the prefix that names where the value comes from
    assert file_message[file_message.index(core):] == flag_message[flag_message.index(core):]


def test_mis_set_without_a_correction_function_is_an_error_like_the_file_key(tmp_path):
    message = mis_set_error("tis_mode=mask", flags=("--use-tis",))
    assert message == ("--mis-set tis_mode is a miles_mis config key, but no --custom-tis-function-path is given, so "
                       "the built-in TIS would silently ignore it: add --custom-tis-function-path "
                       "miles_mis.compute_mis_weights_with_cp (flag or YAML key)")
    file_message, path = yaml_error(tmp_path, "tis_mode: mask\n", "--use-tis")
    assert file_message == f"{path}: key 'tis_mode'" + message[len("--mis-set tis_mode"):]
    # the function named in the file counts, as for the file's own keys
    path.write_text(f"custom_tis_function_path: {PLUGIN}\n")
    args = reference_host.parse_args(["--use-tis", "--custom-config-path", str(path), "--mis-set", "tis_mode=mask"])
    assert args.tis_mode == "mask"


def test_mis_set_use_tis_is_named_in_flag_combination_errors():
    message = mis_set_error("use_tis=true", flags=("--use-rollout-logprobs", "--custom-tis-function-path", PLUGIN))
    assert "mutually exclusive" in message and message.endswith("(flags and --mis-set use_tis together)")


def test_mis_set_in_a_config_file_is_an_error(tmp_path):
    message, path = yaml_error(tmp_path, "mis_set: [tis_mode=clip]\n", *WITH_PLUGIN)
    assert message == (f"{path}: key 'mis_set' (--mis-set) is a command-line flag only: set the keys it would set "
                       "directly in this file (KEY: VALUE)")


def test_lab_mis_set_reaches_the_lab_args_and_its_errors_are_one_line(tmp_path):
    from miles_mis.lab.train import parse_args

    args = parse_args([*WITH_PLUGIN, "--mis-set", "rs_batch_gate={k3: 0.05}", "--mis-set",
                       "metrics_low_prob_threshold=0.05"])
    assert args.rs_batch_gate == {"k3": 0.05} and args.metrics_low_prob_threshold == 0.05
    out = subprocess.run([sys.executable, "-m", "miles_mis.cli", "train", *WITH_PLUGIN, "--mis-set", "tis_mod=clip"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" not in out.stderr and out.stderr.count("\n") == 1
    assert out.stderr.startswith("error: --mis-set tis_mod: unknown key 'tis_mod' (did you mean 'tis_mode'?)")


# ---------------------------------------------------------------- the host reads the config as MisConfig does
from test_config import INVALID_SETTINGS, VALID_SETTINGS, settings_ids  # noqa: E402 (the cases of test_config)

# use_tis is also the host's --use-tis switch: the host checks it as that flag first (test_mis_set_and_the_config_...)
HOST_INVALID_SETTINGS = [setting for setting in INVALID_SETTINGS if setting[0] != "use_tis"]


@pytest.mark.parametrize("key, values, text", VALID_SETTINGS, ids=settings_ids(VALID_SETTINGS))
def test_host_config_file_gives_the_config_of_from_yaml(tmp_path, key, values, text):
    import dataclasses

    from miles_mis import MisConfig

    current = ["--pass-current-log-probs"] if values.get("tis_policy") == "current" else []  # the host passes π_θ
    args, path = parse_with_yaml(tmp_path, text + "\n", *WITH_PLUGIN, *current)
    expected = MisConfig.from_yaml(path)
    expected = expected if "use_tis" in values else dataclasses.replace(expected, use_tis=True)  # --use-tis
    assert MisConfig.from_args(args) == expected


@pytest.mark.parametrize("key, values, text", HOST_INVALID_SETTINGS, ids=settings_ids(HOST_INVALID_SETTINGS))
def test_host_config_file_gives_the_error_of_from_yaml(tmp_path, key, values, text):
    from miles_mis import MisConfig

    message, path = yaml_error(tmp_path, text + "\n", *WITH_PLUGIN)
    with pytest.raises(ValueError) as info:
        MisConfig.from_yaml(path)
    assert message == str(info.value)


def test_the_host_namespace_holds_no_config_key_it_was_not_given():
    # from_args reads a present attribute as given (tis_bounds with an explicit bound is an error): a host that
    # set every config key to its default would make every tis_bounds an error
    from miles_mis import MisConfig
    from miles_mis.lab.train import parse_args as lab_parse_args

    for args in (reference_host.parse_args(list(WITH_PLUGIN)), lab_parse_args(list(WITH_PLUGIN))):
        assert set(vars(args)) & set(MisConfig.keys()) == {"use_tis"}  # the --use-tis flag only


BOUNDS_CONFLICT = ("tis_bounds='0.5_3' is given with {given}: tis_bounds sets tis_lower_bound and tis_upper_bound, "
                   "so give either tis_bounds or the two bounds, not both")


@pytest.mark.parametrize("bound, given", [("tis_upper_bound: 2.0", "tis_upper_bound=2.0"),
                                          ("tis_lower_bound: null", "tis_lower_bound=null"),
                                          ("tis_upper_bound: 3.0", "tis_upper_bound=3.0")])
def test_host_tis_bounds_works_alone_and_fails_with_a_bound(tmp_path, bound, given):
    from miles_mis import MisConfig

    args, path = parse_with_yaml(tmp_path, 'tis_mode: icepop\ntis_bounds: "0.5_3"\n', *WITH_PLUGIN)
    config = MisConfig.from_args(args)
    assert (config.tis_lower_bound, config.tis_upper_bound) == (0.5, 3.0)
    # the bound in the same file: the file's error, as from_yaml and check-config give it
    message, path = yaml_error(tmp_path, f'tis_mode: icepop\ntis_bounds: "0.5_3"\n{bound}\n', *WITH_PLUGIN)
    assert message == f"{path}: " + BOUNDS_CONFLICT.format(given=given)
    # the bound from --mis-set over a file with tis_bounds: the same words, naming --mis-set and the file
    path.write_text('tis_mode: icepop\ntis_bounds: "0.5_3"\n')
    key, _, value = bound.partition(": ")
    message = mis_set_error(f"{key}={'' if value == 'null' else value}",
                            flags=(*WITH_PLUGIN, "--custom-config-path", str(path)))
    assert message == f"--mis-set {key} (with the keys of {path}): " + BOUNDS_CONFLICT.format(given=given)


def test_check_config_and_the_host_refuse_tis_bounds_with_a_bound_alike(tmp_path, capsys):
    from miles_mis import cli

    message, path = yaml_error(tmp_path, 'tis_mode: icepop\ntis_bounds: "0.5_3"\ntis_upper_bound: 2.0\n', *WITH_PLUGIN)
    capsys.readouterr()
    assert cli.main(["check-config", str(path), "--use-tis"]) == 1
    assert capsys.readouterr().err == f"error: {message}\n"
