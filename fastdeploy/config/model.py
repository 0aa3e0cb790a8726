"""What model to run and how its weights are read: :class:`ModelConfig` and :class:`LoadConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.config.checks import check, check_int

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class ModelConfig:
    """What model to run. ``model=None`` means the default SmolLM2-135M-Instruct GGUF.

    ``skip_tokenizer_init``: load no tokenizer; prompts are token ids and outputs carry no text.

    ``max_model_len`` (tokens, prompt + output) of ``None`` is resolved from the model's
    ``max_position_embeddings`` when the engine config is created.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):
            value = getattr(self, name)
            check(value is None or isinstance(value, str), name, value, "a path, a name or null")
        check(self.dtype in DTYPES, "dtype", self.dtype, ", ".join(DTYPES))
        check_int("max_model_len", self.max_model_len, optional=True)
        check_int("seed", self.seed, minimum=0)
        check(
            isinstance(self.skip_tokenizer_init, bool),
            "skip_tokenizer_init",
            self.skip_tokenizer_init,
            "true or false",
        )


@dataclass
class LoadConfig:
    """How weights are read: ``auto`` picks gguf for a ``.gguf`` file, else safetensors."""

    load_format: str = "auto"

    def __post_init__(self) -> None:
        check(
            self.load_format in LOAD_FORMATS,
            "load_format",
            self.load_format,
            ", ".join(LOAD_FORMATS),
        )
