"""The training loop on one process: exact resume, atomic checkpoints, exports, logging, config errors."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import yaml
import torch
from trainer_fixtures import make_setup, train_losses

from headstart.heads.eagle3.module import Eagle3Draft
from headstart.trainer.checkpoint import latest_checkpoint
from headstart.trainer.config import load_config
from headstart.trainer.loop import Trainer
from headstart.trainer.run import build_trainer


def run(overrides: list[str], resume: bool = False) -> Trainer:
    trainer = build_trainer(load_config(None, overrides))
    trainer.train(resume=resume)
    return trainer


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_after_a_crash_matches_an_uninterrupted_run(tmp_path, monkeypatch, optimizer):
    base = make_setup(tmp_path) + [f"--train.optimizer={optimizer}"]
    reference = run(base + [f"--output_dir={tmp_path / 'a'}"])
    losses_a = train_losses(tmp_path / "a" / "metrics.jsonl")
    assert len(losses_a) == 6 and losses_a[-1] < losses_a[0]

    # Crash in step 5, after the step-3 checkpoint was written.
    original = Trainer.train_step

    def crashing(self):
        if self.step == 4:
            raise KeyboardInterrupt("killed")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(KeyboardInterrupt):
        run(base + [f"--output_dir={tmp_path / 'b'}"])
    assert latest_checkpoint(tmp_path / "b").name == "step_000003"
    monkeypatch.setattr(Trainer, "train_step", original)
    resumed = run(base + [f"--output_dir={tmp_path / 'b'}"], resume=True)
    losses_b = train_losses(tmp_path / "b" / "metrics.jsonl")
    assert len(losses_b) == 6  # the crashed run's step 4 was dropped from the log
    assert losses_b == pytest.approx(losses_a, abs=1e-6)
    for (name, a), b in zip(reference.backend.module.state_dict().items(), resumed.backend.module.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    overrides = make_setup(tmp_path) + ["--train.max_steps=6", "--train.save_every=2"]
    calls = {"n": 0}
    original = Trainer.export_draft

    def dying_export(self, directory):
        calls["n"] += 1
        if calls["n"] == 2:  # the step-4 checkpoint dies half-written
            raise KeyboardInterrupt("killed mid-write")
        return original(self, directory)

    monkeypatch.setattr(Trainer, "export_draft", dying_export)
    with pytest.raises(KeyboardInterrupt):
        run(overrides)
    root = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(tmp_path / "run").name == "step_000002"
    assert (root / ".tmp-step_000004" / "state" / "model.safetensors").exists()  # the half-written one
    assert not (root / "step_000004").exists()
    monkeypatch.setattr(Trainer, "export_draft", original)
    run(overrides, resume=True)  # resumes from step 2 and finishes
    assert latest_checkpoint(tmp_path / "run").name == "step_000006"


def test_outputs_are_server_layout_drafts(tmp_path):
    trainer = run(make_setup(tmp_path) + ["--export.format=both"])
    run_dir = tmp_path / "run"
    for draft_dir in [run_dir / "final", latest_checkpoint(run_dir) / "draft"]:
        config = json.loads((draft_dir / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
        spec = json.loads((draft_dir / "speculators" / "config.json").read_text())  # export.format: both
        assert spec["speculators_model_type"] == "eagle3" and spec["draft_vocab_size"] == 64
        assert spec["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
        record = json.loads((draft_dir / "headstart.json").read_text())  # the target it was trained against
        assert record["head"] == "eagle3" and record["target"]["name_or_path"] == str(tmp_path / "target")
        assert record["target"]["tokenizer_sha256"] and record["target"]["config_sha256"]
    head = trainer.backend.module
    reloaded = Eagle3Draft.from_pretrained(run_dir / "final", target_embeddings=head.embed_tokens.weight)
    assert torch.equal(reloaded.d2t, head.d2t)
    torch.testing.assert_close(reloaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    assert evals and {"loss", "acc_0", "sim_accept_len"} <= set(evals[-1])
    import resource

    # The process's peak memory, logged per step: at least what it held when the run was set up, at most its peak now.
    peaks = [r["peak_mem_gib"] for r in records if r["split"] == "train"]
    assert peaks == sorted(peaks) and 0.1 < peaks[-1] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def read_wandb_log(path: Path) -> list[bytes]:
    """Records of a .wandb file: a LevelDB-style log (7-byte header, then 32 KiB blocks of
    [crc32 u32, length u16, type u8] + payload; types 1 full, 2 first, 3 middle, 4 last)."""
    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(raw):
        left_in_block = 32768 - pos % 32768
        if left_in_block < 7:  # block trailer padding
            pos += left_in_block
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        if pos + 7 + length > len(raw):  # a record still being written
            break
        payload = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending += payload
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def test_wandb_offline_run_can_be_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(make_setup(tmp_path) + ["--logging.wandb=true", "--logging.run_name=t", "--train.max_steps=3"])
    import wandb
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # waits for wandb's service process, which writes the file, to exit

    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    logged = {}
    # finish() can return while the service still flushes the file (seen twice in CI): re-read it for a
    # few seconds, skipping a record caught half-written, before judging what was logged.
    for _ in range(40):
        for data in read_wandb_log(files[0]):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(data)
            except DecodeError:
                break
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                logged[items["_step"]] = items
        if len(logged) >= 3:
            break
        time.sleep(0.25)
    jsonl = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in jsonl if r["split"] == "train"}
    assert sorted(logged) == [1, 2, 3]
    for step, items in logged.items():
        assert items["train/loss"] == pytest.approx(train[step]["loss"])


def test_only_logged_steps_are_written_and_they_carry_the_full_metrics(tmp_path):
    """``train.log_every`` 4 over 6 steps: rows for steps 4 and 6 (the last), each with top-5 and sum min(p, q), and
    the same losses as a run that logs every step (steps that are not logged skip only metrics)."""
    every = make_setup(tmp_path / "every")
    build_trainer(load_config(None, every)).train()
    sparse = make_setup(tmp_path / "sparse") + ["--train.log_every=4"]
    build_trainer(load_config(None, sparse)).train()
    rows = {d: [json.loads(x) for x in (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()]
            for d in ("every", "sparse")}
    train = {d: {r["step"]: r for r in rs if r["split"] == "train"} for d, rs in rows.items()}
    assert sorted(train["sparse"]) == [4, 6] and sorted(train["every"]) == [1, 2, 3, 4, 5, 6]
    for step, row in train["sparse"].items():
        assert {"top5_0", "accept_0", "acc_0", "sim_accept_len"} <= set(row)
        assert row["loss"] == pytest.approx(train["every"][step]["loss"], rel=1e-6)
        assert row["accept_0"] == pytest.approx(train["every"][step]["accept_0"], rel=1e-6)


def test_a_draft_config_from_another_target_is_refused_before_training(tmp_path):
    overrides = make_setup(tmp_path)
    other = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 48, "num_attention_heads": 4,
             "intermediate_size": 64, "vocab_size": 1000, "draft_vocab_size": 64,
             "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="does not fit the target") as err:
        build_trainer(load_config(None, overrides + [f"--draft.config={tmp_path / 'other.json'}"]))
    assert "vocab_size 1000" in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['train.learning_rate'\]"):
        load_config(None, ["--train.learning_rate=1"])
    (tmp_path / "c.yaml").write_text("output_dir: x\nparallel:\n  backend: fsdp\n  zero: 3\n")
    with pytest.raises(ValueError, match="parallel.zero"):
        load_config(str(tmp_path / "c.yaml"))
    # A field of another head: refused by name, with the head's own fields (a Medusa recipe never trains TTT steps).
    (tmp_path / "m.yaml").write_text("draft:\n  head: medusa\n  num_heads: 3\n  ttt_steps: 5\n  draft_vocab_size: 8\n")
    with pytest.raises(ValueError, match=r"draft.draft_vocab_size, draft.ttt_steps: not a field of the medusa head; its "
                                         r"fields are \['num_heads', 'num_layers', 'truncated_vocab_size', 'labels', "
                                         r"'step_weight'\], and \['head', 'config', 'loss_chunk_tokens', 'loss', 'init_from'\] for every head"):
        load_config(str(tmp_path / "m.yaml"))
    with pytest.raises(ValueError, match="draft.num_heads: not a field of the eagle3 head"):
        load_config(None, ["--draft.num_heads=2"])
    with pytest.raises(ValueError, match="draft.ttt_step: not a field of the mtp head"):  # a typo, by name
        load_config(None, ["--draft.head=mtp", "--draft.ttt_step=2"])
    with pytest.raises(ValueError, match="draft.num_heads: expected int"):
        load_config(None, ["--draft.head=medusa", "--draft.num_heads=four"])
    with pytest.raises(ValueError, match="unknown draft head 'medusa2'"):
        build_trainer(load_config(None, make_setup(tmp_path) + ["--draft.head=medusa2"]))
    with pytest.raises(ValueError, match=r"export.format 'speculators': MedusaHeads is exported in the layouts \['vllm'\]"):
        build_trainer(load_config(None, make_setup(tmp_path, head="medusa") + ["--export.format=speculators"]))


def test_draft_section_is_flat_in_a_recipe_and_typed_per_head(tmp_path):
    from headstart.heads.medusa.module import MedusaOptions
    from headstart.heads.mtp.module import MTPOptions
    from headstart.trainer.config import to_dict

    (tmp_path / "m.yaml").write_text("draft:\n  head: medusa\n  num_heads: 3\n  step_weight: 1\n  loss_chunk_tokens: 64\n")
    config = load_config(str(tmp_path / "m.yaml"))
    assert config.draft.options == MedusaOptions(num_heads=3, step_weight=1.0)
    assert isinstance(config.draft.options.step_weight, float) and config.draft.loss_chunk_tokens == 64
    flat = to_dict(config)["draft"]  # what run_config.json records: the recipe's own shape, every default filled in
    assert flat == {"head": "medusa", "config": None, "loss_chunk_tokens": 64, "loss": "kl", "init_from": None, "num_heads": 3, "num_layers": 1,
                    "truncated_vocab_size": None, "labels": "target", "step_weight": 1.0}
    (tmp_path / "again.yaml").write_text(yaml.safe_dump({"draft": flat}))
    assert load_config(str(tmp_path / "again.yaml")).draft == config.draft
    assert load_config(None, ["--draft.head=mtp"]).draft.options == MTPOptions()


def test_bf16_target_and_bf16_autocast_train(tmp_path):
    """The GPU recipe's precision path (bf16 target weights, bf16 autocast over fp32 head weights), run on CPU."""
    overrides = [o for o in make_setup(tmp_path) if not o.startswith("--target.dtype")]
    run(overrides + ["--train.max_steps=3", f"--output_dir={tmp_path / 'fp32'}"])
    trainer = run(overrides + ["--target.dtype=bfloat16", "--train.mixed_precision=bf16", "--train.max_steps=3"])
    fp32 = train_losses(tmp_path / "fp32" / "metrics.jsonl")
    bf16 = train_losses(tmp_path / "run" / "metrics.jsonl")
    assert max(fp32) > 1.0  # (a batch may hold no valid token: loss 0 in both runs)
    assert bf16 == pytest.approx(fp32, rel=0.03, abs=1e-3)
    head = trainer.backend.module
    assert head.fc.weight.dtype == torch.float32  # master weights stay fp32 under autocast
    assert trainer.features.target.model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="mixed_precision must be auto, bf16 or fp32"):
        run(overrides + ["--train.mixed_precision=fp8", f"--output_dir={tmp_path / 'x'}"])


