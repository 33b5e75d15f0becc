"""Other RL stacks' per-token dumps, read into the analyzer's ``CallBatch`` so the same statistics, advice and
``--config`` evaluation run on them as on a miles dump.

``open_dump`` tells the format from the files (``detect``); each format is one module: ``prime_rl`` (prime-rl's
trainer token export) and ``nemo_rl`` (NeMo RL's ``train_data_step<N>.jsonl``); ``sequences`` holds what they
share (one JSON-lines record into one response's tensors). miles and slime dumps stay with ``..reading``.
"""

from .detect import KNOWN_FORMATS, DumpFormat, OpenedDump, open_dump

__all__ = ["KNOWN_FORMATS", "DumpFormat", "OpenedDump", "open_dump"]
