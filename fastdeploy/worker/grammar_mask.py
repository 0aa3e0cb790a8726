"""Apply a step's structured-output token bitmask to its logits: :class:`GrammarMask`, owned by
the model runner.

The bitmask arrives with the step (``SchedulerOutput.grammar_bitmask``, int32
``[num_sampling_rows, ceil(V / 32)]`` on the host, built by the engine's matchers). It is copied
into ONE persistent device buffer, :attr:`GrammarMask.bitmask` (``[max_num_seqs, ceil(V / 32)]``
int32, allocated on the first grammar step, fixed address from then on) through a pinned
staging buffer, and applied to the sampled rows' logits with xgrammar's
``apply_token_bitmask_inplace`` (a CUDA / Triton kernel on GPU, a C++ loop on CPU): a disallowed
token's logit becomes ``-inf``. Rows without a grammar carry all ones and are skipped (the kernel
is given the grammar rows' indices).

Graphs: the decode graphs end at the LM head and its argmax; the sampler runs eagerly after the
replay on the graph's static logits, so the mask is applied there and a grammar step replays the
same full decode graph as any other (the graph's argmax is not used for that step). A sampler
captured inside the graph later would read :attr:`GrammarMask.bitmask` at its fixed address, with
a per-step ``[max_num_seqs]`` bool "has grammar" row flag in a second persistent buffer so rows
without a grammar are passed through by the captured kernel (docs/structured-output.md).

Steps without a grammar never touch this class: no copy, no kernel, no sync.
"""

from __future__ import annotations

import torch


class GrammarMask:
    """Owner of the persistent device bitmask (see the module docstring).

    Args:
        max_num_reqs: rows (``max_num_seqs``): a step samples at most that many.
        device: where the logits are.
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.bitmask: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def _buffers(self, words: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bitmask is None or self.bitmask.shape[1] != words:
            shape = (self.max_num_reqs, words)
            self.bitmask = torch.empty(shape, dtype=torch.int32, device=self.device)
            pin = self.device.type == "cuda"
            self._staging = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
        return self.bitmask, self._staging

    def apply(self, logits: torch.Tensor, host_bitmask: torch.Tensor) -> torch.Tensor:
        """Mask ``logits`` (``[N, V]``, the step's sampled rows) with ``host_bitmask`` (int32
        ``[N, ceil(V / 32)]``, host); returns float32 logits with disallowed tokens at ``-inf``
        (a new tensor: the caller's logits, possibly a graph's static output, are not written).

        Raises:
            ValueError: a bitmask whose rows or width do not match ``logits``.
        """
        import xgrammar as xgr

        rows, vocab = logits.shape
        words = (vocab + 31) // 32
        if tuple(host_bitmask.shape) != (rows, words) or rows > self.max_num_reqs:
            raise ValueError(
                f"grammar_bitmask shape {tuple(host_bitmask.shape)} is invalid; allowed: "
                f"({rows}, {words}) for logits {tuple(logits.shape)}, rows <= {self.max_num_reqs}"
            )
        device_mask, staging = self._buffers(words)
        # Only rows with a grammar (not all ones) are masked.
        grammar_rows = (host_bitmask != -1).any(dim=1).nonzero().flatten().tolist()
        if self._copied is not None:  # the pinned buffer's last copy must have landed
            self._copied.synchronize()
        staging[:rows].copy_(host_bitmask)
        device_mask[:rows].copy_(staging[:rows], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, device_mask[:rows], indices=grammar_rows)
        return out
