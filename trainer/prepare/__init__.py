"""Preparing data: sources fetched and read as documents, tokenized in a pool, written as shards
with a manifest (`dtrain prepare`); a tokenizer fitted on a dataset's train split (`dtrain tokenizer train`)."""
