"""The measuring loop: decode Spec-Bench-format questions speculatively and plainly, and time both.

Each question's turns are asked in order; a later turn sees the target's own earlier answers. Speculative and plain
decoding run on the same runner and prompts, so their tokens/s compare; HF ``generate`` is timed as an outside
reference. ``Tally`` counts tau, acceptance by position and the round clock's parts; ``run_benchmark`` returns them as
a report (a dict), which decode/report.py turns into tables.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from headstart.decode.batch_generate import BatchDrafter, PerSequence, batch_plain_generate, batch_speculative_generate
from headstart.decode.clock import PARTS, RoundClock
from headstart.decode.exactness import GreedyCheck
from headstart.decode.generate import Drafter, Generation, Sampling, plain_generate, speculative_generate
from headstart.decode.predict import measure_step_times, predict_speedups, recommend_k, round_overhead
from headstart.decode.quality import text_logprob
from headstart.decode.questions import prompt_ids
from headstart.decode.report import paired_summary
from headstart.decode.target_runner import RaggedRunner, TargetRunner
from headstart.decode.tree import DynamicTree, StaticTree
from headstart.decode.verify import TOKEN, Verification


@dataclass
class Tally:
    tokens: int = 0  # generated tokens counted for tau (the prefill's token excluded)
    forwards: int = 0
    spec_seconds: float = 0.0
    plain_seconds: float = 0.0
    hf_seconds: float = 0.0
    new_tokens: int = 0  # all tokens generated speculatively (for tokens/s)
    plain_tokens: int = 0  # all tokens generated plainly (differs from new_tokens when sampling)
    rounds: int = 0  # speculative rounds (target forwards after the prefill)
    accepted_at: list[int] = field(default_factory=list)  # rounds accepting >= i drafts, i = 1..k
    proposed_at: list[int] = field(default_factory=list)  # rounds proposing >= i drafts
    drafted: list[int] = field(default_factory=lambda: [0, 0])  # drafts proposed, rounds (a confidence stop's share)
    spec_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))  # seconds by part
    plain_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    plain_forwards: int = 0  # plain decoding's one-token target forwards
    timed_runs: int = 0  # add_seconds calls: one per turn (batched: per batch of turns)
    logprob: list[float] = field(default_factory=lambda: [0.0, 0.0])  # sampled: speculative text's sum, its tokens
    plain_logprob: list[float] = field(default_factory=lambda: [0.0, 0.0])  # plain sampling's (decode/quality.py)

    def add_quality(self, spec: tuple[float, int], plain: tuple[float, int]) -> None:
        """Sampled runs: the log-probability sums and token counts of a turn's speculative and plain text."""
        for mine, theirs in ((self.logprob, spec), (self.plain_logprob, plain)):
            mine[0] += theirs[0]
            mine[1] += theirs[1]

    def add_seconds(self, spec: RoundClock, plain: RoundClock, spec_rounds: int, plain_forwards: int) -> None:
        """One timed run: its clocks, its speculative rounds and plain forwards (after the prefill; batched, a round
        is one forward of the whole batch)."""
        for part in PARTS:
            self.spec_parts[part] += spec.seconds[part]
            self.plain_parts[part] += plain.seconds[part]
        self.rounds += spec_rounds
        self.plain_forwards += plain_forwards
        self.timed_runs += 1

    def split(self) -> dict:
        """Milliseconds per speculative round by part (decode/clock.py), the plain target forward per token, and the
        speed-up the measured forwards alone predict: tokens per second of the forwards (prefill, draft, update,
        verify) against plain decoding's per second of its own (prefill, one-token forwards). One sequence at a time
        that is close to tau x plain forward / (draft + update + verify per round); a batch's prompts are a forward
        speculation cannot shorten (a quarter of a 16-row run's time here), and its rounds last as long as its
        slowest row, which the forward seconds carry and tau does not. What the measured speed-up falls short of it is
        the loops' own overhead (their ``other``)."""
        if not self.rounds or not self.plain_forwards or not self.spec_parts["verify"]:
            return {"round_ms": None, "plain_forward_ms": None, "predicted_speedup": None, "prompt_ms": None}
        per_round = {p: self.spec_parts[p] / self.rounds * 1e3 for p in ("draft", "update", "verify", "other")}
        plain_forward = self.plain_parts["verify"] / self.plain_forwards * 1e3
        spec_forwards = sum(self.spec_parts[p] for p in ("prefill", "draft", "update", "verify"))
        plain_forwards = self.plain_parts["prefill"] + self.plain_parts["verify"]
        predicted = (self.new_tokens / spec_forwards) / (self.plain_tokens / plain_forwards)
        # A turn's prompt: speculative decoding's (the target's forward and the drafter reading it) against plain
        # decoding's -- with --compile both run eagerly, where a GPU's launch overhead can outweigh the rounds.
        prompt = {"speculative": self.spec_parts["prefill"] / self.timed_runs * 1e3,
                  "plain": self.plain_parts["prefill"] / self.timed_runs * 1e3}
        return {"round_ms": per_round, "plain_forward_ms": plain_forward, "predicted_speedup": predicted, "prompt_ms": prompt}

    def add(self, spec: Generation, k: int) -> None:
        """k: the deepest draft position a round can reach (chain length or tree depth)."""
        self.tokens += spec.counted_tokens
        self.forwards += spec.target_forwards
        self.new_tokens += len(spec.tokens)
        if not self.accepted_at:
            self.accepted_at, self.proposed_at = [0] * k, [0] * k
        self.drafted[0] += sum(spec.proposed)
        self.drafted[1] += len(spec.proposed)
        for n, m in zip(spec.accepted, spec.proposed):
            for i in range(k):
                self.accepted_at[i] += n > i
                self.proposed_at[i] += m > i

    def summary(self) -> dict:
        return {
            "tau": self.tokens / max(1, self.forwards),
            "acceptance_by_position": [a / p if p else None for a, p in zip(self.accepted_at, self.proposed_at)],
            # what a round verified: k but where the length left, a confidence stop or the drafter cut it shorter
            "drafts_per_round": self.drafted[0] / self.drafted[1] if self.drafted[1] else None,
            # how often a round verified fewer than k (a confidence stop, or a turn's last round where the length left)
            "rounds_cut": 1 - self.proposed_at[-1] / self.drafted[1] if self.drafted[1] and self.proposed_at else None,
            "spec_tokens_per_s": self.new_tokens / self.spec_seconds if self.spec_seconds else None,
            "plain_tokens_per_s": self.plain_tokens / self.plain_seconds if self.plain_seconds else None,
            "hf_generate_tokens_per_s": self.plain_tokens / self.hf_seconds if self.hf_seconds else None,
            "speedup": (self.new_tokens / self.spec_seconds) / (self.plain_tokens / self.plain_seconds)
            if self.spec_seconds and self.plain_seconds else None,
            "generated_tokens": self.new_tokens,
            "seconds_per_round": self.spec_seconds / self.rounds if self.rounds else None,
            # what learning from the served requests cost (an online head's updates, inside the timed decode): ms a token
            "learn_ms_per_token": self.spec_parts["learn"] / self.new_tokens * 1e3 if self.spec_parts["learn"] else None,
            # sampled: the mean target log-probability of a token of the text, speculative and plain (decode/quality.py)
            "mean_logprob": self.logprob[0] / self.logprob[1] if self.logprob[1] else None,
            "plain_mean_logprob": self.plain_logprob[0] / self.plain_logprob[1] if self.plain_logprob[1] else None,
            **self.split(),
        }


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a GPU's), so a wall-clock reading covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