def test_integrated_decode_evaluation_logs_tau(tmp_path):
    """train.decode_eval_prompts decodes held-out prompts with the current head at every evaluation."""
    run(make_setup(tmp_path) + ["--train.decode_eval_prompts=2", "--train.decode_eval_max_new_tokens=12",
                                "--train.eval_every=3", "--train.max_steps=6"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        # tau = tokens per target forward: 1 (nothing accepted) .. 1 + k; 11 tokens counted per prompt
        assert 1.0 <= r["decode_tau"] <= 5.0 and r["decode_tokens"] == 2 * 11


def test_decode_eval_prompts_end_before_the_first_trained_token():
    import datasets

    from headstart.trainer.decode_eval import held_out_prompts

    data = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9], [1, 2, 3], [4, 4]],
                                       "loss_mask": [[0, 0, 1, 1, 0], [1, 1, 1], [0, 1]]})
    prompts = held_out_prompts(data, 3)
    assert [p.tolist() for p in prompts] == [[[5, 6]], [[4]]]  # a row trained from token 0 has no prompt


def test_the_best_head_by_acceptance_is_kept_and_published(tmp_path, capsys):

    from safetensors.torch import load_file

    run(make_setup(tmp_path) + ["--train.max_steps=5", "--train.eval_every=1", "--train.lr=3e-3", "--train.save_every=1",
                                "--train.keep_checkpoints=5"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["sim_accept_len"] for r in records if r["split"] == "eval"}
    bests = [(r["step"], r["sim_accept_len"]) for r in records if r["split"] == "best"]
    assert sorted(evals) == [1, 2, 3, 4, 5]
    # A best is logged exactly when an evaluation beats every earlier one.
    expected = [(s, v) for s, v in evals.items() if all(v > evals[e] for e in evals if e < s)]
    assert bests == expected and bests[0][0] == 1
    best_step, best_value = max(evals.items(), key=lambda kv: kv[1])
    record = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert record == {"step": best_step, "metric": "sim_accept_len", "value": best_value}
    draft = load_file(str(tmp_path / "run" / "best" / "model.safetensors"))
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{best_step:06d}" / "draft" / "model.safetensors"
    assert all(torch.equal(v, load_file(str(checkpoint))[k]) for k, v in draft.items())  # that step's weights
    assert (tmp_path / "run" / "best" / "headstart.json").is_file()

    from headstart.scripts import publish_head as publish

    publish.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "published")])
    card = (tmp_path / "published" / "README.md").read_text()
    assert f"Chosen as the run's best head: step {best_step} of 5, by simulated acceptance length {best_value:.3f}" in card
    assert f"Held-out evaluation at step {best_step} " in card
    run_draft = json.loads((tmp_path / "run" / "run_config.json").read_text())["draft"]
    assert f"{run_draft['head']}: loss {run_draft['loss']}, " in card  # the loss is not in the weights: the card says it
    assert all(torch.equal(v, load_file(str(tmp_path / "published" / "model.safetensors"))[k]) for k, v in draft.items())
    publish.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "last"), "--head", "final"])
    assert "Chosen as" not in (tmp_path / "last" / "README.md").read_text()


