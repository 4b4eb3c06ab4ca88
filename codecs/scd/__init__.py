"""Semantic Cache Distillation (SCD): codes in a producer's calibrated basis, decoded per consumer."""
