"""OpenAI's harmony format for gpt-oss (through the `openai-harmony` package): its vocabulary found
offline, chat requests rendered as harmony conversations, completion tokens parsed into channels and
tool calls (`--reasoning-parser openai_gptoss`)."""
