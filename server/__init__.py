"""Flower server side of fedfuse: the ServerApp and the fusion strategies."""
