"""Which daemon a process attaches to: the node layout of one daemon per GPU, from the
launcher's rank and the GPUs CUDA makes visible."""

from __future__ import annotations

from pathlib import Path

import pytest
from tidalclient.errors import AttachError
from tidalclient.node import LayoutError, gpu_index, socket_dir
from tidalclient.session import socket_dir_from_env


@pytest.mark.parametrize(
    ("env", "gpu"),
    [
        ({}, 0),
        ({"LOCAL_RANK": "3"}, 3),  # every GPU visible: the rank is the index
        ({"SLURM_LOCALID": "2"}, 2),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}, 6),  # the rank's visible GPU
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "5"}, 5),  # one bound to the task
        ({"CUDA_VISIBLE_DEVICES": " 7 "}, 7),
        ({"LOCAL_RANK": "0", "SLURM_LOCALID": "1"}, 0),  # torchrun's first
    ],
)
def test_the_gpu_of_a_process(env: dict[str, str], gpu: int) -> None:
    assert gpu_index(env) == gpu


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not a rank"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not a rank"),
        ({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, "local rank 2, but CUDA_VISIBLE"),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, "lists 2 GPUs and no LOCAL_RANK says which"),
        ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-8a1b,GPU-9c2d"}, "not by index"),
    ],
)
def test_a_gpu_that_cannot_be_told_is_refused_saying_why(env: dict[str, str], why: str) -> None:
    with pytest.raises(LayoutError, match=why):
        gpu_index(env)


def test_the_socket_directory_of_a_process() -> None:
    assert socket_dir(None, {}) == Path("/run/tidalpool")  # one daemon: the image's
    assert socket_dir(None, {"LOCAL_RANK": "1"}) == Path("/run/tidalpool/gpu1")  # the layout
    env = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert socket_dir(None, env) == Path("/run/tidalpool/gpu3")
    assert socket_dir(None, {**env, "TIDALPOOL_SOCKET_DIR": "/srv/tp"}) == Path("/srv/tp")
    templated = {**env, "TIDALPOOL_SOCKET_DIR": "/srv/tp/{gpu}/s"}
    assert socket_dir(None, templated) == Path("/srv/tp/3/s")
    assert socket_dir("/d/gpu{gpu}", env) == Path("/d/gpu3")  # given: it wins, templated too
    assert socket_dir("/d", templated) == Path("/d")


def test_attach_says_which_daemon_it_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.delenv("TIDALPOOL_SOCKET_DIR", raising=False)
    with pytest.raises(AttachError, match="which daemon: local rank 2, but CUDA_VISIBLE_DEVICES"):
        socket_dir_from_env(None)
