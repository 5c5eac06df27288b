"""The distilled draft model's catalog entry: its module, options, drafter and export detector. Its export is a plain
HF causal LM, decoded by the ``draft-model`` method (decode/methods.py) like any other draft model."""

from __future__ import annotations

from headstart.decode.draft_model import DraftModelDrafter, draft_model_runner
from headstart.heads.draft_model.check import check_draft_model, detect_draft_model
from headstart.heads.draft_model.module import DraftModel, DraftModelOptions, build_draft_model
from headstart.heads.spec import HeadSpec


class DistilledDrafter(DraftModelDrafter):
    """The decoder's drafter for a draft model being trained (the evaluation during training): the draft-model method's
    drafter over the head's model (one sequence or a batch), with the catalog's calling convention."""

    def __init__(self, head: DraftModel, max_len: int, compile: bool = False, backend: str = "inductor") -> None:
        super().__init__(draft_model_runner(head.model.eval(), max_len, compile=compile, backend=backend), max_len,
                         head.config.vocab_size)


DRAFT_MODEL = HeadSpec(
    title="draft model", cls=DraftModel, options=DraftModelOptions, build=build_draft_model,
    drafter=DistilledDrafter, detect=detect_draft_model, check=check_draft_model, unit="next token", decoded_by="draft-model",
    cards={"hf": "a plain Hugging Face causal LM (config.json, model.safetensors, the target's tokenizer and "
                 "generation config): vLLM and SGLang load it as a draft model (`\"method\": \"draft_model\"`, "
                 "`--speculative-algorithm STANDALONE`), `headstart bench --method draft-model` decodes it."})
