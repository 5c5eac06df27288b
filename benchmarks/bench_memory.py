"""Peak memory and time of one EAGLE-3 training step (forward + backward, 7 TTT steps) by sequence length.

    python benchmarks/bench_memory.py --lengths 256 1024 2048 4096 --table runs/memory.md
    python benchmarks/bench_memory.py --lengths 256 1024 2048 4096 8192 16384 32768 --impls before blocks after  # GPU

"before": the TTT attention and the loss as they were written before they became memory-linear (a
[B, heads, T, T+k] probability matrix and [B, T, V_d] float32 logits, log-probabilities and target
probabilities kept per step for backward; reproduced in ``dense_loss`` below). "after": headstart's
``Eagle3Draft.loss`` as it runs on the device: on CPU blockwise TTT attention and the chunked PyTorch
loss, both recomputed in backward; on a GPU the compiled flex_attention TTT mask and the fused Triton loss.
"blocks": the CPU path run on a GPU (``HEADSTART_TTT_ATTENTION=blocks HEADSTART_LOSS_KERNEL=torch``).

On CPU each (implementation, length) runs in a fresh process and the number is the peak RSS above the RSS
once the head and the step's inputs exist. On CUDA (bfloat16, as training runs there) each implementation
runs its lengths in one process: one untimed step first (compilation), then the timed step, whose
``max_memory_allocated`` above the memory allocated before it is the number. The head: hidden 1024, 16
heads (4 KV), draft vocab 32k over a 32k target vocab, batch 1, every position trained.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from headstart.heads.eagle3.module import Eagle3Config, Eagle3Draft
from headstart.models.head import Features, loss_denominator, shift_left
from headstart.benchmarks.record import write_table

REPO = Path(__file__).resolve().parents[1]
VOCAB = 32768


def build(T: int, device: torch.device, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816,
                         num_hidden_layers=16, vocab_size=VOCAB, max_position_embeddings=max(T, 4096) * 2)
    torch.manual_seed(0)
    head = Eagle3Draft(Eagle3Config.from_target(target, draft_vocab_size=VOCAB), ttt_steps=7).to(device, dtype)
    g = torch.Generator(device=device).manual_seed(1)
    f = Features(input_ids=torch.randint(0, VOCAB, (1, T), device=device, generator=g),
                 loss_mask=torch.ones(1, T, dtype=torch.long, device=device),
                 aux_hidden_states=torch.randn(1, T, 3 * 1024, device=device, generator=g).to(dtype),
                 target_logits=(torch.randn(1, T, VOCAB, device=device, generator=g) * 3).to(dtype),
                 target_in_draft=torch.ones(1, T, dtype=torch.bool, device=device))
    return head, f


def dense_loss(head, f) -> torch.Tensor:
    """The loss as it was: every step's full logits and the dense attention, kept for backward."""
    head.midlayer.self_attn.block = 10**9  # ttt_attention's single-block path is the dense form
    valid = torch.zeros_like(f.loss_mask, dtype=torch.bool)
    valid[:, :-1] = f.loss_mask[:, 1:].bool() & f.target_in_draft[:, :-1]
    total = torch.zeros((), device=f.input_ids.device)
    for k, logits in enumerate(head.unroll(f)):
        tgt_k = shift_left(f.target_logits, 1 + k, 0.0)
        valid_k = shift_left(valid, 1 + k, False)
        logq = torch.log_softmax(logits, dim=-1)
        p = torch.softmax(tgt_k.float(), dim=-1)
        total = total + head.step_weight**k * -((p * logq).sum(-1) * valid_k).sum() / loss_denominator(f)
    return total


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def step(impl: str, head, f) -> torch.Tensor:
    loss = dense_loss(head, f) if impl == "before" else head.loss(f)[0]
    loss.backward()
    head.zero_grad(set_to_none=True)
    return loss


def worker(impl: str, T: int) -> dict:
    """CPU: one step in this (fresh) process; peak RSS above the RSS with the head and inputs built."""
    device = torch.device("cpu")
    head, f = build(T, device)
    base = rss_mb()
    start = time.perf_counter()
    loss = step(impl, head, f)
    return {"impl": impl, "T": T, "extra_mb": rss_mb() - base, "step_s": time.perf_counter() - start, "loss": float(loss)}


