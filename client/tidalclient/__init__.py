"""The client library: what a training job runs (its public face is `tidalpool`).

A session (`session`) holds a lease of the daemon's pools, mapped into this process
(`devices`), an executor that allocates in it without calling the daemon (`executor`,
`swap`, `native_executor`), and a recorder that streams the trace (`recorder`). Integrations
build on it: `numpy` and `cupy` arrays, `torch` at run time. `status`, `top`, `health`,
`local` and `demo` are the command line's client-side views.

Imports the shared core (`tidalcore`) only: never the planner, the daemon or the offline tools.
"""
