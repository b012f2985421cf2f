"""The drafters (`inference.drafter`): each head kind's neural drafter (neural.py names them), the
n-gram drafter, and the hybrid that merges both into one tree."""
