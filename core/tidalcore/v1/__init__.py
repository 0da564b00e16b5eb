"""Generated stubs of the tidalpool v1 protocol (see proto/tidalpool/v1; regenerate with
`python proto/generate.py`)."""
