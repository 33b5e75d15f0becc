"""Host flags: a --custom-config-path YAML value goes through the same conversion, choices and range checks
as its flag; file plugins are executed once; --help shows the defaults; `miles-mis ... | head` is quiet."""

import subprocess
import sys

import pytest
import torch

from miles_mis import host

PLUGIN = "miles_mis.compute_mis_weights_with_cp"


def parse_with_yaml(tmp_path, text, *flags, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return host.parse_args([*flags, "--custom-config-path", str(path)]), path


def yaml_error(tmp_path, text, *flags):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        host.parse_args([*flags, "--custom-config-path", str(path)])
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
        host.parse_args(argv)
    for word in words:
        assert word in str(info.value)


def test_defaults_and_range_edges_are_valid():
    args = host.parse_args([])
    assert (args.eps_clip, args.eps_clip_high, args.eps_clip_c, args.tis_clip, args.tis_clip_low,
            args.opsm_delta) == (0.2, None, None, 2.0, 0.0, 1e-4)
    args = host.parse_args(["--tis-clip-low", "0", "--opsm-delta", "0", "--eps-clip-c", "1.01", "--eps-clip", "1e-4"])
    assert (args.tis_clip_low, args.opsm_delta, args.eps_clip_c, args.eps_clip) == (0.0, 0.0, 1.01, 1e-4)


def test_one_message_style_for_the_flag_and_the_yaml(tmp_path):
    with pytest.raises(ValueError) as flag:
        host.parse_args(["--eps-clip", "-0.5"])
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

    dests = {action.dest for action in host.build_parser()._actions} - {"help"}
    assert HOST_FLAG_KEYS == dests - {"use_tis", "custom_config_path"}


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
        host.parse_args(["--custom-config-path", str(missing)])
    assert str(info.value).startswith(f"{missing}: cannot read the file")


# ---------------------------------------------------------------- file plugins are executed once
def test_file_plugin_is_executed_once_per_process(tmp_path):
    log = tmp_path / "imports.log"
    path = write_plugin(tmp_path, log)
    args = host.parse_args(["--use-tis", "--custom-tis-function-path", path])
    current = [torch.zeros(3, requires_grad=True)]
    batch = dict(advantages=[torch.ones(3)], log_probs=[torch.zeros(3)], rollout_log_probs=[torch.zeros(3)],
                 loss_masks=[torch.ones(3)], response_lengths=[3], total_lengths=[5])
    for _ in range(3):
        host.policy_loss(args, batch, current)
    assert log.read_text() == "imported\n"
    # the same file under another spelling of its path is the same module
    same = host.load_function(str(tmp_path / "." / "my_plugin.py") + ":correct")
    assert same is host.load_function(path) and log.read_text() == "imported\n"


# ---------------------------------------------------------------- --help
def test_help_shows_defaults():
    text = " ".join(host.build_parser().format_help().split())
    for part in ["--eps-clip EPS_CLIP PPO clip range below 1, > 0 (default: 0.2)", "(default: 0.0)", "(default: 0.0001)",
                 "--loss-type {ppo,reinforce}", "(default: ppo)", "(default: thd)", "(default: 2.0)"]:
        assert part in text, part
    from miles_mis.lab.train import build_parser

    lab = " ".join(build_parser().format_help().split())
    assert "(default: 0.2)" in lab and "--steps STEPS RL steps (rollout batches), >= 0 (default: 60)" in lab and "(default: bf16)" in lab
    assert lab.count("(default: 0.2)") == 1


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
        host.parse_args(["--use-tis", "--custom-tis-function-path", f"{plugin}:f"])


def test_a_function_path_without_a_module_is_named():
    with pytest.raises(ValueError, match=r"^--custom-tis-function-path 'func' is invalid: expected pkg.module.func"):
        host.parse_args(["--use-tis", "--custom-tis-function-path", "func"])


@pytest.mark.parametrize("text, expected", [("010", 10.0), ("1.0e-1", 0.1), ("0.3", 0.3), ("2", 2.0)])
def test_yaml_numbers_are_read_from_their_text_like_the_command_line(tmp_path, text, expected):
    config = tmp_path / "flags.yaml"
    config.write_text(f"eps_clip: {text}\n")  # YAML 1.1 alone would read 010 as the octal 8
    assert host.parse_args(["--custom-config-path", str(config)]).eps_clip == expected
    assert host.parse_args(["--eps-clip", text]).eps_clip == expected


@pytest.mark.parametrize("text", ["0x10", "1:30"])
def test_yaml_numbers_the_command_line_refuses_are_refused(tmp_path, text):
    config = tmp_path / "flags.yaml"
    config.write_text(f"eps_clip: {text}\n")
    with pytest.raises(ValueError, match=r"flags\.yaml: key 'eps_clip' \(--eps-clip\)"):
        host.parse_args(["--custom-config-path", str(config)])
    with pytest.raises(SystemExit):
        host.parse_args(["--eps-clip", text])


def test_miles_mis_keys_without_a_correction_function_are_an_error(tmp_path):
    config = tmp_path / "mis.yaml"
    config.write_text("tis_mode: mask\n")  # with the built-in TIS nothing would read it
    with pytest.raises(ValueError, match=r"mis\.yaml: key 'tis_mode' is a miles_mis config key, but no "
                                         r"--custom-tis-function-path is given"):
        host.parse_args(["--use-tis", "--custom-config-path", str(config)])
    args = host.parse_args(["--use-tis", "--custom-config-path", str(config), "--custom-tis-function-path",
                            "miles_mis.compute_mis_weights_with_cp"])
    assert args.tis_mode == "mask"
