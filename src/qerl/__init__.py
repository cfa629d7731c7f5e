"""QeRL."""
