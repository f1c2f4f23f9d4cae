//! Shared fixtures for the criterion benches (layouts and block lists shaped like real requests).
