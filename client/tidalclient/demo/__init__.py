"""The `tidalpool demo` workload: a NumPy network trained with every array from a Memory."""
