"""Disaggregated prefill/decode: moving a finished prompt's KV blocks from a prefill instance to a decode instance.

head_split.py says which ranks' heads a rank reads (tensor-parallel sizes may differ between the instances);
block_io.py gathers and scatters KV blocks of the paged pool; tcp.py is the TCP transport (pyzmq frames),
nixl.py the NIXL one (UCX over registered host memory). The scheduler's side lives in core/kv_transfer.py, the
runner's in worker/kv_connector.py.
"""
