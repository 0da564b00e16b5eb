"""Tests under tests/gpu need an NVIDIA GPU; without one they are skipped with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest


def gpu_missing() -> str | None:
    """Why there is no usable GPU here, or None when there is one."""
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA GPU on this machine (/dev/nvidiactl is absent)"
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install '.[cuda]')"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        return f"NVML cannot see a GPU: {e}"
    return None if count else "NVML reports no GPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    why = None
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            why = why or gpu_missing()
            if why:
                item.add_marker(pytest.mark.skip(reason=why))


def nvml_used(bus: str) -> int:
    """Bytes in use on the GPU at `bus` (NVML: total - free)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByPciBusId(bus.encode()))
        return int(info.total) - int(info.free)
    finally:
        pynvml.nvmlShutdown()
