"""Integrations with other evaluation tools (optional extras)."""
