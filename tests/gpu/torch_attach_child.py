"""A child process for test_torch_attach.py: an MLP trains with Adam on the GPU, on PyTorch's
own allocator ("default") or attached to a tidalpool daemon ("pool" or "planned"), then asks
for more memory than the lease holds. Prints one JSON line.

    python tests/gpu/torch_attach_child.py default|pool|planned[+swap][+recompute] SOCKET_DIR
        LEASE_BYTES

"+swap": saved tensors swap under an 8 MiB limit; "+recompute": the middle Linear and ReLU
recompute in backward (`tidalpool.torch.recompute`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

STEPS = 30


def second_stream() -> dict[str, Any]:
    """A tensor read on a side stream, marked with record_stream and dropped, then a same-size
    tensor filled on the default stream while the side stream still waits to read the first:
    the read must see the first tensor's values."""
    n = 16 << 20  # 64 MiB of float32
    x = torch.full((n,), 3.0, device="cuda")
    first = x.data_ptr()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000)  # a few hundred ms of GPU cycles before the read
        y = x * 2
    x.record_stream(side)
    del x
    z = torch.full((n,), -1.0, device="cuda")  # may take x's bytes
    reused = z.data_ptr() == first
    torch.cuda.synchronize()
    return {"read_ok": bool((y == 6.0).all().item()), "reused": reused}


def main() -> None:
    mode, socket_dir, lease = sys.argv[1], sys.argv[2], int(sys.argv[3])
    base, *extras = mode.split("+")
    out: dict[str, Any] = {}
    tp = None
    if base != "default":
        import tidalpool.torch

        swap = 8 << 20 if "swap" in extras else None  # below one iteration's 18 MiB saved
        tp = tidalpool.torch.attach(
            socket_dir,
            mode=base,  # type: ignore[arg-type]
            device_limit=lease,
            swap_limit=swap,
            host_limit=256 << 20,
        )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 10),
    ).cuda()
    if "recompute" in extras:
        import tidalpool.torch

        out["recomputed"] = len(tidalpool.torch.recompute([model[2], model[3]]).blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if tp is not None:
        tp.watch(opt)
    x = torch.randn(512, 1024).cuda()
    y = torch.randint(0, 10, (512,)).cuda()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
        time.sleep(0.02)  # room for the daemon to learn and plan; the losses do not change
    torch.cuda.synchronize()
    out["losses"] = losses
    out["second_stream"] = second_stream()
    if tp is not None:
        lease_start = tp.session.device.address
        inside = [lease_start <= p.data_ptr() < lease_start + lease for p in model.parameters()]
        out["inside"] = all(inside)
        stats = tp.stats()
        out["mode"] = stats.session.mode
        out["native"] = {
            k: getattr(stats.native, k)
            for k in ("hits", "misses", "failures", "fallbacks", "stream_records", "stream_waits")
        }
        if base == "pool":
            out["allocated"] = torch.cuda.memory_stats()["allocated_bytes.all.current"]
        if stats.saves_session is not None and stats.saves_session.swap is not None:
            swap_stats = stats.saves_session.swap
            out["swap"] = {
                "out": swap_stats.swapped_out_bytes,
                "in": swap_stats.swapped_in_bytes,
                "peak": swap_stats.peak_resident_bytes,
            }
        try:
            torch.empty(2 * lease, dtype=torch.uint8, device="cuda")
            out["oom"] = "none"
        except torch.OutOfMemoryError as e:
            out["oom"] = f"OutOfMemoryError: {e}"
        except RuntimeError as e:
            out["oom"] = f"RuntimeError: {e}"
        # the job goes on after the refusal
        loss = torch.nn.functional.cross_entropy(model(x), y)
        out["after"] = float(loss.item())
        tp.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