PROMPT_BUCKETS = ((512, "prompt < 512 tokens"), (2048, "prompt 512-2k tokens"), (None, "prompt > 2k tokens"))
"""Prompt-length buckets tau is also reported by: drafts trained on short sequences lose acceptance on long prompts."""


def prompt_bucket(n_tokens: int) -> str:
    return next(name for limit, name in PROMPT_BUCKETS if limit is None or n_tokens < limit)


def decode_tau(runner: TargetRunner, make_drafter: Callable[[], Drafter], prompts: list[torch.Tensor],
               max_new_tokens: int, eos_ids: set[int], k: int, tree: DynamicTree | StaticTree | None = None) -> Tally:
    """Greedy speculative decoding of token prompts [1, T] with nothing else timed or run: tau exactly as the
    benchmark counts it, for the held-out and during-training evaluations (``.summary()['tau']``)."""
    depth = Rival(runner, make_drafter, k, tree).depth
    device = next(runner.target.model.parameters()).device
    tally = Tally()
    for prompt in prompts:
        tally.add(speculative_generate(runner, make_drafter(), prompt.to(device), max_new_tokens, eos_ids, k, tree=tree), depth)
    return tally


@dataclass
class Rival:
    """A second method decoded on every turn beside the first, in the same process (``run_benchmark(versus=)``): its own
    runner over the same target, its drafter (or transformers' loop, ``own_loop``), k and tree. The two take turns at
    decoding first; plain decoding follows both. Their tokens/s then compare turn by turn, under the same
    conditions, where two separate runs minutes apart see this machine's drift (tens of percent on a shared CPU)."""

    runner: TargetRunner
    make_drafter: Callable[[], Drafter] | None
    k: int
    tree: DynamicTree | StaticTree | None = None
    own_loop: Callable[..., Generation] | None = None
    after_warm_up: Callable[[], None] | None = None
    verification: Verification = TOKEN
    """How its sampled drafts are verified (decode/verify.py): each method of a pair its own."""

    @property
    def depth(self) -> int:
        """The deepest draft position a round reaches: the chain's k or the tree's depth."""
        tree = self.tree
        return self.k if tree is None else (tree.depth if isinstance(tree, DynamicTree) else max(map(len, tree.paths)))

    def warm_up(self, prompt: torch.Tensor, eos_ids: set[int], sampling: Sampling | None,
                generator: torch.Generator, max_new_tokens: int | None = None) -> None:
        """An untimed decode long enough for a first round at the full chain or tree depth (a compiled tree's graph is
        per depth), with a fresh drafter and with each drafter it lists in ``warm_ups()`` (a hybrid's model drafting
        every round), then ``after_warm_up``."""
        n = max_new_tokens or (8 if self.own_loop else max(8, self.depth + 2))
        drafter = None if self.own_loop else self.make_drafter()
        for d in [drafter] if drafter is None else [drafter, *drafter.warm_ups()]:
            self.decode(d, prompt, n, eos_ids, sampling, generator)
        if self.after_warm_up is not None:
            self.after_warm_up()

    def decode(self, drafter: Drafter | None, prompt: torch.Tensor, max_new_tokens: int, eos_ids: set[int],
               sampling: Sampling | None, generator: torch.Generator, clock: RoundClock | None = None) -> Generation:
        if self.own_loop is not None:
            return self.own_loop(prompt, max_new_tokens, eos_ids, sampling, generator, clock or RoundClock(prompt.device))
        return speculative_generate(self.runner, drafter, prompt, max_new_tokens, eos_ids, self.k, sampling, generator,
                                    self.tree, clock, self.verification)


