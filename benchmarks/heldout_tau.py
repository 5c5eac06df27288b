"""tau of finished heads on the held-out prompts of a recipe (the rows its eval split kept out of training).

    python benchmarks/heldout_tau.py --config configs/demo/eagle3.yaml [overrides] --heads DIR [DIR ...]

In-domain and deterministic (greedy chain k=4, 64 new tokens): the way to compare heads trained on
the same data, e.g. online vs offline. The heads are of the recipe's ``draft.head`` type; tau is counted as
``headstart bench`` counts it (decode/measure.py: decode_tau).
"""

import argparse

from headstart.decode.measure import decode_tau
from headstart.decode.target_runner import TargetRunner
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.heads.registry import drafter_for, load_head
from headstart.models.target import Target, TargetConfig, load_tokenizer
from headstart.trainer.batches import split_eval
from headstart.trainer.config import load_config
from headstart.trainer.data import build_dataset
from headstart.trainer.decode_eval import held_out_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="the recipe (or give every setting as an override)")
    p.add_argument("--heads", nargs="+", required=True)
    p.add_argument("--k", type=int, default=DEFAULT_SPECULATIVE_TOKENS)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=1000, help="at most this many held-out prompts")
    args, overrides = p.parse_known_args()
    cfg = load_config(args.config, overrides)
    tok = load_tokenizer(cfg.target.path)
    ds, _ = build_dataset(cfg.data, tok)
    _, ev = split_eval(ds, cfg.train.eval_fraction, cfg.train.seed)
    prompts = held_out_prompts(ev, args.prompts)
    target = Target.from_pretrained(TargetConfig(path=cfg.target.path, dtype=cfg.target.dtype, device=cfg.target.device))
    eos = {t for t in (tok.eos_token_id, target.model.generation_config.eos_token_id) if isinstance(t, int)}
    max_len = max(x.shape[1] for x in prompts) + args.max_new_tokens + args.k + 2
    for d in args.heads:
        head = load_head(cfg.draft.head, d, target).to(device=target.lm_head_weight.device)
        runner = TargetRunner(target, max_len, with_aux=type(head).needs.aux_hidden_states)
        tally = decode_tau(runner, lambda: drafter_for(head, max_len), prompts, args.max_new_tokens, eos, args.k)  # noqa: B023
        print(f"{d}: {len(prompts)} held-out prompts, tau {tally.summary()['tau']:.3f} "
              f"({tally.tokens} tokens / {tally.forwards} forwards)", flush=True)


if __name__ == "__main__":
    main()
