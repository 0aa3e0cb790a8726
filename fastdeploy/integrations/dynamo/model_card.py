"""The model directory Dynamo registers: its frontend reads ``config.json`` and the Hugging Face
tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template) from it to
tokenize prompts and detokenize our tokens.

A safetensors model directory already is one. A GGUF file is not (Dynamo 1.6's Python
registration expects Hugging Face files), so for GGUF we write one: the config our loader read
from the GGUF metadata and the tokenizer it built from it (the copy our loader caches with
``save_pretrained``, see ``fastdeploy.model_executor.model_loader.source``), saved again into a
directory of this worker.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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


def model_card_dir(source: Any, workdir: str | None = None) -> str:
    """A directory holding :data:`REQUIRED_FILES` for the model ``source``.

    Args:
        source: a ``fastdeploy.model_executor.model_loader.source.ModelSource``.
        workdir: where to write the directory for a GGUF model (default: a new temporary
            directory; the caller removes it).

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
    target = Path(workdir or tempfile.mkdtemp(prefix="fastdeploy-dynamo-card-"))
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(card_config(source.hf_config), indent=2))
    source.load_tokenizer().save_pretrained(str(target))
    missing = [f for f in REQUIRED_FILES if not (target / f).is_file()]
    if missing:
        raise ValueError(
            f"the tokenizer of {os.path.join(source.path, source.gguf_file or '')!r} saved no "
            f"{', '.join(missing)}; Dynamo's frontend needs a fast (tokenizer.json) tokenizer"
        )
    return str(target)
