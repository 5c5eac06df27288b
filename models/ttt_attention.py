"""EAGLE-3's training-time-test attention with extra memory linear in the sequence length.

At TTT step k the query at position t attends causally to step 0's keys (positions <= t) and to its
own position's key of steps 1..k (the draft's earlier guesses for t):

    out_t = sum_{s<=t} p_s v0_s + sum_{j=1..k} p_j vj_t,    p = softmax(q_t . [k0_{<=t}, k1_t, ..., kk_t] / sqrt(d))

Written densely (``ttt_attention_dense``) every step keeps a [B, heads, T, T+k] probability matrix for
backward: 7 steps at T = 16k are tens of GB. ``ttt_attention`` computes the same in blocks of query
rows, each under activation checkpointing: forward keeps only each block's output, backward recomputes
one block's [B, heads, C, t_end] scores at a time. The softmax runs over the block's causal scores and
its diagonal terms together, in float32, exactly as the dense form does, so the two agree to float
rounding (tests/test_ttt_attention.py, forward and gradients).

On a GPU, ``ttt_attention_flex`` runs the same attention as one compiled ``flex_attention`` (Triton) call per
step over the steps' keys side by side, with a block mask: causal over step 0's keys, the own-position
diagonal over the later steps' -- so the later steps cost one [block x block] tile per query block, and
nothing of size T x T exists in forward or backward.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch.utils.checkpoint import checkpoint

FLEX_BLOCK = 128  # flex_attention's tile; sequences are padded to a multiple of it (see ttt_attention_flex)


def ttt_attention_dense(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        scale: float | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: q [B, nh, T, hd], keys/values: step 0's and steps 1..k's [B, nh, T, hd] -> [B, nh, T, hd_v].
    ``scale``: of the scores, default 1/sqrt(hd). ``documents`` [B, T] (a packed batch, models/head.py): step 0's
    key s is seen from t only when both lie in one document; the own-position keys always are."""
    return _rows(q, keys[0], values[0], keys[1:], values[1:], 0, scale, documents, documents)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], block: int = 512,
                  scale: float | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Same as ``ttt_attention_dense``: on a GPU through ``ttt_attention_flex``; elsewhere, beyond ``block``
    positions, in checkpointed blocks of query rows. ``HEADSTART_TTT_ATTENTION=blocks`` keeps the blocks on a GPU.

    A packed batch (``documents``) takes the blocks on a GPU too unless ``HEADSTART_TTT_ATTENTION=flex``: flex's
    document mask is checked against the blocks on CPU in its eager form only (CPU inductor cannot compile a mask
    that reads a tensor under dynamic shapes), and the compiled GPU kernel with it has not been run yet."""
    T = q.shape[2]
    choice = os.environ.get("HEADSTART_TTT_ATTENTION", "auto")
    if q.is_cuda and q.shape[-1] >= 16 and (choice == "flex" or (choice == "auto" and documents is None)):
        # (compiled flex_attention needs head_dim >= 16)
        return ttt_attention_flex(q, keys, values, scale=scale, documents=documents)
    if T <= block or not torch.is_grad_enabled():
        # One block (or no backward to keep anything for): the dense form is already the cheapest.
        return _rows(q, keys[0], values[0], keys[1:], values[1:], 0, scale, documents, documents)
    outs = []
    for start in range(0, T, block):
        end = min(T, start + block)
        rows = slice(start, end)
        # A packed row: the block's queries see no key before the start of its first query's document.
        first = 0 if documents is None else int(torch.searchsorted(documents, documents[:, start:start + 1]).min())
        docs = () if documents is None else (documents[:, rows], documents[:, first:end])
        outs.append(checkpoint(_block, start, first, scale, len(keys) - 1, q[:, :, rows], keys[0][:, :, first:end],
                               values[0][:, :, first:end], *[k[:, :, rows] for k in keys[1:]],
                               *[v[:, :, rows] for v in values[1:]], *docs, use_reentrant=False))
    return torch.cat(outs, dim=2)


def ttt_attention_at(q: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                     dk: list[torch.Tensor], dv: list[torch.Tensor], block: int = 512, scale: float | None = None,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """``ttt_attention``'s output at chosen positions only, for a step that runs only where a later loss reads it:
    q [1, nh, N, hd] are the queries of (batch row ``rows[i]``, position ``positions[i]``), in row-major order (as
    ``nonzero`` lists them); k0 / v0 [B, nh, T, hd] are step 0's keys at every position (every query's context);
    dk / dv: steps 1..k's keys at the chosen positions, [1, nh, N, hd] each. Checkpointed blocks of ``block``
    queries, each against the keys from its first query's document start to its last query."""
    bounds = torch.searchsorted(rows, torch.arange(k0.shape[0] + 1, device=rows.device)).tolist()  # row r: N range
    outs = []
    for r in range(k0.shape[0]):
        for start in range(bounds[r], bounds[r + 1], block):
            end = min(bounds[r + 1], start + block)
            at, sel = positions[start:end], slice(start, end)
            last = int(at[-1]) + 1
            first = 0 if documents is None else int(torch.searchsorted(documents[r], documents[r, at[:1]]))
            docs = () if documents is None else (documents[r:r + 1, at], documents[r:r + 1, first:last])
            args = (at, first, scale, len(dk), q[:, :, sel], k0[r:r + 1, :, first:last], v0[r:r + 1, :, first:last],
                    *[k[:, :, sel] for k in dk], *[v[:, :, sel] for v in dv], *docs)
            outs.append(checkpoint(_block, *args, use_reentrant=False) if torch.is_grad_enabled() else _block(*args))
    return torch.cat(outs, dim=2) if outs else q.clone()


