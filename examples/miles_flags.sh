#!/usr/bin/env bash
# The flags to add to a miles (or slime) launch script. miles_mis must be importable by the trainer
# processes (pip install -e /path/to/miles_mis in the training image, or on PYTHONPATH).

# Decoupled 3-policy PPO with the miles default correction (token TIS + token RS + veto + normalisation):
MIS_ARGS=(
   --use-tis
   --custom-tis-function-path miles_mis.compute_mis_weights_with_cp
   --custom-config-path configs/mis.yaml
)

# Monitoring only: the same file, no --use-tis; the loss is untouched, mis_* metrics are logged.
MONITOR_ARGS=(
   --get-mismatch-metrics
   --custom-tis-function-path miles_mis.compute_mis_weights_with_cp
   --custom-config-path configs/mis.yaml
)

echo "${MIS_ARGS[@]}"
echo "${MONITOR_ARGS[@]}"
