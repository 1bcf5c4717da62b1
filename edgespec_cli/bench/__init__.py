"""Spec-Bench benchmark: data and runner."""
