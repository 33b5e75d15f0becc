"""The real model's verifiable task: small-number addition in a chat prompt. The reward is computed in code.

Prompt (the user turn, through the model's chat template, which adds SmolLM2's default system turn):

    What is {a} + {b}? Answer with just the number.

with a, b drawn uniformly from 0..10^d − 1 (``--num-digits d``, default 1). Reward: 1.0 when the last integer
in the response (decoded, special tokens dropped) equals a + b, else 0.0; a response that gives the sum and
then keeps talking is judged by the last number it wrote. SmolLM2-135M-Instruct (the Q4_1 wheel) starts at a
reward of about 0.2 at temperature 1 with 24 new tokens (docs/lab/smollm2.md has the candidates measured).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

QUESTION = "What is {a} + {b}? Answer with just the number."
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return QUESTION.format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a + self.b


def make_problems(count: int, num_digits: int, generator: torch.Generator) -> list[Problem]:
    if num_digits < 1:
        raise ValueError(f"--num-digits {num_digits} is invalid with --task add: allowed values are >= 1")
    operands = torch.randint(0, 10 ** num_digits, (count, 2), generator=generator).tolist()
    return [Problem(a, b) for a, b in operands]


def reward(problem: Problem, response_text: str) -> float:
    """1.0 if the last integer in the response is a + b, else 0.0."""
    numbers = _INTEGER.findall(response_text)
    return float(bool(numbers) and int(numbers[-1]) == problem.answer)
