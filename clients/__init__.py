"""Compatibility shim: fedfuse's ClientApp lives in ``fedfuse.flower.client_app``."""
