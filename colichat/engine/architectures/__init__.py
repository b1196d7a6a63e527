"""One module per architecture (the table: model.ARCHITECTURES)."""
