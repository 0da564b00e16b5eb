"""Where this process's daemon is: the node layout of one daemon per GPU.

The template unit (`deploy/systemd/tidalpoold@.service`) and the node DaemonSets
(`deploy/kubernetes/node/`) run one daemon per GPU with its sockets in `/run/tidalpool/gpu<N>`,
N the GPU's index in PCI bus order (nvidia-smi's). A process started by `torchrun` (or Slurm's
`srun`) is one rank of a job with one GPU each: its local rank (`LOCAL_RANK`, `SLURM_LOCALID`)
picks its GPU among those `CUDA_VISIBLE_DEVICES` lists (or is the GPU's index when it lists
none; one listed is the rank's own whatever its rank, as a launcher that binds a GPU to each
task sets it), and that GPU picks its daemon. `TIDALPOOL_SOCKET_DIR` (or an explicit directory)
overrides the layout and may hold `{gpu}`, replaced by the same index; without a rank and
without `{gpu}` the directory is `/run/tidalpool`, a single daemon's (the container image's).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_SOCKET_DIR = Path("/run/tidalpool")
NODE_LAYOUT = "/run/tidalpool/gpu{gpu}"
"""A rank's socket directory on a node run by the template units or the node DaemonSets."""
RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


class LayoutError(ValueError):
    """This process's GPU, and so its daemon, cannot be told from its environment."""


def local_rank(env: Mapping[str, str]) -> int | None:
    """The process's rank on its node, from the launcher's variables; None outside a launcher."""
    for name in RANK_VARIABLES:
        value = env.get(name)
        if value is not None and value.strip():
            try:
                rank = int(value)
            except ValueError:
                raise LayoutError(f"{name}={value!r} is not a rank (a whole number)") from None
            if rank < 0:
                raise LayoutError(f"{name}={value!r} is not a rank (a whole number)")
            return rank
    return None


def gpu_index(env: Mapping[str, str]) -> int:
    """The index (PCI bus order) of the GPU this process uses: the local rank's entry of
    CUDA_VISIBLE_DEVICES (its only entry when it lists one), else the local rank, else 0."""
    rank = local_rank(env)
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return rank or 0
    if len(visible) == 1:
        entry = visible[0]
    elif rank is None:
        raise LayoutError(
            f"CUDA_VISIBLE_DEVICES lists {len(visible)} GPUs and no LOCAL_RANK says which is"
            " this process's: set TIDALPOOL_SOCKET_DIR to its daemon's directory"
        )
    elif rank >= len(visible):
        raise LayoutError(
            f"local rank {rank}, but CUDA_VISIBLE_DEVICES lists {len(visible)} GPUs"
            f" ({','.join(visible)})"
        )
    else:
        entry = visible[rank]
    try:
        index = int(entry)
    except ValueError:
        raise LayoutError(
            f"CUDA_VISIBLE_DEVICES names this process's GPU {entry!r}, not by index: the node"
            " layout is by index (/run/tidalpool/gpu<N>); set TIDALPOOL_SOCKET_DIR to its"
            " daemon's directory"
        ) from None
    if index < 0:
        raise LayoutError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is not a GPU index")
    return index


def socket_dir(given: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path:
    """The daemon's socket directory for this process: `given`, else $TIDALPOOL_SOCKET_DIR,
    else the node layout for a rank of a launcher, else /run/tidalpool; `{gpu}` in the first
    two replaced by this process's GPU index (LayoutError when it cannot be told)."""
    text = os.fspath(given) if given is not None else env.get("TIDALPOOL_SOCKET_DIR") or None
    if text is None:
        if local_rank(env) is None:
            return DEFAULT_SOCKET_DIR
        text = NODE_LAYOUT
    if "{gpu}" in text:
        text = text.replace("{gpu}", str(gpu_index(env)))
    return Path(text)
