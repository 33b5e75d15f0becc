"""The reference host: a small layer that behaves like miles' policy loss, with miles' flags, for running and
testing a correction plugin as miles would call it; :mod:`.flags` parses and validates the flags (with the
``--custom-config-path`` file and ``--mis-set`` keys merged) and loads the correction function, :mod:`.loss`
computes the policy loss of one micro-batch, and this package re-exports the names of both. :mod:`.cp_shards` is the
host's own reading of Megatron's zigzag context-parallel layout (which response tokens a CP rank holds).
"""

from .flags import (COMMAND_LINE_ONLY, FLAG_RANGES, LOSS_DENOMINATORS, MIS_SET_EXAMPLES, HelpFormatter,
                    apply_mis_set, build_parser, check_flag_range, convert_config_values, flag_name, is_packed_entry,
                    load_function, merge_config_file, mis_set_keys, packed_cp_message, parse_args, parse_mis_set,
                    validate_args)
from .loss import (AGREED_FLAGS, LOG_RATIO_CLAMP, Reducer, call_packed, host_config_text, mask_sums, opsm_keep,
                   optional_kwargs_taken, policy_loss, ppo_clip_loss, safe_ratio, sample_denominators, vanilla_tis)
from .score_centering import score_centering_loss

__all__ = [
    "AGREED_FLAGS", "COMMAND_LINE_ONLY", "FLAG_RANGES", "LOG_RATIO_CLAMP", "LOSS_DENOMINATORS", "MIS_SET_EXAMPLES",
    "HelpFormatter", "Reducer", "apply_mis_set", "build_parser", "call_packed", "check_flag_range",
    "convert_config_values", "flag_name", "host_config_text", "is_packed_entry", "load_function", "mask_sums",
    "merge_config_file", "mis_set_keys", "opsm_keep", "optional_kwargs_taken", "packed_cp_message", "parse_args",
    "parse_mis_set", "policy_loss", "ppo_clip_loss", "safe_ratio", "sample_denominators", "validate_args",
    "vanilla_tis",
]
__all__ += ["score_centering_loss"]
