"""Worked examples of custom policies (see docs/policy-api.md)."""
