"""Verifiable toy tasks on digit strings. The reward is computed in code.

Prompt:   BOS d1 d2 ... dn SEP
Answer:   ``sort``: the digits in ascending order, then EOS; ``reverse``: the digits last to first, then EOS
          (with ``--num-digits 64`` a 65-token response: the long-response case, where a sequence-level
          ratio is a product over many tokens).
Reward:   fraction of answer positions right (compared position by position over the longer of the
          answer and the response, EOS included), so partial credit is given and 1.0 means exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

DIGITS = 10
SEP, EOS, BOS, PAD = 10, 11, 12, 13
VOCAB_SIZE = 14
TASKS = ("sort", "reverse")


def make_prompts(count: int, num_digits: int, generator: torch.Generator) -> Tensor:
    digits = torch.randint(0, DIGITS, (count, num_digits), generator=generator)
    bos = torch.full((count, 1), BOS)
    sep = torch.full((count, 1), SEP)
    return torch.cat([bos, digits, sep], dim=1)


def target(prompt: Tensor, kind: str = "sort") -> Tensor:
    digits = prompt[1:-1]
    if kind == "sort":
        answer = digits.sort().values
    elif kind == "reverse":
        answer = digits.flip(0)
    else:
        raise ValueError(f"--task={kind!r} is invalid: allowed values are {', '.join(TASKS)}")
    return torch.cat([answer, torch.tensor([EOS])])


def reward(prompt: Tensor, response: Tensor, kind: str = "sort") -> float:
    answer = target(prompt, kind)
    length = max(answer.numel(), response.numel())
    matches = (answer[:response.numel()] == response[:answer.numel()]).sum().item()
    return matches / length
