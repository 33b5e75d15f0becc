"""What a host passes, validated and packed: the per-sequence lists or flat tensors into one `PackedBatch`
(`packing`), and the optional inputs (lags, advantages, split rollouts, sampling masks, and those a host adapter
provides), each read in its own module."""

from .packing import InputError, PackedInputs, pack_flat, pack_sequences, tensor_problem

__all__ = ["InputError", "PackedInputs", "pack_flat", "pack_sequences", "tensor_problem"]
