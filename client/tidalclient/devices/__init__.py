"""The client's half of the backends: mapping a lease from what the daemon hands over."""
