"""tidalpool.torch.attach where there is no GPU: what it refuses, and the PyTorch symbol that
planned mode's failure handler relies on."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

import tidalpool.torch as tt  # noqa: E402
from tidalclient.torch.oom import TORCH_CHECK_FAIL  # noqa: E402


def test_a_bad_mode_is_refused_before_anything_else(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="mode must be 'pool' or 'planned', got 'cached'"):
        tt.attach(tmp_path, mode="cached")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_attach_refuses_without_contacting_a_daemon(tmp_path: object) -> None:
    # tmp_path has no daemon: the GPU check comes first and says what is missing
    with pytest.raises(tt.TorchAttachError, match="needs a CUDA GPU that PyTorch can use"):
        tt.attach(tmp_path)
    assert tt.current() is None


def test_pytorch_exports_the_failure_handler_planned_mode_installs() -> None:
    address = tt.torch_check_fail()
    assert address is not None and address > 0
    # and it is the function by that name in the libc10 PyTorch loaded
    from pathlib import Path

    c10 = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    assert ctypes.cast(getattr(c10, TORCH_CHECK_FAIL), ctypes.c_void_p).value == address


def test_step_with_nothing_attached_or_active_says_so() -> None:
    with pytest.raises(RuntimeError, match="no session is attached"):
        tt.step()
