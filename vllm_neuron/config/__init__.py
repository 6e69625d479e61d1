"""Engine configuration: option objects, CLI flags <-> LLM kwargs, bucket lists (buckets.py)."""
