"""The mismatch lab: a real GRPO run on a CPU where the rollout engine and the trainer disagree.

- ``model``: a tiny decoder-only transformer; the trainer's fp32 full-sequence forward.
- ``engine``: the rollout engine: a separate incremental (KV-cache) decoder with its own copy of the
  weights, in bf16/fp16/fp32, optionally int8-quantised at every sync, synced every K steps.
- ``task``: a verifiable toy task (sort digits) and its reward.
- ``train``: the GRPO loop around the reference host's policy loss (``miles-mis train``); its flags are in
  ``flags`` (shared with ``measure``), its rollout batches in ``rollout_collection``, its progress, W&B run and
  closing line in ``run_output``.
- ``measure``: an engine's mismatch on the lab's model, without training (``miles-mis measure``).
- ``demo``: four algorithms on one seed and one mismatch setting (``miles-mis demo``).
"""

__all__: list[str] = []  # its commands run as `miles-mis demo|train|measure`; its modules are imported by name
