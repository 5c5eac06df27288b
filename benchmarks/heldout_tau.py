"""tau of EAGLE-3 heads on the held-out prompts of a recipe (the rows its eval split kept out of training).

    python benchmarks/heldout_tau.py --config configs/demo/eagle3.yaml [overrides] --heads DIR [DIR ...]

In-domain and deterministic (greedy chain k=4, 64 new tokens): the way to compare heads trained on
the same data, e.g. online vs offline (benchmarks/bench_offline.sh).
"""

import argparse
from headstart.decode.eagle3_drafter import Eagle3Drafter
from headstart.decode.generate import speculative_generate
from headstart.decode.target_runner import TargetRunner
from headstart.models.eagle3 import Eagle3Draft
from headstart.models.head import DEFAULT_SPECULATIVE_TOKENS
from headstart.models.target import Target, TargetConfig, load_tokenizer
from headstart.trainer.batches import split_eval
from headstart.trainer.config import load_config
from headstart.trainer.data import build_dataset
from headstart.trainer.decode_eval import held_out_prompts

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--config", required=True)
p.add_argument("--heads", nargs="+", required=True)
p.add_argument("--k", type=int, default=DEFAULT_SPECULATIVE_TOKENS)
p.add_argument("--max-new-tokens", type=int, default=64)
args, overrides = p.parse_known_args()
cfg = load_config(args.config, overrides)
tok = load_tokenizer(cfg.target.path)
ds, _ = build_dataset(cfg.data, tok)
_, ev = split_eval(ds, cfg.train.eval_fraction, cfg.train.seed)
prompts = held_out_prompts(ev, 1000)
target = Target.from_pretrained(TargetConfig(path=cfg.target.path, dtype=cfg.target.dtype, device=cfg.target.device))
eos = {t for t in (tok.eos_token_id, target.model.generation_config.eos_token_id) if isinstance(t, int)}
runner = TargetRunner(target, 1024)
for d in args.heads:
    head = Eagle3Draft.from_pretrained(d, target_embeddings=target.embed_tokens.weight)
    toks = fw = 0
    for prompt in prompts:
        out = speculative_generate(runner, Eagle3Drafter(head, 1024), prompt.to(cfg.target.device), args.max_new_tokens, eos, args.k)
        toks += len(out.tokens) - 1
        fw += out.target_forwards
    print(f"{d}: {len(prompts)} held-out prompts, tau {toks / fw:.3f} ({toks} tokens / {fw} forwards)", flush=True)
