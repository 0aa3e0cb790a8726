"""Where the model runs and with which attention backend: :class:`DeviceConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.config.checks import check

DEVICES = ("auto", "cuda", "cpu")


@dataclass
class DeviceConfig:
    """Where the model runs and with which attention backend.

    ``device="auto"`` and ``attention_backend=None`` are what a user may leave open;
    ``EngineArgs.create_engine_config`` resolves both before the graph policy runs (``cuda`` or
    ``cpu``, and a registered backend name), so the resolved config records what will run.
    Backend names are checked against the registry at that resolution.
    """

    device: str = "auto"
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        check(self.device in DEVICES, "device", self.device, ", ".join(DEVICES))
        check(
            self.attention_backend is None or isinstance(self.attention_backend, str),
            "attention_backend",
            self.attention_backend,
            "a backend name or null (the platform's default)",
        )

    @property
    def is_resolved(self) -> bool:
        """Both the device and the attention backend are decided."""
        return self.device != "auto" and self.attention_backend is not None
