"""Two nodes on one machine: two launchers on localhost, one rank each, meet at a c10d rendezvous on 127.0.0.1 and
train as one job of world size 2 -- the same job as one launcher with 2 ranks: the same losses, the same head, and
every per-job file written once. Killed on one "node" and resumed on one launcher with 2 ranks, it ends the same."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_distributed import torchrun
from trainer_fixtures import make_setup, train_losses

pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "GLOO_SOCKET_IFNAME": "lo"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(command: list[str], overrides: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """One "node": a launcher of its own, in its own process group."""
    return subprocess.Popen([*command, *overrides], cwd=cwd, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def listening(port: int) -> bool:
    """Whether a process on this machine listens on ``port`` (read from /proc, without connecting to it)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def start_nodes(command: list[str], overrides: list[str], homes: list[Path], logs: list[Path],
                launched: list[subprocess.Popen], port: int) -> list[subprocess.Popen]:
    """Node 0 first, the next once node 0's launcher listens at the rendezvous endpoint: node 0 hosts the job's
    store, as the node named by --rdzv-endpoint does on a cluster (the first launcher to bind the port hosts it)."""
    deadline, nodes = time.monotonic() + 120, []
    for home, log in zip(homes, logs):
        while nodes and not listening(port):
            assert time.monotonic() < deadline and nodes[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        nodes.append(node(command, overrides, home, log))
        launched.append(nodes[-1])
    return nodes


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_node(proc: subprocess.Popen) -> None:
    """A lost machine: its launcher and every rank it started (torchrun starts each rank in a session of its own, so
    killing the launcher's process group alone would leave its ranks training on)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def launched():
    """The nodes a test starts; whatever still runs at its end (a failed assertion) is killed, ranks and all, so that
    it cannot slow or disturb the tests after it."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            kill_node(proc)


def headstart_train(port: int) -> list[str]:
    """What docs/TRAINING.md tells each node to run (here with one rank a node)."""
    return [sys.executable, "-m", "headstart.train", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "two-nodes", "--nproc-per-node", "1"]


def plain_torchrun(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
            str(Path(__file__).resolve().parents[1] / "scripts" / "train_eagle3.py")]


def wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> None:
    for proc, log in zip(procs, logs):
        assert proc.wait(timeout=timeout) == 0, log.read_text()[-4000:]


def weights(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def assert_same_run(a: Path, b: Path) -> None:
    losses_a, losses_b = train_losses(a / "metrics.jsonl"), train_losses(b / "metrics.jsonl")
    assert len(losses_a) == len(losses_b) > 2 and losses_a[-1] != losses_a[0]
    assert losses_a == pytest.approx(losses_b, rel=1e-6, abs=1e-7)
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb)
    for name in wa:  # bf16 exports: within one rounding step
        assert (wa[name].float() - wb[name].float()).abs().max() <= 1e-2 * wa[name].float().abs().max(), name


def test_two_launchers_train_as_one_launcher_with_two_ranks(tmp_path, launched):
    base = make_setup(tmp_path) + ["--train.batch_size=1", "--train.grad_accum=2", "--train.max_steps=4",
                                   "--train.save_every=2"]
    torchrun(base + [f"--output_dir={tmp_path / 'one'}"], tmp_path, nproc=2)
    port = free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = start_nodes(headstart_train(port), base + [f"--output_dir={tmp_path / 'two'}"], [tmp_path] * 2, logs,
                        launched, port)
    wait(nodes, logs)

    assert_same_run(tmp_path / "one", tmp_path / "two")
    # Once per job: one log line per step (not one per node), one export, rank 0's messages printed once in all.
    records = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    state = json.loads((tmp_path / "two" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    printed = "".join(log.read_text() for log in logs)
    assert printed.count("done. The trained head is in") == 1
    assert not list((tmp_path / "two").glob(".probe-*"))  # the shared-directory probe is cleaned up


def test_a_job_killed_on_one_node_resumes_on_one_launcher_with_two_ranks(tmp_path, launched):
    base = make_setup(tmp_path) + ["--train.batch_size=1", "--train.grad_accum=2", "--train.max_steps=120",
                                   "--train.save_every=4", "--train.eval_every=1000"]  # long enough to be killed midway
    torchrun(base + [f"--output_dir={tmp_path / 'whole'}"], tmp_path, nproc=2)
    run, port = tmp_path / "killed", free_port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = start_nodes(plain_torchrun(port), base + [f"--output_dir={run}"], [tmp_path] * 2, logs, launched, port)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "latest").is_file():  # the first checkpoint is in place: kill a node now
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), logs[0].read_text()[-3000:]
        time.sleep(0.02)
    kill_node(nodes[1])
    # The other node's rank finds its peer gone at its next collective and the job stops there (no hang).
    assert nodes[0].wait(timeout=300) != 0
    assert not (run / "final").exists(), "the job finished before the kill: nothing was tested"
    killed_at = (run / "checkpoints" / "latest").read_text().strip()

    torchrun(base + [f"--output_dir={run}", "--resume"], tmp_path, nproc=2)
    assert_same_run(tmp_path / "whole", run)
    assert int(killed_at.split("_")[1]) < 120


def test_an_output_dir_local_to_each_node_is_refused_before_training(tmp_path, launched):
    """Each "node" in its own working directory with a relative output_dir: the same path, two directories (as on
    node-local disks). Rank 0 writes checkpoints that rank 1 could never read back: refused at the start."""
    base = make_setup(tmp_path) + ["--output_dir=run"]
    port, logs = free_port(), [tmp_path / f"node{i}.log" for i in range(2)]
    homes = [tmp_path / f"node{i}" for i in range(2)]
    for home in homes:
        home.mkdir()
    nodes = start_nodes(headstart_train(port), base, homes, logs, launched, port)
    codes = [proc.wait(timeout=300) for proc in nodes]
    printed = [log.read_text() for log in logs]
    assert codes[0] == 2, printed[0][-3000:]  # the node hosting the rendezvous: its ranks' refusal
    # The other node prints its ranks' refusal too, or, when the host's launcher left before this one saw its own
    # ranks stop, that the host stopped; never a traceback.
    lost = "error: the node hosting the job's rendezvous at 127.0.0.1:"
    assert codes[1] == 2 or (codes[1] == 1 and lost in printed[1]), printed[1][-3000:]
    assert not any("Traceback" in text for text in printed)
    printed = "".join(printed)
    assert "run is not one directory for every rank: rank(s) 1 on" in printed and "storage every node mounts" in printed
    assert not any((home / "run" / "metrics.jsonl").exists() for home in homes)