def cuda_worker(impl: str, lengths: list[int]) -> list[dict]:
    """CUDA: every length in this process; a warm-up step each (compilation), then the measured one."""
    import os

    if impl in ("before", "blocks"):  # the CPU path's attention (before: forced dense in dense_loss)
        os.environ["HEADSTART_TTT_ATTENTION"] = "blocks"
    if impl == "blocks":
        os.environ["HEADSTART_LOSS_KERNEL"] = "torch"
    out = []
    for T in lengths:
        head = f = None
        torch.cuda.empty_cache()
        try:
            head, f = build(T, torch.device("cuda"), torch.bfloat16)
            step(impl, head, f)  # warm-up: compiles flex_attention and the Triton kernels for this length
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() / 2**20
            start = time.perf_counter()
            loss = step(impl, head, f)
            torch.cuda.synchronize()
            out.append({"impl": impl, "T": T, "extra_mb": torch.cuda.max_memory_allocated() / 2**20 - base,
                        "step_s": time.perf_counter() - start, "loss": float(loss)})
        except torch.cuda.OutOfMemoryError:
            out.append({"impl": impl, "T": T, "extra_mb": float("nan"), "step_s": float("nan"),
                        "error": f"out of memory ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    p.add_argument("--impls", nargs="+", default=["before", "after"])
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "T"), help=argparse.SUPPRESS)
    p.add_argument("--cuda-worker", nargs=2, metavar=("IMPL", "LENGTHS"), help=argparse.SUPPRESS)
    p.add_argument("--table", default=None, help="write the table to this markdown file")
    p.add_argument("--plot", default=str(REPO / "docs" / "bench_memory.png"))
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return 0
    if args.cuda_worker:
        print(json.dumps(cuda_worker(args.cuda_worker[0], [int(t) for t in args.cuda_worker[1].split(",")])))
        return 0
    cuda = torch.cuda.is_available()
    results = []
    runs = ([(impl, None) for impl in args.impls] if cuda else [(impl, T) for T in args.lengths for impl in args.impls])
    for impl, T in runs:
        cmd = ([sys.executable, __file__, "--cuda-worker", impl, ",".join(map(str, args.lengths))] if cuda
               else [sys.executable, __file__, "--worker", impl, str(T)])
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:  # killed for memory, most likely: recorded, not fatal
            error = (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
            results += [{"impl": impl, "T": t, "extra_mb": float("nan"), "step_s": float("nan"), "error": error}
                        for t in ([T] if T is not None else args.lengths)]
        else:
            got = json.loads(run.stdout.strip().splitlines()[-1])
            results += got if isinstance(got, list) else [got]
        print(json.dumps(results[-1]), flush=True)
    by = {(r["impl"], r["T"]): r for r in results}
    cell = lambda r: "n/a" if r is None else (f"failed ({r['error']})" if "error" in r else f"{r['extra_mb']:,.0f} MiB / {r['step_s']:.3f} s")  # noqa: E731
    rows = []
    for T in args.lengths:
        b, a = by.get(("before", T)), by.get(("after", T))
        ratio = b["extra_mb"] / a["extra_mb"] if a and b and "error" not in a and "error" not in b else float("nan")
        rows.append(f"| {T:,} | " + " | ".join(cell(by.get((impl, T))) for impl in args.impls) + f" | {ratio:.1f}x |")
    device = torch.cuda.get_device_name(0) + ", bfloat16" if cuda else "CPU, float32"
    table = (f"{device}\n\n| T | " + " | ".join(f"{impl}: peak extra memory / step time" for impl in args.impls)
             + " | memory before / after |\n|---|" + "---|" * len(args.impls) + "---|\n" + "\n".join(rows))
    print(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for impl in args.impls:
        pts = [(r["T"], r["extra_mb"]) for r in results if r["impl"] == impl and "error" not in r]
        ax.plot([t for t, _ in pts], [m for _, m in pts], marker="o", label=impl)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak memory above the model (MiB)")
    ax.set_title("one EAGLE-3 training step, 7 TTT steps, V_d 32k")
    ax.legend()
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=100)
    if args.table:
        # the plot's path as the markdown file's reader resolves it: relative to that file (the plot may be anywhere)
        plot = os.path.relpath(Path(args.plot).resolve(), Path(args.table).resolve().parent)
        write_table(args.table, "Training memory by sequence length: TTT attention and loss"
                       + (" (CUDA)" if cuda else ""),
                       "One EAGLE-3 training step (forward + backward, 7 TTT steps, batch 1, hidden 1024, 16 heads, "
                       "draft vocab 32,768, every position trained), each in a fresh process; memory is the peak above "
                       "the head and its inputs. before = dense TTT attention and full per-step logits kept for backward; "
                       "after = headstart's loss as it runs there (CPU: blockwise attention and chunked loss; GPU: compiled "
                       "flex_attention and the fused Triton loss, after one warm-up step); blocks = the CPU path on the "
                       f"GPU.\n\n{table}\n\n"
                       f"![memory by length]({plot})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