def run_benchmark(
    runner: TargetRunner,
    make_drafter: Callable[[], Drafter],
    tokenizer: PreTrainedTokenizerBase,
    questions: list[dict],
    k: int,
    max_new_tokens: int,
    eos_ids: set[int],
    verify_greedy: bool = False,
    hf_reference: bool = True,
    progress: Callable[[str], None] = print,
    tree: DynamicTree | StaticTree | None = None,
    sampling: Sampling | None = None,
    seed: int = 0,
    own_loop: Callable[..., Generation] | None = None,
    batch_size: int = 1,
    make_batch_drafter: Callable[[int], BatchDrafter] | None = None,
    after_warm_up: Callable[[], None] | None = None,
    versus: Rival | None = None,
    verification: Verification = TOKEN,
) -> dict:
    """Speculative and plain decoding of every turn; with ``sampling`` both sample (same seed per
    turn), so ``verify_greedy`` (token equality) only applies to greedy runs. ``own_loop`` (prompt, max new
    tokens, eos ids, sampling, generator, clock) -> Generation replaces headstart's loop and drafter (transformers'
    own speculative decoding: decode/hf_peers.py). ``batch_size`` > 1 decodes that many questions' turns together
    (``_run_batched``) with ``make_batch_drafter(B)``, or one ``make_drafter()`` per sequence. ``after_warm_up``: undo what
    the untimed warm-up decode left that would leak into the timed ones (a learning n-gram store's counts of question 1).
    ``versus``: a second method decoded on every turn too (``Rival``); the report then adds its own report under
    ``versus`` and the turn-by-turn comparison under ``paired`` (``paired_summary``). Plain decoding runs once a turn,
    on the first method's runner (compiled or not as the first method is): both reports' plain columns are its.
    ``verification``: how the first method's sampled drafts are verified (the second's: its ``Rival``)."""
    if verify_greedy and sampling is not None:
        raise ValueError("--verify-greedy compares with greedy decoding; it cannot be combined with sampling")
    device = next(runner.target.model.parameters()).device
    generator = torch.Generator(device=device)
    if batch_size > 1:
        if tree is not None or own_loop is not None or versus is not None:
            raise ValueError("a batch decodes headstart's chains alone; trees, transformers' loops and a second method "
                             "run at batch size 1")
        tallies: dict[str, Tally] = defaultdict(Tally)
        by_length: dict[str, Tally] = defaultdict(Tally)  # the same turns, by the length of their prompt
        check = GreedyCheck(runner.target.model) if verify_greedy else None
        make_batch = make_batch_drafter or (lambda b: PerSequence([make_drafter() for _ in range(b)]))
        ragged = runner if isinstance(runner, RaggedRunner) else RaggedRunner(runner.target, runner.max_len, runner.with_aux)
        _run_batched(ragged, make_batch, tokenizer, questions, k, max_new_tokens, eos_ids, batch_size, sampling, seed,
                     generator, progress, tallies, by_length, check, verification)
        return _report(tallies, by_length, check)
    methods = [Rival(runner, make_drafter, k, tree, own_loop, after_warm_up, verification),
               *([versus] if versus is not None else [])]
    tallies_of = [defaultdict(Tally) for _ in methods]
    by_length_of = [defaultdict(Tally) for _ in methods]  # the same turns, by the length of their prompt
    checks = [GreedyCheck(runner.target.model) if verify_greedy else None for _ in methods]
    turn_speeds: list[list[float]] = [[] for _ in methods]  # tokens/s of each timed turn, for the paired comparison
    # each timed turn in serving order: [tokens tau counts, target forwards, tokens, seconds] -- a drafter that learns
    # as it serves is read window by window (benchmarks/online_shift.py)
    turns_of: list[list[list[float]]] = [[] for _ in methods]
    if questions:  # untimed warm-up: CUDA context, cuBLAS handles and allocator growth would land in the first timing
        warm = prompt_ids(tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}]).to(device)
        for m in methods:
            m.warm_up(warm, eos_ids, sampling, generator)
        plain_generate(runner, warm, 8, eos_ids, sampling, generator, RoundClock(device))
        sync(device)
    for index, q in enumerate(questions):
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(q["turns"]):
            messages.append({"role": "user", "content": text})
            prompt = prompt_ids(tokenizer, messages).to(device)
            drafters = [None if m.own_loop else m.make_drafter() for m in methods]
            # Untimed: the prompt once through the target and the drafter, so what a new prompt length costs the first
            # time (on a GPU: allocator growth, cuBLAS and attention kernel choice) lands in neither timing -- else it
            # lands in whichever decodes first (the speculative run, ~40 ms a turn on an H200 with SmolLM2).
            for m, drafter in zip(methods, drafters):
                m.decode(drafter, prompt, 1, eos_ids, sampling, generator)
            specs: list[tuple[Generation, RoundClock, float]] = [None] * len(methods)  # type: ignore[list-item]
            # two methods take turns at going first -- by question and turn, so that neither always goes first on a
            # question's first (shorter) turn of MT-bench's two
            order = range(len(methods)) if (index + turn) % 2 == 0 else reversed(range(len(methods)))
            for i in order:
                clock = RoundClock(device)
                sync(device)
                t0 = time.perf_counter()
                generator.manual_seed(seed)
                spec = methods[i].decode(drafters[i], prompt, max_new_tokens, eos_ids, sampling, generator, clock)
                sync(device)
                specs[i] = (spec, clock, time.perf_counter() - t0)
            plain_clock = RoundClock(device)
            t1 = time.perf_counter()
            generator.manual_seed(seed)
            plain = plain_generate(runner, prompt, max_new_tokens, eos_ids, sampling, generator, plain_clock)
            sync(device)
            t2 = time.perf_counter()
            hf_seconds = 0.0
            if hf_reference:
                with torch.no_grad():
                    runner.target.model.generate(prompt, max_new_tokens=len(plain.tokens), min_new_tokens=len(plain.tokens),
                                                 do_sample=sampling is not None, pad_token_id=tokenizer.pad_token_id or 0,
                                                 **({} if sampling is None else {"temperature": sampling.temperature,
                                                    "top_k": sampling.top_k or None, "top_p": sampling.top_p}))
                sync(device)
                hf_seconds = time.perf_counter() - t2
            if sampling is not None:  # untimed: what the target thinks of each text (decode/quality.py)
                plain_quality = text_logprob(runner.target.model, prompt, plain.tokens, sampling)
            for i, (m, (spec, clock, seconds)) in enumerate(zip(methods, specs)):
                quality = text_logprob(runner.target.model, prompt, spec.tokens, sampling) if sampling is not None else None
                if checks[i] is not None:
                    checks[i].compare(f"question {q['question_id']} turn {turn + 1}", prompt, plain.tokens, spec.tokens)
                turn_speeds[i].append(len(spec.tokens) / seconds)
                turns_of[i].append([spec.counted_tokens, spec.target_forwards, len(spec.tokens), round(seconds, 6)])
                for tally in (tallies_of[i][q["category"]], tallies_of[i]["overall"],
                              by_length_of[i][prompt_bucket(prompt.shape[1])]):
                    tally.add(spec, m.depth)
                    tally.add_seconds(clock, plain_clock, spec.target_forwards, plain.target_forwards)
                    tally.spec_seconds += seconds
                    tally.plain_seconds += t2 - t1
                    tally.plain_tokens += len(plain.tokens)
                    tally.hf_seconds += hf_seconds
                    if quality is not None:
                        tally.add_quality(quality, plain_quality)
            messages.append({"role": "assistant", "content": tokenizer.decode(plain.tokens, skip_special_tokens=True)})
        progress(f"question {q['question_id']} ({q['category']}): tau so far "
                 + " / ".join(f"{t['overall'].summary()['tau']:.2f}" for t in tallies_of))
    report = {**_report(tallies_of[0], by_length_of[0], checks[0]), "turns": turns_of[0]}
    if versus is not None:
        report["versus"] = {**_report(tallies_of[1], by_length_of[1], checks[1]), "turns": turns_of[1]}
        overall = [t["overall"].summary()["spec_tokens_per_s"] for t in tallies_of]
        report["paired"] = paired_summary(turn_speeds[0], turn_speeds[1],
                                          overall[0] / overall[1] if overall[0] and overall[1] else None)
    return report


