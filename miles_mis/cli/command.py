"""The ``miles-mis`` command.

  miles-mis demo                            the mismatch lab: four algorithms, one seed, one engine setting
  miles-mis train [flags]                   one lab run (miles' host flags plus the lab's)
  miles-mis measure [flags]                 an engine's mismatch on the lab's model (e.g. --model smollm2-135m),
                                            where it lives and what each shipped config does, without training
  miles-mis admit DUMP_DIR | [lab flags]    the model-admission check (every step's k3 < 0.015, the drift) on
                                            dumps of miles, slime, prime-rl or NeMo RL, or on the lab's model
  miles-mis check-config FILE [--use-tis]   print the effective config (defaults filled in) or the error
  miles-mis analyze DUMP_DIR [--out-dir D]  read miles, slime, prime-rl or NeMo RL dumps: where the mismatch
                                            lives, which correction (--write-config F), two dumps side by side
                                            (--compare)
  miles-mis plugin-demo [--configs-dir DIR] run the plugin on a shipped example batch with every config
                                            in configs/ and print the host-reduced metrics side by side
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from ..config import MisConfig, yaml_value


def _default_configs_dir() -> Path:
    from ..config import preset_files

    files = preset_files()
    return next(iter(files.values())).parent if files else Path("configs")


def check_config(path: str, use_tis: bool | None) -> int:
    from .. import reference_host
    from ..config import HOST_FLAG_KEYS, load_yaml_mapping

    try:
        values = load_yaml_mapping(path)
        cfg = MisConfig.from_dict(values, source=path)
        # host flag keys: converted and checked as the host's --custom-config-path does it
        flags = reference_host.convert_config_values({k: v for k, v in values.items() if k in HOST_FLAG_KEYS},
                                                     source=path)
        if use_tis is not None and "use_tis" not in values:
            cfg = dataclasses.replace(cfg, use_tis=use_tis)
        # the flag combinations the host refuses (a file that sets use_rollout_logprobs with use_tis, ...), as the
        # host sees them: its defaults, the file's keys, and this plugin as the correction function
        args = reference_host.build_parser().parse_args([])
        # a host that runs tis_policy: current passes the current policy (ours with --pass-current-log-probs)
        vars(args).update(values, **flags, custom_config_path=path, use_tis=cfg.use_tis)
        if "pass_current_log_probs" not in values:
            args.pass_current_log_probs = cfg.tis_policy == "current"
        args.custom_tis_function_path = args.custom_tis_function_path or "miles_mis.compute_mis_weights_with_cp"
        try:
            reference_host.validate_args(args)
        except ValueError as error:
            raise ValueError(str(error) if str(error).startswith(path) else f"{path}: {error}") from None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    keys = set(values)
    if "tis_bounds" in keys:
        keys |= {"tis_lower_bound", "tis_upper_bound"}  # resolved from the tis_bounds alias
    print(f"# effective config of {path}")
    for key, value in cfg.to_dict().items():
        if key == "tis_bounds":  # an input alias, already resolved into the two bounds
            continue
        origin = "" if key in keys else "   # default" + (" (host flag --use-tis)" if key == "use_tis" else "")
        print(f"{key}: {yaml_value(value)}{origin}")
    if cfg.tis_policy == "current":
        print("# tis_policy is current: the host must pass the current policy's log-probs (cur_log_probs or "
              "current_log_probs; the reference host: --pass-current-log-probs)")
    if "use_tis" in keys:
        print("# use_tis is set in the file: it overrides the host's --use-tis flag")
    elif not cfg.use_tis:
        print("# use_tis is false: metrics-only mode (pg_loss and masks unchanged) unless the host passes --use-tis")
    return 0


def _yaml_keys(path: str) -> set[str]:
    from ..config import load_yaml_mapping

    return set(load_yaml_mapping(path))


def plugin_demo(configs_dir: Path) -> int:
    from ..plugin import compute_mis_weights_with_cp
    from .example_batch import make_example_batch
    from .reporting import format_table, reduce_metrics

    files = sorted(configs_dir.glob("*.yaml"))
    if not files:
        print(f"error: no *.yaml configs in {configs_dir}", file=sys.stderr)
        return 1
    batch = make_example_batch()
    num_tokens = sum(int(m.sum()) for m in batch["loss_masks"])
    print(f"example micro-batch: {len(batch['loss_masks'])} sequences, {num_tokens} trained tokens; "
          "rollout log-probs from bf16-rounded logits, trainer log-probs in fp32 (synthetic logits)\n")
    columns = {}
    for path in files:
        cfg = MisConfig.from_yaml(path)
        if "use_tis" not in _yaml_keys(str(path)):
            cfg = dataclasses.replace(cfg, use_tis=True)  # as with --use-tis
        pg_loss = torch.ones(sum(batch["response_lengths"]))
        _, masks, metrics = compute_mis_weights_with_cp(cfg, pg_loss=pg_loss, **batch)
        reduced = reduce_metrics(metrics, batch["loss_masks"])
        kept = sum(float(m.sum()) for m in masks) / max(num_tokens, 1)
        reduced["kept_token_fraction"] = kept
        columns[path.stem] = reduced
    rows = sorted({name for col in columns.values() for name in col})
    rows.remove("kept_token_fraction")
    print(format_table(["kept_token_fraction"] + rows, columns))
    print("\nvalues are the host's mean over sequences of the per-sequence masked mean; '-' = not emitted")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command; a reader that closes early (``miles-mis ... | head``) ends it quietly, exit status 1."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # inside the try: a broken pipe at the interpreter's final flush would print a traceback
        return status
    except BrokenPipeError:
        # the standard way (Python docs, "Note on SIGPIPE"): point stdout at devnull, so that the final flush
        # of what is still buffered succeeds, and exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the lab commands own their flags (miles' host flags included): hand them over untouched
    if argv and argv[0] == "admit":
        return _admit(argv[1:])
    if argv and argv[0] in ("train", "demo", "measure"):
        if argv[0] == "train":
            from ..lab.train import main as train_main

            return _run_lab(train_main, argv[1:])
        if argv[0] == "measure":
            from ..lab.measure import main as measure_main

            return _run_lab(measure_main, argv[1:])
        from ..lab.demo import main as demo_main

        return _run_lab(demo_main, argv[1:])
    parser = argparse.ArgumentParser(prog="miles-mis", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the mismatch lab demo (miles-mis demo --help)")
    sub.add_parser("train", help="one lab run (miles-mis train --help)")
    sub.add_parser("measure", help="an engine's mismatch on the lab's model, without training (miles-mis measure "
                                   "--help)")
    sub.add_parser("admit", help="the model-admission check: every step's mismatch under a bar, its drift; on a "
                                 "dump directory or the lab's model (miles-mis admit --help)")
    check = sub.add_parser("check-config", help="print the effective config of a YAML file, or its error")
    check.add_argument("file")
    check.add_argument("--use-tis", action="store_true", default=None,
                       help="as if the host passed --use-tis (when the file does not set use_tis)")
    from ..analyze.command import add_arguments as add_analyze_arguments

    add_analyze_arguments(sub.add_parser("analyze", help="read miles --dump-details dumps: where the mismatch lives, "
                                                         "which correction, a ready config",
                                         formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    demo_parser = sub.add_parser("plugin-demo", help="run the plugin on a shipped example batch with every config")
    demo_parser.add_argument("--configs-dir", type=Path, default=_default_configs_dir())
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return check_config(args.file, args.use_tis)
    if args.command == "analyze":
        from ..analyze.command import run

        return run(args)
    return plugin_demo(args.configs_dir)


def _admit(argv: list[str]) -> int:
    """``admit DUMP_DIR [flags]`` judges dumps; ``admit [lab flags]`` (no directory first) runs the lab's model."""
    if argv and not argv[0].startswith("-"):
        from ..analyze import admit_command

        parser = argparse.ArgumentParser(prog="miles-mis admit", description=admit_command.__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        admit_command.add_arguments(parser)
        return _run_lab(admit_command.run, parser.parse_args(argv))
    from ..lab.admit import build_parser as lab_admit_parser
    from ..lab.admit import main as admit_main

    # A directory after the flags is left over by the lab form's parser (it takes no positional): the user meant
    # the dump form, so say where the directory goes instead of argparse's "unrecognized arguments".
    _, leftover = lab_admit_parser().parse_known_args(argv)
    stray = [arg for arg in leftover if not arg.startswith("-") and Path(arg).is_dir()]
    if stray:
        print(f"error: {stray[0]}: put the dump directory first: miles-mis admit DUMP_DIR [flags]", file=sys.stderr)
        return 1

    return _run_lab(admit_main, argv)


def _run_lab(entry, argv: list[str]) -> int:
    try:
        return entry(argv)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

