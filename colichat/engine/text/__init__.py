"""Text <-> token ids."""
