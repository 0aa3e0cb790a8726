"""Reading GGUF files (llama.cpp's format): dequantise every tensor and rename it to Hugging Face.

Tensor names follow the GGUF "standardized tensor names" (``blk.N.attn_q.weight``, ...; see
ggml's docs/gguf.md). llama.cpp's converter permutes the rows of the Q and K projections of
Llama-architecture models (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``) so that its RoPE
kernel can rotate adjacent pairs; :func:`reverse_permute` undoes it, as ``transformers``'
``LlamaTensorProcessor`` does. Other architectures (qwen2, qwen3, qwen3moe) are stored unpermuted.

Mixture-of-experts tensors use the names the ``gguf`` package gives them (``gguf.constants``
``TENSOR_NAMES``): the router ``ffn_gate_inp``, the stacked experts ``ffn_{gate,up,down}_exps``
(``[E, I, H]`` and ``[E, H, I]``), the shared experts ``ffn_{gate,up,down}_shexp`` and the
selection bias ``exp_probs_b``; they map to the stacked Hugging Face-style names that
:class:`~fastdeploy.model_executor.models.moe_decoder.MoEDecoderForCausalLM` loads.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF name inside ``blk.N`` -> Hugging Face module path inside ``model.layers.N``.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # glm4moe's name for it
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# ``blk.N.exp_probs_b.bias`` is a parameter of its own, not a module's bias.
GGUF_EXP_PROBS_B = "exp_probs_b"
GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Llama 3 frequency factors; we compute RoPE from the config's rope parameters instead.
GGUF_IGNORED = {"rope_freqs.weight"}
# GGUF architectures whose Q/K rows llama.cpp permutes on conversion.
PERMUTED_ARCHITECTURES = {"llama"}


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ValueError: a tensor name we do not know.
    """
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] == GGUF_EXP_PROBS_B:
        return f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unknown GGUF tensor {name!r}")


def reverse_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: ``[n_head * head_dim, ...]`` -> the same shape.

    llama.cpp stores head rows ``(n_head, 2, head_dim // 2)`` reordered as
    ``(n_head, head_dim // 2, 2)``; this swaps them back.
    """
    half = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def _reader(path: str | Path) -> Any:
    """An open ``gguf.GGUFReader`` of ``path``, shared within the process per file version
    (absolute path, size, modification time). Building one parses the whole metadata (a
    vocabulary and its merges: seconds), and a load opens the file twice (count, then iterate);
    the reader maps the file read-only and is never written, so sharing it changes nothing."""
    p = Path(path).resolve()
    stat = p.stat()
    return _open_reader(str(p), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def gguf_architecture(reader: Any) -> str:
    """``general.architecture`` of an open ``gguf.GGUFReader`` (e.g. ``"llama"``)."""
    return reader.fields["general.architecture"].contents()


#: GGUF metadata that ``transformers``' GGUF config reader ignores, per GGUF architecture:
#: ``{arch}.<key>`` -> config field.
GGUF_CONFIG_FIXES = {"qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"}}
#: The ``transformers`` model types whose GGUF files need :data:`GGUF_CONFIG_FIXES`; other files
#: are not opened a second time (reading a file's metadata takes seconds).
GGUF_FIXED_MODEL_TYPES = ("qwen3_moe",)


def gguf_config_fixes(path: str | Path) -> dict[str, Any]:
    """Config fields that ``transformers`` does not read from this GGUF file's metadata (e.g.
    ``moe_intermediate_size`` of a qwen3moe file, left at its 768 default there)."""
    reader = _reader(path)
    arch = gguf_architecture(reader)
    fixes = {}
    for key, field in GGUF_CONFIG_FIXES.get(arch, {}).items():
        entry = reader.fields.get(f"{arch}.{key}")
        if entry is not None:
            fixes[field] = entry.contents()
    return fixes


def count_gguf(path: str | Path) -> int:
    """Number of tensors in the file."""
    return len(_reader(path).tensors)


def iterate_gguf(path: str | Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every weight in the file, dequantised one at a time
    with ``gguf.quants.dequantize``, Q/K un-permuted where llama.cpp permuted them.

    Args:
        path: the ``.gguf`` file.
        hf_config: its Hugging Face config (head counts for the un-permute).

    Raises:
        ValueError: a tensor name we do not know.
    """
    from gguf.quants import dequantize

    reader = _reader(path)
    permuted = gguf_architecture(reader) in PERMUTED_ARCHITECTURES
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    for tensor in reader.tensors:
        if tensor.name in GGUF_IGNORED:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if not array.flags.writeable:  # float32 tensors come back as views of the read-only map
            array = array.copy()
        weight = torch.from_numpy(array)
        if permuted and ".attn_q." in tensor.name:
            weight = reverse_permute(weight, num_heads)
        elif permuted and ".attn_k." in tensor.name:
            weight = reverse_permute(weight, num_kv_heads)
        yield hf_name, weight
