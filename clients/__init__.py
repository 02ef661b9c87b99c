"""Flower ClientApp of fedfuse."""
