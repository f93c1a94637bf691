"""Write a trained model as a Hugging Face directory, without any process holding it whole.

    >>> write_part(OUT / ".parts", "rank-0", {"model.embed_tokens.weight": tensor, ...})   # each rank its own
    >>> finish_hf_directory(OUT, config=config_json, tokenizer="models/qwen2")   # the launcher, at the end
    >>> transformers.AutoModelForCausalLM.from_pretrained(OUT)

Each pipeline rank writes its own stages' tensors, by their Hugging Face names, as one
safetensors "part" (a tied head's copy is left out: the checkpoint holds the weight once and
transformers ties it again on load). `finish_hf_directory` then streams the parts' bytes
into the final files: one `model.safetensors` when the model is at most `max_shard_bytes`,
else `model-00001-of-0000N.safetensors` shards of at most that size (whole tensors each) with
`model.safetensors.index.json`, as `save_pretrained` writes them. Bytes are copied in chunks
straight from the parts, so no process, the launcher included, holds more than one chunk.
It writes config.json, and copies the tokenizer's files and generation_config.json.

The safetensors layout (the format's specification): 8 bytes of little-endian header
length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {...}}, then the tensors' bytes, offsets counted from the end of the header.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Mapping

__all__ = ["DEFAULT_SHARD_BYTES", "PARTS", "TOKENIZER_FILES", "finish_hf_directory", "write_part"]

DEFAULT_SHARD_BYTES = 5 * 10**9
"""above this, the weights are sharded (transformers' default cut is of this order)"""
PARTS = ".pipeblocks-parts"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
_CHUNK = 16 * 2**20


def write_part(directory: str | os.PathLike, name: str, tensors: Mapping[str, Any]) -> Path:
    """Write `tensors` (name -> tensor) as the safetensors part `name` in `directory`, atomically."""
    from safetensors.torch import save_file  # optional (the hf extra)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{name}.safetensors"
    tmp = directory / f".{name}.safetensors.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, final)
    return final


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def finish_hf_directory(out: str | os.PathLike, *, config: Mapping[str, Any], tokenizer: str | None = None,
                        generation_config: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Turn the parts in `out`/.pipeblocks-parts into the model's safetensors file(s) and write
    config.json and the tokenizer files; returns the weight files written."""
    out = Path(out)
    parts_dir = out / PARTS
    parts = sorted(parts_dir.glob("*.safetensors"))
    if not parts:
        raise ValueError(f"no weights were written to {str(parts_dir)!r}: nothing to export")
    entries = []  # (name, dtype, shape, part, absolute begin, byte count)
    for part in parts:
        start, header = _header(part)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            entries.append((name, info["dtype"], info["shape"], part, start + begin, end - begin))
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"two ranks wrote the same tensor ({sorted({n for n in names if names.count(n) > 1})[:3]})")
    groups, size = [[]], 0
    for entry in entries:  # whole tensors per file, at most max_shard_bytes each (one larger tensor alone)
        if groups[-1] and size + entry[5] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry[5]
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    files = [out / "model.safetensors"] if len(groups) == 1 else [
        out / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for path, group in zip(files, groups):
        _stream(path, group)
        weight_map.update({e[0]: path.name for e in group})
        total += sum(e[5] for e in group)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    _write_text(out / "config.json", json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    for source, names in ((tokenizer, TOKENIZER_FILES), (generation_config, ("generation_config.json",))):
        if source is None:
            continue
        source = Path(source)
        for name in names:
            found = source / name if source.is_dir() else (source if source.name == name else None)
            if found is not None and found.is_file():
                shutil.copyfile(found, out / name)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return files


def _stream(path: Path, entries: list) -> None:
    """Write one safetensors file of `entries`, copying each tensor's bytes from its part."""
    header, offset = {}, 0
    for name, dtype, shape, _, _, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for _, _, _, part, begin, nbytes in entries:
            with open(part, "rb") as source:
                source.seek(begin)
                left = nbytes
                while left:
                    chunk = source.read(min(_CHUNK, left))
                    if not chunk:
                        raise ValueError(f"{str(part)!r} ended early: a part was cut short, export again")
                    handle.write(chunk)
                    left -= len(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
