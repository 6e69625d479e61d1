"""Multimodal inputs: media loading (media.py), the items a request carries (inputs.py) and the
model-specific processor that turns media into pixel patches and placeholder tokens (processor.py)."""
