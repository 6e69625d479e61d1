"""Tensor / expert parallel state on torch.distributed (see parallel_state.py)."""
