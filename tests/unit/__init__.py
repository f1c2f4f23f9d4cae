"""Tests of kvpush alone: no NIXL, no second process, no vLLM."""
