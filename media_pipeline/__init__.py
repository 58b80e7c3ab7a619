"""Video transcoding with progress."""
