"""What a host passes, read once (`host_call`: one `HostCall` per entry point call): the per-sequence lists or flat
tensors validated and packed into one `PackedBatch` (`packing`), and the optional inputs (lags, advantages, split
rollouts, sampling masks, from the host or, through `batch_channel`, from a host adapter), each read in its own
module."""

from .batch_channel import BATCH_INPUTS, BatchChannel, Deferred
from .host_call import HostCall, LogProbLists, config_text, read_flat, read_lists
from .packing import InputError, PackedInputs, pack_flat, pack_sequences, tensor_problem

__all__ = ["BATCH_INPUTS", "BatchChannel", "Deferred", "HostCall", "InputError", "LogProbLists", "PackedInputs",
           "config_text", "pack_flat", "pack_sequences", "read_flat", "read_lists", "tensor_problem"]
