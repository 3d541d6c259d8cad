"""Diagnostics: what a run resolved, how memory and communication behave, and how fast it is."""
