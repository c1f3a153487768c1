"""Turning a source model folder into a candidate: lossy recipes and lossless coding."""
