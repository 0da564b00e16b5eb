"""The client library: what a training job runs (its public face is `tidalpool`).

A `Session` (`session`) is built from parts: the lease mapped into this process (`devices`),
the link to the daemon (`connection`), an executor that allocates in the lease without calling
the daemon (`executors`: Python, swapping over it, or native), the recorder that streams the
trace (`recorder`), and the views ops compute on (`views`: NumPy or CuPy). Integrations build on
it: `numpy` and `cupy` arrays, `torch` at run time. `status`, `top`, `health`, `local` and `demo`
are the command line's client-side views.

Imports the shared core (`tidalcore`) only: never the planner, the daemon or the offline tools.
"""