def _block(start: int | torch.Tensor, first: int, scale: float | None, n: int, q: torch.Tensor, k0: torch.Tensor,
           v0: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    docs = rest[2 * n:] or (None, None)  # the query rows' and the keys' documents, when packed
    return _rows(q, k0, v0, list(rest[:n]), list(rest[n:2 * n]), start, scale, *docs, first=first)


def _rows(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, dk: list[torch.Tensor], dv: list[torch.Tensor],
          start: int | torch.Tensor, scale: float | None = None, q_docs: torch.Tensor | None = None,
          k_docs: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """Query rows start..start+C (q [B, nh, C, hd]; or at the positions ``start`` [C]) against step 0's keys
    first..first+S-1 (k0 [B, nh, S, hd]), causally, and their own diagonal keys; ``q_docs`` [B, C] and ``k_docs``
    [B, S]: the rows' and the keys' documents (a packed batch), else None."""
    C, S = q.shape[2], k0.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rows = (torch.arange(start, start + C, device=q.device) if isinstance(start, int) else start)[:, None]
    causal = torch.arange(first, first + S, device=q.device)[None, :] <= rows  # [C, S]
    if q_docs is not None:
        causal = (causal & (q_docs[:, :, None] == k_docs[:, None, :])).unsqueeze(1)  # [B, 1, C, S]
    s0 = (q @ k0.transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~causal, torch.finfo(s0.dtype).min)
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in dk]  # each [B, nh, C, 1]
    probs = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)  # [B, nh, C, S+k]
    out = probs[..., :S] @ v0
    for j, v in enumerate(dv):
        out = out + probs[..., S + j : S + j + 1] * v
    return out


def ttt_attention_flex(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       compiled: bool | None = None, scale: float | None = None,
                       documents: torch.Tensor | None = None) -> torch.Tensor:
    """``ttt_attention_dense`` through ``flex_attention``: the query at t sees kv index i of [k0 | k1 | ... | kk]
    when i < T and i <= t (causal over step 0) or i >= T and i mod T == t (its own position in steps 1..k).

    T is padded to a multiple of ``FLEX_BLOCK`` so a run compiles for a handful of lengths, not one per batch;
    padding is exact: a real query's mask never reaches a padded key. ``compiled`` (default: on a GPU) runs
    the Triton kernels; eager flex_attention is the math form, for checking the mask on CPU. ``documents`` [B, T]
    (a packed batch) adds the document mask; step 0's tiles below the diagonal are then no longer known to be
    full, so every listed tile evaluates the mask."""
    from torch.nn.attention.flex_attention import flex_attention

    B, nh, T, hd = q.shape
    Tp = -(-T // FLEX_BLOCK) * FLEX_BLOCK

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, 0, 0, Tp - T)) if Tp != T else x

    if documents is None:
        mask = _ttt_block_mask(Tp, len(keys), str(q.device))
    else:
        docs = torch.nn.functional.pad(documents, (0, Tp - T), value=-1) if Tp != T else documents
        mask = _ttt_block_mask(Tp, len(keys), str(q.device), docs)
    k = torch.cat([pad(x) for x in keys], dim=2)
    v = torch.cat([pad(x) for x in values], dim=2)
    attend = _compiled_flex() if (q.is_cuda if compiled is None else compiled) else flex_attention
    return attend(pad(q), k, v, block_mask=mask, scale=scale)[:, :, :T]


