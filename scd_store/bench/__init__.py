"""Benchmarks behind ``scd-store bench ...`` (JSON output)."""
