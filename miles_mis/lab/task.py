"""A verifiable toy task: sort the prompt's digits. The reward is computed in code.

Prompt:   BOS d1 d2 ... dn SEP        Answer: the digits in ascending order, then EOS.
Reward:   fraction of answer positions right (compared position by position over the longer of the
          answer and the response, EOS included), so partial credit is given and 1.0 means exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

DIGITS = 10
SEP, EOS, BOS, PAD = 10, 11, 12, 13
VOCAB_SIZE = 14


def make_prompts(count: int, num_digits: int, generator: torch.Generator) -> Tensor:
    digits = torch.randint(0, DIGITS, (count, num_digits), generator=generator)
    bos = torch.full((count, 1), BOS)
    sep = torch.full((count, 1), SEP)
    return torch.cat([bos, digits, sep], dim=1)


def target(prompt: Tensor) -> Tensor:
    digits = prompt[1:-1]
    return torch.cat([digits.sort().values, torch.tensor([EOS])])


def reward(prompt: Tensor, response: Tensor) -> float:
    answer = target(prompt)
    length = max(answer.numel(), response.numel())
    matches = (answer[:response.numel()] == response[:answer.numel()]).sum().item()
    return matches / length
