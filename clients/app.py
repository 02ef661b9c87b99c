"""Compatibility shim: the ClientApp lives in ``fedfuse.flower.client_app`` (``clients.app:app`` keeps working)."""

from fedfuse.flower.client_app import app, make_client_app  # noqa: F401
