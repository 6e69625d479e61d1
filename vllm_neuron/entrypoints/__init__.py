"""Entry points: the offline LLM, the `vllm-neuron` command and the OpenAI-compatible server."""