def test_a_full_disk_names_the_path_and_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    """ENOSPC in the middle of the second checkpoint (the optimizer file), as a full disk gives it."""
    import errno

    import headstart.trainer.distributed as distributed
    from headstart.trainer.checkpoint import WriteError

    overrides = make_setup(tmp_path) + ["--train.max_steps=6", "--train.save_every=2"]
    original, calls = distributed.save_file, []

    def full_disk(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 4:  # checkpoint 2: model.safetensors is written, optimizer.safetensors is not
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return original(tensors, path, *args, **kwargs)

    monkeypatch.setattr(distributed, "save_file", full_disk)
    with pytest.raises(WriteError) as caught:
        run(overrides)
    message = str(caught.value)
    assert f"could not write checkpoint step_000004 to {calls[3]}: No space left on device" in message
    assert f"the last checkpoint, {tmp_path / 'run' / 'checkpoints' / 'step_000002'}, is whole" in message
    assert "--resume" in message and calls[3].endswith("optimizer.safetensors")
    root = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(tmp_path / "run").name == "step_000002" and not (root / ".tmp-step_000004").exists()
    monkeypatch.setattr(distributed, "save_file", original)  # space freed
    resumed = run(overrides, resume=True)
    assert resumed.step == 6 and len(train_losses(tmp_path / "run" / "metrics.jsonl")) == 6


def test_a_file_size_limit_is_reported_as_one_error_line(tmp_path):
    """A real OS refusal (RLIMIT_FSIZE: writes past 4 KiB fail with EFBIG) in the training script: one
    `error:` line naming the checkpoint and the file, no traceback, nothing half-written left behind."""
    import resource
    import signal
    import subprocess
    import sys

    overrides = make_setup(tmp_path) + ["--train.max_steps=2", "--train.save_every=1"]
    run(overrides[:1] + [f"--output_dir={tmp_path / 'warm'}"] + overrides[1:])  # tokenize: the data cache is written now

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    script = Path(__file__).parents[1] / "scripts" / "train_eagle3.py"
    result = subprocess.run([sys.executable, str(script), *overrides], capture_output=True, text=True, preexec_fn=limit,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"could not write checkpoint step_000001 to {tmp_path / 'run' / 'checkpoints' / '.tmp-step_000001'}" in errors[0]
    assert "File too large" in errors[0] and "no checkpoint was written yet" in errors[0]
    assert not (tmp_path / "run" / "checkpoints" / ".tmp-step_000001").exists()


def test_resume_refuses_a_checkpoint_of_another_head_shape_vocab_or_target(tmp_path):
    overrides = make_setup(tmp_path) + ["--train.max_steps=2", "--train.save_every=1"]
    run(overrides)
    with pytest.raises(ValueError, match=r"cannot resume .*step_000002: its tensors have other shapes: "
                                         r".*lm_head.weight \[64, \d+\] there vs \[48, \d+\] here"):
        run(overrides + ["--draft.draft_vocab_size=48", "--train.max_steps=3"], resume=True)
    with pytest.raises(ValueError, match="it trains a eagle3 head, this run a medusa head"):
        medusa = [o for o in overrides if not o.startswith(("--draft.draft_vocab_size", "--draft.ttt_steps"))]
        run(medusa + ["--draft.head=medusa", "--train.max_steps=3"], resume=True)
    with pytest.raises(ValueError, match="its optimizer state is adamw's, this run uses muon"):
        run(overrides + ["--train.optimizer=muon", "--train.max_steps=3"], resume=True)
    rows = (tmp_path / "chat.jsonl").read_text().splitlines()
    (tmp_path / "other.jsonl").write_text("\n".join(rows[:6]) + "\n")  # other data: another draft vocab
    with pytest.raises(ValueError, match=r"its draft vocab \(d2t/t2d\) differs"):
        run(overrides + [f"--data.files=[{tmp_path / 'other.jsonl'}]", "--train.max_steps=3"], resume=True)
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    rope = {**config.get("rope_parameters", {}), "rope_theta": 1234.0}
    (tmp_path / "target" / "config.json").write_text(json.dumps({**config, "rope_parameters": rope, "rope_theta": 1234.0}))
    with pytest.raises(ValueError, match="its target .* has another config than this run's"):
        run(overrides + ["--train.max_steps=3"], resume=True)


def test_a_kill_between_the_best_heads_renames_and_after_its_checkpoint_is_repaired_on_resume(tmp_path):
    overrides = make_setup(tmp_path) + ["--train.max_steps=4", "--train.eval_every=1", "--train.save_every=2",
                                        "--train.lr=3e-3"]
    run(overrides[:1] + [f"--output_dir={tmp_path / 'whole'}"] + overrides[1:])
    run(overrides)
    out = tmp_path / "run"
    # As if killed after step 3's best export (best/ moved aside, the new one not yet in place) and before step 4's
    # checkpoint: the run resumes from step 2 with best/ missing and .old-best/ holding a head from after step 2.
    (out / "best").rename(out / ".old-best")
    (out / "checkpoints" / "latest").write_text("step_000002")
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_000004")
    shutil.rmtree(out / "final")
    run(overrides, resume=True)
    from headstart.trainer.run_dir import MACHINE_METRICS

    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k not in MACHINE_METRICS}  # noqa: E731
                       for x in (p / "metrics.jsonl").read_text().splitlines()]
    assert strip(out) == strip(tmp_path / "whole")
    assert json.loads((out / "best" / "best.json").read_text()) == json.loads((tmp_path / "whole" / "best" / "best.json").read_text())
    assert not (out / ".old-best").exists()


