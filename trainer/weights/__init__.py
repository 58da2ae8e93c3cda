"""Weights into a model that is not the run saving them: a new run's first weights (model.init_from:
init_source.py checks the source before anything is written, init_from.py loads it into the wrapped
model), and a checkpoint's weights in a plain GPT for eval, sample and export (from_checkpoint.py).
The run's own save and restore are trainer/checkpoint/'s."""
