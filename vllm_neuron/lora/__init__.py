"""LoRA adapters: the request's adapter (`request.py`) and PEFT adapter folders read and checked against the
base model (`peft_adapter.py`). Importable by every layer, like config/: no engine, worker or model imports."""
