"""GGUF checkpoints: dequantized once into an ordinary safetensors checkpoint in the cache.

``LLM(model="x.gguf")`` (and the CLI) call :func:`resolve_model`, which turns a ``.gguf`` file
into a Hugging Face model directory under ``<cache>/gguf/<stem>-<digest>``: config, tokenizer
(with the chat template the GGUF carries), generation config and bf16 safetensors. The digest
is the file's sha256, so a changed file converts again and the second load is instant.

Invariants:

* the directory is complete or absent: everything is written into a temporary sibling that is
  renamed into place as the last step (a rename within one directory is atomic), and the
  temporary is removed on any failure;
* failures raise :class:`GGUFConversionError` with what went wrong and what to do.

The GGUF parsing, tensor name mapping and dequantization are transformers' (it reads the
metadata into a config and tokenizer, and undoes llama.cpp's Q/K row permutation) for the
architectures it reads; the GDN hybrids and the Mamba-2 family, which transformers 5 does not
read, pagefold reads itself (``models/gguf_native.py``, tables in ``models/gguf_archs.py``),
into the same stored form. An architecture neither reads is a :class:`GGUFConversionError`
naming it. pagefold adds the caching, the atomic write and the messages.

Kept quantized (the default of ``LLM`` and the CLI; ``keep_quantized=True``): the directory
``<stem>-<digest>-gguf`` holds the same config, tokenizer and generation config, with
``quantization_config: {"quant_method": "gguf"}``, and the file's quantized blocks under
Hugging Face names, rows permuted as transformers permutes them (``models/gguf_raw.py``);
``pagefold.quantization.gguf`` loads them into quantized layers. ``quantization="none"``
(``--quantization none``) keeps the dequantized bf16 conversion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch

from pagefold.models.gguf_archs import ARCHS, GGUFConversionError
from pagefold.models.gguf_native import native_arch, read_gguf
from pagefold.models.gguf_raw import quantized_tensors
from pagefold.quantization.gguf_blocks import GGUFTypeError

logger = logging.getLogger("pagefold")

GGUF_MAGIC = b"GGUF"
_STALE_TMP_SECONDS = 3600.0


def default_cache_dir() -> Path:
    """pagefold's cache root: ``$PAGEFOLD_CACHE`` or ``~/.cache/pagefold``."""
    return Path(os.environ.get("PAGEFOLD_CACHE", Path.home() / ".cache" / "pagefold"))


def is_gguf(model: str | os.PathLike) -> bool:
    return str(model).lower().endswith(".gguf")


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def converted_dir(gguf_path: Path, cache_root: Path | None = None,
                  keep_quantized: bool = False) -> Path:
    """Where the conversion of ``gguf_path`` lives (whether or not it exists yet)."""
    root = (cache_root or default_cache_dir()) / "gguf"
    tail = "-gguf" if keep_quantized else ""
    return root / f"{gguf_path.stem}-{file_digest(gguf_path)[:16]}{tail}"


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise GGUFConversionError(
            "reading GGUF files needs the 'gguf' package: pip install 'pagefold[smollm2]' "
            "(or pip install gguf)") from e


def _check_header(path: Path) -> None:
    if not path.is_file():
        raise GGUFConversionError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFConversionError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); the file is "
            "corrupt or of another format: download or reinstall it")


