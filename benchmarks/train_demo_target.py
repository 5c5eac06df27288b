"""Train the demo target: a small Llama and its byte-level BPE tokenizer, on the demo chat data.

The result (an ordinary HF checkpoint under configs/demo/target/) stands in for a real target in
the README, the demo recipes and the benchmarks. It is trained on all tokens of the chat-rendered
data, packed into fixed-length sequences, like a (very) small pre-trained chat model.

    python benchmarks/train_demo_target.py --output configs/demo/target --steps 700
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from headstart.trainer.conversations import detect_format, to_messages
from headstart.trainer.data import read_rows

DEMO_DATA = Path(__file__).resolve().parents[1] / "configs" / "demo" / "data"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def load_conversations(files: list[Path]) -> list[list[dict[str, str]]]:
    conversations = []
    for path in files:
        rows = read_rows(str(path))
        fmt = detect_format(rows[0])
        conversations += [to_messages(row, fmt) for row in rows]
    return conversations


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=4096,
    )


def pack(token_lists: list[list[int]], sep: int, seq_len: int) -> torch.Tensor:
    stream = [t for ids in token_lists for t in ids + [sep]]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len]).view(n, seq_len)  # [N, seq_len]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, data: torch.Tensor, batch_size: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        batch = data[i : i + batch_size]
        total += model(input_ids=batch, labels=batch).loss.item() * batch.numel()
        count += batch.numel()
    model.train()
    return total / count


def write_model_card(out: Path, stats: dict) -> None:
    a = stats["args"]
    files = ", ".join(f"`configs/demo/data/{Path(f).name}`" for f in a["data"])
    command = (f"python benchmarks/train_demo_target.py --output {a['output']} "
               f"--steps {a['steps']} --batch-size {a['batch_size']} --warmup {a['warmup']}")
    if a["layers"] != 8:
        command += f" --layers {a['layers']}"
    if a.get("tokenizer"):
        command += f" --tokenizer {a['tokenizer']}"
        title, intro = "headstart demo draft model", (
            "An independent small draft model for the demo target (the `--method draft-model` baseline of the decoding\n"
            f"benchmark). It shares the target's tokenizer (`{a['tokenizer']}`) and was trained on the same data split.")
    else:
        title, intro = "headstart demo target", (
            "A small Llama-architecture chat model that stands in for a real target in headstart's demo recipes,\n"
            "tests of the full pipeline, and benchmarks. It is not a useful assistant; it is a real, trained\n"
            "causal LM with a real chat template, so draft heads trained against it learn something measurable.")
    tokenizer_line = (f"the demo target's (`{a['tokenizer']}`)" if a.get("tokenizer") else
                      f"byte-level BPE, {a['vocab_size']} tokens, trained on the training split")
    card = f"""# {title}

{intro}

- Architecture: `LlamaForCausalLM`, {a['layers']} layers, hidden {a['hidden']}, {a['heads']} heads
  ({a['kv_heads']} KV heads), MLP {a['intermediate']}, tied embeddings, `max_position_embeddings` 4096,
  {stats['parameters'] / 1e6:.2f}M parameters, stored in bfloat16.
- Tokenizer: {tokenizer_line}; ChatML chat
  template (`<|im_start|>{{role}}`, newline, content, `<|im_end|>`); EOS (generation config) = `<|im_end|>`.
- Data: {files} (GSM8K, MIT; GPTeacher, MIT; licences beside them), every row rendered with the chat
  template, shuffled (seed {a['seed']}), {a['holdout']:.0%} of the conversations held out; packed into
  {a['seq_len']}-token sequences separated by `<|endoftext|>`; loss on all tokens.
- Training: {a['steps']} steps x {a['batch_size']} x {a['seq_len']} tokens = {stats['train_tokens_seen']:,} tokens
  ({stats['train_tokens_seen'] / stats['train_tokens_available']:.2f} epochs of {stats['train_tokens_available']:,}),
  AdamW lr {a['lr']} (betas 0.9/0.95, wd 0.1), {a['warmup']} warmup steps then cosine, clip 1.0;
  {stats['train_minutes']} min at {stats['tokens_per_second']:,} tokens/s on a 2-core CPU.
- Held-out loss: **{stats['held_out_loss']:.4f}** (perplexity {math.exp(stats['held_out_loss']):.1f}) on
  {stats['held_out_tokens']:,} held-out tokens; final training loss {stats['final_train_loss']:.4f}.

Reproduce:

```bash
{command}
```
"""
    (out / "README.md").write_text(card)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="configs/demo/target")
    p.add_argument("--data", nargs="+", default=sorted(str(f) for f in DEMO_DATA.glob("*.json*")))
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--holdout", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="reuse this tokenizer (a draft model must share its target's) instead of training one")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)

    conversations = load_conversations([Path(f) for f in args.data])
    random.Random(args.seed).shuffle(conversations)
    n_hold = max(1, int(len(conversations) * args.holdout))
    held, train = conversations[:n_hold], conversations[n_hold:]
    print(f"{len(conversations):,} conversations: {len(train):,} train, {len(held):,} held out")

    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = train_tokenizer([m["content"] for c in train for m in c], args.vocab_size)
    render = lambda convs: [tokenizer.apply_chat_template(c, tokenize=False) for c in convs]  # noqa: E731
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    sep = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    train_data = pack(encode(render(train)), sep, args.seq_len)
    held_data = pack(encode(render(held)), sep, args.seq_len)
    print(f"train: {train_data.numel():,} tokens in {len(train_data)} sequences; held out: {held_data.numel():,}")

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)

    model.train()
    order = torch.randperm(len(train_data), generator=torch.Generator().manual_seed(args.seed))
    start, tokens_seen, log = time.time(), 0, []
    bar = tqdm(range(args.steps), desc="demo target")
    for step in bar:
        idx = order[(torch.arange(args.batch_size) + step * args.batch_size) % len(order)]
        batch = train_data[idx]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += batch.numel()
        tps = tokens_seen / (time.time() - start)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tps:,.0f}")
        log.append({"step": step, "loss": loss.item()})
    train_seconds = time.time() - start
    held_loss = evaluate(model, held_data, args.batch_size)
    print(f"held-out loss {held_loss:.4f} (ppl {math.exp(held_loss):.2f}); {train_seconds / 60:.1f} min")

    model.config.dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    stats = {
        "parameters": n_params,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "train_tokens_seen": tokens_seen,
        "train_tokens_available": train_data.numel(),
        "held_out_tokens": held_data.numel(),
        "held_out_loss": round(held_loss, 4),
        "final_train_loss": round(sum(r["loss"] for r in log[-20:]) / min(20, len(log)), 4),
        "train_minutes": round(train_seconds / 60, 1),
        "tokens_per_second": round(tokens_seen / train_seconds),
        "args": vars(args),
    }
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2))
    write_model_card(out, stats)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
