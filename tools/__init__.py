"""Helpers of the tests and scripts that run next to the daemon: a Prometheus, a workload."""
