"""A small synthetic micro-batch with a genuine numeric mismatch, for ``miles-mis plugin-demo``, the tests and
examples/call_like_a_host.py.

Logits are random (seeded); the "trainer" scores sampled tokens with a float32 log-softmax of the
logits, the "rollout engine" samples and scores them from the same logits rounded to bfloat16, as
a bf16 inference kernel would. Nothing here is a real model: it is a reproducible stand-in for one
micro-batch; real RL runs with their engines' mismatch are the lab's (``miles_mis.lab``, ``miles-mis demo``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def make_example_batch(num_seqs: int = 32, max_len: int = 256, vocab: int = 512, seed: int = 0,
                       rollout_dtype: torch.dtype = torch.bfloat16, logit_scale: float = 4.0
                       ) -> dict[str, list[Tensor] | list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max_len // 4, max_len + 1, (num_seqs,), generator=gen)
    logits = torch.randn(int(lengths.sum()), vocab, generator=gen) * logit_scale
    train_all = torch.log_softmax(logits, dim=-1)
    rollout_all = torch.log_softmax(logits.to(rollout_dtype).float(), dim=-1)
    tokens = torch.multinomial(rollout_all.exp(), 1, generator=gen).squeeze(1)
    train = train_all.gather(1, tokens[:, None]).squeeze(1)
    rollout = rollout_all.gather(1, tokens[:, None]).squeeze(1)
    masks = torch.ones_like(train)
    # every third sequence is "multi-turn": a tool-output span in the middle is not trained
    split = lengths.tolist()
    masks_list = list(torch.split(masks, split))
    for i in range(0, num_seqs, 3):
        n = split[i]
        masks_list[i][n // 3: n // 3 + n // 10] = 0.0
    prompt = 64
    return {
        "train_log_probs": list(torch.split(train, split)),
        "rollout_log_probs": list(torch.split(rollout, split)),
        "loss_masks": masks_list,
        "response_lengths": split,
        "total_lengths": [n + prompt for n in split],
    }
