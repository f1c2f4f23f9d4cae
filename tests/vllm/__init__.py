"""Tests against vLLM's own code, in-process (run with .venv-vllm's python): layouts, the
connector's hooks in vLLM's scheduler, KV cache groups, the GPU check's CPU mode."""