def _read_with_transformers(path: Path, dtype: torch.dtype, keep_quantized: bool):
    """(config, tokenizer, meta-device model, stored tensors, Hugging Face names covered) of
    a GGUF whose architecture transformers reads."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):  # only for transformers' tensor name map: no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    if keep_quantized:
        tensors, names = quantized_tensors(path, skeleton)
    else:
        # transformers shows a tqdm bar over the tensors while it dequantizes them.
        parsed = load_gguf_checkpoint(str(path), return_tensors=True,
                                      model_to_load=skeleton, torch_dtype=dtype)
        tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
        names = set(tensors)
    return config, tokenizer, skeleton, tensors, names


def _check_architecture(path: Path, reader) -> str | None:
    """The architecture when pagefold reads it itself (``gguf_native``); None when
    transformers does; else a GGUFConversionError naming it and both lists."""
    arch = native_arch(reader)
    if arch is not None:
        return arch
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    f = reader.fields.get("general.architecture")
    name = str(f.contents()) if f is not None else "(none)"
    aliases = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
               "minimax-m2": "minimax_m2"}
    if name not in GGUF_SUPPORTED_ARCHITECTURES and aliases.get(name) not in (
            GGUF_SUPPORTED_ARCHITECTURES):
        raise GGUFConversionError(
            f"{path}: GGUF architecture {name!r} is not supported (pagefold reads "
            f"{', '.join(sorted(ARCHS))} itself; transformers reads "
            f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    return None


def _write_checkpoint(path: Path, out: Path, dtype: torch.dtype,
                      keep_quantized: bool = False) -> None:
    """Everything of the checkpoint into ``out`` (an empty directory)."""
    import gguf
    from safetensors.torch import save_file

    with _one_reader():
        reader = gguf.GGUFReader(str(path))
        if _check_architecture(path, reader) is not None:
            config, tokenizer, skeleton, tensors, names = read_gguf(path, reader, dtype,
                                                                    keep_quantized)
        else:
            config, tokenizer, skeleton, tensors, names = _read_with_transformers(
                path, dtype, keep_quantized)
    expected = {k for k in skeleton.state_dict()
                if not (getattr(config, "tie_word_embeddings", False) and k == "lm_head.weight")}
    missing = sorted(expected - names)
    if missing:
        raise GGUFConversionError(
            f"{path} lacks {len(missing)} tensors the {config.model_type} model needs "
            f"(first: {missing[:3]}); the file is truncated or corrupt")
    for k, v in tensors.items():
        if v.is_floating_point() and not torch.isfinite(v.float()).all():
            raise GGUFConversionError(f"{path}: tensor {k} has non-finite values; the file is "
                                      "corrupt")
    config.dtype = dtype
    if keep_quantized:
        config.quantization_config = {"quant_method": "gguf"}
    config.architectures = [type(skeleton).__name__]  # GGUF metadata names none
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "pagefold_source.json").write_text(json.dumps(
        {"gguf": str(path), "sha256": file_digest(path), "dtype": str(dtype),
         "kept_quantized": keep_quantized}, indent=2) + "\n")


@contextmanager
def _one_reader():
    """One ``gguf.GGUFReader`` per file while converting: transformers parses the whole
    metadata again for the config, the tokenizer and the tensors (seconds each for a
    49k-token vocabulary, in Python), and every parse of an unchanged file is the same."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(p, mode="r"):
        key = (str(Path(p).resolve()), mode)
        if key not in readers:
            readers[key] = original(p, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _remove_stale_tmp(root: Path) -> None:
    """Temporaries of a killed conversion (no exception handler ran) are removed later."""
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def convert_gguf(path: str | os.PathLike, *, cache_root: Path | None = None,
                 dtype: torch.dtype = torch.bfloat16, keep_quantized: bool = False) -> Path:
    """The converted checkpoint directory of ``path``; converts it on first use.
    ``keep_quantized``: the quantized tensors stay in the file's blocks (module docstring).

    Raises :class:`GGUFConversionError` (nothing left in the cache) when the package is missing
    or the file is not a readable GGUF of a supported architecture.
    """
    path = Path(path).expanduser().resolve()
    _check_header(path)
    final = converted_dir(path, cache_root, keep_quantized)
    if (final / "config.json").exists():
        return final
    _require_gguf_package()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    logger.info("converting %s into %s (once; later loads reuse it)", path, final)
    what = "quantized" if keep_quantized else str(dtype).removeprefix("torch.")
    print(f"pagefold: converting {path.name} to a {what} checkpoint in {final} (once)",
          flush=True)
    try:
        try:
            _write_checkpoint(path, tmp, dtype, keep_quantized)
        except GGUFConversionError:
            raise
        except GGUFTypeError as e:
            raise GGUFConversionError(f"cannot load {path} kept quantized: {e}") from e
        except Exception as e:  # noqa: BLE001 - gguf/transformers raise many kinds
            raise GGUFConversionError(
                f"cannot convert {path}: {type(e).__name__}: {e}. The file is corrupt or "
                "truncated (download or reinstall it) or its architecture is not one "
                "transformers reads from GGUF") from e
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").exists():  # not a concurrent conversion's win
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(model: str, cache_root: Path | None = None,
                  quantization: str | None = None) -> str:
    """``model`` itself, or for a ``.gguf`` file the directory of its converted checkpoint:
    kept quantized unless ``quantization`` asks for another (``none``: dequantized bf16;
    ``fp8`` / ``int8`` / ``int4``: the bf16 conversion, quantized on load)."""
    if is_gguf(model):
        keep = quantization is None or quantization.strip().lower() == "gguf"
        return str(convert_gguf(model, cache_root=cache_root, keep_quantized=keep))
    return model
