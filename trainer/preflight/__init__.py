"""Every check before a run writes anything: the config against the data, the checkpoint a
continuation would load, the run directory and its lock (torch-free), then the checks that need
torch (torch_checks.py), still before anything is written.
"""
