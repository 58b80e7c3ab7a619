"""Worker start-up hooks."""
