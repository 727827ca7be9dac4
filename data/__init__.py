"""Datasets in the Medical Segmentation Decathlon layout, patch sampling, augmentation, synthetic data."""