@pytest.mark.parametrize("schedule,at_half,at_end", [("cosine", 0.5, 0.0), ("linear", 0.5, 0.0), ("constant", 1.0, 1.0)])
def test_learning_rate_schedules(schedule, at_half, at_end):
    from headstart.trainer.config import TrainConfig
    from headstart.trainer.distributed import lr_lambda

    f = lr_lambda(TrainConfig(max_steps=110, warmup_ratio=10 / 110, schedule=schedule))
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # linear warm-up over 10 steps
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(at_half) and f(110) == pytest.approx(at_end, abs=1e-12)
    assert f(35) == pytest.approx({"cosine": 0.5 * (1 + math.cos(math.pi / 4)), "linear": 0.75, "constant": 1.0}[schedule])


def test_unknown_schedule_is_refused_by_name():
    from headstart.trainer.config import TrainConfig
    from headstart.trainer.distributed import lr_lambda

    with pytest.raises(ValueError, match="train.schedule='cosin'"):
        lr_lambda(TrainConfig(schedule="cosin"))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tmp_path):
    from headstart.trainer.config import TrainConfig
    from headstart.trainer.distributed import _optimizers

    trainer = build_trainer(load_config(None, make_setup(tmp_path) + [f"--output_dir={tmp_path / 'm'}"]))
    head = trainer.backend.module
    muon, adamw = _optimizers(head, TrainConfig(optimizer="muon"))
    names = {id(p): n for n, p in head.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= in_muon
    assert {"lm_head.weight", "norm.weight", "midlayer.hidden_norm.weight"} <= in_adamw and not in_muon & in_adamw
    assert in_muon | in_adamw == {n for n, p in head.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match="train.optimizer='sgd'"):
        _optimizers(head, TrainConfig(optimizer="sgd"))


def test_without_periodic_evaluation_there_is_no_best_and_the_resolved_aux_ids_are_recorded(tmp_path, capsys):
    """eval_every 0: only the final evaluation runs, and one evaluation is no choice, so no best/ (it would
    be a copy of final/). run_config.json says which target layers the head read, not ``null``."""
    run(make_setup(tmp_path, layers=8))  # eval_fraction 0.2, eval_every left at its default 0
    out = tmp_path / "run"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "eval"] == [6]  # the final evaluation is still logged
    assert not [r for r in records if r["split"] == "best"]
    assert not (out / "best").exists() and (out / "final" / "model.safetensors").is_file()
    assert json.loads((out / "run_config.json").read_text())["target"]["aux_layer_ids"] == [2, 4, 5]  # (2, L//2, L-3)
    assert "reads the target's hidden states [2, 4, 5]" in capsys.readouterr().out