def _ttt_block_mask(T: int, steps: int, device: str, documents: torch.Tensor | None = None):
    """``_ttt_tiles``' mask; with ``documents`` [B, T] (a packed batch) also within each document. Step 0's tiles
    below the diagonal may then hold two documents, so none is marked full: query tile i lists step 0's tiles
    0..i and tile i of every later step, and each evaluates the mask."""
    if documents is None:
        return _ttt_tiles(T, steps, device)
    from torch.nn.attention.flex_attention import BlockMask

    ttt_mask = _ttt_tiles(T, steps, device).mask_mod
    kv_documents = documents.repeat(1, steps)  # the keys are the steps' T positions side by side

    def packed_mask(b, h, q_idx, kv_idx):
        return ttt_mask(b, h, q_idx, kv_idx) & (documents[b, q_idx] == kv_documents[b, kv_idx])

    n = T // FLEX_BLOCK
    rows = [list(range(i + 1)) + [i + j * n for j in range(1, steps)] for i in range(n)]
    kv_indices = torch.tensor([r + [0] * (n * steps - len(r)) for r in rows], dtype=torch.int32, device=device)
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int32, device=device)
    return BlockMask.from_kv_blocks(counts[None, None], kv_indices[None, None], BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=packed_mask, seq_lengths=(T, T * steps))


@functools.lru_cache(maxsize=64)
def _ttt_tiles(T: int, steps: int, device: str):
    """The TTT mask as flex_attention's BlockMask, its tiles written down rather than found by evaluating the
    mask on all T x steps*T pairs (create_block_mask would hold that dense mask): query tile i computes step 0's
    tiles 0..i-1 in full and, partially, step 0's tile i and tile i of every later step. T: a multiple of
    FLEX_BLOCK."""
    from torch.nn.attention.flex_attention import BlockMask

    # T as a captured tensor, not a Python int: compiled flex_attention then treats it as an input instead of
    # specialising (and recompiling) on every length.
    length = torch.tensor(T, device=device)

    def ttt_mask(b, h, q_idx, kv_idx):
        return ((kv_idx < length) & (kv_idx <= q_idx)) | ((kv_idx >= length) & (kv_idx % length == q_idx))

    n = T // FLEX_BLOCK
    tiles = torch.arange(n, device=device, dtype=torch.int32)
    partial = torch.stack([tiles + j * n for j in range(steps)], dim=-1)  # [n, steps]
    kv_indices = torch.cat([partial, torch.zeros(n, n * steps - steps, dtype=torch.int32, device=device)], dim=-1)
    full_kv_indices = tiles.expand(n, n * steps).contiguous() if steps == 1 else torch.cat(
        [tiles.expand(n, n), torch.zeros(n, n * (steps - 1), dtype=torch.int32, device=device)], dim=-1)
    return BlockMask.from_kv_blocks(
        torch.full((1, 1, n), steps, dtype=torch.int32, device=device), kv_indices[None, None],
        tiles[None, None].clone(), full_kv_indices[None, None],  # query tile i: step 0's tiles 0..i-1 are full
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=ttt_mask, seq_lengths=(T, T * steps))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic: one compilation for every length and step (KV_LEN = (k+1) T differs per step); with static
    # shapes a run would compile 7 times per length and hit dynamo's recompile limit, then fall back to the
    # unfused (T x T) form.
    return torch.compile(flex_attention, dynamic=True)
