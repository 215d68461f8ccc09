"""Trainers: one config + trainer module per method, all on ``transformers.Trainer``."""
