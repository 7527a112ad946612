"""ml_collections experiment configs."""
