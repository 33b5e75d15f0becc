"""The reference host's own reading of which response tokens a context-parallel (CP) rank holds.

The host is an oracle for the plugin, so it does not borrow the plugin's layout code (``miles_mis.parallel``): this
module restates the layout from the trainers' sources, one sequence at a time, in plain Python. What was read:

- NVIDIA/Megatron-LM, ``megatron/core/utils.py`` at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553:
  ``get_batch_on_this_cp_rank`` and the helpers it dispatches to (``_get_batch_on_this_cp_rank_per_sequence_balancing``
  and, for packed documents, ``_get_batch_on_this_cp_rank_per_document_balancing``). A sequence whose length is a
  multiple of 2·C (C the CP size) is cut into 2·C equal chunks; rank r keeps chunk r and chunk 2·C−1−r, in that
  order, so each rank has one early and one late chunk of the causal attention's work.
- radixark/miles at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76:
  ``miles/backends/training_utils/cp_utils.py`` (``slice_with_cp``, ``get_logits_and_tokens_offset_with_cp``,
  ``slice_log_prob_with_cp``), ``miles/backends/training_utils/data.py`` (``get_batch``) and
  ``miles/backends/training_utils/loss_hub/logit_processors.py`` (the CP branch of the response iterator).
  (Older miles kept the first two under ``miles/backends/megatron_utils/``.)

The facts this module is written from:

1. Padding. miles pads each sequence at its end (pad token 0) to 2·C·c positions, c = ceil(S / (2·C)), and takes
   chunks r and 2·C−1−r of c positions each. S is the sequence's own total length T (prompt + response) for qkv
   format "thd", and the micro-batch's ``max_seq_len`` for "bshd" (``get_batch`` asserts every sequence fits in it).
   Only c depends on the format; the chunk rule is the same.
2. Log-probs. The logit at position p predicts the token at position p + 1. A response of R tokens after a prompt
   of P = T − R tokens occupies token positions P .. T−1, so its log-probs come from logit positions P−1 .. T−2;
   the response's first token is scored by the prompt's last position, which is why a prompt has at least one token.
3. The local shard. A rank's log-probs of one sequence are those whose logit position lies in its first chunk, then
   those in its second chunk (``slice_log_prob_with_cp`` concatenates the two parts in that order); a part may be
   empty, and pad positions (p ≥ T−1) score no response token. With C = 1 nothing is cut.

Here the rule is applied token by token through fact 2: a rank holds response token q (P ≤ q ≤ T−1, response
offset q − P) exactly when the logit position q − 1 lies in one of its two chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

QKV_FORMATS = ("thd", "bshd")


def chunks_of_rank(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices rank ``cp_rank`` keeps, in the order its shard lists them: r, then 2·C−1−r."""
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} is invalid: allowed values are integers >= 1")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is invalid: allowed values are 0 .. {cp_size - 1} (cp_size={cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def chunk_length(padded_over: int, cp_size: int) -> int:
    """c = ceil(S / (2·C)): the positions in each of the 2·C chunks of a sequence padded to 2·C·c positions."""
    pieces = 2 * cp_size
    return (padded_over + pieces - 1) // pieces


def sequence_shard(total_length: int, response_length: int, cp_rank: int, cp_size: int, qkv_format: str = "thd",
                   max_seq_len: int | None = None) -> list[int]:
    """The response offsets (0 .. R−1) whose log-probs rank ``cp_rank`` holds for one sequence, in local order."""
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format={qkv_format!r} is invalid: allowed values are {', '.join(QKV_FORMATS)}")
    prompt_length = total_length - response_length
    if response_length < 0 or prompt_length < 1:
        raise ValueError(f"total length {total_length} with response length {response_length} is invalid: allowed "
                         "values have a response length >= 0 and at least one prompt token (its last position scores "
                         "the first response token)")
    first_chunk, second_chunk = chunks_of_rank(cp_rank, cp_size)
    if cp_size == 1:
        return list(range(response_length))
    if qkv_format == "thd":
        padded_over = total_length
    else:
        if max_seq_len is None:
            raise ValueError("qkv_format 'bshd' pads every sequence to max_seq_len: max_seq_lens is required")
        if max_seq_len < total_length:
            raise ValueError(f"max_seq_len {max_seq_len} is shorter than the sequence's total length {total_length}")
        padded_over = max_seq_len
    c = chunk_length(padded_over, cp_size)
    held = []
    for chunk in (first_chunk, second_chunk):
        logit_positions = range(chunk * c, (chunk + 1) * c)
        for token in range(prompt_length, total_length):  # the response's tokens, in order
            if token - 1 in logit_positions:
                held.append(token - prompt_length)
    return held


def rank_shards(total_lengths: Sequence[int], response_lengths: Sequence[int], cp_rank: int, cp_size: int,
                qkv_format: str = "thd", max_seq_lens: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """For a micro-batch: (each sequence's local length on this rank, and the indices of the rank's tokens into the
    concatenation of the full responses, sequence after sequence, each in local order)."""
    if qkv_format not in QKV_FORMATS:  # the batch's settings first: refused even for an empty batch
        raise ValueError(f"qkv_format={qkv_format!r} is invalid: allowed values are {', '.join(QKV_FORMATS)}")
    chunks_of_rank(cp_rank, cp_size)
    if len(total_lengths) != len(response_lengths):
        raise ValueError(f"{len(total_lengths)} total lengths but {len(response_lengths)} response lengths")
    if qkv_format == "bshd" and max_seq_lens is None and cp_size > 1:
        raise ValueError("qkv_format 'bshd' pads every sequence to max_seq_len: max_seq_lens is required")
    if max_seq_lens is not None and len(max_seq_lens) != len(total_lengths):
        raise ValueError(f"{len(max_seq_lens)} max_seq_lens but {len(total_lengths)} sequences")
    lengths, indices = [], []
    start = 0  # where this sequence's response begins in the concatenation of the full responses
    for i, (total, response) in enumerate(zip(total_lengths, response_lengths)):
        span = None if max_seq_lens is None else int(max_seq_lens[i])
        try:
            offsets = sequence_shard(int(total), int(response), cp_rank, cp_size, qkv_format, span)
        except ValueError as error:
            raise ValueError(f"sequence {i}: {error}") from None
        lengths.append(len(offsets))
        indices.extend(start + offset for offset in offsets)
        start += int(response)
    return lengths, indices
