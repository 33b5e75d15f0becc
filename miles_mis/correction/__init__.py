"""The correction core: pure functions on packed (concatenated) per-sequence tensors.

One call (``correct``, in ``pipeline``: the one function that knows the stage order) runs its stages in order, each
vectorised over the whole batch (no Python loop over sequences, so the number of tensor operations does not grow
with the batch size):

1. ``token_terms``   per-token quantities of this rank's tokens (log ratio, token-level decisions);
2. ``batch_values``  a fixed-size vector of batch sums (``local_batch_values``, combined over the CP group in its
                     agreement), then the adaptive token-level bound chosen from it (``bound_token_terms``);
3. ``seq_table``     per-sequence sums and extremes, one [B, K] table with a named schema (``local_table``,
                     combined over the CP group);
4. ``finalize``      sequence-level decisions, weights, normalisation and metrics.

Every formula is written once here and once in docs/math.md. The packed tensors are ``miles_mis.tensors.packed_batch``.
"""

from .batch_values import combine_batch_values
from .finalize import Correction
from .pipeline import LOCAL, LocalReductions, Reductions, correct
from .seq_table import TableSchema
from .token_terms import TokenTerms

__all__ = ["LOCAL", "Correction", "LocalReductions", "Reductions", "TableSchema", "TokenTerms",
           "combine_batch_values", "correct"]
