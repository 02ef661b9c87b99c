"""Test-only support code (fault injection for fedfuse's Flower apps, lying clients, the checkout's layout); never
imported by the product."""
