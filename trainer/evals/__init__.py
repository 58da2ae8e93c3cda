"""Evaluations run during training and by `dtrain eval` (hellaswag.py: multiple choice, sharded by rank)."""