def test_a_published_cards_command_names_what_the_run_changed_from_its_recipe(tmp_path):
    """publish_head's card command = the recipe plus the run's own overrides (what it takes to train the head again);
    output paths, logging and settings the run resolved at start are not overrides."""
    import shlex

    from headstart.scripts.publish_head import overrides_of
    from headstart.trainer.config import load_config, to_dict

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("target:\n  path: configs/demo/target\ndata:\n  files: [a.jsonl]\ntrain:\n  lr: 2.0e-3\n"
                      "  batch_size: 4\ndraft:\n  head: eagle3\n  ttt_steps: 7\n")
    changes = ["--train.batch_size=8", "--train.optimizer=muon", "--draft.ttt_steps=3", "--data.tokens_per_batch=1024",
               "--data.files=[a.jsonl, my chats.jsonl]", "--logging.progress=false", "--output_dir=elsewhere"]
    ran = json.loads(json.dumps(to_dict(load_config(str(recipe), changes))))
    ran["target"]["aux_layer_ids"] = [2, 4, 5]  # resolved by the trainer at start
    flags = overrides_of(str(recipe), ran)
    assert flags == ["'--data.files=[\"a.jsonl\", \"my chats.jsonl\"]'", "--data.tokens_per_batch=1024",
                     "--draft.ttt_steps=3", "--train.batch_size=8", "--train.optimizer=muon"]
    # The flags, as a shell passes them, load the run's config again (a None default overridden, a list, a space).
    again = json.loads(json.dumps(to_dict(load_config(str(recipe), [shlex.split(f)[0] for f in flags]))))
    assert {k: v for k, v in again.items() if k not in ("output_dir", "logging", "target")} == \
        {k: v for k, v in ran.items() if k not in ("output_dir", "logging", "target")}
    assert overrides_of(str(recipe), json.loads(json.dumps(to_dict(load_config(str(recipe)))))) == []
