"""miles_mis: measure and correct the training–inference mismatch in LLM RL.

Load it into miles unchanged::

    --custom-tis-function-path miles_mis.compute_mis_weights_with_cp --custom-config-path configs/mis.yaml
"""

from .config import MisConfig
from .plugin import (compute_mis_weights, compute_mis_weights_fsdp, compute_mis_weights_packed,
                     compute_mis_weights_with_cp)

__version__ = "0.2.2"

__all__ = ["MisConfig", "compute_mis_weights", "compute_mis_weights_fsdp", "compute_mis_weights_packed",
           "compute_mis_weights_with_cp", "__version__"]
