"""Evaluation of a policy on held-out prompts and the noise report."""
