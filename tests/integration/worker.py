"""A client process for fault tests, driven line by line over stdin/stdout.

    python worker.py SOCKET_DIR SEED
prints "ready <session id> <lease bytes>" after filling a few arrays with bytes
from SEED (NumPy arrays on sim; CuPy arrays through tidalpool.cupy on cuda), then answers:
    check -> "ok" if every array still holds exactly its bytes, else "corrupt <i>"
    churn -> allocates and frees 1000 blocks, then "churned"
    quit  -> closes the session and exits
"""

from __future__ import annotations

import sys

import numpy as np
import tidalpool


def main() -> None:
    socket_dir, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    session = tidalpool.attach(socket_dir, device_limit="16MiB", job_name=f"worker-{seed}")
    if session.cuda is not None:  # GPU memory: CuPy arrays allocated from the lease
        import cupy
        import tidalclient.cupy as tpc

        cupy.cuda.Device(session.cuda.ordinal).use()
        tpc.use(session, pinned=False)
    arrays, expected = [], []
    for n in (1000, 65536, 300000):
        values = rng.integers(0, 256, n, dtype=np.uint8)
        if session.cuda is not None:
            a = cupy.empty(n, dtype=cupy.uint8)
            a.set(values)
        else:
            a = session.array(n, "uint8")
            a[:] = values
        arrays.append(a)
        expected.append(values)
    print(f"ready {session.id} {session.device.length}", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "check":
            bad = [
                i
                for i, (a, e) in enumerate(zip(arrays, expected, strict=True))
                if not np.array_equal(a if session.cuda is None else cupy.asnumpy(a), e)
            ]
            print("ok" if not bad else f"corrupt {bad}", flush=True)
        elif command == "churn":
            for size in rng.integers(1, 1 << 16, 1000):
                session.free(session.malloc(int(size)))
            print("churned", flush=True)
        elif command == "quit":
            break
    session.close()


if __name__ == "__main__":
    main()
