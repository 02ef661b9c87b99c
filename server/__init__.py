"""Compatibility shim: fedfuse's ServerApp and strategies live in ``fedfuse.flower``."""
