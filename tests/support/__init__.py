"""Test-only support code (fault injection for fedfuse's Flower apps); never imported by the product."""
