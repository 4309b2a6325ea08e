"""Per-request logits processing before sampling: logit_bias, min_tokens, and the repetition,
frequency and presence penalties (vLLM's and OpenAI's semantics), batched over the rows that use them.

Order (as vLLM's sampler): logit_bias is added and, below min_tokens, EOS and the stop token ids
are forbidden; then the penalties: repetition (over prompt + output tokens: a positive logit is
divided by it, a negative one multiplied), frequency (minus f x the token's count in the output)
and presence (minus p if it occurs in the output). Temperature, top-k/p and the grammar mask come
after. Every row a request samples is processed with the tokens it has at that row — a speculative
step's row j counts the first j draft tokens as generated, so speculation stays exact.
Rows of requests without any of these pass through untouched (no copy).
"""

from __future__ import annotations

import array
from typing import Any

import torch

from kernels import native_cpu


def active(params: Any) -> bool:
    return bool(params.logit_bias or params.min_tokens or params.repetition_penalty != 1.0
                or params.frequency_penalty or params.presence_penalty)


def process(rows: torch.Tensor, reqs: list[Any], extra: list[list[int]] | None = None) -> torch.Tensor:
    """rows [N, V'] of logits, one per (request, extra generated tokens) pair; returns the processed
    rows (the input when no request needs processing)."""
    todo = [i for i, r in enumerate(reqs) if active(r.params)]
    if not todo:
        return rows
    rows = rows.clone()
    vocab = rows.shape[1]
    dev = rows.device
    for i in todo:  # the per-row parts that are a few indices each
        r, p = reqs[i], reqs[i].params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            rows[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=rows.dtype, device=dev)
        generated = r.num_output_tokens + (len(extra[i]) if extra else 0)
        if generated < p.min_tokens:
            banned = [t for t in (*r.eos_token_ids, *p.stop_token_ids) if t < vocab]
            rows[i, banned] = float("-inf")
    pen = [i for i in todo if _penalized(reqs[i].params)]
    if pen:
        _penalize(rows, reqs, pen, extra)
    return rows


def _penalize(rows: torch.Tensor, reqs: list[Any], pen: list[int], extra: list[list[int]] | None) -> None:
    """The three penalties on rows `pen`, in place, touching only the (row, token) entries they change:
    the tokens a request has seen, not its whole vocabulary row. Why: the shipped model's generation
    config asks for repetition_penalty 1.2, so every request served with its defaults takes this path,
    and a per-request loop of vocabulary-wide tensors cost ~20% of a decode worker's time at 64
    requests (one tensor of indices for the whole batch instead)."""
    dev, vocab = rows.device, rows.shape[1]
    if _penalize_native(rows, reqs, pen, extra):
        return
    seqs = [reqs[i].token_array() for i in pen]  # prompt + output, int64
    if extra:
        seqs = [q + array.array("q", extra[i]) if extra[i] else q for q, i in zip(seqs, pen)]
    lens = torch.tensor([len(q) for q in seqs], dtype=torch.long)
    flat = torch.frombuffer(bytearray(b"".join(seqs)), dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(pen)), lens)
    starts = torch.cumsum(lens, 0) - lens
    prompt_lens = torch.tensor([reqs[i].num_prompt_tokens for i in pen], dtype=torch.long)
    is_output = torch.arange(len(flat)) - starts[owner] >= prompt_lens[owner]
    row_of = torch.tensor(pen, dtype=torch.long)
    params = [reqs[i].params for i in pen]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=rows.dtype)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=rows.dtype)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=rows.dtype)
    # repetition: every value is computed from the logits before any is written, so a token seen twice
    # is written twice with the same value: no need to deduplicate (a sort of all the ids) first
    r_idx, t_idx = row_of[owner].to(dev), flat.to(dev)
    vals = rows[r_idx, t_idx]
    f = rep[owner].to(dev)
    rows[r_idx, t_idx] = scale_repeated(vals, f)
    # frequency and presence: once per distinct output token, with its count
    if bool((freq != 0).any() or (pres != 0).any()) and bool(is_output.any()):
        keys, counts = torch.unique((owner * vocab + flat)[is_output], return_counts=True)
        who, tok = keys // vocab, keys % vocab
        r_idx, t_idx = row_of[who].to(dev), tok.to(dev)
        vals = rows[r_idx, t_idx] - (freq[who] * counts.to(rows.dtype)).to(dev)
        rows[r_idx, t_idx] = vals - pres[who].to(dev)


_marks: dict[int, torch.Tensor] = {}  # per vocabulary size: the C pass's scratch, zero between calls


def _packed(reqs: list[Any], pen: list[int], extra: list[list[int]] | None
            ) -> tuple[array.array, array.array, array.array]:
    """Every penalized row's tokens (prompt + output + its extra) as (flat, starts, lens) for the C pass.
    A speculative step's rows are one request's tokens followed by 0, 1, .. k drafts: those rows share one
    copy (row j reads a longer prefix of it) instead of k + 1 copies of the whole sequence."""
    flat, starts, lens = array.array("q"), array.array("q"), array.array("q")
    prev = None
    for i in pen:
        r, more = reqs[i], extra[i] if extra else []
        base = r.token_array()
        if prev is not None and prev[0] is r and prev[1] == more[:len(prev[1])]:
            starts.append(starts[-1])  # extends the previous row's tokens, which end `flat`: append what it adds
            flat.extend(more[len(prev[1]):])
        else:
            starts.append(len(flat))
            flat.extend(base)
            flat.extend(more)
        lens.append(len(base) + len(more))
        prev = (r, more)
    return flat, starts, lens


def _penalize_native(rows: torch.Tensor, reqs: list[Any], pen: list[int], extra: list[list[int]] | None) -> bool:
    """_penalize's work in one call of kernels/csrc/penalty_cpu.c (same values, bit for bit); False where
    it does not apply (not a contiguous fp32 CPU tensor, or no native library) and torch does it."""
    lib = native_cpu.library()
    if lib is None or rows.device.type != "cpu" or rows.dtype != torch.float32 or not rows.is_contiguous():
        return False
    vocab = rows.shape[1]
    marks = _marks.get(vocab)
    if marks is None:
        marks = _marks[vocab] = torch.zeros(vocab, dtype=torch.int32)
    params = [reqs[i].params for i in pen]
    flat, starts, lens = _packed(reqs, pen, extra)
    columns = [array.array("q", pen), array.array("q", [reqs[i].num_prompt_tokens for i in pen]),
               array.array("f", [p.repetition_penalty for p in params]),
               array.array("f", [p.frequency_penalty for p in params]),
               array.array("f", [p.presence_penalty for p in params])]
    addr = [c.buffer_info()[0] for c in (flat, starts, lens, *columns)]
    status = lib.tandem_penalize_f32(rows.data_ptr(), vocab, vocab, len(pen), addr[3], addr[0], addr[1], addr[2],
                                     addr[4], addr[5], addr[6], addr[7], marks.data_ptr())
    if status != 0:
        raise IndexError(f"a token id lies outside the logits' {vocab} columns")
    return True


def scale_repeated(logits: torch.Tensor, penalty: torch.Tensor | float) -> torch.Tensor:
    """The repetition penalty on the logits of tokens already seen: positive ones divided by it, the
    rest multiplied (CTRL's rule, as vLLM and transformers apply it). Speculators' drafts apply it too."""
    return torch.where(logits > 0, logits / penalty, logits * penalty)


def _penalized(params: Any) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.frequency_penalty or params.presence_penalty)
