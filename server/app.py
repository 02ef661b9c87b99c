"""Compatibility shim: the ServerApp lives in ``fedfuse.flower.server_app`` (``server.app:app`` keeps working)."""

from fedfuse.flower.server_app import app, make_server_app, run_server, setup  # noqa: F401
