"""Steering as the user writes it: spec files and their vectors, vectors from contrastive pairs, reading user files."""
