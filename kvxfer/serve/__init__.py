"""Serving P and D behind one OpenAI-compatible endpoint: `kvxfer proxy` (see README.md here)."""
