"""A child process for test_native_torch.py: an MLP trains with Adam on the GPU, either on
PyTorch's own allocator ("default") or on the native hot path ("native") in a lease of device
memory allocated with the driver API. In native mode it learns the iteration from the drained
events, plans it with the daemon's planner, installs the plan and trains on planned.

    python tests/gpu/native_torch_child.py default|native  ->  one JSON line on stdout
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Callable

import numpy as np
import torch
from tidalclient.hotpath import ALLOC_SYMBOL, FREE_SYMBOL, HotPath, library_path
from tidalclient.plans import PlanTable
from tidalcore.events import Events
from tidalplan.learn import extract, to_problem
from tidalplan.placement import solve
from tidalplan.validate import validate

LEASE = 2 << 30
STEPS = 10
LEARN_AT = 4  # after the step that begins this iteration: plan the one before it


def device_lease(nbytes: int) -> int:
    """Device memory outside PyTorch, in the primary context PyTorch will use."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device, context, address = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for status in (
        cuda.cuInit(0),
        cuda.cuDeviceGet(ctypes.byref(device), 0),
        cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
        cuda.cuCtxSetCurrent(context),
        cuda.cuMemAlloc_v2(ctypes.byref(address), ctypes.c_size_t(nbytes)),
    ):
        if status != 0:
            raise SystemExit(f"CUDA driver error {status}")
    return address.value


def train(on_step: Callable[[int], None]) -> tuple[list[float], list[int]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 10),
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(512, 1024).cuda()
    y = torch.randint(0, 10, (512,)).cuda()
    losses = []
    for i in range(STEPS):
        on_step(i)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    torch.cuda.synchronize()
    pointers = [p.data_ptr() for p in model.parameters()] + [x.data_ptr(), y.data_ptr()]
    return losses, pointers


def plan_from(batches: list[np.ndarray]) -> PlanTable:
    """What the daemon would do with the trace: learn the iteration, place it, validate."""
    ev = np.concatenate(batches)
    zeros = np.zeros(len(ev), dtype=np.int64)
    events = Events(ev["kind"], ev["block"], ev["size"], zeros, zeros, {})
    iteration = extract(events, events.marks())
    problem, mapping = to_problem(iteration, alignment=256)
    placement = solve(problem, time_limit_s=5.0)
    validate(problem, placement)
    sizes = [int(b.size) for b in iteration.blocks]
    offsets = [0] * len(sizes)
    for buffer_index, block_index in enumerate(mapping):
        offsets[block_index] = int(placement.offsets[buffer_index])
    return PlanTable.build(1, sizes, offsets, placement.height, 256)


def main() -> None:
    if sys.argv[1] == "default":
        losses, _ = train(lambda i: None)
        print(json.dumps({"losses": losses}))
        return
    base = device_lease(LEASE)
    hp = HotPath(0)
    hp.configure(base, LEASE, ring_events=1 << 20)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        str(library_path()), ALLOC_SYMBOL, FREE_SYMBOL
    )
    torch.cuda.memory.change_current_allocator(allocator)
    batches: list[np.ndarray] = []
    per_iteration: list[tuple[int, int]] = []
    plan: list[PlanTable] = []

    def on_step(i: int) -> None:
        before = hp.stats()
        hp.step()
        batches.append(hp.drain(1 << 20))
        per_iteration.append((before.hits, before.misses))
        if i == LEARN_AT:
            plan.append(plan_from(batches))
            hp.install_plan(plan[0])

    losses, pointers = train(on_step)
    s = hp.stats()
    print(
        json.dumps(
            {
                "losses": losses,
                "inside": all(base <= p < base + LEASE for p in pointers),
                "slots": len(plan[0].sizes),
                "hits_misses_before_step": per_iteration,
                "stats": {
                    k: getattr(s, k)
                    for k in ("hits", "misses", "online", "failures", "fallbacks", "overflow")
                },
                "planned": s.planned,
            }
        )
    )


if __name__ == "__main__":
    main()
