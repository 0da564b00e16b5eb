"""What virtual residency's page mapping costs on a GPU (needs an NVIDIA GPU and cuda-bindings).

    python bench/gpu_vmm.py [--repeats 200] [--out PATH]

On GPU 0, with a paged lease's exportable chunks of 2 MiB (1 GiB in all; on cuda a page is a
whole chunk, since cuMemMap maps a handle only from its first byte) and one chunk of 64 MiB:
  map     cuMemMap of a whole chunk plus cuMemSetAccess over it, for chunks of 2 MiB and
          64 MiB: median and p99 (nearest rank) of the host time, microseconds
  unmap   cuMemUnmap of that chunk, the same statistics
  remap   1 GiB through CudaPageSpace, page by page: unmap 512 pages of 2 MiB (one call each),
          then map them again (cuMemMap + cuMemSetAccess each); GiB/s, median of 5 rounds
Prints a table and writes JSON to --out (default bench/results/gpu-vmm-<date>-<device>.json).
Without a GPU it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tidalclient.devices.pages import CudaPageSpace
from tidalcore.cuda_driver import CudaDriver, CudaError, Driver, MemHandle, PyNvml

MiB, GiB = 1 << 20, 1 << 30
PAGE = 2 * MiB
BIG = 64 * MiB
PAGES = GiB // PAGE
ROUNDS = 5
WARMUP = 10


def open_gpu() -> CudaDriver | str:
    """The driver on GPU 0, or why there is none."""
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA GPU on this machine (/dev/nvidiactl is absent)"
    try:
        driver = CudaDriver()
        driver.open_device(0)
    except ImportError as e:
        return f"cuda-bindings is not installed ({e})"
    except CudaError as e:
        return f"CUDA cannot open GPU 0: {e}"
    return driver


def device_name(driver: CudaDriver) -> str:
    try:
        nvml = PyNvml()
        nvml.open(driver.pci_bus_id())
        try:
            return nvml.facts().name
        finally:
            nvml.close()
    except Exception:  # nvidia-ml-py absent or NVML unusable: the name only labels the file
        return "gpu0"


def us(samples_ns: list[int]) -> dict[str, float]:
    """Median and nearest-rank p99 of `samples_ns`, in microseconds."""
    ordered = sorted(samples_ns)
    p99 = ordered[math.ceil(0.99 * len(ordered)) - 1]
    return {"median_us": statistics.median(ordered) / 1e3, "p99_us": p99 / 1e3}


def time_run(driver: Driver, handle: MemHandle, size: int, repeats: int) -> dict[str, Any]:
    """Map the whole `handle` of `size` bytes into a range of its own and unmap it again,
    `repeats` times after a warm-up."""
    ptr = driver.address_reserve(size, PAGE)
    maps, unmaps = [], []
    try:
        for k in range(WARMUP + repeats):
            t0 = time.perf_counter_ns()
            driver.mem_map(ptr, size, handle)
            driver.set_access(ptr, size)
            t1 = time.perf_counter_ns()
            driver.mem_unmap(ptr, size)
            t2 = time.perf_counter_ns()
            if k >= WARMUP:
                maps.append(t1 - t0)
                unmaps.append(t2 - t1)
    finally:
        driver.address_free(ptr, size)
    return {"bytes": size, "map": us(maps), "unmap": us(unmaps)}


def time_remap(driver: Driver, handles: list[MemHandle]) -> dict[str, Any]:
    """Unmap then map again all 512 pages of 1 GiB, one page a call, through CudaPageSpace."""
    space = CudaPageSpace(driver, handles, PAGE, PAGE, GiB)
    pages = len(handles)
    seconds = []
    try:
        for p in range(pages):
            space.map(p * PAGE, [p])
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            for p in range(pages):
                space.unmap(p * PAGE, 1)
            for p in range(pages):
                space.map(p * PAGE, [p])
            seconds.append(time.perf_counter() - t0)
    finally:
        space.close()
    median = statistics.median(seconds)
    return {
        "bytes": GiB,
        "pages": pages,
        "rounds": ROUNDS,
        "seconds_median": median,
        "gib_per_s": 1 / median,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    driver = open_gpu()
    if isinstance(driver, str):
        print(f"gpu_vmm: {driver}", file=sys.stderr)
        return 2
    try:
        name = device_name(driver)
        granularity = driver.granularity(exportable=True)
        if PAGE % granularity:
            print(
                f"gpu_vmm: 2 MiB is not a multiple of the granularity {granularity}",
                file=sys.stderr,
            )
            return 2
        handles = [driver.mem_create(PAGE, exportable=True) for _ in range(PAGES)]
        big = driver.mem_create(BIG, exportable=True)
        try:
            runs = [time_run(driver, handles[0], PAGE, args.repeats)]
            runs.append(time_run(driver, big, BIG, args.repeats))
            remap = time_remap(driver, handles)
        finally:
            for h in [*handles, big]:
                driver.mem_release(h)
    finally:
        driver.close_device()

    print(f"{name}, granularity {granularity // MiB} MiB, {args.repeats} repeats")
    print(f"{'run':>9} | {'map+access median/p99 (us)':>28} | {'unmap median/p99 (us)':>24}")
    for r in runs:
        m, u = r["map"], r["unmap"]
        print(
            f"{r['bytes'] // MiB:>5} MiB | {m['median_us']:>13.1f} / {m['p99_us']:<12.1f} |"
            f" {u['median_us']:>11.1f} / {u['p99_us']:<10.1f}"
        )
    print(f"remap 1 GiB as 512 pages of 2 MiB: {remap['gib_per_s']:.2f} GiB/s")

    date = datetime.date.today().isoformat()
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = args.out or Path(__file__).parent / "results" / f"gpu-vmm-{date}-{slug}.json"
    result = {
        "device": name,
        "date": date,
        "granularity": granularity,
        "page_bytes": PAGE,
        "chunk_bytes": PAGE,
        "repeats": args.repeats,
        "runs": runs,
        "remap": remap,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
