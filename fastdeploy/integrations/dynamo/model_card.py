"""The model directory Dynamo registers: its frontend reads ``config.json`` and the Hugging Face
tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) from it to
tokenize prompts and detokenize our tokens.

A safetensors model directory already is one. A GGUF file is not (Dynamo 1.6's Python
registration expects Hugging Face files), so for GGUF we write one: the config our loader read
from the GGUF metadata and the tokenizer it built from it (the copy our loader caches with
``save_pretrained``, see ``fastdeploy.model_executor.model_loader.source``), saved again into a
cached directory per GGUF file version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from fastdeploy.model_executor.model_loader.source import gguf_config_cache_dir

#: Files Dynamo's frontend needs in the registered directory.
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def card_config(hf_config: Any) -> dict:
    """``hf_config`` as a ``config.json`` dict with ``architectures`` (Dynamo 1.6's model card
    parser requires the field; a config read from GGUF metadata lacks it): the causal-LM class
    ``transformers`` maps the ``model_type`` to.

    Raises:
        ValueError: no ``architectures`` and a ``model_type`` transformers has no causal LM for.
    """
    config = hf_config.to_dict()
    if not config.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_type = config.get("model_type")
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(
                f"model_type={model_type!r} has no causal-LM class in transformers; "
                "Dynamo's model card needs config.json's architectures"
            )
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return config


def model_card_dir(source: Any, cache_dir: str | Path | None = None) -> str:
    """A directory holding :data:`REQUIRED_FILES` for the model ``source``.

    Args:
        source: a ``fastdeploy.model_executor.model_loader.source.ModelSource``.
        cache_dir: where written directories are kept (default: ``dynamo-cards`` beside our GGUF
            config cache, ``$XDG_CACHE_HOME/fastdeploy``); one per GGUF file version (path, size,
            modification time), written once (to a temporary name, then renamed, so workers
            starting together never read a half-written one) and reused by later starts.

    Returns:
        ``source.path`` when it already holds the files (a Hugging Face directory), else the
        written directory.

    Raises:
        OSError: the directory cannot be written.
        ValueError: the tokenizer cannot be saved in the Hugging Face format (no
            ``tokenizer.json``: a slow tokenizer), naming the model.
    """
    if source.gguf_file is None and all((Path(source.path) / f).is_file() for f in REQUIRED_FILES):
        return source.path
    gguf = Path(source.path) / (source.gguf_file or "")
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    if cache_dir is None:
        cache_dir = gguf_config_cache_dir().parent / "dynamo-cards"
    target = Path(cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:32]
    if all((target / f).is_file() for f in REQUIRED_FILES):
        return str(target)
    tmp = target.with_name(f"{target.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(card_config(source.hf_config), indent=2))
    source.load_tokenizer().save_pretrained(str(tmp))
    missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(
            f"the tokenizer of {str(gguf)!r} saved no {', '.join(missing)}; Dynamo's frontend "
            "needs a fast (tokenizer.json) tokenizer"
        )
    try:
        os.replace(tmp, target)
    except OSError:  # another worker stored it first: theirs is kept
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
