"""PyTorch training on tidalpool vs plain PyTorch (needs an NVIDIA GPU and a cuda daemon).

    .venv/bin/python bench/torch_train.py [--models gpt2,resnet50]
        [--dtypes fp32,bf16] [--steps 20] [--skip throughput,limit,batch,latency] [--json PATH]

Every configuration runs in its own process (planned mode replaces PyTorch's allocator for the
whole process), started by this script; the tidalpool ones attach to a `tidalpoold --backend
cuda` started here. Models, built from torch.nn with random weights:
  gpt2      GPT-2 small: 12 pre-norm blocks of width 768, 12 heads, MLP 3072, vocabulary
            50,257 (tied head), sequence 1,024, causal; batch 8
  resnet50  ResNet-50 v1.5 (torchvision's layout: bottlenecks 3-4-6-3, stride on the 3x3),
            224x224 inputs, 1,000 classes; batch 64
each in fp32 and in bf16 autocast, AdamW, cross-entropy. A step is forward, backward, optimizer
step; step time is the median of `--steps` steps after warm-up (in planned mode, after the
daemon's plan serves the iteration), each ended by torch.cuda.synchronize().

  throughput  plain PyTorch vs pool mode vs planned mode, same batch: ratio of steps/s
  limit       at half of plain PyTorch's peak (max_memory_allocated): the overhead vs
              unconstrained of save_on_cpu(pin_memory=True), of checkpointing every block, of
              tidalpool's SavedTensors on a cuda session beside PyTorch's allocator ("saved"),
              of planned mode with its saved tensors swapped ("planned_swap"), and of the
              same with the blocks `tidalpool.torch.plan_recompute` chooses for the cap
              recomputed ("planned_recompute"; chosen on the meta device, in bf16 autocast
              for the bf16 runs, at --bandwidth GB/s), same batch; tidalpool's saves get a
              swap limit of a quarter of the cap and a lease of saves_lease(that), the
              allocator the rest of the cap; their host lease is --host-lease, by default
              all the daemon's host pool (--host-pool) can lease beside an allocator session
  batch       the largest batch that trains 3 steps in 8 GiB (doubling, then bisection):
              plain PyTorch capped by set_per_process_memory_fraction, planned mode in an
              8 GiB lease, and planned mode with its saved tensors swapped (swap limit
              --batch-swap-limit, the two leases 8 GiB together)
  latency     torch.empty + release of 64 tensors (4 KiB to 64 MiB) per iteration: ns per pair,
              PyTorch's caching allocator vs planned mode once its plan serves the iteration

    python bench/torch_train.py child --model gpt2 --mode plain ...   (one configuration)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GiB = 1 << 30
MODES = ("plain", "pool", "planned", "save_on_cpu", "checkpoint", "saved")
# How the child's step() trains, for record() and plan_recompute() to record the same loop:
# gradients set to None, the model's output dropped once the loss is computed.
LOOP = {"set_to_none": True, "keep_output": False}


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- models (imported lazily: the parent process does not need torch) ---------------------------


def record_training(
    name: str,
    batch: int,
    path: Path,
    tiny: bool = False,
    autocast: Any = None,
    roofline: Any = None,
) -> None:
    """Record the bench's training loop of model `name` at `batch` (cross-entropy, AdamW) with
    `tidalpool.torch.record` to the trace CSV `path`; `autocast` and `roofline` as it takes them."""
    import tidalpool.torch
    import torch

    model, make_batch, _ = build(name, tiny)
    tidalpool.torch.record(
        model,
        make_batch(batch),
        torch.nn.functional.cross_entropy,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
        path=path,
        autocast=autocast,
        roofline=roofline,
        **LOOP,
    )


def gpt2(vocab: int, seq: int, width: int = 768, heads: int = 12, depth: int = 12) -> Any:
    """GPT-2 from torch.nn: token and position embeddings, `depth` pre-norm causal blocks, a
    final norm and a head tied to the token embedding; logits flattened for the loss. GPT-2
    small with the defaults (traces/record.py records it too)."""
    import torch
    from torch import nn

    class GPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(seq, width)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    width,
                    heads,
                    4 * width,
                    dropout=0.0,
                    activation="gelu",
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(depth)
            )
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.tokens.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            n = idx.shape[1]
            x = self.tokens(idx) + self.positions(torch.arange(n, device=idx.device))
            mask = nn.Transformer.generate_square_subsequent_mask(n, device=idx.device)
            for block in self.blocks:
                x = block(x, src_mask=mask, is_causal=True)
            logits: torch.Tensor = self.head(self.norm(x))
            return logits.flatten(0, 1)

    return GPT2()


def build(name: str, tiny: bool) -> tuple[Any, Callable[[int], tuple[Any, Any]], list[Any]]:
    """(model, batch maker, the blocks to checkpoint) on the CPU."""
    import torch
    from torch import nn

    if name == "gpt2":
        width, heads, depth, vocab, seq = (64, 4, 2, 97, 32) if tiny else (768, 12, 12, 50257, 1024)
        model = gpt2(vocab, seq, width, heads, depth)

        def batch(b: int) -> tuple[Any, Any]:
            idx = torch.randint(0, vocab, (b, seq))
            return idx, torch.randint(0, vocab, (b * seq,))

        return model, batch, list(model.blocks)

    if name == "resnet50":

        class Bottleneck(nn.Module):
            def __init__(self, cin: int, mid: int, stride: int) -> None:
                super().__init__()
                cout = 4 * mid
                self.body = nn.Sequential(
                    nn.Conv2d(cin, mid, 1, bias=False),
                    nn.BatchNorm2d(mid),
                    nn.ReLU(True),
                    nn.Conv2d(mid, mid, 3, stride, 1, bias=False),
                    nn.BatchNorm2d(mid),
                    nn.ReLU(True),
                    nn.Conv2d(mid, cout, 1, bias=False),
                    nn.BatchNorm2d(cout),
                )
                self.down = (
                    nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                    if stride != 1 or cin != cout
                    else nn.Identity()
                )

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(self.body(x) + self.down(x))

        blocks: list[nn.Module] = []
        cin = 64
        for mid, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for k in range(count):
                blocks.append(Bottleneck(cin, mid, stride if k == 0 else 1))
                cin = 4 * mid
        side, classes = (32, 10) if tiny else (224, 1000)
        model = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(True),
            nn.MaxPool2d(3, 2, 1),
            *blocks,
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2048, classes),
        )

        def batch(b: int) -> tuple[Any, Any]:
            return torch.randn(b, 3, side, side), torch.randint(0, classes, (b,))

        return model, batch, blocks
    raise SystemExit(f"unknown model {name!r} (gpt2, resnet50)")


# -- one configuration (child process) --------------------------------------------------------


def child(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"model": a.model, "mode": a.mode, "dtype": a.dtype, "batch": a.batch}
    tp = None
    cuda = a.device == "cuda"
    if a.mode in ("pool", "planned"):
        import tidalpool.torch

        tp = tidalpool.torch.attach(
            a.socket_dir,
            mode=a.mode,
            device_limit=a.lease,
            swap_limit=a.swap_limit,
            host_limit=a.host_lease if a.swap_limit else None,
        )
    elif cuda and a.memory_bytes:
        from tidalpool.torch import saves_lease

        total = torch.cuda.get_device_properties(0).total_memory
        own = a.memory_bytes - (saves_lease(a.swap_limit) if a.swap_limit else 0)
        torch.cuda.set_per_process_memory_fraction(own / total)  # the saves' lease holds the rest
    torch.manual_seed(0)
    model, make_batch, blocks = build(a.model, a.tiny)
    if a.mode == "checkpoint":
        import tidalpool.torch

        tidalpool.torch.recompute(blocks)  # torch.utils.checkpoint on every block
    if a.recompute:
        import tidalpool.torch

        plan = tidalpool.torch.plan_recompute(
            model,
            make_batch(a.batch),
            torch.nn.functional.cross_entropy,
            lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
            blocks,
            limit=a.recompute,
            bandwidth_gbps=a.bandwidth,
            autocast=torch.bfloat16 if a.dtype == "bf16" else None,
            **LOOP,
        )
        plan.apply()
        out["recompute"] = {
            "blocks": list(plan.names),
            "of": len(blocks),
            "predicted_overhead": plan.overhead,
        }
    model = model.to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if tp is not None:
        tp.watch(opt)
    x, y = (t.to(a.device) for t in make_batch(a.batch))
    autocast = torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.dtype == "bf16")
    saving: Any = contextlib.nullcontext()
    session = None
    if a.mode == "save_on_cpu":
        saving = torch.autograd.graph.save_on_cpu(pin_memory=cuda)
    elif a.mode == "saved":
        import tidalpool
        import tidalpool.torch

        limit = a.swap_limit
        session = tidalpool.attach(
            a.socket_dir,
            device_limit=tidalpool.torch.saves_lease(limit),
            host_limit=a.host_lease,
            swap_limit=limit,
        )
        saved = tidalpool.torch.SavedTensors(session, opt)
        saved.__enter__()

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast, saving:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    try:
        warm = 0
        while warm < a.warmup or (
            a.mode == "planned"
            and tp is not None
            and tp.stats().session.mode != "planned"
            and warm < a.max_warmup
        ):
            step()
            warm += 1
        times = [step() for _ in range(a.steps)]
    except (RuntimeError, torch.OutOfMemoryError) as e:
        out["error"] = str(e).splitlines()[0][:300]
        return out
    out["warmup_steps"] = warm
    out["step_ms"] = 1e3 * statistics.median(times)
    if cuda and tp is None:
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    saves = session.stats() if session is not None else None
    if tp is not None and tp.saved is not None:
        saves = tp.stats().saves_session
    if saves is not None and saves.swap is not None:
        swap = saves.swap
        out["swap"] = {
            "limit": swap.limit,
            "peak_resident_bytes": swap.peak_resident_bytes,
            "out_bytes_per_step": swap.swapped_out_bytes // (warm + a.steps),
            "stall_ms_per_step": swap.stall_ns / 1e6 / (warm + a.steps),
        }
    if session is not None:
        saved.__exit__(None, None, None)
        session.close()
    if tp is not None:
        s = tp.stats()
        out["native"] = {
            k: getattr(s.native, k)
            for k in ("hits", "misses", "fallbacks", "peak_live_bytes", "stream_waits")
        }
        out["session_mode"] = s.session.mode  # "learning" if no plan came within max_warmup
        if a.latency:
            out["latency_ns"] = latency(tp.step)
        tp.close()
    elif a.latency:
        out["latency_ns"] = latency(lambda: None)
    return out


def latency(step: Callable[[], None], iterations: int = 300) -> float:
    """ns per torch.empty + release, 64 tensors per iteration, the last 100 iterations."""
    import torch

    sizes = [4096 << (k % 15) for k in range(64)]  # 4 KiB .. 64 MiB
    per_iteration = []
    for _ in range(iterations):
        step()
        t = time.perf_counter_ns()
        for n in sizes:
            del_me = torch.empty(n, dtype=torch.uint8, device="cuda")
            del del_me
        per_iteration.append((time.perf_counter_ns() - t) / len(sizes))
        time.sleep(0.001)  # the recorder's thread drains the ring; the daemon plans
    return statistics.median(per_iteration[-100:])


# -- the parent --------------------------------------------------------------------------------


def run_child(timeout: float = 900, **options: Any) -> dict[str, Any]:
    """One configuration in a child process (the package as installed, the environment as it
    is): its JSON line, or the options with the error that stopped it."""
    command = [sys.executable, __file__, "child"]
    for key, value in options.items():
        if value is True:
            command.append(f"--{key.replace('_', '-')}")
        elif value not in (None, False):
            command += [f"--{key.replace('_', '-')}", str(value)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**options, "error": f"the child did not end within {timeout:g} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        said = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        return {**options, "error": said[0][:300]}
    result: dict[str, Any] = json.loads(lines[-1])
    log("  ", json.dumps(result))
    return result


def saves_host_lease(asked: int | None, pool_bytes: int, chunk_bytes: int) -> int:
    """The saved tensors' host lease: `asked`, or by default all the daemon's host pool can
    lease beside it (the pool less the one chunk an allocator session leases in planned and
    pool mode). SystemExit names both when `asked` is more than that, before anything runs."""
    room = pool_bytes - chunk_bytes
    if asked is None:
        return room
    if asked > room:
        raise SystemExit(
            f"torch_train: --host-lease {format_gib(asked)} is more than the daemon's host pool"
            f" of {format_gib(pool_bytes)} can lease beside an allocator session"
            f" ({format_gib(room)}): ask for less, or give --host-pool more"
        )
    return asked


def format_gib(n: int) -> str:
    return f"{n / GiB:.4g} GiB"


BATCH = {"gpt2": 8, "resnet50": 64}


def largest_batch(fits: Callable[[int], bool], start: int) -> int:
    """The largest b with fits(b), doubling from `start` then bisecting (0 if start fails)."""
    if not fits(start):
        return 0
    low, high = start, 2 * start
    while fits(high):
        low, high = high, 2 * high
    while high - low > max(1, low // 16):
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("child")
    c.add_argument("--model", required=True)
    c.add_argument("--mode", choices=MODES, required=True)
    c.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    c.add_argument("--batch", type=int, required=True)
    c.add_argument("--steps", type=int, default=20)
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--max-warmup", type=int, default=200, help="steps to wait for a plan")
    c.add_argument("--socket-dir")
    c.add_argument("--lease", type=int, help="device lease bytes (pool, planned)")
    c.add_argument("--memory-bytes", type=int, help="cap plain PyTorch at this many bytes")
    c.add_argument(
        "--swap-limit", type=int, help="saved tensors' swap limit (mode saved, pool, planned)"
    )
    c.add_argument(
        "--host-lease", type=int, default=16 * GiB, help="saved tensors' host lease (swap limit)"
    )
    c.add_argument(
        "--recompute", type=int, help="recompute the blocks plan_recompute picks for this limit"
    )
    c.add_argument("--bandwidth", type=float, default=50.0, help="GB/s each way (--recompute)")
    c.add_argument("--latency", action="store_true")
    c.add_argument("--tiny", action="store_true", help="a small model (tests)")
    c.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="gpt2,resnet50")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", default="")
    parser.add_argument("--host-pool", default="48GiB", help="the daemon's pinned host pool")
    parser.add_argument(
        "--host-lease",
        type=int,
        help="host lease of the saved tensors (default: what the daemon's host pool can give)",
    )
    parser.add_argument(
        "--batch-swap-limit", type=int, default=2 * GiB, help="saves' swap limit (batch)"
    )
    parser.add_argument(
        "--bandwidth", type=float, default=50.0, help="host link GB/s each way, for plan_recompute"
    )
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    if a.command == "child":
        print(json.dumps(child(a)))
        return
    from tidalclient import status
    from tidalclient.local import LocalDaemon
    from tidalpool.torch import saves_lease

    skip = set(a.skip.split(",")) - {""}
    results: dict[str, Any] = {"throughput": [], "limit": [], "batch": [], "latency": []}

    def save() -> None:  # after every row: a run stopped midway keeps the rows it finished
        if a.json:
            a.json.write_text(json.dumps(results, indent=2))

    with (
        tempfile.TemporaryDirectory(prefix="tp-", dir="/tmp") as tmp,
        LocalDaemon.start(
            Path(tmp), device_pool="60GiB", host_pool=a.host_pool, backend="cuda", timeout=300
        ) as d,
    ):
        sock = str(d.socket_dir)
        pool = status.fetch(d.socket_dir)[0]
        host_lease = saves_host_lease(a.host_lease, pool.host.total_bytes, pool.chunk_bytes)
        results["host_lease"] = host_lease
        for model in a.models.split(","):
            for dtype in a.dtypes.split(","):
                common = {"model": model, "dtype": dtype, "steps": a.steps}
                b = BATCH[model]
                log(f"{model} {dtype}")
                plain = run_child(mode="plain", batch=b, **common)
                if "throughput" not in skip:
                    row = {"model": model, "dtype": dtype, "batch": b, "plain": plain}
                    for mode in ("pool", "planned"):
                        r = run_child(mode=mode, batch=b, socket_dir=sock, lease=40 * GiB, **common)
                        row[mode] = r
                        if "step_ms" in r and "step_ms" in plain:
                            row[f"{mode}_vs_plain"] = plain["step_ms"] / r["step_ms"]
                    results["throughput"].append(row)
                    save()
                if "limit" not in skip and "peak_bytes" in plain:
                    cap = plain["peak_bytes"] // 2
                    row = {"model": model, "dtype": dtype, "batch": b, "limit_bytes": cap}
                    swap = {"socket_dir": sock, "swap_limit": cap // 4, "host_lease": host_lease}
                    configurations: dict[str, dict[str, Any]] = {
                        "save_on_cpu": {"mode": "save_on_cpu", "memory_bytes": cap},
                        "checkpoint": {"mode": "checkpoint", "memory_bytes": cap},
                        "saved": {"mode": "saved", "memory_bytes": cap, **swap},
                        "planned_swap": {
                            "mode": "planned",
                            "lease": cap - saves_lease(cap // 4),
                            "max_warmup": 60,
                            **swap,
                        },
                        "planned_recompute": {
                            "mode": "planned",
                            "lease": cap - saves_lease(cap // 4),
                            "max_warmup": 60,
                            "recompute": cap,
                            "bandwidth": a.bandwidth,
                            **swap,
                        },
                    }
                    for mode, options in configurations.items():
                        r = run_child(batch=b, **common, **options)
                        row[mode] = r
                        if "step_ms" in r:
                            row[f"{mode}_overhead"] = r["step_ms"] / plain["step_ms"] - 1
                    results["limit"].append(row)
                    save()
                if "batch" not in skip:

                    def fits(batch: int, common: dict[str, Any] = common, **extra: Any) -> bool:
                        r = run_child(
                            batch=batch, **{**common, "steps": 3, "max_warmup": 30, **extra}
                        )
                        return "step_ms" in r

                    plain_max = largest_batch(
                        lambda n: fits(n, mode="plain", memory_bytes=8 * GiB), b // 2
                    )
                    planned_max = largest_batch(
                        lambda n: fits(n, mode="planned", socket_dir=sock, lease=8 * GiB), b // 2
                    )
                    swapped_max = largest_batch(
                        lambda n: fits(
                            n,
                            mode="planned",
                            socket_dir=sock,
                            lease=8 * GiB - saves_lease(a.batch_swap_limit),
                            swap_limit=a.batch_swap_limit,
                            host_lease=host_lease,
                        ),
                        b // 2,
                    )
                    best = max(planned_max, swapped_max)
                    results["batch"].append(
                        {
                            "model": model,
                            "dtype": dtype,
                            "plain": plain_max,
                            "planned": planned_max,
                            "planned_swap": swapped_max,
                            "swap_limit": a.batch_swap_limit,
                            "ratio": best / plain_max if plain_max else math.nan,
                        }
                    )
                    save()
                if "latency" not in skip and dtype == a.dtypes.split(",")[0]:
                    tiny = {"model": model, "dtype": dtype, "steps": 1, "tiny": True, "batch": 2}
                    p = run_child(mode="plain", latency=True, **tiny)
                    q = run_child(
                        mode="planned", latency=True, socket_dir=sock, lease=4 * GiB, **tiny
                    )
                    results["latency"].append(
                        {
                            "plain_ns": p.get("latency_ns"),
                            "planned_ns": q.get("latency_ns"),
                            "planned_session_mode": q.get("session_mode"),
                        }
                    )
                    save()
    save()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