def _report(tallies: dict[str, Tally], by_length: dict[str, Tally], check: GreedyCheck | None) -> dict:
    result = {k_: t.summary() for k_, t in tallies.items()}
    lengths = {name: by_length[name].summary() for _, name in PROMPT_BUCKETS if name in by_length}
    overall = result.get("overall", {})
    return {"speedup": overall.get("speedup"), "predicted_speedup": overall.get("predicted_speedup"),
            "results": result, "by_prompt_length": lengths, "mismatches": check.mismatches if check else [],
            "near_ties": check.near_ties if check else []}


def _run_batched(runner: RaggedRunner, make_drafter: Callable[[int], BatchDrafter], tokenizer: PreTrainedTokenizerBase,
                 questions: list[dict], k: int, max_new_tokens: int, eos_ids: set[int], batch_size: int,
                 sampling: Sampling | None, seed: int, generator: torch.Generator, progress: Callable[[str], None],
                 tallies: dict[str, Tally], by_length: dict[str, Tally], check: GreedyCheck | None,
                 verification: Verification = TOKEN) -> None:
    """``batch_size`` questions at a time: their turn t decoded together (speculative, then plain on the same
    runner), a later turn seeing the plain answers as at batch size 1. Tau and acceptance are per sequence, by
    category and prompt length; tokens/s, the speed-up and the round split are the batch's, so only overall."""
    device = next(runner.target.model.parameters()).device
    depth = k
    # Every batch size the run decodes (a last, smaller batch; turns some questions lack): a compiled runner compiles
    # each one's widths now, and each is warmed up untimed (see run_benchmark).
    sizes = sorted({sum(turn < len(q["turns"]) for q in questions[start : start + batch_size])
                    for start in range(0, len(questions), batch_size)
                    for turn in range(max(len(q["turns"]) for q in questions[start : start + batch_size]))})
    for size in sizes:
        runner.precompile_batch(size, [1, k + 1])
        drafter = make_drafter(size)
        if drafter.capabilities.compiled_batch:  # a compiled batched draft layer: commits of 1..k + 1, steps of 1
            drafter.precompile_batch(size, k + 1)
        warm = [prompt_ids(tokenizer, [{"role": "user", "content": questions[0]["turns"][0]}]).to(device)] * size
        batch_speculative_generate(runner, make_drafter(size), warm, max(8, k + 2), eos_ids, k, sampling, generator,
                                   verification=verification)
        batch_plain_generate(runner, warm, 8, eos_ids, sampling, generator)
        sync(device)
    overall = tallies["overall"]
    for start in range(0, len(questions), batch_size):
        chunk = questions[start : start + batch_size]
        histories: list[list[dict[str, str]]] = [[] for _ in chunk]
        for turn in range(max(len(q["turns"]) for q in chunk)):
            rows = [i for i, q in enumerate(chunk) if turn < len(q["turns"])]
            for i in rows:
                histories[i].append({"role": "user", "content": chunk[i]["turns"][turn]})
            prompts = [prompt_ids(tokenizer, histories[i]).to(device) for i in rows]
            # untimed: the prompts once through the target and the drafter (see run_benchmark)
            batch_speculative_generate(runner, make_drafter(len(rows)), prompts, 1, eos_ids, k, sampling, generator,
                                       verification=verification)
            spec_clock, plain_clock = RoundClock(device), RoundClock(device)
            sync(device)
            t0 = time.perf_counter()
            generator.manual_seed(seed)
            specs, rounds = batch_speculative_generate(runner, make_drafter(len(rows)), prompts, max_new_tokens,
                                                       eos_ids, k, sampling, generator, spec_clock, verification)
            sync(device)
            t1 = time.perf_counter()
            generator.manual_seed(seed)
            plains, steps = batch_plain_generate(runner, prompts, max_new_tokens, eos_ids, sampling, generator, plain_clock)
            sync(device)
            t2 = time.perf_counter()
            overall.add_seconds(spec_clock, plain_clock, rounds, steps)
            overall.spec_seconds += t1 - t0
            overall.plain_seconds += t2 - t1
            for i, spec, plain, prompt in zip(rows, specs, plains, prompts):
                q = chunk[i]
                if check is not None:
                    check.compare(f"question {q['question_id']} turn {turn + 1}", prompt, plain.tokens, spec.tokens)
                quality = (None if sampling is None else (text_logprob(runner.target.model, prompt, spec.tokens, sampling),
                                                          text_logprob(runner.target.model, prompt, plain.tokens, sampling)))
                for tally in (tallies[q["category"]], overall, by_length[prompt_bucket(prompt.shape[1])]):
                    tally.add(spec, depth)
                    if quality is not None:
                        tally.add_quality(*quality)
                overall.plain_tokens += len(plain.tokens)
                histories[i].append({"role": "assistant", "content": tokenizer.decode(plain.tokens, skip_special_tokens=True)})
        progress(f"questions {start + 1}-{start + len(chunk)}: tau so far {overall.summary()['tau']:.2f}")


def predict_chains(runner: TargetRunner, drafter: Drafter, prompt: torch.Tensor, overall: dict, k_run: int) -> dict:
    """``--predict``: step times measured at ``prompt`` (target forwards of 1..9 tokens, the drafter's proposals of
    k = 1..8) and the chain speed-ups of k = 1..8 they predict from the run's acceptance (decode/predict.py): by the
    steps alone, and with the rest of a round calibrated from the run's own seconds per round at ``k_run`` and plain
    decoding costed at its measured seconds per token."""
    times = measure_step_times(runner, drafter, prompt)
    acceptance = overall["acceptance_by_position"]
    bare = predict_speedups(acceptance, times["verify_seconds"], times["draft_seconds"])
    overhead = round_overhead(overall["seconds_per_round"], min(k_run, 8), times["verify_seconds"], times["draft_seconds"])
    rows = predict_speedups(acceptance, times["verify_seconds"], times["draft_seconds"], overhead,
                            1.0 / overall["plain_tokens_per_s"])
    return {**times, "overhead_seconds": overhead, "rows_steps_only": bare, "rows": rows, "recommended_k": recommend_k(rows)}
