"""LoRA on the runner's side: the device slot table (`slots.py`, pure), the host LRU of loaded adapters
(`host_cache.py`, pure) and `LoRAState` (`state.py`), the component both runners call at fixed points."""
