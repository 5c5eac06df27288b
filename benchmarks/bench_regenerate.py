"""Throughput of regenerate_data.py's backends on this machine: hf at batch 1 and 16, openai against
`transformers serve` (started here) serving the same target. Run with nothing else running.

    python benchmarks/bench_regenerate.py --target configs/demo/target --data configs/demo/data/*.json* \
        --rows-per-file 8 --max-new-tokens 128 --benchmarks runs/lab-notes.md
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

import torch

from headstart.models.target import TargetConfig, load_causal_lm, load_tokenizer
from headstart.trainer.regenerate import read_sources, run_shards
from headstart.trainer.reply_backends import HFBackend, OpenAIBackend, SamplingSettings


def serve(target: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["transformers", "serve", target, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for _ in range(180):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if server.poll() is not None:
                raise SystemExit("transformers serve exited; is transformers[serving] installed?")
            time.sleep(1)
    server.kill()
    raise SystemExit("transformers serve did not come up in 180 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--rows-per-file", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--benchmarks", default=None, help="append the table to this markdown file")
    args = p.parse_args()
    sources = read_sources(args.data, rows_per_file=args.rows_per_file)
    sampling = SamplingSettings(args.temperature, 0.95 if args.temperature > 0 else 1.0, args.max_new_tokens)
    model = load_causal_lm(TargetConfig(path=args.target, dtype="float32", device="cpu")).eval()
    runs = [(f"hf, batch {b}", lambda b=b: HFBackend(model, load_tokenizer(args.target), sampling, b)) for b in (1, 16)]
    rows = []
    for name, make in runs:
        with tempfile.TemporaryDirectory() as out:
            (Path(out) / "shards").mkdir()
            s = run_shards(Path(out), sources, make().generate, sampling, len(sources), [0], progress=False)
        rows.append((name, s))
        print(f"{name}: {s.rows / s.seconds:.2f} rows/s, {s.tokens / s.seconds:.1f} tokens/s", flush=True)
    server, endpoint = serve(args.target)
    try:
        backend = OpenAIBackend(endpoint, args.target, sampling, args.concurrency)
        first_user = next(i for i, m in enumerate(sources[0].messages) if m["role"] == "user")
        backend.generate([sources[0].messages[: first_user + 1]], [0])  # the server loads the model on the first request
        with tempfile.TemporaryDirectory() as out:
            (Path(out) / "shards").mkdir()
            s = run_shards(Path(out), sources, backend.generate, sampling, len(sources), [0], progress=False)
        name = f"openai, `transformers serve`, {args.concurrency} in flight"
        rows.append((name, s))
        print(f"{name}: {s.rows / s.seconds:.2f} rows/s, {s.tokens / s.seconds:.1f} tokens/s", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    base = rows[0][1]
    table = ("| backend | rows | generated tokens | seconds | rows/s | tokens/s | vs hf batch 1 |\n|---|---|---|---|---|---|---|\n"
             + "\n".join(f"| {n} | {s.rows} | {s.tokens} | {s.seconds:.1f} | {s.rows / s.seconds:.2f} | "
                         f"{s.tokens / s.seconds:.1f} | {(s.tokens / s.seconds) / (base.tokens / base.seconds):.2f}x |"
                         for n, s in rows))
    print(table)
    if args.benchmarks:
        with open(args.benchmarks, "a") as f:
            f.write(f"\n## Regenerating data: backend throughput\n\n{date.today()}, {platform.machine()} CPU "
                    f"({os.cpu_count()} cores), torch {torch.__version__}, target `{args.target}` (float32). "
                    f"{len(sources)} conversations (the first {args.rows_per_file} of each of {len(args.data)} files), "
                    f"T = {args.temperature}, max {args.max_new_tokens} new tokens, one run each in one sequence with "
                    f"nothing else running. Command: `python benchmarks/bench_regenerate.py --target {args.target} "
                    f"--data {' '.join(args.data)} --rows-per-file {args.rows_per_file} --max-new-tokens "
                    f"{args.max_new_tokens} --benchmarks {args.benchmarks}`.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
