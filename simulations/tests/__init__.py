"""Tests of the experiments (benchmarks, runners, the trust benchmark's threats); the product's tests are tests/."""
