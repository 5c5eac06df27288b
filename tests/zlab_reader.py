"""Decode with z-lab's own DFlash code: its ``DFlashDraftModel`` loads a headstart export and its ``dflash_generate``
runs the speculative loop greedily against the target (both from the ``dflash`` package).

Runs inside the dflash virtual environment (tests/dflash_env.py builds it): it imports dflash, transformers, torch and
safetensors only, never headstart. Called as

    python zlab_reader.py request.json

request: {"head": dir, "target": dir, "prompts": [[ids...], ...], "max_new_tokens": n, "report": .json}
report:  {"class": the draft's class, "block_size": B, "outputs": [[generated ids...], ...],
          "missing" / "unexpected": the draft's tensors the export lacks / the export's it has no place for,
          "acceptance": [[tokens each verify forward produced: accepted drafts + 1], ...],
          "first_block": [[the B-1 drafts of the block after the prompt, greedy], ...],
          "first_logits": a torch file of those slots' logits before any selector, [prompts, B-1, V]}
The first block is drafted the way ``dflash_generate`` drafts every block (its own helpers and classes), so a head
whose drafts are rarely accepted is still compared draft by draft.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import dflash.model
from dflash.model import (DFlash2DraftModel, DFlashDraftModel, _draft_value, _make_cache, _output_head,
                          _raw_input_embeddings, dflash_generate, extract_context_feature)
from transformers import AutoModelForCausalLM


def first_block(draft, target, prompt: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """The greedy drafts of the block after ``prompt``, as dflash_generate's loop computes them, and the slots' logits
    (the output head's, before DFlash2's selector) [B-1, V]."""
    out = target(prompt, output_hidden_states=True)
    bonus = out.logits[:, -1].argmax(-1)
    block = torch.full((1, draft.block_size), draft.mask_token_id, dtype=torch.long)
    block[0, 0] = bonus
    n = prompt.shape[1]
    hidden = draft(target_hidden=extract_context_feature(out.hidden_states, draft.target_layer_ids),
                   noise_embedding=_raw_input_embeddings(target, block,
                                                         float(_draft_value(draft.config, "input_embedding_scale", 1.0))),
                   position_ids=torch.arange(n + draft.block_size)[None], past_key_values=_make_cache(draft.config),
                   use_cache=True)[:, 1 - draft.block_size:, :]
    logits = draft.compute_logits(hidden, _output_head(target))
    if isinstance(draft, DFlash2DraftModel):
        return draft.propose(hidden, block[:, 0], _output_head(target), 0.0)[0][0].tolist(), logits[0]
    return logits.argmax(-1)[0].tolist(), logits[0]


def cpu_time() -> float:
    return time.perf_counter()


def main(path: str) -> None:
    dflash.model._cuda_time = cpu_time  # its stats time CUDA events; on a CPU the wall clock does (unused here)
    request = json.loads(open(path).read())
    target = AutoModelForCausalLM.from_pretrained(request["target"], dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    config = json.loads(open(f"{request['head']}/config.json").read())
    cls = DFlash2DraftModel if "DFlash2DraftModel" in config["architectures"] else DFlashDraftModel
    draft, info = cls.from_pretrained(request["head"], attn_implementation="sdpa", dtype=torch.float32,
                                      output_loading_info=True)
    draft.eval()
    outputs, acceptance, blocks, logits = [], [], [], []
    for ids in request["prompts"]:
        prompt = torch.tensor([ids])
        with torch.no_grad():
            drafts, slot_logits = first_block(draft, target, prompt)
            blocks.append(drafts)
            logits.append(slot_logits.float())
            out = dflash_generate(draft, target, prompt, request["max_new_tokens"], None, temperature=0.0,
                                  return_stats=True)
        outputs.append(out.output_ids[0, prompt.shape[1]:].tolist())
        acceptance.append([int(n) for n in out.acceptance_lengths])
    torch.save(torch.stack(logits), f"{request['report']}.logits.pt")
    json.dump({"class": type(draft).__name__, "block_size": draft.block_size, "outputs": outputs,
               "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
               "acceptance": acceptance, "first_block": blocks,
               "first_logits": f"{request['report']}.logits.pt"}, open(request["report"], "w"))


if __name__ == "__main__":
    main(sys.argv[1])
