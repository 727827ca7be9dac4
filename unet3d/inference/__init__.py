"""Inference and metrics, on one device or on every rank: what validation and evaluate.py share.

sliding_window  InferenceSettings, Gaussian-weighted sliding windows, predict (with mirroring TTA)
metrics         Dice, IoU, HD95 and volumes per class, with fixed conventions for empty masks
pictures        image | reference | prediction overlays, overview.png
devices         choosing one device for a single-process job without touching any other GPU
"""
