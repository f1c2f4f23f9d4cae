"""Tests of two real endpoints, in two processes over NIXL (or one over the loopback transport):
transfers, the fault matrix, real network namespaces, the soak."""
