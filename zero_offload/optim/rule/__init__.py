"""rule."""
