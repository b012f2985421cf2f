"""Headway: draft heads for speculative decoding, trained on a frozen target model."""

__version__ = "0.1.0"
