"""A two-rank `torchrun` job (DDP, gloo, on the CPU) with each rank's saved activations in a
session of its own GPU's daemon, found through the node layout: training under a swap limit
equals training without tidalpool, both ranks run the same plan, and it was solved once."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from tidalclient.local import LocalDaemon

pytest.importorskip("torch")

RANKS = 2
RANK_SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tidalpool
    import tidalpool.torch as tt

    MOST, STEADY = 400, 3  # iterations at most; planned ones every rank runs after its switch

    dist.init_process_group("gloo")
    rank = dist.get_rank()


    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
            torch.nn.ReLU(), torch.nn.Linear(256, 10),
        )
        model = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        batches = [
            (torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g))
            for _ in range(4)
        ]
        return model, optimizer, batches


    def step(model, optimizer, batches, i):
        x, y = batches[i % len(batches)]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()


    model, optimizer, batches = setup()
    losses, planned = [], 0
    with (
        tidalpool.attach(device_limit="2MiB", host_limit="2MiB", swap_limit="64KiB",
                         copy_gbps=2.0) as session,
        tt.SavedTensors(session, optimizer),
    ):
        while len(losses) < MOST and planned < STEADY:
            losses.append(step(model, optimizer, batches, len(losses)))
            # Every rank runs as many iterations: go on until all run their plan.
            mine = torch.tensor([session.stats().mode == "planned"], dtype=torch.int32)
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)
            planned += int(mine.item())
        plan = session.plan
        update = type(plan.update)()
        update.CopyFrom(plan.update)
        update.plan_id = 0  # each daemon numbers its own plans
        update.ClearField("prediction")  # and predicts it on its own rank's op times
        digest = hashlib.sha256(update.SerializeToString()).hexdigest()

    model, optimizer, batches = setup()
    plain = [step(model, optimizer, batches, i) for i in range(len(losses))]
    result = {"rank": rank, "losses": losses, "plain": plain, "plan": digest,
              "swaps": len(plan.swaps)}
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:  # ranks share stdout: a file each
        json.dump(result, f)
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()
    """
)


@pytest.fixture
def node() -> Iterator[Path]:
    """A node's layout in a short temporary directory: a sim daemon per GPU in gpu<N>, all of
    them sharing one plan cache, as the template units run them."""
    base = Path(tempfile.mkdtemp(prefix="tp-node-", dir="/tmp"))
    daemons: list[LocalDaemon] = []
    try:
        for gpu in range(RANKS):
            daemons.append(
                LocalDaemon.start(
                    base / f"gpu{gpu}",
                    device_pool="16MiB",
                    host_pool="16MiB",
                    default_lease="4MiB",
                    extra=("--plan-cache-dir", str(base / "plans")),
                    chunk_size="2MiB",
                )
            )
        yield base
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_torchrun_job_trains_as_without_tidalpool_on_one_plan_solved_once(
    node: Path, tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDALPOOL", "CUDA_VISIBLE"))}
    env["TIDALPOOL_SOCKET_DIR"] = f"{node}/gpu{{gpu}}"  # the layout, under a test directory
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={RANKS}",
            str(script),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(RANKS)]
    assert [r["rank"] for r in ranks] == list(range(RANKS))
    for r in ranks:
        assert r["losses"] == r["plain"]  # bit-identical to DDP without tidalpool
        assert r["swaps"] > 0  # under the limit, the plan swaps
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank its own data
    assert len({r["plan"] for r in ranks}) == 1  # one schedule for all ranks
    # Each rank's session went to its own GPU's daemon, and the plan was solved once: the
    # other daemon took it from the shared cache.
    sent = []
    for gpu in range(RANKS):
        log = (node / f"gpu{gpu}" / "tidalpoold.log").read_text()
        assert "session.attached" in log, f"no session at gpu{gpu}"
        sent += re.findall(r"plan\.sent.*?source=(\S+)", log)
    assert sorted(s == "cache" for s in sent) == [False, True], sent
