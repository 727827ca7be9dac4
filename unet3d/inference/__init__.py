"""Inference and metrics, on one device or on every rank: what validation and evaluate.py share.

sliding_window  InferenceSettings, Gaussian-weighted sliding windows, predict (with mirroring TTA)
predictor       one model, an ensemble or cross-validation folds, predicting back to each file's grid
cases           what to predict: a dataset split, or a folder of NIfTI files (nnU-Net channel files grouped)
postprocess     keep the largest connected component per class, where cross-validation says it helps
outputs         label maps, probabilities, metrics.csv and summary.json, written atomically
metrics         Dice, IoU, HD95 and volumes per class, with fixed conventions for empty masks
pictures        image | reference | prediction overlays, overview.png
devices         choosing one device for a single-process job without touching any other GPU
"""
